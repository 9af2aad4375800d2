"""ONNX export (``impala.nets.onnx_export``, ``impala-export``): files run by onnxruntime, no mocks.

- ML-Agents 0.28's own exporter (``ModelSerializer`` over its ``SimpleActor``) and ours write the
  same interface for the same behaviour (names, shapes, dtypes, opset, constants) and, with the
  same weights and normalizer statistics, the same actions.
- onnxruntime on our file gives the torch policy's deterministic env actions (normalizer folded
  in, actions clipped as the env gets them) to 1e-5; the stochastic output has the policy's spread.
- IMPALA: onnxruntime logits and baselines equal torch's (an MLP for CartPole, a CNN on 4x84x84).
- ``impala-export`` on checkpoints written by real short runs; one real process for bad input.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the 'export' extra (onnx, onnxruntime) is not installed")
ort = pytest.importorskip("onnxruntime", reason="the 'export' extra (onnx, onnxruntime) is not installed")

from impala.envs import EnvSpec  # noqa: E402
from impala.envs.probe import EnvInfo  # noqa: E402
from impala.evaluation import read_policy_checkpoint  # noqa: E402
from impala.nets import onnx_export  # noqa: E402
from impala.nets.impala_net import build_model  # noqa: E402
from impala.nets.onnx_export import export_impala_onnx, export_ppo_onnx  # noqa: E402
from impala.nets.ppo_policy import ActorCritic, env_action, make_policy  # noqa: E402
from impala.run.config import RunConfig  # noqa: E402
from impala.run.ppo_config import PPOConfig  # noqa: E402
from impala.transport.params import load_state_arrays  # noqa: E402
from learner.cli.export_cli import main as export_main  # noqa: E402

ATOL = 1e-5
OBS_SIZES = (5, 3)  # two observations (sensors), as a Unity agent with two vector sensors
ACTIONS = 2
HIDDEN = 16


def session(path) -> "ort.InferenceSession":
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def io_signature(model) -> dict:
    """Each input/output: (elem type, dims); a dynamic dim reads 'dyn' whatever its symbol is called."""

    def sig(values):
        return {
            v.name: (
                v.type.tensor_type.elem_type,
                tuple(
                    d.dim_value if d.HasField("dim_value") else "dyn" for d in v.type.tensor_type.shape.dim
                ),
            )
            for v in values
        }

    return {
        "inputs": sig(model.graph.input),
        "outputs": sig(model.graph.output),
        "output_order": [o.name for o in model.graph.output],
        "opset": [(o.domain, o.version) for o in model.opset_import],
        "ir_version": model.ir_version,
    }


def trained_looking(policy: ActorCritic, seed: int) -> ActorCritic:
    """Non-zero biases and log_sigma (fresh ones are 0 and would hide slips)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("log_sigma"):
                p.copy_(-1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return policy


def random_obs(n: int, dim: int, seed: int) -> np.ndarray:
    # Wide, shifted values, so that some normalized values hit the normalizer's clip.
    rng = np.random.default_rng(seed)
    return (rng.normal(1.0, 4.0, (n, dim)) * rng.uniform(0.5, 3.0, dim)).astype(np.float32)


def split(obs: np.ndarray, sizes=OBS_SIZES) -> dict[str, np.ndarray]:
    parts = np.split(obs, np.cumsum(sizes)[:-1], axis=1)
    return {f"obs_{i}": np.ascontiguousarray(p) for i, p in enumerate(parts)}


# --------------------------------------------------------------------------- ML-Agents' own exporter


def mlagents_actor_and_file(tmp_path: Path):
    """ML-Agents' SimpleActor (OBS_SIZES -> ACTIONS continuous, normalizers warmed), exported by its own
    ModelSerializer.

    Returns (actor, path of its .onnx or None, why its exporter could not run or None).
    """
    from mlagents_shims import require_mlagents, vector_observation_specs

    require_mlagents()
    from mlagents.trainers.settings import NetworkSettings
    from mlagents.trainers.torch.model_serialization import ModelSerializer
    from mlagents.trainers.torch.networks import SimpleActor
    from mlagents_envs.base_env import ActionSpec, BehaviorSpec

    specs = vector_observation_specs(OBS_SIZES)
    behavior = BehaviorSpec(specs, ActionSpec.create_continuous(ACTIONS))
    torch.manual_seed(0)
    actor = SimpleActor(
        specs, NetworkSettings(normalize=True, hidden_units=HIDDEN, num_layers=2), behavior.action_spec
    )
    with torch.no_grad():
        for i, processor in enumerate(actor.network_body.observation_encoder.processors):
            processor.normalizer.update(torch.from_numpy(random_obs(40, OBS_SIZES[i], 10 + i)))
        trained_looking(actor, 1)

    class Policy:  # what ModelSerializer reads of a TorchPolicy
        behavior_spec = behavior
        export_memory_size = 0

    Policy.actor = actor
    # torch >= 2.9 defaults torch.onnx.export to the dynamo exporter (it needs onnxscript and opset >= 18);
    # ML-Agents 0.28 ran on torch 1.x, whose only exporter was the TorchScript one that dynamo=False selects.
    export = functools.partial(torch.onnx.export, dynamo=False)
    base = tmp_path / "mlagents"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.onnx, "export", export)
            ModelSerializer(Policy).export_policy_model(str(base))
    except (
        Exception
    ) as e:  # a torch without the TorchScript exporter: fall back to ML-Agents' source constants
        return actor, None, f"{type(e).__name__}: {e}".splitlines()[0]
    return actor, base.with_suffix(".onnx"), None


def ours_from_mlagents(actor) -> ActorCritic:
    """Our policy with ML-Agents' actor weights and (concatenated) normalizer statistics."""
    ours = ActorCritic(
        sum(OBS_SIZES), ACTIONS, hidden_units=HIDDEN, num_layers=2, obs_norm="mlagents", seed=0
    )
    theirs = dict(actor.named_parameters()) | dict(actor.named_buffers())
    norms = [p.normalizer for p in actor.network_body.observation_encoder.processors]
    with torch.no_grad():
        for i in (0, 2):
            for p in ("weight", "bias"):
                getattr(ours.actor_body[i], p).copy_(theirs[f"network_body._body_endoder.seq_layers.{i}.{p}"])
        ours.mu_head.weight.copy_(theirs["action_model._continuous_distribution.mu.weight"])
        ours.mu_head.bias.copy_(theirs["action_model._continuous_distribution.mu.bias"])
        ours.log_sigma.copy_(theirs["action_model._continuous_distribution.log_sigma"].reshape(-1))
        ours.actor_norm.steps.copy_(norms[0].normalization_steps)
        ours.actor_norm.mean.copy_(torch.cat([n.running_mean for n in norms]))
        ours.actor_norm.m2.copy_(torch.cat([n.running_variance for n in norms]))
    return ours


# ML-Agents' exporter call on torch 2.x's TorchScript exporter: deprecation notices only.
@pytest.mark.filterwarnings(
    "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"
)
@pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning")
def test_same_interface_and_actions_as_mlagents_own_export(tmp_path):
    actor, theirs_path, why = mlagents_actor_and_file(tmp_path)
    ours_path = export_ppo_onnx(ours_from_mlagents(actor), str(tmp_path / "ours.onnx"), obs_sizes=OBS_SIZES)
    ours = io_signature(onnx.load(ours_path))
    obs = random_obs(64, sum(OBS_SIZES), 3)
    got = dict(zip(ours["output_order"], session(ours_path).run(None, split(obs))))

    if theirs_path is None:
        # The names, shapes and constants ML-Agents' source defines (model_serialization.py, networks.py).
        from mlagents.trainers.settings import SerializationSettings
        from mlagents.trainers.torch.model_serialization import TensorNames
        from mlagents.trainers.torch.networks import SimpleActor

        f32 = onnx.TensorProto.FLOAT
        assert ours["inputs"] == {
            TensorNames.get_observation_name(i): (f32, ("dyn", n)) for i, n in enumerate(OBS_SIZES)
        }
        assert ours["output_order"] == [
            TensorNames.version_number,
            TensorNames.memory_size,
            TensorNames.continuous_action_output,
            TensorNames.continuous_action_output_shape,
            TensorNames.deterministic_continuous_action_output,
        ]
        assert ours["opset"] == [("", SerializationSettings.onnx_opset)]
        assert got["version_number"].tolist() == [SimpleActor.MODEL_EXPORT_VERSION]
        assert got["memory_size"].tolist() == [0] and got["continuous_action_output_shape"].tolist() == [
            ACTIONS
        ]
        pytest.skip(
            f"ML-Agents' own exporter could not run on torch {torch.__version__} ({why}); "
            "checked our file against the names, opset and constants in its source instead"
        )

    theirs = io_signature(onnx.load(str(theirs_path)))
    assert (
        ours == theirs
    )  # inputs (no action_masks for continuous actions), outputs in order, dtypes, dims, opset, IR
    want = dict(zip(theirs["output_order"], session(theirs_path).run(None, split(obs))))
    for name in ("version_number", "memory_size", "continuous_action_output_shape"):
        assert got[name].dtype == want[name].dtype and got[name].tolist() == want[name].tolist(), name
    assert got["version_number"].tolist() == [3.0] and got["memory_size"].tolist() == [0.0]
    np.testing.assert_allclose(
        got["deterministic_continuous_actions"], want["deterministic_continuous_actions"], atol=ATOL
    )
    # Both are clamp(sample, -3, 3) / 3 of independent draws: same shape and range.
    assert got["continuous_actions"].shape == want["continuous_actions"].shape == (64, ACTIONS)
    assert np.abs(got["continuous_actions"]).max() <= 1.0 and np.abs(want["continuous_actions"]).max() <= 1.0


# --------------------------------------------------------------------------- our policy vs its file


@pytest.mark.parametrize(
    "obs_norm,action_clip,activation",
    [("mlagents", "mlagents", "swish"), ("vecnormalize", "bounds", "tanh"), ("none", "mlagents", "relu")],
)
def test_onnxruntime_matches_the_torch_policy(tmp_path, obs_norm, action_clip, activation):
    dim, low, high = sum(OBS_SIZES), np.array([-2.0, -0.5], np.float32), np.array([2.0, 1.5], np.float32)
    policy = ActorCritic(
        dim, ACTIONS, hidden_units=HIDDEN, num_layers=3, activation=activation, obs_norm=obs_norm, seed=4
    )
    trained_looking(policy, 5)
    if obs_norm == "mlagents":
        policy.update_normalizer(torch.from_numpy(random_obs(200, dim, 6)))
    elif obs_norm == "vecnormalize":
        rng = np.random.default_rng(7)
        policy.obs_norm.set_stats(rng.normal(1.0, 2.0, dim), rng.uniform(0.5, 9.0, dim))
    path = export_ppo_onnx(
        policy,
        str(tmp_path / "p.onnx"),
        action_clip=action_clip,
        action_low=low,
        action_high=high,
        obs_sizes=OBS_SIZES,
        seed=11,  # RandomNormalLike's seed: the statistical checks below see the same draws every run
    )
    obs = random_obs(256, dim, 8)
    out = dict(zip([o.name for o in onnx.load(path).graph.output], session(path).run(None, split(obs))))
    with torch.no_grad():
        want = env_action(policy.mean(torch.from_numpy(obs)), mode=action_clip, low=low, high=high).numpy()
    assert out["deterministic_continuous_actions"].dtype == np.float32
    np.testing.assert_allclose(out["deterministic_continuous_actions"], want, atol=ATOL, rtol=0)
    assert 0 < np.abs(want).max() and (np.abs(want) < 1).any()  # not all clipped: the test sees the network

    # Stochastic output: one observation repeated; samples spread by exp(log_sigma) around the mean
    # (the clip barely bites here: mean within the bounds, sigma ~0.37).
    many = np.repeat(obs[:1], 20000, axis=0)
    sample = dict(zip([o.name for o in onnx.load(path).graph.output], session(path).run(None, split(many))))[
        "continuous_actions"
    ]
    assert sample.shape == (20000, ACTIONS) and sample.dtype == np.float32
    with torch.no_grad():
        mean, sigma = policy.mean(torch.from_numpy(obs[:1]))[0].numpy(), torch.exp(policy.log_sigma).numpy()
    scale = 1 / 3 if action_clip == "mlagents" else 1.0
    inside = (np.abs(mean) + 4 * sigma) < (3.0 if action_clip == "mlagents" else np.minimum(-low, high))
    assert inside.any()
    if action_clip == "mlagents":
        assert np.abs(sample).max() <= 1.0
    else:
        assert (sample >= low).all() and (sample <= high).all()
    np.testing.assert_allclose(
        sample.mean(0)[inside], (mean * scale)[inside], atol=5 * sigma.max() * scale / np.sqrt(20000)
    )
    np.testing.assert_allclose(sample.std(0)[inside], (sigma * scale)[inside], rtol=0.05)


def test_one_input_when_the_observation_split_is_unknown_and_batch_is_dynamic(tmp_path):
    policy = trained_looking(ActorCritic(7, 1, hidden_units=8, num_layers=1, seed=0), 0)
    path = export_ppo_onnx(policy, str(tmp_path / "p.onnx"))
    sig = io_signature(onnx.load(path))
    assert sig["inputs"] == {"obs_0": (onnx.TensorProto.FLOAT, ("dyn", 7))}
    for n in (1, 33):
        obs = random_obs(n, 7, n)
        det = session(path).run(["deterministic_continuous_actions"], {"obs_0": obs})[0]
        with torch.no_grad():
            np.testing.assert_allclose(
                det, env_action(policy.mean(torch.from_numpy(obs)), mode="mlagents").numpy(), atol=ATOL
            )
    with pytest.raises(onnx_export.ExportError, match="sum to the policy's 7"):
        export_ppo_onnx(policy, str(tmp_path / "q.onnx"), obs_sizes=(3, 3))
    with pytest.raises(onnx_export.ExportError, match="does not exist"):
        export_ppo_onnx(policy, str(tmp_path / "no" / "q.onnx"))


# --------------------------------------------------------------------------- IMPALA


@pytest.mark.parametrize(
    "kind,obs_shape,dtype,obs_norm",
    [
        ("mlp", (4,), np.float32, False),
        ("shallow", (4, 84, 84), np.uint8, False),
        ("shallow", (4, 84, 84), np.uint8, True),  # the pixel statistics go into the graph
    ],
)
def test_impala_logits_and_baseline_match_torch(tmp_path, kind, obs_shape, dtype, obs_norm):
    torch.manual_seed(0)
    model = build_model(kind, obs_shape, 6, obs_norm=obs_norm).eval()
    if obs_norm:  # statistics of real-looking frames: a gray field, a few bright pixels
        frames = torch.full((64, *obs_shape), 87, dtype=torch.uint8)
        frames[:, :, 40:44, 10:12] = 236
        frames[::2, :, 20:24, 60:62] = 236
        model.torso.pixel_norm.observe(frames, stride=1)
    with torch.no_grad():  # a trained-looking PopArt: values in return units differ from normalized ones
        model.baseline.mu.fill_(2.5)
        model.baseline.sigma.fill_(4.0)
    path = export_impala_onnx(model, obs_shape, str(tmp_path / f"{kind}.onnx"), obs_dtype=dtype)
    rng = np.random.default_rng(1)
    obs = (
        rng.uniform(0, 255, (5, *obs_shape)) if dtype == np.uint8 else rng.normal(0, 2, (5, *obs_shape))
    ).astype(dtype)
    logits, baseline = session(path).run(["policy_logits", "baseline"], {"obs": obs})
    with torch.no_grad():
        out, _ = model(torch.from_numpy(obs)[None], torch.zeros(1, 5, dtype=torch.bool))
        values = out.values[0] * model.baseline.sigma.float() + model.baseline.mu.float()
    np.testing.assert_allclose(logits, out.policy_logits[0].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        baseline[:, 0], values.numpy(), atol=ATOL * 10, rtol=1e-6
    )  # values are ~10x larger


# ------------------------------------------------------------------ impala-export and the trainer hook

TINY_PPO = (
    "--env Pendulum-v1 --workers 1 --in-process --total-steps 600 --buffer-size 64 --batch-size 32 "
    "--hidden-units 8 --num-layers 1 --time-horizon 32 --no-progress --device cpu"
).split()


def _train_ppo(logdir: Path, semantics: str) -> Path:
    from learner.cli import launch_ppo

    threads = torch.get_num_threads()
    try:
        assert launch_ppo.main([*TINY_PPO, "--semantics", semantics, "--logdir", str(logdir)]) == 0
    finally:
        torch.set_num_threads(threads)
    return logdir


@pytest.mark.parametrize(
    "semantics", ["mlagents", "sb3"]
)  # ML-Agents' normalizer and clip; VecNormalize and bounds
def test_cli_exports_a_real_ppo_checkpoint(tmp_path, capsys, semantics):
    run = _train_ppo(tmp_path / "run", semantics)
    assert export_main([str(run)]) == 0
    path = run / "Pendulum-v1.onnx"
    assert f"wrote {path}" in capsys.readouterr().out
    ck = read_policy_checkpoint(str(run))
    policy = make_policy(ck.agent.config, ck.agent.obs_dim, ck.agent.action_dim)
    load_state_arrays(policy, ck.params)
    obs = random_obs(50, 3, 9)
    det = session(path).run(["deterministic_continuous_actions"], {"obs_0": obs})[0]
    with torch.no_grad():
        want = env_action(
            policy.mean(torch.from_numpy(obs)),
            mode=ck.agent.config.action_clip,
            low=np.array(ck.agent.action_low, np.float32),
            high=np.array(ck.agent.action_high, np.float32),
        )
    np.testing.assert_allclose(det, want.numpy(), atol=ATOL, rtol=0)
    # -o elsewhere; a second export over the first is fine
    assert export_main([str(run / "checkpoint.pt"), "-o", str(tmp_path / "x.onnx")]) == 0
    assert (tmp_path / "x.onnx").stat().st_size == path.stat().st_size


def test_cli_exports_a_real_impala_checkpoint(tmp_path, capsys):
    from learner.cli import launch_impala

    threads = torch.get_num_threads()
    try:
        assert (
            launch_impala.main(
                [
                    *(
                        "--env CartPole-v1 --workers 1 --in-process --total-frames 2000 --unroll-length "
                        "8 --batch-size 4 --minibatches 1 --no-progress --device cpu --logdir"
                    ).split(),
                    str(tmp_path),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    assert export_main([str(tmp_path)]) == 0
    path = tmp_path / "CartPole-v1.onnx"
    assert f"wrote {path}" in capsys.readouterr().out
    ck = read_policy_checkpoint(str(tmp_path))
    model = build_model(ck.agent.model, (4,), 2).eval()
    load_state_arrays(model, ck.params)
    obs = random_obs(9, 4, 1)
    logits = session(path).run(["policy_logits"], {"obs": obs})[0]
    with torch.no_grad():
        want = model.policy(model.torso(torch.from_numpy(obs))).numpy()
    np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0)
    # --obs-sizes is PPO's: refused for an IMPALA checkpoint, in one line
    assert export_main([str(tmp_path), "--obs-sizes", "2,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "applies to PPO checkpoints only" in err[0]


def test_cli_bad_input_in_process(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_text("not a checkpoint")
    cases = [
        ([str(tmp_path / "missing")], "no checkpoint at"),
        ([str(ckpt)], "cannot be read"),
        ([str(tmp_path), "--obs-sizes", "1,x"], "--obs-sizes"),
        ([str(tmp_path), "-o", str(tmp_path / "nofolder" / "a.onnx")], "--output"),  # before the checkpoint
    ]
    for argv, text in cases:
        assert export_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("impala-export: error: ") and text in err[0], err
    # onnx not installed (a None entry in sys.modules makes `import onnx` fail as a missing package does)
    monkeypatch.setitem(sys.modules, "onnx", None)
    assert export_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "impala-export: error: the onnx package is not installed; install it with: "
        "pip install 'impala-rl[export]'"
    ], err


def test_cli_bad_input_as_a_real_process(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "learner.cli.export_cli", str(tmp_path / "nothing-here")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"impala-export: error: no checkpoint at {tmp_path / 'nothing-here'}"
    ]
    assert r.stdout == ""


def test_trainer_hook_writes_behaviour_onnx(tmp_path):
    from learner.ppo_learner import PPOTrainer

    ones = np.ones(2, np.float32)
    spec = EnvSpec(
        "unity:Crawler", kwargs={"file_name": "/builds/Crawler", "behavior_name": "Crawler?team=0"}
    )
    env = EnvInfo(spec, (8,), "float32", "Box", "Box", action_low=-ones, action_high=ones, obs_sizes=(5, 3))
    trainer = PPOTrainer(
        PPOConfig(hidden_units=8, num_layers=1),
        RunConfig(env="Pendulum-v1", unroll_length=8, device="cpu"),
        env,
    )
    path = trainer.export_onnx(str(tmp_path))
    assert path == str(tmp_path / "Crawler.onnx")
    sig = io_signature(onnx.load(path))
    assert sig["inputs"] == {
        "obs_0": (onnx.TensorProto.FLOAT, ("dyn", 5)),
        "obs_1": (onnx.TensorProto.FLOAT, ("dyn", 3)),
    }
    obs = random_obs(4, 8, 2)
    det = session(path).run(["deterministic_continuous_actions"], split(obs))[0]
    with torch.no_grad():
        want = env_action(
            trainer.learner.policy.mean(torch.from_numpy(obs)),
            mode=trainer.config.action_clip,
            low=-ones,
            high=ones,
        )
    np.testing.assert_allclose(det, want.numpy(), atol=ATOL)


# --------------------------------------------------------------------------- discrete and hybrid actions

BRANCHES = (3, 2)


@pytest.mark.filterwarnings(
    "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"
)
@pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning")
@pytest.mark.parametrize("continuous", [0, ACTIONS])
def test_discrete_branches_and_masks_as_mlagents_own_export_writes_them(tmp_path, continuous):
    """ML-Agents' SimpleActor with discrete branches (and, hybrid, continuous actions too), exported by its
    own ModelSerializer, and ours with its weights: the same interface (action_masks input, int64 action
    outputs, the [1, branches] shape constant) and, under masks, the same deterministic actions; sampled
    actions never take a blocked one."""
    from mlagents_shims import require_mlagents, vector_observation_specs

    require_mlagents()
    from mlagents.trainers.settings import NetworkSettings
    from mlagents.trainers.torch.model_serialization import ModelSerializer
    from mlagents.trainers.torch.networks import SimpleActor
    from mlagents_envs.base_env import ActionSpec, BehaviorSpec

    specs = vector_observation_specs(OBS_SIZES)
    action_spec = ActionSpec(continuous, BRANCHES)
    torch.manual_seed(0)
    actor = SimpleActor(
        specs, NetworkSettings(normalize=False, hidden_units=HIDDEN, num_layers=2), action_spec
    )
    trained_looking(actor, 2)

    class Policy:  # what ModelSerializer reads of a TorchPolicy
        behavior_spec = BehaviorSpec(specs, action_spec)
        export_memory_size = 0

    Policy.actor = actor
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.onnx, "export", functools.partial(torch.onnx.export, dynamo=False))
        ModelSerializer(Policy).export_policy_model(str(tmp_path / "mlagents"))

    ours = ActorCritic(
        sum(OBS_SIZES), continuous, hidden_units=HIDDEN, num_layers=2, obs_norm="none", branches=BRANCHES
    )
    theirs = dict(actor.named_parameters())
    with torch.no_grad():
        for i in (0, 2):
            for p in ("weight", "bias"):
                getattr(ours.actor_body[i], p).copy_(theirs[f"network_body._body_endoder.seq_layers.{i}.{p}"])
        for p in ("weight", "bias"):
            branches = [theirs[f"action_model._discrete_distribution.branches.{i}.{p}"] for i in range(2)]
            getattr(ours.branch_head, p).copy_(torch.cat(branches))
            if continuous:
                getattr(ours.mu_head, p).copy_(theirs[f"action_model._continuous_distribution.mu.{p}"])
        if continuous:
            ours.log_sigma.copy_(theirs["action_model._continuous_distribution.log_sigma"].reshape(-1))
    ours_path = export_ppo_onnx(ours, str(tmp_path / "ours.onnx"), obs_sizes=OBS_SIZES)
    theirs_path = tmp_path / "mlagents.onnx"
    assert io_signature(onnx.load(ours_path)) == io_signature(onnx.load(str(theirs_path)))

    rng = np.random.default_rng(5)
    obs = random_obs(256, sum(OBS_SIZES), 4)
    masks = (rng.random((256, sum(BRANCHES))) < 0.6).astype(np.float32)
    masks[np.arange(256), rng.integers(0, 3, 256)] = 1.0  # every branch keeps an allowed action
    masks[np.arange(256), 3 + rng.integers(0, 2, 256)] = 1.0
    feeds = {**split(obs), "action_masks": masks}
    got = dict(zip(io_signature(onnx.load(ours_path))["output_order"], session(ours_path).run(None, feeds)))
    want = dict(
        zip(io_signature(onnx.load(str(theirs_path)))["output_order"], session(theirs_path).run(None, feeds))
    )
    assert (
        got["discrete_action_output_shape"].tolist()
        == want["discrete_action_output_shape"].tolist()
        == [[3, 2]]
    )
    np.testing.assert_array_equal(
        got["deterministic_discrete_actions"], want["deterministic_discrete_actions"]
    )
    if continuous:
        np.testing.assert_allclose(
            got["deterministic_continuous_actions"], want["deterministic_continuous_actions"], atol=ATOL
        )
    # the torch policy's greedy actions, and samples only where the mask allows
    greedy = ours.act(torch.from_numpy(obs), deterministic=True, action_mask=torch.from_numpy(masks > 0))
    np.testing.assert_array_equal(got["deterministic_discrete_actions"], greedy.discrete_action.numpy())
    offsets = np.array([0, 3])
    assert (np.take_along_axis(masks, got["discrete_actions"] + offsets, axis=1) == 1).all()
