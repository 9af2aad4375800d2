"""PPO with visual observations: the encoders against ML-Agents' and SB3's own classes (weights copied,
outputs equal), the policy's sensor split against ML-Agents' ObservationEncoder, refusals, and short runs
of launch_ppo through a fake Unity camera over gRPC and a tiny uint8 image env."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from impala.envs.obs_layout import ObsLayout, image_layout  # noqa: E402
from impala.nets import visual  # noqa: E402
from impala.nets.ppo_policy import make_policy  # noqa: E402
from impala.options import ConfigError  # noqa: E402
from impala.run.ppo_config import PPOConfig  # noqa: E402

LAUNCH_PPO = str(Path(sys.executable).parent / "launch_ppo")


def _mlagents():
    from mlagents_shims import require_mlagents

    require_mlagents()
    from mlagents.trainers.torch import encoders

    return encoders


@pytest.mark.parametrize(
    "kind, theirs, hwc",
    [
        ("simple", "SimpleVisualEncoder", (20, 24, 3)),
        ("nature_cnn", "NatureVisualEncoder", (36, 40, 2)),
        ("resnet", "ResNetVisualEncoder", (15, 17, 3)),
    ],
)
def test_mlagents_encoders_match_their_classes(kind, theirs, hwc):
    """ML-Agents' encoder (NHWC input, permuted inside) and ours (NCHW after the policy's permute) give the
    same features with the same weights: same layers, same state_dict keys."""
    enc = _mlagents()
    h, w, c = hwc
    torch.manual_seed(0)
    ref = getattr(enc, theirs)(h, w, c, 24)
    ours, size = visual.make_encoder(kind, (c, h, w), 24, 2)
    assert size == 24
    ours.load_state_dict(ref.state_dict())  # strict: the keys are ML-Agents' own
    x = torch.rand(5, h, w, c)
    torch.testing.assert_close(ours(x.permute(0, 3, 1, 2)), ref(x), atol=1e-5, rtol=1e-5)


def test_mlagents_dense_init_is_kaiming_linear_times_1_41():
    ours, _ = visual.make_encoder("simple", (3, 84, 84), 256, 1, torch.Generator().manual_seed(0))
    w = ours.dense[0].weight
    expected = 1.41 / math.sqrt(w.shape[1])
    assert abs(w.std().item() - expected) / expected < 0.05 and not ours.dense[0].bias.any()


def test_policy_encodes_sensors_as_mlagents_observation_encoder():
    """A [vector 4, camera 20x20x3] behaviour: ML-Agents' ObservationEncoder (normalize=True: the vector
    sensor only) and our actor's input agree once the weights and normalizer updates are the same."""
    _mlagents()
    from mlagents.trainers.settings import EncoderType
    from mlagents.trainers.torch.networks import ObservationEncoder
    from mlagents_envs.base_env import DimensionProperty, ObservationSpec, ObservationType

    def spec(shape, props):
        return ObservationSpec(shape, props, ObservationType.DEFAULT, "o")

    specs = [
        spec((4,), (DimensionProperty.NONE,)),
        spec((20, 20, 3), (DimensionProperty.TRANSLATIONAL_EQUIVARIANCE,) * 2 + (DimensionProperty.NONE,)),
    ]
    ref = ObservationEncoder(specs, 16, EncoderType.SIMPLE, normalize=True)
    cfg = PPOConfig.preset("mlagents", hidden_units=16)
    policy = make_policy(cfg, 4 + 1200, 0, (3,), ObsLayout(((4,), (20, 20, 3))))
    policy.actor_encoders[0].load_state_dict(ref.processors[1].state_dict())
    assert policy.actor_norm.mean.shape == (4,)  # images are not normalized
    g = torch.Generator().manual_seed(1)
    vec, img = torch.randn(7, 4, generator=g) * 3 + 1, torch.rand(7, 20, 20, 3, generator=g)
    flat = torch.cat([vec, img.reshape(7, -1)], dim=1)
    policy.update_normalizer(flat)
    ref.processors[0].update_normalization(vec)
    got = policy._actor_in(flat, False)
    torch.testing.assert_close(got, ref([vec, img]), atol=1e-5, rtol=1e-5)
    assert policy.actor_body[0].in_features == ref.total_enc_size == 4 + 16


def test_sb3_nature_cnn_matches_sb3():
    """SB3's NatureCNN on a channel-last uint8 Box (SB3: VecTransposeImage, then / 255 in preprocess_obs)
    and our policy's image path (permute, * 1/255) give the same features with the same weights."""
    gym = pytest.importorskip("gymnasium")
    sb3_layers = pytest.importorskip("stable_baselines3.common.torch_layers")
    from stable_baselines3.common.preprocessing import preprocess_obs

    chw_space = gym.spaces.Box(0, 255, (3, 40, 36), np.uint8)
    torch.manual_seed(0)
    ref = sb3_layers.NatureCNN(chw_space, features_dim=512)
    layout = image_layout((40, 36, 3), "uint8")
    assert layout.channels_last and layout.image_scale == 1 / 255
    cfg = PPOConfig.preset("sb3", obs_norm="none")
    assert cfg.vis_encode_type == "sb3_nature_cnn"
    policy = make_policy(cfg, 40 * 36 * 3, 0, (2,), layout)
    policy.actor_encoders[0].load_state_dict(ref.state_dict())
    hwc = np.random.default_rng(0).integers(0, 256, (6, 40, 36, 3), dtype=np.uint8)
    theirs = ref(preprocess_obs(torch.as_tensor(hwc.transpose(0, 3, 1, 2)), chw_space))
    flat = torch.as_tensor(hwc.reshape(6, -1), dtype=torch.float32)  # what the unroll carries
    torch.testing.assert_close(policy._actor_in(flat, False), theirs, atol=1e-5, rtol=1e-5)
    # SB3's ortho_init of a features extractor: orthogonal, gain sqrt(2), zero biases.
    lin = policy.critic_encoders[0].linear[0]
    torch.testing.assert_close(
        lin.weight.T @ lin.weight, 2 * torch.eye(lin.weight.shape[1]), atol=1e-4, rtol=0
    )
    # beside another sensor SB3's MultiInputPolicy (CombinedExtractor) uses 256 features
    both = make_policy(cfg, 5 + 40 * 36 * 3, 0, (2,), ObsLayout(((5,), (3, 40, 36)), channels_last=False))
    assert both.actor_body[0].in_features == 5 + 256


def test_refusals_are_one_line():
    layout = ObsLayout(((4,), (20, 20, 3)))
    with pytest.raises(ConfigError, match=r"^obs_norm: 'vecnormalize' does not take image observations"):
        make_policy(PPOConfig.preset("sb3"), 1204, 0, (3,), layout)
    with pytest.raises(ConfigError, match=r"too small for 'nature_cnn', whose minimum side is 36.*resnet"):
        make_policy(PPOConfig.preset("mlagents", vis_encode_type="nature_cnn"), 1204, 0, (3,), layout)
    with pytest.raises(
        ConfigError, match="vis_encode_type: must be one of simple, nature_cnn, resnet, sb3_nature_cnn"
    ):
        PPOConfig(vis_encode_type="match3")
    with pytest.raises(ValueError, match="vector .rank 1. or an image .rank 3."):
        ObsLayout(((4, 4),))


def test_trainer_yaml_vis_encode_type(tmp_path):
    from impala.run.ppo_config import from_mlagents_yaml

    f = tmp_path / "t.yaml"
    f.write_text("behaviors:\n  B:\n    network_settings:\n      vis_encode_type: resnet\n")
    assert from_mlagents_yaml(str(f)).vis_encode_type == "resnet"
    f.write_text("behaviors:\n  B:\n    network_settings:\n      vis_encode_type: match3\n")
    with pytest.raises(ConfigError, match=r"vis_encode_type: 'match3' is not built here; use one of simple"):
        from_mlagents_yaml(str(f))


def test_onnx_export_refuses_visual_policies(tmp_path):
    from impala.nets.onnx_export import ExportError, export_ppo_onnx

    policy = make_policy(PPOConfig.preset("mlagents"), 1204, 0, (3,), ObsLayout(((4,), (20, 20, 3))))
    with pytest.raises(ExportError, match="visual observations .simple encoders. is not written yet"):
        export_ppo_onnx(policy, str(tmp_path / "x.onnx"))


def test_agent_spec_carries_the_layout():
    from impala.transport.messages import PPOAgentSpec

    spec = PPOAgentSpec(
        PPOConfig.preset("mlagents"),
        1204,
        0,
        (),
        (),
        branches=(3,),
        obs_layout=ObsLayout(((4,), (20, 20, 3))),
    )
    back = PPOAgentSpec.from_dict(spec.to_dict())
    assert back.obs_layout == spec.obs_layout and back.obs_layout.visual
    old = spec.to_dict()
    del old["obs_layout"]  # settings from before visual observations: one vector
    assert PPOAgentSpec.from_dict(old).obs_layout == ObsLayout()


# ------------------------------------------------------------------------------ end to end


def _launch(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{HERE.parent}:{HERE}")
    return subprocess.run(
        [LAUNCH_PPO, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE.parent
    )


def test_visual_unity_agent_learns_over_grpc(tmp_path):
    """The fake player's ``visual`` behaviour (vector 2 + camera 20x20x3, one masked branch of 3 whose
    rewarded action only the image shows) trains with ML-Agents' simple encoder: random choice among the
    allowed actions earns about 14 of the best 27.5 per episode; 6k steps reach > 20 (about 24 here)."""
    pytest.importorskip("mlagents_envs")
    from fake_unity import write_fake_build
    from test_launch_ppo import free_base_port

    records = tmp_path / "records"
    records.mkdir()
    build = write_fake_build(tmp_path / "Visual.x86_64", preset="visual", record=records / "player.json")
    run = _launch(
        "--unity-build", str(build), "--semantics", "mlagents", "--workers", "1",
        "--unity-base-port", str(free_base_port(1)), "--buffer-size", "256", "--batch-size", "64",
        "--hidden-units", "32", "--num-layers", "1", "--time-horizon", "32", "--unroll-length", "32",
        "--learning-rate", "3e-3", "--beta", "0.005", "--total-steps", "6000", "--log-interval", "0",
        "--no-progress", "--logdir", str(tmp_path / "run"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    mean = float(re.search(r"mean return \(last 100\) ([\d.]+)", run.stdout).group(1))
    assert mean > 20, run.stdout[-2000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert any(k.startswith("actor_encoders.0.conv_layers") for k in ckpt["trainer"]["policy"])
    assert run.stderr.count("is not written yet") == 1  # the ONNX refusal is said once, not per checkpoint


def test_image_env_runs_under_sb3_and_refuses_vecnormalize(tmp_path):
    """``--env custom_envs:TinyImage-v0`` (uint8 36x36x1) under SB3 semantics with NatureCNN: two updates
    run; the preset's VecNormalize is refused in one line."""
    common = ["--env", "custom_envs:TinyImage-v0", "--semantics", "sb3", "--workers", "1"]
    bad = _launch(*common, "--total-steps", "64", "--logdir", str(tmp_path / "bad"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("launch_ppo: error: obs_norm: 'vecnormalize'")
    assert "Traceback" not in bad.stderr
    run = _launch(
        *common, "--obs-norm", "none", "--envs-per-worker", "4", "--buffer-size", "128", "--batch-size", "64",
        "--num-epoch", "2", "--unroll-length", "32", "--total-steps", "256", "--log-interval", "0",
        "--no-progress", "--logdir", str(tmp_path / "run"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "launch_ppo: done" in run.stdout


def test_env_layouts_and_atari_refusal():
    from impala.envs import EnvSpec
    from impala.envs.probe import EnvInfo

    img = EnvInfo(EnvSpec("CartPole-v1"), (36, 36, 1), "uint8", "Box", "Discrete", num_actions=2)
    img.require_ppo_spaces("launch_ppo")
    assert img.obs_layout == ObsLayout(((36, 36, 1),), channels_last=True, image_scale=1 / 255)
    unity = EnvInfo(EnvSpec("unity:V"), (1202,), "float32", "Box", "Box", obs_shapes=((2,), (20, 20, 3)))
    assert unity.obs_layout.visual and unity.obs_layout.image_scale == 1.0
    pong = EnvInfo(EnvSpec("ALE/Pong-v5"), (4, 84, 84), "uint8", "Box", "Discrete", num_actions=6)
    with pytest.raises(ConfigError, match=r"^ALE/Pong-v5 is an Atari game; launch_ppo does not train Atari"):
        pong.require_ppo_spaces("launch_ppo")
