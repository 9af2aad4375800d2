"""IMPALA networks: shapes for Pong and CartPole, LSTM reset at episode starts."""

import pytest
import torch

from impala.nets import impala_net

PONG_OBS = (4, 84, 84)
PONG_ACTIONS = 6


def _frames(T, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (T, B, *PONG_OBS), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("kind", ["shallow", "nature", "deep"])
@pytest.mark.parametrize("use_lstm", [False, True])
def test_pong_shapes(kind, use_lstm):
    torch.manual_seed(0)
    net = impala_net.build_model(kind, PONG_OBS, PONG_ACTIONS, use_lstm=use_lstm)
    T, B = 3, 2
    first = torch.zeros(T, B, dtype=torch.bool)
    out, state = net(_frames(T, B), first)
    assert out.policy_logits.shape == (T, B, PONG_ACTIONS)
    assert out.values.shape == (T, B)
    assert out.task_values.shape == (T, B, 1)
    assert out.values.dtype == torch.float32
    if use_lstm:
        assert [s.shape for s in state] == [(1, B, 256), (1, B, 256)]
        assert [s.shape for s in net.initial_state(B)] == [(1, B, 256), (1, B, 256)]
    else:
        assert state == () and net.initial_state(B) == ()
    out.policy_logits.sum().add(out.values.sum()).backward()
    assert all(p.grad is not None for p in net.parameters())


def test_torso_architectures():
    shallow, deep = impala_net.ShallowCNN(PONG_OBS), impala_net.DeepResNet(PONG_OBS)
    assert shallow.fc.in_features == 32 * 9 * 9  # 84 -8/4-> 20 -4/2-> 9
    assert deep.fc.in_features == 32 * 11 * 11  # 84 -pool/2-> 42 -> 21 -> 11
    assert [s[0].out_channels for s in deep.sections] == [16, 32, 32]
    assert sum(isinstance(m, impala_net._ResidualBlock) for m in deep.modules()) == 6


def test_uint8_scaled_inside_model():
    torch.manual_seed(0)
    torso = impala_net.ShallowCNN(PONG_OBS)
    frames = _frames(1, 2)[0]
    torch.testing.assert_close(torso(frames), torso(frames.float() / 255.0))


def test_channels_last_matches():
    torch.manual_seed(0)
    net = impala_net.build_model("deep", PONG_OBS, PONG_ACTIONS)
    obs, first = _frames(2, 2), torch.zeros(2, 2, dtype=torch.bool)
    ref, _ = net(obs, first)
    net.torso.to_channels_last()
    assert net.torso.sections[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    got, _ = net(obs, first)
    torch.testing.assert_close(got.policy_logits, ref.policy_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["shallow", "deep"])
def test_channels_last_gradients_are_the_nchw_gradients_in_nchw_order(kind):
    """The channels-last torso hands its gradient back through the flatten in channels-last order (a speed
    fix); every weight's gradient is still the NCHW network's, and the conv weights' gradients keep the
    weights' own (channels-last) layout."""
    torch.manual_seed(0)
    ref = impala_net.build_model(kind, PONG_OBS, PONG_ACTIONS)
    net = impala_net.build_model(kind, PONG_OBS, PONG_ACTIONS)
    net.load_state_dict(ref.state_dict())
    net.torso.to_channels_last()
    obs, first = _frames(3, 4, seed=5), torch.zeros(3, 4, dtype=torch.bool)
    for model, frames in ((ref, obs), (net, net.torso.lay_out(obs))):
        out, _ = model(frames, first)
        (out.policy_logits.logsumexp(-1).sum() + out.values.pow(2).sum()).backward()
    # float32's reordering error only (the sums run in another order in channels-last kernels). The deep
    # torso's first convolutions sum 3 x 4 x 84 x 84 products per weight that cancel to a small fraction of
    # their size: there float32 kernels differ from each other, and from float64, by up to ~4e-3 of the
    # largest gradient (NCHW with one torch thread from the start of the process 8e-4 from float64,
    # oneDNN's channels-last 3e-3), so 1e-2. A layout bug moves gradients by their own size.
    tolerance = 1e-5 if kind == "shallow" else 1e-2
    for (name, want), got in zip(ref.named_parameters(), net.parameters()):
        assert (got.grad - want.grad).abs().max() <= tolerance * want.grad.abs().max(), name
    first_conv = net.torso.conv1 if kind == "shallow" else net.torso.sections[0][0]
    assert first_conv.weight.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_lay_out_over_an_earlier_batch_gives_the_fresh_values(precision, channels_last):
    """``out=``: the learner lays each batch's frames out over the previous batch of its staging slot (no
    fresh 120 MB per batch); the result is the very tensor passed in, holding what a fresh lay_out makes of
    the new frames, bit for bit. An ``out`` of another shape or dtype is not written."""
    torso = impala_net.ShallowCNN(PONG_OBS)
    if channels_last:
        torso.to_channels_last()
    torso.compute_dtype = precision
    first_batch, second_batch = _frames(3, 2, seed=1), _frames(3, 2, seed=2)
    earlier = torso.lay_out(first_batch)
    assert earlier.dtype == (precision or torch.float32)  # scaled once on CPU, in both precisions
    fresh = torso.lay_out(second_batch)
    reused = torso.lay_out(second_batch, out=earlier)
    assert reused is earlier and torch.equal(reused, fresh)
    assert reused.stride() == fresh.stride()
    other_shape = torso.lay_out(_frames(2, 2, seed=1))
    snapshot = other_shape.clone()
    got = torso.lay_out(second_batch, out=other_shape)
    assert got is not other_shape and torch.equal(got, fresh) and torch.equal(other_shape, snapshot)
    wrong_dtype = torch.zeros(fresh.shape, dtype=torch.float64)
    assert torso.lay_out(second_batch, out=wrong_dtype) is not wrong_dtype and not wrong_dtype.any()


def test_bf16_lay_out_is_what_autocast_makes_of_the_float_frames():
    """With compute_dtype bf16 the learner scales each batch's frames once (lay_out); the values are the
    ones autocast would round the float32 frames to inside every forward pass, bit for bit."""
    torso = impala_net.ShallowCNN(PONG_OBS).to_channels_last()
    torso.compute_dtype = torch.bfloat16
    obs = torch.arange(256, dtype=torch.uint8).repeat(3 * 2 * 4 * 84 * 84 // 256 + 1)[: 3 * 2 * 4 * 84 * 84]
    obs = obs.view(3, 2, *PONG_OBS)  # every uint8 value
    got = torso.lay_out(obs)
    want = (obs.float() / 255.0).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("kind", ["shallow", "nature", "deep"])
def test_bf16_torso_stays_close_to_float32_and_hands_float32_on(kind):
    """bf16 in the torso rounds activations to 8 significant bits; the features, logits and values it
    yields stay within a few percent of float32's (about 2% for the 15-layer deep torso), and leave the
    torso as float32 (the heads and the losses are float32). Prescaled bf16 frames and uint8 frames give
    the same outputs."""
    torch.manual_seed(0)
    net = impala_net.build_model(kind, PONG_OBS, PONG_ACTIONS)
    net.torso.to_channels_last()
    obs, first = _frames(4, 8, seed=9), torch.zeros(4, 8, dtype=torch.bool)
    frames = net.torso.lay_out(obs)
    ref, _ = net(frames, first)
    net.torso.compute_dtype = torch.bfloat16
    got, _ = net(obs, first)
    prescaled, _ = net(net.torso.lay_out(obs), first)
    assert got.policy_logits.dtype == torch.float32 and got.values.dtype == torch.float32
    torch.testing.assert_close(prescaled.policy_logits, got.policy_logits)
    feats = net.torso(frames[0])
    net.torso.compute_dtype = None
    want_feats = net.torso(frames[0])
    assert feats.dtype == torch.float32
    rel = (feats - want_feats).norm() / want_feats.norm()
    assert 0 < rel < 0.03, rel  # > 0: bf16 did run
    for a, b in ((got.policy_logits, ref.policy_logits), (got.values, ref.values)):
        assert (a - b).abs().max() <= 0.04 * b.abs().max() + 1e-4


def test_lstm_resets_at_first():
    torch.manual_seed(0)
    net = impala_net.build_model("shallow", PONG_OBS, PONG_ACTIONS, use_lstm=True)
    T, B = 5, 3
    obs = _frames(T, B, seed=1)
    # A state that is clearly not the initial one.
    _, warm_state = net(_frames(4, B, seed=2), torch.zeros(4, B, dtype=torch.bool))
    assert warm_state[0].abs().sum() > 0

    fresh, _ = net(obs[2:], torch.zeros(T - 2, B, dtype=torch.bool))  # starts from initial_state

    first = torch.zeros(T, B, dtype=torch.bool)
    first[2, 1] = True  # env 1 starts a new episode at step 2
    out, _ = net(obs, first, warm_state)
    torch.testing.assert_close(out.policy_logits[2:, 1], fresh.policy_logits[:, 1])
    torch.testing.assert_close(out.values[2:, 1], fresh.values[:, 1])
    # Env 0 had no reset: its outputs depend on the carried state.
    assert not torch.allclose(out.policy_logits[2:, 0], fresh.policy_logits[:, 0])

    no_reset, _ = net(obs, torch.zeros(T, B, dtype=torch.bool), warm_state)
    assert not torch.allclose(no_reset.policy_logits[2:, 1], fresh.policy_logits[:, 1])
    # Steps before the reset are untouched by it.
    torch.testing.assert_close(no_reset.policy_logits[:2], out.policy_logits[:2])

    first_at_0 = torch.zeros(T, B, dtype=torch.bool)
    first_at_0[0] = True
    from_reset, _ = net(obs, first_at_0, warm_state)
    from_init, _ = net(obs, torch.zeros(T, B, dtype=torch.bool))
    torch.testing.assert_close(from_reset.policy_logits, from_init.policy_logits)


def test_lstm_segments_match_per_step_loop():
    # The segment-wise core must equal TorchBeast's one-step-at-a-time notdone masking.
    torch.manual_seed(0)
    net = impala_net.build_model("mlp", (4,), 2, use_lstm=True)
    T, B = 9, 4
    obs = torch.randn(T, B, 4)
    first = torch.rand(T, B) < 0.3
    state = tuple(torch.randn(1, B, 256) for _ in range(2))
    out, (h, c) = net(obs, first, state)
    x = net.torso(obs.reshape(T * B, 4)).view(T, B, -1)
    hs, cs = state
    ys = []
    for t in range(T):
        nd = (~first[t]).float().view(1, B, 1)
        y, (hs, cs) = net.core(x[t : t + 1], (hs * nd, cs * nd))
        ys.append(y)
    ref_logits = net.policy(torch.cat(ys)).view(T, B, 2)
    torch.testing.assert_close(out.policy_logits, ref_logits)
    torch.testing.assert_close(h, hs)
    torch.testing.assert_close(c, cs)


@pytest.mark.parametrize("use_lstm", [False, True])
def test_mlp_cartpole_shapes(use_lstm):
    net = impala_net.build_model("auto", (4,), 2, use_lstm=use_lstm)
    assert isinstance(net.torso, impala_net.MLPTorso) and net.torso.out_features == 64
    out, _ = net(torch.randn(7, 3, 4), torch.zeros(7, 3, dtype=torch.bool))
    assert out.policy_logits.shape == (7, 3, 2) and out.values.shape == (7, 3)


def test_build_model_kinds_and_errors():
    assert isinstance(impala_net.build_model("auto", PONG_OBS, 6).torso, impala_net.ShallowCNN)
    assert isinstance(impala_net.build_model("deep", PONG_OBS, 6).torso, impala_net.DeepResNet)
    assert isinstance(impala_net.build_model("nature", PONG_OBS, 6).torso, impala_net.NatureCNN)
    with pytest.raises(
        ValueError, match="unknown model kind 'resnet'; choose one of auto, shallow, nature, deep, mlp"
    ):
        impala_net.build_model("resnet", PONG_OBS, 6)
    with pytest.raises(ValueError, match="'mlp' needs 1-D observations"):
        impala_net.build_model("mlp", PONG_OBS, 6)
    with pytest.raises(ValueError, match="'auto' cannot choose"):
        impala_net.build_model("auto", (3, 4), 6)
    with pytest.raises(ValueError, match="image observations"):
        impala_net.build_model("shallow", (4,), 6)


def test_task_ids_select_popart_head():
    net = impala_net.build_model("mlp", (4,), 2, num_tasks=3)
    tasks = torch.tensor([[0, 2], [1, 2]])
    out, _ = net(torch.randn(2, 2, 4), torch.zeros(2, 2, dtype=torch.bool), task_ids=tasks)
    assert out.task_values.shape == (2, 2, 3)
    torch.testing.assert_close(out.values, out.task_values.gather(-1, tasks[..., None]).squeeze(-1))


def _pong_like_frames(T, B, seed=0):
    """A constant gray field with a few bright moving pixels, as Pong's preprocessed frames are."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.full((T, B, *PONG_OBS), 87, dtype=torch.uint8)
    rows, cols = torch.randint(0, 84, (2, T, B), generator=g)
    for t in range(T):
        for b in range(B):
            frames[t, b, :, rows[t, b], cols[t, b]] = 236
    return frames


def test_pixel_normalizer_statistics_are_the_pooled_moments():
    """``observe`` merges batches as one pool of samples, the prior (count 1, mean 0, variance 1) included:
    checked against the moments of all samples observed, computed at once in float64."""
    norm = impala_net.PixelNormalizer(PONG_OBS)
    seen = []
    for seed, stride in ((0, 4), (1, 1), (2, 3)):
        frames = _pong_like_frames(5, 3, seed) if seed != 1 else _frames(2, 3, seed)
        norm.observe(frames, stride=stride)
        seen.append(frames[::stride].reshape(-1, *PONG_OBS).double() / 255.0)  # every stride-th step of T
    x = torch.cat(seen)
    n = x.shape[0] + 1  # with the prior sample
    mean = x.sum(0) / n  # the prior's mean is 0
    var = (1.0 + x.square().sum(0)) / n - mean.square()  # E[x^2] - mean^2; the prior's E[x^2] is 1
    assert float(norm.count) == n
    assert torch.allclose(norm.mean.double(), mean, atol=1e-6)
    assert torch.allclose(norm.var.double(), var, atol=1e-6)


@pytest.mark.parametrize("channels_last", [False, True])
def test_obs_norm_standardizes_each_pixel_and_the_learners_layout_matches_the_actors_path(channels_last):
    """With --obs-norm an image torso reads clamp((x/255 - mean) / sqrt(var + 1e-5), -5, 5) per pixel: the
    learner's lay_out (once per batch, over an earlier batch too) and an actor's uint8 forward pass give it
    alike, and the background of a Pong-like frame is near 0 while its moving pixels stand out."""
    torch.manual_seed(0)
    net = impala_net.build_model("shallow", PONG_OBS, PONG_ACTIONS, obs_norm=True)
    if channels_last:
        net.torso.to_channels_last()
    norm = net.torso.pixel_norm
    assert isinstance(norm, impala_net.PixelNormalizer)
    assert {"torso.pixel_norm.mean", "torso.pixel_norm.var", "torso.pixel_norm.count"} <= set(
        net.state_dict()
    )
    for seed in range(4):
        norm.observe(_pong_like_frames(8, 4, seed), stride=1)
    frames = _pong_like_frames(3, 2, seed=9)
    want = ((frames.float() / 255.0 - norm.mean) / torch.sqrt(norm.var + 1e-5)).clamp(-5, 5)
    laid = net.torso.lay_out(frames)
    assert torch.allclose(laid, want, atol=1e-5)
    again = net.torso.lay_out(frames, out=net.torso.lay_out(_pong_like_frames(3, 2, seed=3)))
    assert torch.equal(again, laid)
    background = frames == 87
    assert laid[background].abs().max() < 0.5 and laid[~background].min() > 2.0
    first = torch.zeros(3, 2, dtype=torch.bool)
    from_uint8, _ = net(frames, first)
    from_laid, _ = net(laid, first)
    assert torch.allclose(from_uint8.policy_logits, from_laid.policy_logits, atol=1e-5)
    plain = impala_net.build_model("shallow", PONG_OBS, PONG_ACTIONS)
    assert plain.torso.pixel_norm is None and not any("pixel_norm" in k for k in plain.state_dict())
    assert impala_net.build_model("mlp", (4,), 2, obs_norm=True).state_dict().keys() == (
        impala_net.build_model("mlp", (4,), 2).state_dict().keys()
    )  # vector observations: no pixel statistics


def test_an_actor_normalizes_with_the_statistics_of_the_weights_it_loaded_last():
    """The normalizer keeps its scale and shift between calls (an actor's forward pass would otherwise
    recompute them every step); new weights loaded into its buffers, or a learner's observe, replace them."""
    from impala.transport.params import load_state_arrays, state_dict_arrays

    actor = impala_net.build_model("shallow", PONG_OBS, PONG_ACTIONS, obs_norm=True)
    actor.torso.to_channels_last()  # as an actor runs it
    learner = impala_net.build_model("shallow", PONG_OBS, PONG_ACTIONS, obs_norm=True)
    frames = _pong_like_frames(1, 4, seed=5)[0]
    with torch.no_grad():
        before = actor.torso(frames)
        for seed in range(3):
            learner.torso.pixel_norm.observe(_pong_like_frames(4, 4, seed), stride=1)
            load_state_arrays(actor, state_dict_arrays(learner))
            got, want = actor.torso(frames), learner.torso(frames)
            assert torch.allclose(got, want, atol=1e-5), seed  # the statistics just loaded, not cached ones
        assert not torch.allclose(before, got)


def _observe_a_share(rank: int, port: int, frames, out) -> None:
    """One rank of a 2-rank gloo group: observe its half of the batch's unrolls with the group's sum."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def allreduce(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    norm = impala_net.PixelNormalizer(PONG_OBS)
    half = frames.shape[1] // 2
    norm.observe(frames[:, rank * half : (rank + 1) * half], allreduce=allreduce)
    out.put((rank, norm.mean.numpy().copy(), norm.var.numpy().copy(), float(norm.count)))
    dist.destroy_process_group()


def test_a_learner_group_merges_the_whole_batchs_pixel_statistics_on_every_rank():
    """--learners 2: each rank holds half of a batch's unrolls; with the moments summed over the ranks, both
    end with the statistics one learner gets from the whole batch (real processes, a real gloo group)."""
    import multiprocessing

    from procs import free_port_pair

    frames = _pong_like_frames(9, 6, seed=3)
    whole = impala_net.PixelNormalizer(PONG_OBS)
    whole.observe(frames)
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port_pair()
    ranks = [ctx.Process(target=_observe_a_share, args=(r, port, frames, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = [out.get(timeout=120) for _ in ranks]
    for p in ranks:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in ranks)
    for _, mean, var, count in got:
        assert count == float(whole.count)
        assert torch.allclose(torch.from_numpy(mean), whole.mean, atol=1e-6)
        assert torch.allclose(torch.from_numpy(var), whole.var, atol=1e-6)
