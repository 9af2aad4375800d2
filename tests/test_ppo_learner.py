"""PPOLearner: ingestion semantics, update mechanics, rejection of bad data, checkpoints."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from impala.algos import ppo
from impala.run.ppo_config import PPOConfig
from learner.ppo_learner import PPOLearner, TrajectoryPiece

OBS, ACT = 5, 3


def make_piece(T, rng, policy=None, terminated_at=(), truncated_at=(), source=0, with_values=True):
    obs = rng.normal(size=(T, OBS)).astype(np.float32)
    if policy is not None:
        out = policy.act(torch.as_tensor(obs))
        actions, logp, values = out.action.numpy(), out.log_prob.numpy(), out.value.numpy()
    else:
        actions = rng.normal(size=(T, ACT)).astype(np.float32)
        logp = rng.normal(size=(T, ACT)).astype(np.float32) - 1.0
        values = rng.normal(size=T).astype(np.float32)
    term, trunc = np.zeros(T, bool), np.zeros(T, bool)
    term[list(terminated_at)] = True
    trunc[list(truncated_at)] = True
    next_obs = np.concatenate([obs[1:], rng.normal(size=(1, OBS)).astype(np.float32)])
    ended = term | trunc
    next_obs[ended] = rng.normal(size=(int(ended.sum()), OBS)).astype(
        np.float32
    )  # final obs of ended episodes
    return TrajectoryPiece(
        obs,
        actions,
        logp,
        rng.normal(size=T).astype(np.float32),
        term,
        trunc,
        next_obs,
        values if with_values else None,
        source,
    )


def small(semantics, **kw):
    """Tiny networks. The tests below hand over pieces that are trajectories already (independent random
    pieces, not the continuation of one stream), so each is processed as it comes: 'rollout' (#15). The
    'mlagents' trajectory cutting has its own tests at the end of this file and in
    test_mlagents_trajectories."""
    base = dict(
        batch_size=4,
        buffer_size=10,
        num_epoch=2,
        hidden_units=16,
        num_layers=2,
        max_steps=1000,
        trajectory_handling="rollout",
    )
    base.update(kw)
    return PPOConfig.preset(semantics, **base)


@pytest.mark.parametrize("semantics", ["mlagents", "sb3"])
def test_tiny_update_runs_and_metrics_finite(semantics):
    rng = np.random.default_rng(0)
    learner = PPOLearner(small(semantics), OBS, ACT, -np.ones(ACT), np.ones(ACT))
    before = [p.detach().clone() for p in learner.policy.parameters()]
    while not learner.ready():
        assert learner.ingest(
            make_piece(4, rng, learner.policy, terminated_at=[3] if rng.random() < 0.5 else [])
        )
    m = learner.update()
    for k in (
        "policy_loss",
        "value_loss",
        "entropy",
        "approx_kl",
        "clip_fraction",
        "explained_variance",
        "learning_rate",
        "epsilon",
        "beta",
    ):
        assert k in m and math.isfinite(m[k]), k
    assert learner.buffer.num_steps == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))


def test_update_trigger():
    rng = np.random.default_rng(1)
    ml = PPOLearner(small("mlagents"), OBS, ACT)
    sb = PPOLearner(small("sb3"), OBS, ACT)
    for learner in (ml, sb):
        learner.ingest(make_piece(5, rng))
        learner.ingest(make_piece(5, rng))
    assert not ml.ready()  # ML-Agents: needs MORE than buffer_size
    assert sb.ready()  # SB3: exactly n_steps * n_envs
    ml.ingest(make_piece(1, rng))
    assert ml.ready()


def test_nan_piece_rejected_and_counted():
    rng = np.random.default_rng(2)
    learner = PPOLearner(small("mlagents"), OBS, ACT)
    good = make_piece(6, rng)
    norm_before = learner.policy.actor_norm.steps.clone()
    for field, bad in (("obs", np.nan), ("rewards", np.inf), ("next_obs", -np.inf)):
        arr = getattr(good, field).copy()
        arr.flat[3] = bad
        assert not learner.ingest(good._replace(**{field: arr}))
    assert learner.rejected_batches == 3
    assert learner.buffer.num_steps == 0 and learner.total_steps == 0
    assert torch.equal(learner.policy.actor_norm.steps, norm_before)
    assert learner.ingest(good)
    assert learner.buffer.num_steps == 6


def test_bad_shapes_raise():
    rng = np.random.default_rng(3)
    learner = PPOLearner(small("mlagents"), OBS, ACT)
    p = make_piece(6, rng)
    with pytest.raises(ValueError, match="log_probs"):
        learner.ingest(p._replace(log_probs=p.log_probs.sum(-1)))  # summed instead of per-dim


@pytest.mark.parametrize("remainder, per_epoch", [("drop", 2), ("keep", 3)])
def test_minibatch_remainder(remainder, per_epoch):
    rng = np.random.default_rng(4)
    # 11 steps, batch 4: drop -> 11 // 4 = 2 minibatches, keep -> 3 (the last has 3 steps).
    learner = PPOLearner(small("mlagents", minibatch_remainder=remainder, num_epoch=3), OBS, ACT)
    learner.ingest(make_piece(11, rng))
    assert learner.ready()
    sizes = [s.stop - s.start for s in learner.minibatch_slices(11)]
    assert sizes == ([4, 4] if remainder == "drop" else [4, 4, 3])
    m = learner.update()
    assert m["n_minibatches"] == 3 * per_epoch and m["buffer_steps"] == 11


def test_mlagents_ingest_gae_segments_and_normalizer():
    """Per episode segment (an ML-Agents trajectory): normalizer update, then that segment's values;
    value_next = 0 at termination, V(final obs) at truncation/cut."""
    rng = np.random.default_rng(5)
    cfg = small("mlagents", gamma=0.9, lambd=0.8)
    learner = PPOLearner(cfg, OBS, ACT)
    ref = copy.deepcopy(learner.policy)
    p = make_piece(9, rng, terminated_at=[2], truncated_at=[5])
    learner.ingest(p)
    assert int(learner.policy.actor_norm.steps) == 1 + 9 == int(learner.policy.critic_norm.steps)
    assert learner.policy.actor_norm.steps.dtype == torch.int64
    r = torch.as_tensor(p.rewards, dtype=torch.float64)
    v, expect = [], []
    for a, b, bootstrap in [(0, 3, False), (3, 6, True), (6, 9, True)]:
        ref.update_normalizer(torch.as_tensor(p.obs[a:b]))  # this segment only, before its values
        with torch.no_grad():
            v_seg = ref.value(torch.as_tensor(p.obs[a:b])).double()
            nxt = ref.value(torch.as_tensor(p.next_obs[b - 1 : b])).double()[0] if bootstrap else 0.0
        v.append(v_seg)
        expect.append(ppo.mlagents_gae(r[a:b], v_seg, nxt, gamma=0.9, lambd=0.8).advantages)
    v, expect = torch.cat(v), torch.cat(expect)
    with torch.no_grad():  # one update with the whole piece would have given other values
        assert not torch.allclose(learner.policy.value(torch.as_tensor(p.obs[:3])).double(), v[:3], atol=1e-4)
    got = learner.buffer.stacked()
    np.testing.assert_allclose(got["advantages"].numpy(), expect.numpy(), atol=1e-5)
    np.testing.assert_allclose(got["values"].numpy(), v.numpy(), atol=1e-6)  # not the actor's stored values
    np.testing.assert_allclose(got["obs"].numpy(), p.obs)  # raw obs stored


def test_sb3_and_mlagents_gae_forms_agree_on_same_values():
    rng = np.random.default_rng(6)
    p = make_piece(12, rng, terminated_at=[3], truncated_at=[7], with_values=False)
    common = dict(obs_norm="none", reward_norm=False, gamma=0.95, lambd=0.9, init="sb3", activation="tanh")
    a = PPOLearner(small("mlagents", **common), OBS, ACT)
    b = PPOLearner(small("mlagents", gae_form="sb3", **common), OBS, ACT)
    b.policy.load_state_dict(a.policy.state_dict())
    a.ingest(p)
    b.ingest(p)
    np.testing.assert_allclose(a.buffer.stacked()["advantages"], b.buffer.stacked()["advantages"], atol=1e-5)
    np.testing.assert_allclose(a.buffer.stacked()["returns"], b.buffer.stacked()["returns"], atol=1e-5)


def test_bootstrap_truncated_off_treats_truncation_as_terminal():
    rng = np.random.default_rng(7)
    p = make_piece(6, rng, truncated_at=[5])
    on = PPOLearner(small("mlagents", obs_norm="none"), OBS, ACT)
    off = PPOLearner(small("mlagents", obs_norm="none", bootstrap_truncated=False), OBS, ACT)
    off.policy.load_state_dict(on.policy.state_dict())
    on.ingest(p)
    off.ingest(p)
    with torch.no_grad():
        v_final = float(on.policy.value(torch.as_tensor(p.next_obs[5:6])))
    diff = on.buffer.stacked()["returns"][-1] - off.buffer.stacked()["returns"][-1]
    assert float(diff) == pytest.approx(0.99 * v_final, abs=1e-5)


def test_sb3_uses_stored_values_and_normalized_obs():
    rng = np.random.default_rng(8)
    learner = PPOLearner(small("sb3"), OBS, ACT)
    p = make_piece(10, rng, learner.policy)
    p = p._replace(obs=p.obs * 10 + 3)
    learner.ingest(p)
    got = learner.buffer.stacked()
    np.testing.assert_allclose(got["values"].numpy(), p.values, atol=1e-6)
    # Stored with the snapshot the actor acted with (initial: mean 0, var 1 -> clip only).
    np.testing.assert_allclose(got["obs"].numpy(), np.clip(p.obs / np.sqrt(1 + 1e-8), -10, 10), atol=1e-5)
    learner.ingest(make_piece(10, rng, learner.policy))
    learner.update()
    np.testing.assert_allclose(learner.policy.obs_norm.mean.numpy(), learner.obs_rms.mean)


def test_value_loss_choices_in_the_update():
    """'mlagents' (as 0.28 runs, #6281) trains exactly as 'mse'; 'mlagents_intended' differs once the
    critic has moved past epsilon from the values stored at ingest."""
    rng = np.random.default_rng(5)
    pieces = [make_piece(6, rng, terminated_at=[5]) for _ in range(2)]
    after = {}
    for loss in ("mlagents", "mse", "mlagents_intended"):
        learner = PPOLearner(
            small(
                "mlagents",
                value_loss=loss,
                buffer_size=12,
                batch_size=12,
                num_epoch=3,
                learning_rate=0.05,
                lr_schedule="constant",
            ),
            OBS,
            ACT,
        )
        for p in pieces:
            learner.ingest(p)
        learner.update()
        after[loss] = torch.cat([q.detach().flatten() for q in learner.policy.critic_body.parameters()])
    torch.testing.assert_close(after["mlagents"], after["mse"], rtol=0, atol=1e-6)
    assert not torch.allclose(after["mlagents_intended"], after["mse"], atol=1e-4)


def test_schedules_use_total_agent_steps():
    rng = np.random.default_rng(9)
    cfg = small("mlagents", max_steps=100)
    learner = PPOLearner(cfg, OBS, ACT)
    learner.ingest(make_piece(11, rng))
    m = learner.update()
    assert m["learning_rate"] == pytest.approx(ppo.polynomial_decay(3e-4, 1e-10, 11, 100))
    assert m["epsilon"] == pytest.approx(ppo.polynomial_decay(0.2, 0.1, 11, 100))
    assert m["beta"] == pytest.approx(ppo.polynomial_decay(5e-3, 1e-5, 11, 100))
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(m["learning_rate"])


def test_target_kl_stops_early():
    rng = np.random.default_rng(10)
    learner = PPOLearner(small("sb3", target_kl=1e-12, learning_rate=1e-2, reward_norm=False), OBS, ACT)
    learner.ingest(make_piece(10, rng, learner.policy))
    m = learner.update()
    # First minibatch: ratio == 1, kl == 0 -> step; the second sees kl > 0 and stops.
    assert m["early_stop"] == 1.0 and m["n_minibatches"] == 2


def test_env_action():
    cfg_ml, cfg_sb = small("mlagents"), small("sb3")
    a = np.array([[-4.0, 0.5, 9.0]], np.float32)
    np.testing.assert_allclose(PPOLearner(cfg_ml, OBS, ACT).env_action(a), np.clip(a, -3, 3) / 3)
    np.testing.assert_allclose(
        PPOLearner(cfg_sb, OBS, ACT, [-2, -1, 0], [2, 1, 1]).env_action(a), [[-2, 0.5, 1]]
    )


@pytest.mark.parametrize("semantics", ["mlagents", "sb3"])
def test_state_dict_round_trip(semantics):
    rng = np.random.default_rng(11)
    cfg = small(semantics)
    a = PPOLearner(cfg, OBS, ACT)
    pieces = [make_piece(6, rng, a.policy, source=i % 2) for i in range(4)]
    for p in pieces[:2]:
        a.ingest(p)
    a.update()
    state = a.state_dict()
    b = PPOLearner(cfg.__class__.preset(semantics, **{**cfg.__dict__, "seed": 99}), OBS, ACT)
    b.load_state_dict(state)
    for k, v in a.policy.state_dict().items():
        assert torch.equal(v, b.policy.state_dict()[k]), k
    assert (b.total_steps, b.update_count, b.rejected_batches) == (
        a.total_steps,
        a.update_count,
        a.rejected_batches,
    )
    # Same data after the restore -> identical next update (optimizer moments, normalizers, RNG all restored).
    for learner in (a, b):
        for p in pieces[2:]:
            learner.ingest(p)
        learner.update()
    for pa, pb in zip(a.policy.parameters(), b.policy.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


# ------------------------------------------------------- trajectory_handling='mlagents' (#15)


def mlagents_processor_cuts(ended: np.ndarray, time_horizon: int) -> tuple[list[tuple[int, int]], list[int]]:
    """ML-Agents' ``AgentProcessor._process_step`` restated for one agent: append each step to the agent's
    list; emit the list as a trajectory when it holds ``time_horizon`` steps or the step is terminal, then
    start an empty one. Returns the emitted [start, stop) ranges and the steps still waiting."""
    emitted, current = [], []
    for t, is_terminal in enumerate(ended):
        current.append(t)
        if len(current) >= time_horizon or is_terminal:
            emitted.append((current[0], current[-1] + 1))
            current = []
    return emitted, current


def agent_stream(n: int, rng, source, p_end=0.12) -> TrajectoryPiece:
    """One agent's consecutive steps; obs[:, 0] is the step index (to find rows again), next_obs[t] is
    obs[t + 1] unless the episode ended at t (then a final observation)."""
    obs = rng.normal(size=(n + 1, OBS)).astype(np.float32)
    obs[:, 0] = np.arange(n + 1)
    ends = rng.random(n) < p_end
    term = ends & (rng.random(n) < 0.5)
    trunc = ends & ~term
    next_obs = obs[1:].copy()
    next_obs[ends] = rng.normal(size=(int(ends.sum()), OBS)).astype(np.float32)
    return TrajectoryPiece(
        obs[:n],
        rng.normal(size=(n, ACT)).astype(np.float32),
        rng.normal(size=(n, ACT)).astype(np.float32) - 1,
        rng.normal(size=n).astype(np.float32),
        term,
        trunc,
        next_obs,
        None,
        source,
    )


def split_stream(stream: TrajectoryPiece, rng, max_len=9) -> list[TrajectoryPiece]:
    cuts = np.cumsum(rng.integers(1, max_len + 1, size=len(stream.rewards)))
    bounds = [0, *[int(c) for c in cuts if c < len(stream.rewards)], len(stream.rewards)]
    return [
        TrajectoryPiece(*(x[a:b] for x in stream[:7]), None, stream.source)
        for a, b in zip(bounds, bounds[1:])
    ]


def interleave(per_source: list[list[TrajectoryPiece]], rng) -> list[TrajectoryPiece]:
    """The pieces of all streams in a random arrival order that keeps each stream's own order."""
    queues = [list(q) for q in per_source]
    out = []
    while any(queues):
        q = queues[rng.choice([i for i, q in enumerate(queues) if q])]
        out.append(q.pop(0))
    return out


@pytest.mark.parametrize("time_horizon", [1, 4, 7, 1000])
def test_agent_trajectories_cut_where_mlagents_agent_processor_does(time_horizon):
    """Pieces of any size, three agents interleaved: the trajectories come out exactly where ML-Agents'
    AgentProcessor emits them, counted from each trajectory's own start (not on the pieces' grid)."""
    from learner.ppo_learner import AgentTrajectories

    rng = np.random.default_rng(time_horizon)
    streams = [agent_stream(120, rng, source=("actor", k)) for k in range(3)]
    assembler = AgentTrajectories(time_horizon)
    got: dict = {s.source: [] for s in streams}
    for piece in interleave([split_stream(s, rng) for s in streams], rng):
        for traj in assembler.add(piece):
            got[traj.source].append(traj)
    assert assembler.broken == 0
    for s in streams:
        ended = s.terminated | s.truncated
        want, waiting = mlagents_processor_cuts(ended, time_horizon)
        ranges = [(int(t.obs[0, 0]), int(t.obs[-1, 0]) + 1) for t in got[s.source]]
        assert ranges == want
        assert assembler.pending_length(s.source) == len(waiting)
        for t, (a, b) in zip(got[s.source], want):  # every row as recorded, in order
            for i in range(7):
                np.testing.assert_array_equal(t[i], s[i][a:b])
    if time_horizon == 7:
        # The point of "own start": some trajectory starts after an episode end and is cut 7 steps later,
        # off any fixed grid of 7.
        assert any(
            a % 7 and b - a == 7
            for a, b in mlagents_processor_cuts(streams[0].terminated | streams[0].truncated, 7)[0]
        )


def test_agent_trajectories_discard_a_stream_that_does_not_continue():
    from learner.ppo_learner import AgentTrajectories

    rng = np.random.default_rng(3)
    s = agent_stream(30, rng, source=0, p_end=0.0)
    assembler = AgentTrajectories(10)
    assert assembler.add(TrajectoryPiece(*(x[:4] for x in s[:7]), None, 0)) == []
    # Steps 4..5 were lost on the way: 6.. does not continue the waiting 0..3, which can never be completed.
    out = assembler.add(TrajectoryPiece(*(x[6:20] for x in s[:7]), None, 0))
    assert assembler.broken == 1 and assembler.broken_steps == 4
    assert [(int(t.obs[0, 0]), len(t.rewards)) for t in out] == [(6, 10)]
    assert assembler.pending_length(0) == 4


def mlagents_learner(**kw) -> PPOLearner:
    return PPOLearner(small("mlagents", trajectory_handling="mlagents", **kw), OBS, ACT)


def test_unfinished_trajectory_straddles_an_update_with_action_time_log_probs():
    """ML-Agents keeps an agent's unfinished trajectory through an update: it is processed when complete, with
    the normalizer and critic of that moment, and trains in the next update with the log-probs from action
    time.
    Its steps count for the schedules when it is processed (RLTrainer._process_trajectory ->
    _increment_step)."""
    rng = np.random.default_rng(12)
    learner = mlagents_learner(time_horizon=8, buffer_size=10, batch_size=4, max_steps=100)
    a = agent_stream(8, rng, source="a", p_end=0.0)
    b = agent_stream(11, rng, source="b", p_end=0.0)
    b.terminated[-1] = True
    first, rest = (
        TrajectoryPiece(*(x[:5] for x in a[:7]), None, "a"),
        TrajectoryPiece(*(x[5:] for x in a[:7]), None, "a"),
    )
    assert learner.ingest(first)
    assert learner.buffer.num_steps == 0 and learner.total_steps == 0  # waiting, not counted yet
    assert learner.ingest(b)
    assert learner.ready() and learner.buffer.num_steps == 11 and learner.total_steps == 11
    m = learner.update()
    assert m["learning_rate"] == pytest.approx(ppo.polynomial_decay(3e-4, 1e-10, 11, 100))
    assert (
        m["pending_steps"] == 5.0 and learner.buffer.num_steps == 0
    )  # the buffer is cleared, the 5 steps wait

    ref = copy.deepcopy(learner.policy)  # the weights after the update: the ones that process `a`
    assert learner.ingest(rest)  # steps 5..7: time_horizon 8 reached -> processed now
    assert learner.total_steps == 19 and learner.trajectories.pending_steps == 0
    got = learner.buffer.stacked()
    np.testing.assert_array_equal(got["log_probs"].numpy(), a.log_probs)  # all 8 as recorded at action time
    np.testing.assert_array_equal(got["obs"].numpy(), a.obs)
    ref.update_normalizer(torch.as_tensor(a.obs))  # the whole trajectory, before its values
    with torch.no_grad():
        v = ref.value(torch.as_tensor(a.obs)).double()
        v_next = ref.value(torch.as_tensor(a.next_obs[-1:])).double()[0]  # cut at time_horizon: bootstrap
    want = ppo.mlagents_gae(
        torch.as_tensor(a.rewards, dtype=torch.float64), v, v_next, gamma=0.99, lambd=0.95
    )
    np.testing.assert_allclose(got["values"].numpy(), v.numpy(), atol=1e-6)
    np.testing.assert_allclose(got["advantages"].numpy(), want.advantages.numpy(), atol=1e-5)
    np.testing.assert_allclose(got["returns"].numpy(), want.returns.numpy(), atol=1e-5)


def test_rollout_handling_processes_each_piece_when_it_arrives():
    """The SB3 preset's 'rollout': the same first five steps are processed (and counted) at once, cut
    there."""
    rng = np.random.default_rng(12)
    learner = PPOLearner(small("sb3"), OBS, ACT)
    assert (
        learner.config.trajectory_handling == "rollout"
        and PPOConfig.preset("sb3").trajectory_handling == "rollout"
    )
    a = agent_stream(8, rng, source="a", p_end=0.0)
    assert learner.ingest(TrajectoryPiece(*(x[:5] for x in a[:7]), None, "a"))
    assert learner.buffer.num_steps == 5 and learner.total_steps == 5 and learner.trajectories is None


def test_nan_piece_breaks_its_stream_under_mlagents_handling():
    rng = np.random.default_rng(13)
    learner = mlagents_learner(time_horizon=50)
    s = agent_stream(12, rng, source=7, p_end=0.0)
    assert learner.ingest(TrajectoryPiece(*(x[:6] for x in s[:7]), None, 7))
    bad = TrajectoryPiece(*(x[6:].copy() for x in s[:7]), None, 7)
    bad.rewards[2] = np.nan
    assert not learner.ingest(bad)
    assert (
        learner.rejected_batches == 1
        and learner.trajectories.broken == 1
        and learner.trajectories.pending_steps == 0
    )
    assert learner.total_steps == 0 and int(learner.policy.actor_norm.steps) == 1


def test_mlagents_handling_state_dict_drops_unfinished_trajectories():
    rng = np.random.default_rng(14)
    learner = mlagents_learner(time_horizon=50)
    learner.ingest(agent_stream(6, rng, source=0, p_end=0.0))
    assert learner.trajectories.pending_steps == 6
    state = learner.state_dict()
    other = mlagents_learner(time_horizon=50)
    other.ingest(agent_stream(3, rng, source=1, p_end=0.0))
    other.load_state_dict(state)
    assert other.trajectories.pending_steps == 0 and other.total_steps == 0
