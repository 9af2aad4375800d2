"""``launch_ppo`` with ``mlagents-learn``'s command line and every part of an ML-Agents trainer YAML.

The Unity case runs the real console script against the fake Unity player (``tests/fake_unity.py``,
started by mlagents-envs as a build, over real gRPC) and reads what each player received. The rest
calls ``launch_ppo.main`` in this process (tiny Pendulum runs with in-process actors) or its parser.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("mlagents_envs")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from impala.options import ConfigError  # noqa: E402
from impala.run.ppo_config import from_mlagents_yaml, ppo_config_from_file, read_mlagents_yaml  # noqa: E402
from learner.cli import launch_ppo  # noqa: E402
from test_launch_ppo import free_base_port, recording_build, wait_records  # noqa: E402

LAUNCH_PPO = str(Path(sys.executable).parent / "launch_ppo")
TINY_BEHAVIOUR = {
    "trainer_type": "ppo",
    "hyperparameters": {"batch_size": 32, "buffer_size": 64},
    "network_settings": {"hidden_units": 8, "num_layers": 1},
    "time_horizon": 16,
    "max_steps": 256,
}
PENDULUM = ["--env", "Pendulum-v1", "--in-process", "--no-progress", "--torch-device", "cpu"]


def write_yaml(path: Path, doc: dict) -> str:
    path.write_text(yaml.safe_dump(json.loads(json.dumps(doc)), sort_keys=False))  # no YAML aliases
    return str(path)


def error_line(capsys) -> str:
    """The one line an entry point printed on stderr for bad input (log lines aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.match(r"^\d{4}-\d\d-\d\d ", ln)]
    assert len(lines) == 1 and lines[0].startswith("launch_ppo: error: "), lines
    return lines[0]


def main_rc(*argv: str) -> int:
    try:
        return launch_ppo.main(list(argv))
    except SystemExit as e:  # argparse
        return int(e.code)


# ------------------------------------------------------------------ the Unity command line, end to end


def _onnx_plays_the_checkpoint(run: Path) -> None:
    """The run's <behaviour>.onnx, in onnxruntime, gives the checkpoint's torch policy's deterministic
    actions (one input per Crawler sensor: 126 + 32 values)."""
    import numpy as np

    ort = pytest.importorskip("onnxruntime")
    from impala.evaluation import read_policy_checkpoint
    from impala.nets.ppo_policy import env_action, make_policy
    from impala.transport.params import load_state_arrays

    ck = read_policy_checkpoint(str(run))
    agent = ck.agent
    policy = make_policy(agent.config, agent.obs_dim, agent.action_dim, agent.branches, agent.obs_layout)
    load_state_arrays(policy, ck.params)
    obs = np.random.default_rng(0).normal(0.0, 2.0, (16, agent.obs_dim)).astype(np.float32)
    session = ort.InferenceSession(str(run / "CrawlerFake.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["deterministic_continuous_actions"], {"obs_0": obs[:, :126], "obs_1": obs[:, 126:]})[0]
    with torch.no_grad():
        want = env_action(policy.mean(torch.from_numpy(obs)), mode=agent.config.action_clip)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)


def test_mlagents_learn_command_line_against_fake_unity(tmp_path):
    """``launch_ppo config.yaml --run-id X --num-envs 2 --env BUILD --time-scale 20`` as typed for
    mlagents-learn: two Unity instances on base_port + 0/1 get the engine settings (the command line's time
    scale over the file's, the file's width), the run lands in results/X/<behaviour>/ with
    results/X/configuration.yaml and results/X/<behaviour>.onnx."""
    base = free_base_port(3)
    records = tmp_path / "records"
    recording_build(tmp_path / "FakeCrawler.x86_64", records)
    behaviour = {
        **TINY_BEHAVIOUR,
        "hyperparameters": {"batch_size": 64, "buffer_size": 256},
        "network_settings": {"hidden_units": 16, "num_layers": 1, "normalize": True},
        "reward_signals": {"extrinsic": {"gamma": 0.99, "strength": 0.5}},
        "time_horizon": 32,
        "max_steps": 700,
        "summary_freq": 200,
    }
    write_yaml(
        tmp_path / "config.yaml",
        {
            "behaviors": {"CrawlerFake": behaviour},
            "env_settings": {"base_port": base},
            "engine_settings": {"time_scale": 5, "width": 100, "no_graphics": True},
        },
    )
    cmd = [LAUNCH_PPO, "config.yaml", "--run-id", "X", "--num-envs", "2", "--env", "FakeCrawler.x86_64"]
    out = subprocess.run(
        [*cmd, "--time-scale", "20", "--log-interval", "1000", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "launch_ppo: done" in out.stdout
    run = tmp_path / "results" / "X"
    assert (run / "CrawlerFake" / "checkpoint.pt").is_file()
    assert (run / "CrawlerFake.onnx").is_file() and (run / "CrawlerFake" / "CrawlerFake.onnx").is_file()
    _onnx_plays_the_checkpoint(run / "CrawlerFake")
    resolved = yaml.safe_load((run / "configuration.yaml").read_text())
    assert resolved["engine_settings"]["time_scale"] == 20.0 and resolved["engine_settings"]["width"] == 100
    assert resolved["env_settings"]["num_envs"] == 2 and resolved["env_settings"]["base_port"] == base
    assert resolved["checkpoint_settings"]["run_id"] == "X"
    assert resolved["behaviors"]["CrawlerFake"]["reward_signals"]["extrinsic"]["strength"] == 0.5
    back = read_mlagents_yaml(str(run / "configuration.yaml"))  # reads back as a trainer YAML
    assert ppo_config_from_file(back) == from_mlagents_yaml(str(tmp_path / "config.yaml"))
    assert back.run["time_scale"] == 20.0 and back.run["workers"] == 2

    # --num-envs 2: workers on base + 0 and base + 1; the launcher's probe on base + 2 (default settings)
    rec = wait_records(records, [base, base + 1, base + 2])
    for port in (base, base + 1):
        engine = rec[port]["engine_config"]
        assert engine["time_scale"] == 20.0, engine
        assert engine["screen_resolution"] == [100, 84], engine
        assert (engine["quality_level"], engine["target_frame_rate"], engine["capture_frame_rate"]) == (
            5,
            -1,
            60,
        )
        assert "-nographics" in rec[port]["args"] and rec[port]["n_steps"] > 0
    # summary_freq 200 (in agent steps), not --log-interval 1000 s: a row per 200 steps passed
    with open(run / "CrawlerFake" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert len(steps) >= 3 and all(b // 200 > a // 200 for a, b in zip(steps, steps[1:])), steps

    # the same command again: the run's folder holds a run (as mlagents-learn: --resume or --force)
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert (
        again.stderr.strip()
        .splitlines()[-1]
        .startswith("launch_ppo: error: run folder results/X/CrawlerFake")
    )

    # --resume with other engine settings (they do not make it another env): the new time scale reaches Unity
    for f in records.iterdir():
        f.unlink()
    resumed = subprocess.run(
        [*cmd, "--resume", "--time-scale", "10", "--total-steps", "1100", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rec = wait_records(records, [base, base + 1])
    assert rec[base]["engine_config"]["time_scale"] == 10.0 and rec[base]["n_steps"] > 0
    assert int(torch.load(run / "CrawlerFake" / "checkpoint.pt", weights_only=True)["agent_steps"]) >= 1100


def test_graphics_and_env_args_reach_the_player(tmp_path):
    """engine_settings.no_graphics: false and env_settings.env_args, as UnityVecEnv gives them to a build."""
    from impala.envs.unity import UnityVecEnv

    port = free_base_port(1)
    build = recording_build(tmp_path / "FakeCrawler.x86_64", tmp_path / "rec")
    env = UnityVecEnv(
        str(build), base_port=port, timeout_wait=30, no_graphics=False, additional_args=["--mode", "x"]
    )
    env.close()
    args = wait_records(tmp_path / "rec", [port])[port]["args"]
    assert "-nographics" not in args and args[-2:] == ["--mode", "x"], args


def test_unity_build_path_that_does_not_exist_is_one_line(tmp_path):
    out = subprocess.run(
        [LAUNCH_PPO, "--env", "builds/NoSuchCrawler.x86_64"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "launch_ppo: error: --env builds/NoSuchCrawler.x86_64: no Unity build there (no such file or "
        f"folder, resolved against {tmp_path}); pass the path of the build, e.g. builds/Crawler.x86_64, or a "
        "gymnasium id"
    )


def test_env_path_or_gymnasium_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build = recording_build(tmp_path / "Game.x86_64", tmp_path / "rec")
    args = launch_ppo.parse_args(["--env", str(build)])
    assert (args.unity_build, args.env) == (str(build), None)
    args = launch_ppo.parse_args(["--env", "Game"])  # completed to Game.x86_64 as mlagents-envs does
    assert (args.unity_build, args.env) == ("Game", None)
    args = launch_ppo.parse_args(["--env", "Pendulum-v1"])
    assert (args.unity_build, args.env) == (None, "Pendulum-v1")
    with pytest.raises(ConfigError, match="--env ./Nothing: no Unity build there"):
        launch_ppo.parse_args(["--env", "./Nothing"])
    with pytest.raises(ConfigError, match="pass either --unity-build or --env"):
        launch_ppo.parse_args(["--env", str(build), "--unity-build", str(build)])


# ------------------------------------------------------------------ precedence: defaults < YAML < flags


def test_flags_override_the_trainer_yaml_which_overrides_defaults(tmp_path):
    path = write_yaml(
        tmp_path / "t.yaml",
        {
            "behaviors": {"B": TINY_BEHAVIOUR},
            "env_settings": {"base_port": 6000, "num_envs": 3, "seed": 7},
            "engine_settings": {"time_scale": 5, "width": 100, "height": 90, "no_graphics": False},
            "checkpoint_settings": {"run_id": "fromfile", "results_dir": "res", "force": True},
            "torch_settings": {"device": "cpu"},
        },
    )
    names = ("unity_base_port", "workers", "seed", "time_scale", "width")
    names += ("graphics", "run_id", "runs_dir", "force", "device")
    settings = lambda argv: {k: getattr(launch_ppo.parse_args(argv), k) for k in names}
    from_file = {"unity_base_port": 6000, "workers": 3, "seed": 7, "time_scale": 5.0, "width": 100}
    from_file |= {"graphics": True, "run_id": "fromfile", "runs_dir": "res", "force": True, "device": "cpu"}
    assert settings([path]) == from_file
    flags = ["--base-port", "7000", "--num-envs", "2", "--seed", "3", "--time-scale", "20", "--no-graphics"]
    flags += ["--run-id", "cli", "--results-dir", "out", "--torch-device", "auto", "--no-force"]
    from_flags = {"unity_base_port": 7000, "workers": 2, "seed": 3, "time_scale": 20.0, "width": 100}
    from_flags |= {"graphics": False, "run_id": "cli", "runs_dir": "out", "force": False, "device": "auto"}
    assert settings([path, *flags]) == from_flags
    # --trainer-config reads the same file the same way (without mlagents-learn's defaults and layout)
    args = launch_ppo.parse_args(["--trainer-config", path, "--height", "60"])
    assert (args.height, args.width, args.workers, args.mlagents_form) == (60, 100, 3, False)
    # mlagents-learn's defaults in its form: results/, run id ppo, one Unity instance
    bare = write_yaml(tmp_path / "bare.yaml", {"behaviors": {"B": TINY_BEHAVIOUR}})
    args = launch_ppo.parse_args([bare])
    assert (args.runs_dir, args.run_id, args.workers) == ("results", "ppo", 1)
    args = launch_ppo.parse_args(["--trainer-config", bare])
    assert (args.runs_dir, args.run_id, args.workers) == ("runs", None, 2)


def test_a_config_preset_yields_to_the_trainer_yaml(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("time_scale: 3\nheight: 70\nworkers: 4\n")
    path = write_yaml(
        tmp_path / "t.yaml", {"behaviors": {"B": TINY_BEHAVIOUR}, "engine_settings": {"time_scale": 5}}
    )
    args = launch_ppo.parse_args(["--config", str(preset), path])
    assert (args.time_scale, args.height, args.workers) == (5.0, 70, 4)


def test_resume_and_initialize_from_precedence(tmp_path):
    path = write_yaml(
        tmp_path / "t.yaml",
        {"behaviors": {"B": TINY_BEHAVIOUR}, "checkpoint_settings": {"initialize_from": "old"}},
    )
    args = launch_ppo.parse_args([path, "--resume"])  # the command line's resume over the file's init
    assert (args.resume, args.initialize_from) == (True, None)
    path = write_yaml(
        tmp_path / "r.yaml", {"behaviors": {"B": TINY_BEHAVIOUR}, "checkpoint_settings": {"resume": True}}
    )
    args = launch_ppo.parse_args([path, "--initialize-from", "old"])
    assert (args.resume, args.initialize_from) == (False, "old")
    with pytest.raises(ConfigError, match="give one"):
        launch_ppo.parse_args([path.replace("r.yaml", "t.yaml"), "--resume", "--initialize-from", "x"])


# ------------------------------------------------------------------ every part of a trainer YAML


def test_default_settings_merge_key_by_key_as_mlagents(tmp_path):
    path = write_yaml(
        tmp_path / "t.yaml",
        {
            "default_settings": {
                "hyperparameters": {"batch_size": 32, "buffer_size": 128, "learning_rate": 1e-3},
                "network_settings": {"hidden_units": 64, "normalize": True},
                "reward_signals": {"extrinsic": {"gamma": 0.9, "strength": 0.5}},
                "max_steps": 1000,
                "summary_freq": 100,
            },
            "behaviors": {
                "B": {
                    "hyperparameters": {"buffer_size": 256},  # nested: only this key replaced
                    "reward_signals": {"extrinsic": {"gamma": 0.8}},
                    "max_steps": 2000,
                }
            },
        },
    )
    file = read_mlagents_yaml(path)
    cfg = ppo_config_from_file(file)
    assert (cfg.batch_size, cfg.buffer_size, cfg.learning_rate) == (32, 256, 1e-3)
    assert (cfg.hidden_units, cfg.obs_norm, cfg.gamma, cfg.max_steps) == (64, "mlagents", 0.8, 2000)
    assert file.run == {"summary_freq": 100, "extrinsic_strength": 0.5}
    # a file with only default_settings: any behaviour takes them
    only = write_yaml(tmp_path / "d.yaml", {"default_settings": {"hyperparameters": {"batch_size": 16}}})
    assert from_mlagents_yaml(only).batch_size == 16
    assert from_mlagents_yaml(only, behavior="Anything").batch_size == 16


OK = None
# (section of a trainer YAML, what it sets: launch options (dict), PPOConfig fields ("ppo", dict), or the
# start of the one-line refusal (str))
CASES = [
    ({"env_settings": {"env_path": "Pendulum-v1"}}, {"env": "Pendulum-v1"}),
    ({"env_settings": {"env_args": ["-a", "1"]}}, {"env_args": ("-a", "1")}),
    ({"env_settings": {"base_port": 6000}}, {"unity_base_port": 6000}),
    ({"env_settings": {"num_envs": 3}}, {"workers": 3}),
    ({"env_settings": {"seed": 11}}, {"seed": 11}),
    ({"env_settings": {"num_areas": 1, "max_lifetime_restarts": 10}}, {}),
    ({"env_settings": {"num_areas": 2}}, "env_settings.num_areas: 2 is not supported"),
    (
        {"env_settings": {"max_lifetime_restarts": 3}},
        "env_settings.max_lifetime_restarts: 3 is not supported",
    ),
    ({"env_settings": {"port": 1}}, "env_settings.port: unknown key"),
    ({"engine_settings": {"width": 100, "height": 90, "quality_level": 2}}, {"width": 100, "height": 90}),
    (
        {"engine_settings": {"time_scale": 1, "target_frame_rate": 30}},
        {"time_scale": 1.0, "target_frame_rate": 30},
    ),
    ({"engine_settings": {"capture_frame_rate": 0, "no_graphics": False}}, {"graphics": True}),
    ({"engine_settings": {"width": "wide"}}, "engine_settings.width: expected an integer"),
    ({"checkpoint_settings": {"run_id": "r", "results_dir": "res"}}, {"run_id": "r", "runs_dir": "res"}),
    ({"checkpoint_settings": {"resume": True, "inference": True}}, {"resume": True, "inference": True}),
    ({"checkpoint_settings": {"load_model": True}}, {"resume": True}),
    (
        {"checkpoint_settings": {"force": True, "initialize_from": "x"}},
        {"force": True, "initialize_from": "x"},
    ),
    ({"checkpoint_settings": {"train_model": False, "initialize_from": None}}, {}),
    ({"torch_settings": {"device": "cpu"}}, {"device": "cpu"}),
    ({"debug": True}, {"log_level": "DEBUG"}),
    ({"environment_parameters": {"x": 1}}, "environment_parameters: not supported"),
    ({"behaviours": {}}, "behaviours: unknown key"),
    ({"B": {"summary_freq": 500, "checkpoint_interval": 1000, "keep_checkpoints": 2}}, {"summary_freq": 500}),
    ({"B": {"reward_signals": {"extrinsic": {"strength": 0.5, "gamma": 0.9}}}}, ("ppo", {"gamma": 0.9})),
    (
        {"B": {"reward_signals": {"extrinsic": {"strength": -1}}}},
        "behaviors.B.reward_signals.extrinsic.strength",
    ),
    (
        {"B": {"reward_signals": {"curiosity": {"strength": 0.1}}}},
        "behaviors.B.reward_signals.curiosity: the",
    ),
    ({"B": {"reward_signals": {"gail": {"demo_path": "x"}}}}, "behaviors.B.reward_signals.gail: the GAIL"),
    ({"B": {"reward_signals": {"rnd": {}}}}, "behaviors.B.reward_signals.rnd: the RND"),
    ({"B": {"trainer_type": "sac"}}, "behaviors.B.trainer_type: sac: SAC is not implemented"),
    ({"B": {"trainer_type": "poca"}}, "behaviors.B.trainer_type: poca: MA-POCA"),
    (
        {"B": {"self_play": {"window": 10}}},
        "behaviors.B.self_play: {'window': 10} is not supported (self-play",
    ),
    (
        {"B": {"behavioral_cloning": {"demo_path": "d"}}},
        "behaviors.B.behavioral_cloning: {'demo_path': 'd'} is",
    ),
    ({"B": {"network_settings": {"memory": {"memory_size": 64}}}}, "behaviors.B.network_settings.memory: {"),
    ({"B": {"network_settings": {"memory": None, "vis_encode_type": "simple"}}}, ("ppo", {})),
    (
        {"B": {"network_settings": {"deterministic": True}}},
        "behaviors.B.network_settings.deterministic: True",
    ),
    ({"B": {"hyperparameters": {"shared_critic": True}}}, "behaviors.B.hyperparameters.shared_critic: True"),
    ({"B": {"threaded": True}}, "behaviors.B.threaded: True is not supported"),
    ({"B": {"even_checkpoints": True}}, "behaviors.B.even_checkpoints: True is not supported"),
    ({"B": {"init_path": "old/B.pt"}}, "behaviors.B.init_path: 'old/B.pt' is not supported"),
    ({"B": {"summary_freqs": 1}}, "behaviors.B.summary_freqs: unknown key"),
]


@pytest.mark.parametrize("section,expected", CASES, ids=[str(i) for i in range(len(CASES))])
def test_each_part_of_a_trainer_yaml_is_honoured_or_refused(section, expected, tmp_path):
    behaviour = {**TINY_BEHAVIOUR, **section.pop("B", {})}
    path = write_yaml(tmp_path / "t.yaml", {"behaviors": {"B": behaviour}, **section})
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as e:
            ppo_config_from_file(read_mlagents_yaml(path))
        assert str(e.value).startswith(expected), str(e.value)
        assert "\n" not in str(e.value)
        return
    file = read_mlagents_yaml(path)
    cfg = ppo_config_from_file(file)
    if isinstance(expected, tuple):
        assert all(getattr(cfg, k) == v for k, v in expected[1].items()), cfg
    else:
        assert {k: file.run[k] for k in expected} == expected, file.run


def test_random_seed_as_mlagents(tmp_path):
    path = write_yaml(tmp_path / "t.yaml", {"behaviors": {"B": TINY_BEHAVIOUR}, "env_settings": {"seed": -1}})
    seeds = {read_mlagents_yaml(path).run["seed"] for _ in range(20)}
    assert all(0 <= s < 10_000 for s in seeds) and len(seeds) > 1


def test_several_behaviours_are_refused_naming_them_and_behavior(tmp_path, capsys):
    path = write_yaml(
        tmp_path / "t.yaml", {"behaviors": {"Walker": TINY_BEHAVIOUR, "Crawler": TINY_BEHAVIOUR}}
    )
    assert main_rc(path, *PENDULUM) == 2
    line = error_line(capsys)
    assert "2 behaviours (Walker, Crawler)" in line and "--behavior NAME" in line
    file = read_mlagents_yaml(path, "Crawler")
    assert file.behavior == "Crawler"


# ------------------------------------------------------------------ bad input: one line, exit 2


@pytest.mark.parametrize(
    "doc,extra,expected",
    [
        (
            {"behaviors": {"B": {**TINY_BEHAVIOUR, "hyperparameter": {}}}},
            [],
            "behaviors.B.hyperparameter: unknown",
        ),
        (
            {"behaviors": {"B": TINY_BEHAVIOUR}, "engine_settings": {"time_scale": 0}},
            [],
            "--time-scale must be > 0",
        ),
        ({"behaviors": {"B": TINY_BEHAVIOUR}}, ["--width", "0"], "--width must be >= 1"),
        (
            {"behaviors": {"B": TINY_BEHAVIOUR}},
            ["--time-scale", "5"],
            "--time-scale 5.0: engine settings apply",
        ),
        (
            {"behaviors": {"B": TINY_BEHAVIOUR}},
            ["--initialize-from", "nothing"],
            "--initialize-from nothing: no",
        ),
        ({"behaviors": {"B": TINY_BEHAVIOUR}}, ["--trainer-config", "x.yaml"], "the trainer YAML twice"),
        (
            {"behaviors": {"B": {**TINY_BEHAVIOUR, "max_steps": "many"}}},
            [],
            "behaviors.B.max_steps: expected an",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(doc, extra, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_yaml(tmp_path / "t.yaml", doc)
    assert main_rc(path, *PENDULUM, *extra) == 2
    assert expected in error_line(capsys)
    # a failed start leaves none of the folders it made: RESULTS_DIR/RUN_ID/<behaviour> nor new parents
    assert os.listdir(tmp_path) == ["t.yaml"]


# ------------------------------------------------------------------ checkpoints, initialize_from, inference


def test_checkpoints_initialize_from_and_inference(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="launch_ppo")
    behaviour = {**TINY_BEHAVIOUR, "max_steps": 512, "checkpoint_interval": 128, "keep_checkpoints": 2}
    path = write_yaml(tmp_path / "t.yaml", {"behaviors": {"Pendulum": behaviour}})
    assert main_rc(path, "--run-id", "A", *PENDULUM) == 0
    folder = tmp_path / "results" / "A" / "Pendulum"
    numbered = sorted(p.name for p in folder.glob("Pendulum-v1-*.pt"))
    assert len(numbered) == 2, numbered  # keep_checkpoints 2 of the 3+ written
    assert len(list(folder.glob("Pendulum-v1-*.onnx"))) == 2
    first = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert first["trainer"]["total_steps"] >= 256

    # initialize_from: A's weights, not its counters
    capsys.readouterr()
    small = write_yaml(tmp_path / "s.yaml", {"behaviors": {"Pendulum": {**TINY_BEHAVIOUR, "max_steps": 128}}})
    assert main_rc(small, "--run-id", "B", "--initialize-from", "A", *PENDULUM) == 0
    assert "initialized from results/A/Pendulum/checkpoint.pt" in caplog.text
    second = torch.load(tmp_path / "results" / "B" / "Pendulum" / "checkpoint.pt", weights_only=True)
    assert 0 < second["trainer"]["total_steps"] <= 256 and second["version"] <= 2
    # the loader alone: a fresh trainer takes A's weights, optimizer and normalizers, and starts at step 0
    from impala.envs import EnvSpec
    from impala.envs.probe import probe_env
    from impala.run.config import RunConfig

    run = RunConfig(env="Pendulum-v1", workers=1, unroll_length=16, device="cpu")
    fresh = launch_ppo.MLAgentsPPOTrainer(
        ppo_config_from_file(read_mlagents_yaml(small)), run, probe_env(EnvSpec("Pendulum-v1"), seed=0)
    )
    fresh.initialize_from(str(folder / "checkpoint.pt"))
    saved = first["trainer"]["policy"]
    assert all(torch.equal(v.cpu(), saved[k]) for k, v in fresh.learner.policy.state_dict().items())
    assert (fresh.learner.total_steps, fresh.learner.update_count) == (0, 0)

    # inference: no updates, no checkpoint; the banner says so
    capsys.readouterr()
    assert main_rc(small, "--run-id", "C", "--initialize-from", "A", "--inference", *PENDULUM) == 0
    out = capsys.readouterr().out
    assert "launch_ppo: INFERENCE: the policy acts (weights of results/A/Pendulum/checkpoint.pt)" in out
    assert "0 updates" in out and "no checkpoint written" in out
    assert not (tmp_path / "results" / "C" / "Pendulum" / "checkpoint.pt").exists()

    # --resume --inference on a finished run plays its checkpoint; the run's own files stay as they were
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}
    assert main_rc(small, "--run-id", "A", "--resume", "--inference", "--summary-freq", "64", *PENDULUM) == 0
    out = capsys.readouterr().out
    assert "launch_ppo: INFERENCE: the policy acts (weights of results/A/Pendulum/checkpoint.pt)" in out
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()} == before
    with open(folder / "inference" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) >= 1  # rows without updates (summary_freq in steps)
    # a start that fails after it made RUN/inference (the env id is checked later) takes that folder away
    shutil.rmtree(folder / "inference")
    capsys.readouterr()
    assert main_rc(small, "--run-id", "A", "--resume", "--inference", *PENDULUM, "--env", "Pendulum-v9") == 2
    assert "Pendulum-v9" in error_line(capsys)
    assert not (folder / "inference").exists()
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()} == before

    # --force starts A over: its numbered checkpoints go with its other files
    assert main_rc(small, "--run-id", "A", "--force", *PENDULUM) == 0
    assert not list(folder.glob("Pendulum-v1-*")), sorted(p.name for p in folder.iterdir())


def test_extrinsic_strength_scales_the_rewards_trained_on():
    """With gamma 0 the returns the learner buffers are the rewards it trains on: strength times the env's."""
    import numpy as np

    from impala.envs import EnvSpec
    from impala.envs.probe import probe_env
    from impala.run.config import RunConfig
    from impala.run.ppo_config import PPOConfig
    from impala.transport import wire

    env = probe_env(EnvSpec("Pendulum-v1"), seed=0)
    run = RunConfig(env="Pendulum-v1", workers=1, envs_per_worker=1, unroll_length=4, device="cpu")
    cfg = PPOConfig.preset(
        "mlagents", buffer_size=8, batch_size=4, time_horizon=4, hidden_units=8, num_layers=1, gamma=0.0
    )
    rewards = np.array([-3.0, 1.0, 2.0, -0.5], np.float32)
    for strength in (1.0, 0.25, 0.0):
        trainer = launch_ppo.MLAgentsPPOTrainer(cfg, run, env, strength=strength)
        arrays = {a.name: np.zeros(a.shape, a.dtype) for a in trainer.schema.arrays}
        arrays["log_probs"][:] = -0.9
        arrays["rewards"] = rewards.copy()
        arrays["terminated"][-1] = True  # the trajectory completes: the learner buffers it
        assert trainer.ingest(wire.Message("unroll", 0, 0, arrays, {"env": 0}), 0)
        returns = trainer.learner.buffer.stacked()["returns"].cpu().numpy()
        assert np.allclose(returns, strength * rewards, atol=1e-6), (strength, returns)
        assert np.array_equal(arrays["rewards"], rewards)  # the message's own array is left as sent


# ------------------------------------------------------------------ against ML-Agents' own settings code


def test_merge_and_a_written_configuration_as_mlagents_reads_them(tmp_path):
    """ML-Agents 0.28's own ``RunOptions`` resolves a file with default_settings; the behaviour it trains has
    the hyperparameters ours has, and the configuration.yaml it writes (every key, at its defaults where
    unset) reads here with the same values."""
    from mlagents_shims import require_mlagents

    require_mlagents()
    from mlagents.trainers.settings import RunOptions

    doc = {
        "default_settings": {
            "trainer_type": "ppo",  # ML-Agents wants it wherever hyperparameters are given
            "hyperparameters": {"batch_size": 32, "buffer_size": 128, "learning_rate": 1e-3, "beta": 1e-3},
            "network_settings": {"hidden_units": 64, "normalize": True},
            "reward_signals": {"extrinsic": {"gamma": 0.9, "strength": 0.5}},
            "max_steps": 1000,
        },
        "behaviors": {
            "B": {
                "trainer_type": "ppo",
                "hyperparameters": {"buffer_size": 256, "num_epoch": 5},
                "reward_signals": {"extrinsic": {"gamma": 0.8}},
                "time_horizon": 32,
            }
        },
    }
    try:
        theirs = RunOptions.from_dict(json.loads(json.dumps(doc)))
        written = theirs.as_dict()
    finally:
        from mlagents.trainers.settings import TrainerSettings

        TrainerSettings.default_override = None  # a class attribute ML-Agents sets while reading
    b = written["behaviors"]["B"]
    ours = from_mlagents_yaml(write_yaml(tmp_path / "in.yaml", doc))
    hp = b["hyperparameters"]
    assert (ours.batch_size, ours.buffer_size, ours.learning_rate, ours.beta, ours.num_epoch) == (
        hp["batch_size"],
        hp["buffer_size"],
        hp["learning_rate"],
        hp["beta"],
        hp["num_epoch"],
    )
    net = b["network_settings"]
    assert (ours.hidden_units, ours.obs_norm != "none", ours.num_layers) == (
        net["hidden_units"],
        net["normalize"],
        net["num_layers"],
    )
    ext = b["reward_signals"]["extrinsic"]
    assert (ours.gamma, ours.max_steps, ours.time_horizon) == (
        ext["gamma"],
        b["max_steps"],
        b["time_horizon"],
    )
    assert ext["strength"] == 0.5  # merged from default_settings, key by key

    # mlagents-learn's configuration.yaml, every key written out: read as written
    path = write_yaml(tmp_path / "configuration.yaml", written)
    file = read_mlagents_yaml(path)
    assert ppo_config_from_file(file) == ours
    run = file.run
    assert (run["run_id"], run["runs_dir"], run["workers"], run["unity_base_port"]) == (
        "ppo",
        "results",
        1,
        5005,
    )
    assert (run["graphics"], run["time_scale"], run["extrinsic_strength"], run["keep_checkpoints"]) == (
        True,
        20.0,
        0.5,
        5,
    )
    assert (run["summary_freq"], run["checkpoint_interval"]) == (b["summary_freq"], b["checkpoint_interval"])
    assert 0 <= run["seed"] < 10_000  # seed -1: a random one, as mlagents-learn
