"""``impala-eval``: real checkpoints (trained here for a few seconds), real worker processes, no mocks.

Each checkpoint is made by the real launcher (CartPole and Pong with launch_impala, Pendulum
with launch_ppo: its ``main``, in this process with ``--in-process``) once per module. Episodes are kept short
with ``--max-frames`` so that a
tiny Pong agent's games end quickly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from impala.envs import EnvSpec, make_env
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.protocols import FRAME_CAP, NetworkActions, ProtocolError, action_index_map, eval_protocol
from impala.evaluation import RESULT_SCHEMA, EvalConfig, read_policy_checkpoint
from impala.options import ConfigError
from impala.run.checkpoint import CheckpointError
from learner.cli.eval_cli import main
from learner.evaluator import EvalJob, checkpoint_agent, evaluate_params, run_episodes
from procs import run

BIN = Path(sys.executable).parent
ALE_NOISE = ("A.L.E:", "[Powered by Stella]")

TINY_CARTPOLE = (
    "launch_impala --env CartPole-v1 --workers 1 --in-process --total-frames 2000 --unroll-length 8 "
    "--batch-size 4 --minibatches 1 --no-progress --device cpu"
).split()
TINY_PONG = (
    "launch_impala --env PongDeterministic-v4 --workers 1 --in-process --envs-per-worker 1 --unroll-length "
    "8 --batch-size 2 --minibatches 1 --total-frames 400 --no-progress --device cpu"
).split()
TINY_PPO = (
    "launch_ppo --env Pendulum-v1 --semantics sb3 --workers 1 --in-process --total-steps 600 --buffer-size "
    "64 --batch-size 32 --hidden-units 8 --num-layers 1 --time-horizon 32 --no-progress --device cpu"
).split()


def _train(cmd: list[str], logdir: Path) -> Path:
    """The launcher's main in this process (the runs are --in-process; impala-eval's own CLI runs as a real
    process below)."""
    from learner.cli import launch_impala, launch_ppo

    launcher = {"launch_impala": launch_impala.main, "launch_ppo": launch_ppo.main}[cmd[0]]
    threads = torch.get_num_threads()
    try:
        assert launcher([*cmd[1:], "--logdir", str(logdir)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (logdir / "checkpoint.pt").is_file()
    return logdir / "checkpoint.pt"


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory) -> Path:
    return _train(TINY_CARTPOLE, tmp_path_factory.mktemp("cartpole"))


@pytest.fixture(scope="module")
def pong(tmp_path_factory) -> Path:
    return _train(TINY_PONG, tmp_path_factory.mktemp("pong"))


@pytest.fixture(scope="module")
def ppo(tmp_path_factory) -> Path:
    return _train(TINY_PPO, tmp_path_factory.mktemp("ppo"))


def eval_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The installed console script, in its own process."""
    return run(["impala-eval", *args], timeout=timeout)


def eval_main(capsys, *args: str) -> tuple[int, str, str]:
    """``impala-eval``'s main in this process (its episode workers are still real processes unless
    --workers 0)."""
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(ALE_NOISE)]


def check_result_schema(data: dict, *, episodes: int) -> None:
    """Every key the JSON file promises, consistent with itself."""
    assert data["schema"] == RESULT_SCHEMA
    for key in (
        "protocol",
        "settings",
        "policy",
        "seed",
        "episodes",
        "mean",
        "std",
        "median",
        "min",
        "max",
        "returns",
        "episode_steps",
        "episode_frames",
        "episode_capped",
        "episode_seeds",
        "total_steps",
        "total_frames",
        "wall_time_s",
        "workers",
        "env",
        "agent",
        "checkpoint",
        "config",
        "video",
    ):
        assert key in data, key
    returns = np.array(data["returns"], dtype=float)
    assert (
        data["episodes"]
        == episodes
        == len(returns)
        == len(data["episode_steps"])
        == len(data["episode_frames"])
    )
    assert data["mean"] == pytest.approx(returns.mean()) and data["std"] == pytest.approx(returns.std())
    assert (
        data["median"] == pytest.approx(np.median(returns))
        and data["min"] == returns.min()
        and data["max"] == returns.max()
    )
    assert data["total_frames"] == sum(data["episode_frames"]) and data["total_steps"] == sum(
        data["episode_steps"]
    )
    assert data["episode_seeds"] == [data["seed"] + i for i in range(episodes)]
    assert data["settings"]["protocol"] == data["protocol"]
    # every episode was played by a worker that first measured and checked its env
    played = sorted(i for w in data["workers"] for i in w["episodes"])
    assert played == list(range(episodes))
    for w in data["workers"]:
        assert w["checked"] and all("fingerprint" in c for c in w["checked"]), w


# ---------------------------------------------------------------------------
# CartPole, PPO, the JSON file
# ---------------------------------------------------------------------------


def test_cartpole_checkpoint_json_schema_table_and_workers(cartpole):
    r = eval_cli(
        str(cartpole.parent), "--episodes", "4", "--workers", "2", "--seed", "7"
    )  # a logdir is accepted for its checkpoint.pt
    assert r.returncode == 0, r.stdout + r.stderr
    out = cartpole.parent / "eval-train-sample-4.json"
    data = json.loads(out.read_text())
    check_result_schema(data, episodes=4)
    assert data["protocol"] == "train" and data["policy"] == "sample" and data["seed"] == 7
    assert data["settings"]["env_id"] == "CartPole-v1" and data["settings"]["max_episode_steps"] == 500
    assert data["checkpoint"]["sha256"] == hashlib.sha256(cartpole.read_bytes()).hexdigest()
    assert data["checkpoint"]["path"] == str(cartpole) and data["checkpoint"]["kind"] == "impala"
    assert data["checkpoint"]["env_frames"] == 2000
    stored = torch.load(cartpole, weights_only=True)
    assert data["config"] == json.loads(json.dumps(stored["config"]))
    assert data["agent"] == stored["agent"] and data["env"] == stored["env"]
    assert data["episode_steps"] == data["episode_frames"]  # no frame skip: frames are agent steps
    assert all(w["pid"] != os.getpid() for w in data["workers"])
    assert (
        "mean ± std" in r.stdout
        and "train: CartPole-v1 as trained" in r.stdout
        and f"wrote {out}" in r.stdout
    )
    # Episode i resets its env and seeds its agent with seed + i, whoever plays it: in this process, the same
    # returns.
    ck = read_policy_checkpoint(str(cartpole))
    here = evaluate_params(ck.env, ck.agent, ck.params, policy="sample", workers=0, episodes=4, seed=7)
    assert here.returns == data["returns"] and [e.seed for e in here.episodes] == [7, 8, 9, 10]


def test_ppo_checkpoint_greedy_plays_the_mean_action(ppo, tmp_path, capsys):
    out = tmp_path / "ppo.json"
    rc, stdout, stderr = eval_main(
        capsys,
        str(ppo),
        "--episodes",
        "2",
        "--workers",
        "0",
        "--policy",
        "greedy",
        "--max-frames",
        "50",
        "--out",
        str(out),
    )
    assert rc == 0, stdout + stderr
    data = json.loads(out.read_text())
    check_result_schema(data, episodes=2)
    assert (
        data["checkpoint"]["kind"] == "ppo" and data["agent"]["kind"] == "ppo" and data["policy"] == "greedy"
    )
    assert data["episode_steps"] == [50, 50] and data["episode_capped"] == [True, True]
    assert data["settings"]["max_frames_per_episode"] == 50


def test_greedy_and_sample_switch_in_both_agents(cartpole, ppo):
    """act_greedy is argmax of the logits / the mean action; act keeps sampling; both from the same
    weights."""
    for path in (cartpole, ppo):
        ck = read_policy_checkpoint(str(path))
        env = make_env(ck.env, seed=0)
        obs = np.expand_dims(np.asarray(env.reset(seed=0)[0]), 0)
        first = np.ones(1, dtype=bool)
        a = checkpoint_agent(ck.agent, ck.params, envs=_One(env), first_obs=obs, seed=1)
        b = checkpoint_agent(ck.agent, ck.params, envs=_One(env), first_obs=obs, seed=2)
        greedy = [a.act_greedy(obs, first)[0] for _ in range(3)] + [b.act_greedy(obs, first)[0]]
        assert all(np.array_equal(g, greedy[0]) for g in greedy)  # no randomness, whatever the seed
        if ck.kind == "impala":
            logits = a.act_greedy(obs, first)[1]["behaviour_logits"]
            assert int(greedy[0][0]) == int(np.argmax(logits[0]))
        else:
            import torch as t

            from impala.nets.ppo_policy import env_action

            mu = a.policy.mean(t.from_numpy(obs.astype(np.float32))).detach().numpy()
            np.testing.assert_allclose(
                greedy[0], env_action(mu, mode=a.config.action_clip, low=a.action_low, high=a.action_high)
            )
            samples = [a.act(obs, first)[0] for _ in range(5)]
            assert not all(np.array_equal(s, samples[0]) for s in samples)  # sampling still samples
        env.close()


class _One:
    num_envs = 1

    def __init__(self, env):
        self.action_space, self.observation_space = env.action_space, env.observation_space


def test_greedy_and_sample_results_are_seeded(cartpole):
    ck = read_policy_checkpoint(str(cartpole))
    runs = {
        (policy, seed): evaluate_params(
            ck.env, ck.agent, ck.params, policy=policy, workers=0, episodes=4, seed=seed
        )
        for policy in ("greedy", "sample")
        for seed in (3, 3, 4)
    }
    assert runs[("greedy", 3)].policy == "greedy" and runs[("sample", 3)].policy == "sample"
    again = evaluate_params(ck.env, ck.agent, ck.params, policy="sample", workers=0, episodes=4, seed=3)
    assert again.returns == runs[("sample", 3)].returns  # sampling is seeded
    assert (
        runs[("greedy", 3)].returns[1:] == runs[("greedy", 4)].returns[:3]
    )  # greedy: only the env's seed matters
    assert runs[("greedy", 3)].to_dict()["workers"][0]["pid"] == os.getpid()


# ---------------------------------------------------------------------------
# Pong under each protocol, fingerprint checked in every worker, video
# ---------------------------------------------------------------------------

PROTOCOL_CASES = {
    # protocol: (sticky, action set, no-op max, TimeLimit, video args)
    "train": (0.0, "minimal", 30, 100_000, ["--video-episodes", "2", "--video-scale", "1"]),
    "machado": (0.25, "full", 0, None, ["--video-max-frames", "40"]),
    "dqn": (0.0, "minimal", 30, None, []),
}


@pytest.mark.parametrize("protocol", list(PROTOCOL_CASES))
def test_pong_checkpoint_under_each_protocol(protocol, pong, tmp_path, capsys):
    sticky, action_set, noop_max, limit, video_args = PROTOCOL_CASES[protocol]
    video = tmp_path / ("episode.gif" if protocol == "machado" else "episode.mp4")
    # train: 2 worker processes; machado: 1; dqn: played in this process (a worker all the same: it checks its
    # env)
    workers = {"train": "2", "machado": "1", "dqn": "0"}[protocol]
    args = [
        str(pong),
        "--protocol",
        protocol,
        "--episodes",
        "2",
        "--workers",
        workers,
        "--max-frames",
        "400",
        "--policy",
        "greedy" if protocol == "dqn" else "sample",
        "--out",
        str(tmp_path / "r.json"),
    ]
    if video_args:
        args += ["--video", str(video), *video_args]
    rc, stdout, stderr = eval_main(capsys, *args)
    assert rc == 0, stdout + stderr
    data = json.loads((tmp_path / "r.json").read_text())
    check_result_schema(data, episodes=2)
    s = data["settings"]
    assert (s["protocol"], s["sticky"], s["action_set"], s["network_action_set"]) == (
        protocol,
        sticky,
        action_set,
        "minimal",
    )
    assert (s["noop_max"], s["max_frames_per_episode"], s["max_episode_steps"], s["frameskip"]) == (
        noop_max,
        400,
        limit,
        4,
    )
    assert s["life_loss_terminal"] is False
    assert f"protocol {protocol}:" in stdout and "settings {" in stdout  # printed before playing
    # each worker's measured env is the protocol's
    assert all((w["pid"] == os.getpid()) == (workers == "0") for w in data["workers"])
    for w in data["workers"]:
        fp = w["checked"][0]["fingerprint"]
        assert (fp["frameskip_min"], fp["frameskip_max"], fp["sticky"]) == (4, 4, sticky)
        assert fp["num_actions"] == (18 if action_set == "full" else 6) and fp["max_episode_steps"] == limit
    # the ALE's own frame cap cut the episodes at 400 emulator frames (a tiny agent never ends a game so fast)
    assert data["episode_frames"] == [400, 400] and data["episode_capped"] == [True, True]
    assert all(95 <= n <= 100 for n in data["episode_steps"])  # 400 frames, frameskip 4, minus the no-ops
    if not video_args:
        assert data["video"] is None
        return
    assert data["video"]["path"] == str(video) and data["video"]["fps"] == 15
    if video.suffix == ".mp4":
        import cv2

        assert video_stream(video).startswith("h264")
        cap = cv2.VideoCapture(str(video))
        frames = []
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(frame)
        cap.release()
        # both episodes, the first screen of each plus one per agent step
        assert len(frames) == data["video"]["frames"] == sum(data["episode_steps"]) + 2
        assert (
            frames[0].shape[1] == 160 and frames[0].shape[0] > 210
        )  # the raw screen plus the caption, not 84x84
        assert frames[0][:210].std() > 5  # a picture, not a blank frame
    else:
        from PIL import Image

        with Image.open(video) as gif:
            assert gif.n_frames == data["video"]["frames"] == 40
            assert gif.size[0] == 320 and gif.size[1] > 420  # --video-scale 2 (default)


def test_network_on_the_minimal_set_takes_the_same_ale_actions_under_the_full_set():
    # The map itself: Pong's minimal set in the full set's order.
    import ale_py

    A = ale_py.Action
    minimal = [A.NOOP, A.FIRE, A.RIGHT, A.LEFT, A.RIGHTFIRE, A.LEFTFIRE]
    legal = list(A)[:18]
    assert (
        action_index_map(minimal, legal).tolist() == [legal.index(a) for a in minimal] == [0, 1, 3, 4, 11, 12]
    )
    with pytest.raises(ValueError, match="lacks"):
        action_index_map(legal, minimal)
    # The same action sequence through the map on the full set plays the same game as on the minimal set.
    spec = {"repeat_action_probability": 0.0, "noop_max": 0}
    small = make_env(EnvSpec("PongDeterministic-v4", spec), seed=3)
    full_env = make_env(EnvSpec("PongDeterministic-v4", {**spec, "full_action_space": True}), seed=3)
    ale = full_env.unwrapped.ale
    full = NetworkActions(
        full_env, action_index_map(list(ale.getMinimalActionSet()), list(ale.getLegalActionSet()))
    )
    assert full.action_space.n == small.action_space.n == 6 and full_env.action_space.n == 18
    o1, _ = small.reset(seed=3)
    o2, _ = full.reset(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = int(rng.integers(6))
        o1, *_ = small.step(a)
        o2, *_ = full.step(a)
        assert np.array_equal(small.unwrapped.ale.getRAM(), ale.getRAM())
    assert np.array_equal(o1, o2)
    small.close()
    full.close()


def test_a_worker_whose_env_is_not_the_protocols_is_stopped_naming_the_fields(pong):
    ck = read_policy_checkpoint(str(pong))
    machado = eval_protocol(ck.env, "machado", max_frames=400)
    # A worker that built the trained env (sticky 0, minimal actions, 30 no-ops, no frame cap)
    # while the protocol says machado: what a lost kwarg would do.
    wrong = dataclasses.replace(machado, env=ck.env)
    job = EvalJob(wrong, ck.agent, ck.params, "sample", 0, 100)
    for workers in (0, 1):  # in this process, and in a spawned worker process
        with pytest.raises(FingerprintMismatchError) as info:
            run_episodes(job, episodes=2, workers=workers)
        msg = str(info.value)
        assert "does not run protocol machado" in msg
        for field in (
            "sticky: configured 0.25, measured 0",
            "action_set: configured full (18)",
            "max_frames_per_episode: configured 400",
            "noop_max: configured 0, measured 30",
            "max_episode_steps: configured None, measured 100000",
        ):
            assert field in msg, msg
    # The same job with the protocol's own env passes.
    ok = run_episodes(dataclasses.replace(job, protocol=machado), episodes=1, workers=0)
    assert ok[0].checks[0]["fingerprint"]["sticky"] == 0.25


def test_protocol_definitions():
    pong = EnvSpec("PongDeterministic-v4")
    m = eval_protocol(pong, "machado")
    assert m.env.kwargs == {
        "repeat_action_probability": 0.25,
        "full_action_space": True,
        "noop_max": 0,
        "max_num_frames_per_episode": FRAME_CAP,
        "max_episode_steps": None,
    }
    assert (m.expected.sticky, m.expected.full_action_space, m.expected.frameskip, m.max_frames) == (
        0.25,
        True,
        4,
        108_000,
    )
    d = eval_protocol(pong, "dqn")
    assert (d.expected.sticky, d.expected.full_action_space, d.noop_max, d.max_frames) == (
        0.0,
        False,
        30,
        108_000,
    )
    t = eval_protocol(pong, "train")
    assert (
        t.env == pong
        and t.max_frames is None
        and t.noop_max == 30
        and t.expected.max_episode_steps == 100_000
    )
    assert eval_protocol(pong, "machado", max_frames=500).max_frames == 500
    # the trained kwargs are kept under every protocol (here a frame skip of 4 on the NoFrameskip id)
    nf = EnvSpec("PongNoFrameskip-v4", {"frameskip": 4})
    assert eval_protocol(nf, "dqn").expected.frameskip == 4
    with pytest.raises(ProtocolError, match="Atari envs only; CartPole-v1 is not one"):
        eval_protocol(EnvSpec("CartPole-v1"), "machado")
    assert eval_protocol(EnvSpec("CartPole-v1"), "train", max_frames=9).max_frames == 9


# ---------------------------------------------------------------------------
# Old checkpoints, bad input
# ---------------------------------------------------------------------------


def test_old_format_checkpoint_falls_back_to_its_config_record(cartpole, tmp_path):
    state = torch.load(cartpole, weights_only=True)
    for key in ("kind", "env", "agent", "agent_steps"):
        del state[key]
    # the old flat record, with an env override that shows it is used: episodes end at 12 steps
    state["config"] = {**state["config"], "env_kwargs": json.dumps({"max_episode_steps": 12})}
    old = tmp_path / "checkpoint.pt"
    torch.save(state, old)
    ck = read_policy_checkpoint(str(tmp_path))
    assert (
        ck.legacy
        and ck.kind == "impala"
        and ck.env.kwargs == {"max_episode_steps": 12}
        and ck.agent_steps is None
    )
    out = tmp_path / "old.json"
    rc = main([str(old), "--episodes", "3", "--workers", "0", "--policy", "greedy", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["checkpoint"]["format"].startswith("legacy") and data["settings"]["env_kwargs"] == {
        "max_episode_steps": 12
    }
    assert max(data["episode_steps"]) <= 12


def test_a_run_records_its_network_and_an_auto_checkpoint_still_plays(cartpole, pong, tmp_path):
    """``--model auto`` is decided once, at start, from the observations: config.yaml and the checkpoint's
    agent record name the network. A checkpoint written before that (agent model "auto") still loads and
    plays, its network chosen by the same rule."""
    import yaml

    for checkpoint, network in ((cartpole, "mlp"), (pong, "shallow")):
        recorded = yaml.safe_load((checkpoint.parent / "config.yaml").read_text())
        state = torch.load(checkpoint, weights_only=True)
        assert recorded["model"] == network and state["agent"]["model"] == network, checkpoint
    state = torch.load(cartpole, weights_only=True)
    state["agent"]["model"] = "auto"
    state["config"]["model"] = "auto"
    old = tmp_path / "checkpoint.pt"
    torch.save(state, old)
    assert read_policy_checkpoint(str(old)).agent.model == "auto"
    out = tmp_path / "auto.json"
    assert main([str(old), "--episodes", "2", "--workers", "0", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["returns"]) == 2


def _foreign(tmp_path: Path, kind: str, cartpole: Path) -> str:
    path = tmp_path / f"{kind}.pt"
    if kind == "text":
        path.write_text("not a checkpoint\n")
    elif kind == "list":
        torch.save([1, 2, 3], path)
    elif kind == "no_trainer":
        torch.save({"weights": torch.zeros(3)}, path)
    elif kind == "env_not_installed":
        state = torch.load(cartpole, weights_only=True)
        state["env"] = {"id": "NoSuchGame-v9", "kwargs": {}, "preprocess": True}
        torch.save(state, path)
    elif kind == "deep_tasks":  # a list nested 5,000 deep: repr() of it exhausts the recursion limit
        state = torch.load(cartpole, weights_only=True)
        deep: list = []
        for _ in range(5000):
            deep = [deep]
        state["tasks"] = deep
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(50000)  # (for pickling it here)
        try:
            torch.save(state, path)
        finally:
            sys.setrecursionlimit(limit)
    elif kind == "wrong_weights":
        state = torch.load(cartpole, weights_only=True)
        state["env"] = {
            "id": "Acrobot-v1",
            "kwargs": {},
            "preprocess": True,
        }  # 6 observations, the network takes 4
        torch.save(state, path)
    return str(path)


@pytest.mark.parametrize(
    "case, args, expect",
    [
        ("missing", ["/no/such/run/checkpoint.pt"], "no checkpoint at /no/such/run/checkpoint.pt"),
        ("empty_logdir", ["{tmp}"], "no checkpoint at {tmp}/checkpoint.pt"),
        ("text", ["{text}"], "cannot be read"),
        ("list", ["{list}"], "holds a list, not a checkpoint dict"),
        ("no_trainer", ["{no_trainer}"], "not a launch_impala or launch_ppo checkpoint"),
        ("env_not_installed", ["{env_not_installed}"], "not installed here: unknown env id 'NoSuchGame-v9'"),
        ("wrong_weights", ["{wrong_weights}"], "the checkpoint cannot play Acrobot-v1"),
        ("deep_tasks", ["{deep_tasks}"], "its env/agent record is unusable (env spec must be"),
        (
            "protocol",
            ["{cartpole}", "--protocol", "machado"],
            "--protocol machado is defined for Atari envs only",
        ),
        ("ppo_protocol", ["{ppo}", "--protocol", "dqn"], "--protocol dqn is defined for Atari envs only"),
        ("episodes", ["{cartpole}", "--episodes", "0"], "--episodes must be >= 1, got 0"),
        ("workers", ["{cartpole}", "--workers", "-1"], "--workers must be >= 0"),
        ("max_frames", ["{cartpole}", "--max-frames", "-5"], "--max-frames must be >= 0"),
        ("video_suffix", ["{cartpole}", "--video", "{tmp}/clip.avi"], "must end in .mp4 or .gif"),
        (
            "video_episodes",
            ["{cartpole}", "--episodes", "2", "--video-episodes", "3"],
            "--video-episodes must be in 1..--episodes (2)",
        ),
        (
            "out_folder",
            ["{cartpole}", "--out", "/no/such/dir/r.json"],
            "--out /no/such/dir/r.json: the folder /no/such/dir does not exist",
        ),
        ("protocol_name", ["{cartpole}", "--protocol", "atari100k"], "invalid choice: 'atari100k'"),
    ],
)
def test_bad_input_is_one_line_exit_2(case, args, expect, cartpole, ppo, tmp_path, capsys):
    names = {"tmp": str(tmp_path), "cartpole": str(cartpole), "ppo": str(ppo)}
    for kind in ("text", "list", "no_trainer", "env_not_installed", "wrong_weights", "deep_tasks"):
        if "{" + kind + "}" in " ".join(args):
            names[kind] = _foreign(tmp_path, kind, cartpole)
    argv = [a.format(**names) for a in args] + (["--workers", "0"] if "--workers" not in args else [])
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = errors(err)
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("impala-eval: error: "), lines
    assert expect.format(**names) in lines[0], lines[0]


def video_stream(path: Path) -> str:
    """The video stream line ffmpeg reads from ``path`` (``Video: h264 (High) ..., yuv420p, ...``): the
    ffmpeg binary imageio-ffmpeg ships, so the check does not depend on how the file was written."""
    import imageio_ffmpeg

    probe = subprocess.run(
        [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line.strip() for line in probe.stderr.splitlines() if "Stream #" in line and "Video:" in line]
    assert len(lines) == 1, probe.stderr
    return lines[0].split("Video:", 1)[1].strip()


def test_cartpole_video_is_h264_in_the_run_folder(cartpole, capsys):
    """The quick start's next step (``impala-eval RUN --video episode.mp4``): CartPole draws with pygame
    (the render extra scripts/setup.sh installs) and the MP4 is H.264 in yuv420p, what browsers play
    inline; a relative --video name lands in the run folder, not wherever the command was typed."""
    video, result = cartpole.parent / "episode.mp4", cartpole.parent / "eval-train-greedy-2.json"
    rc = main([str(cartpole.parent), *"--episodes 2 --workers 0 --policy greedy --video episode.mp4".split()])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    stream = video_stream(video)
    assert stream.startswith("h264") and "yuv420p" in stream, stream
    data = json.loads(result.read_text())
    assert data["video"]["path"] == str(video) and data["video"]["frames"] == data["episode_steps"][0] + 1
    import cv2

    reader = cv2.VideoCapture(str(video))
    frames = int(reader.get(cv2.CAP_PROP_FRAME_COUNT))
    ok, frame = reader.read()
    reader.release()
    # CartPole's 600-pixel-wide screen at --video-scale 2
    assert ok and frames == data["video"]["frames"] and frame.shape[1] == 1200
    assert frame.std() > 5  # a picture, not a blank frame


def test_a_cartpole_video_on_a_headless_box_prints_no_display_noise(cartpole, tmp_path):
    """impala-eval --video on CartPole, as a user's shell runs it on a box without a display (no
    XDG_RUNTIME_DIR, no SDL settings): pygame draws off-screen without looking for a display, so stderr holds
    no "XDG_RUNTIME_DIR is invalid" (it printed that twice)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SDL_VIDEODRIVER", "DISPLAY")}
    out = subprocess.run(
        [str(Path(sys.executable).parent / "impala-eval"), str(cartpole.parent), "--episodes", "1",
         "--workers", "1", "--video", str(tmp_path / "clip.mp4"), "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "clip.mp4").stat().st_size > 0
    assert "XDG_RUNTIME_DIR" not in out.stderr + out.stdout, out.stderr[-2000:]


def test_relative_out_goes_to_the_run_folder_and_other_settings_keep_their_files(cartpole, capsys):
    for episodes in ("2", "3"):
        assert main([str(cartpole), "--episodes", episodes, "--workers", "0"]) == 0
    assert main([str(cartpole), "--episodes", "2", "--workers", "0", "--out", "mine.json"]) == 0
    capsys.readouterr()
    for name in ("eval-train-sample-2.json", "eval-train-sample-3.json", "mine.json"):
        assert json.loads((cartpole.parent / name).read_text())["episodes"] in (2, 3), name


def test_eval_config_rejects_what_cannot_work():
    with pytest.raises(ConfigError, match="--episodes must be >= 1"):
        EvalConfig(episodes=0)
    with pytest.raises(ConfigError, match="--policy must be one of sample, greedy"):
        EvalConfig(policy="argmax")
    with pytest.raises(ConfigError, match="--video-scale must be in 1..8"):
        EvalConfig(video_scale=0)
    dqn = EvalConfig(protocol="dqn", policy="greedy")
    assert dqn.result_path("/x/run/checkpoint.pt") == "/x/run/eval-dqn-greedy-30.json"
    # the episodes are in the name: a quick 2-episode look never overwrites a 30-episode result
    assert EvalConfig(episodes=2).result_path("/x/run/checkpoint.pt") == "/x/run/eval-train-sample-2.json"


def test_frameskip_plot_reads_checkpoints_through_the_same_loader(pong, ppo):
    from learner.cli.frameskip_plot import check_checkpoint

    assert check_checkpoint(str(pong.parent), "PongDeterministic-v4") == "policy from checkpoint.pt"
    with pytest.raises(CheckpointError, match="this one is ppo's"):
        check_checkpoint(str(ppo), "PongDeterministic-v4")
