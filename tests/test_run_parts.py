"""The named parts runtime.run wires, each alone: the fingerprint guard, the budget, resume and the
checkpointer (disk errors survived, finished runs), log rows, actor configs, and the one flag mechanism."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from actors.loop import actor_configs
from impala.envs import EnvSpec
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.probe import probe_env
from impala.options import ConfigError, FlagParser, add_flags, apply_preset, capped, given_flags, read_yaml
from impala.run.checkpoint import (
    LOCK_FILE,
    CheckpointError,
    drop_unused_run_folder,
    load_checkpoint,
    prepare_run_folder,
    release_run_folders,
)
from impala.run.config import RunConfig
from impala.transport.messages import ImpalaAgentSpec, RunInfo
from learner.run import checkpointer as ckpt_module
from learner.run.budget import Budget
from learner.run.checkpointer import FINISHED_MARKER, Checkpointer, Progress, RunFinished, resume
from learner.run.guard import FingerprintGuard
from learner.run.log_rows import LogRows


@pytest.fixture(scope="module")
def cartpole():
    return probe_env(EnvSpec("CartPole-v1"), seed=0)


# --------------------------------------------------------------------------- guard


def test_guard_accepts_a_matching_local_actor_and_stops_on_a_differing_one(cartpole):
    acrobot = probe_env(EnvSpec("Acrobot-v1"), seed=0)
    guard = FingerprintGuard([cartpole], local_workers=2)
    good = {"local_token": guard.local_token, "fingerprint": cartpole.fingerprint.to_dict()}
    assert guard.on_hello(0, good) is None and guard.verified_local == {0}
    guard.check()  # nothing refused yet
    bad = {"local_token": guard.local_token, "fingerprint": acrobot.fingerprint.to_dict()}
    assert guard.on_hello(1, bad) is not None
    with pytest.raises(FingerprintMismatchError, match="actor 1's environment differs"):
        guard.check()


def test_guard_refuses_a_local_id_without_the_token_and_only_keeps_remote_mismatches_out(cartpole):
    guard = FingerprintGuard([cartpole], local_workers=1)
    forged = {"local_token": "0" * 32, "fingerprint": cartpole.fingerprint.to_dict()}
    assert "reserved for this learner's local actors" in guard.on_hello(0, forged)
    assert guard.verified_local == set()
    assert guard.on_hello(7, {"fingerprint": "junk"}) == "hello carries no env fingerprint"
    guard.check()  # a refused remote actor does not stop the run


def test_guard_checks_each_actor_against_its_own_task(cartpole):
    acrobot = probe_env(EnvSpec("Acrobot-v1"), seed=0)
    # one env per actor: actor 5 plays task 1 (5 % 2), actor 4 task 0
    guard = FingerprintGuard([cartpole, acrobot], local_workers=0)
    fp = {0: cartpole.fingerprint.to_dict(), 1: acrobot.fingerprint.to_dict()}
    assert guard.on_hello(5, {"task_fingerprints": [[1, fp[1]]]}) is None
    assert "no env fingerprint for task 0" in guard.on_hello(4, {"task_fingerprints": [[1, fp[1]]]})
    assert "task 0 (CartPole-v1)" in guard.on_hello(4, {"task_fingerprints": [[0, fp[1]]]})
    # three envs per actor: every actor plays both tasks and must show both
    guard = FingerprintGuard([cartpole, acrobot], local_workers=0, envs_per_worker=3)
    assert guard.on_hello(4, {"task_fingerprints": [[0, fp[0]], [1, fp[1]]]}) is None
    assert "task 1 (Acrobot-v1)" in guard.on_hello(4, {"task_fingerprints": [[0, fp[0]], [1, fp[0]]]})
    assert "no env fingerprint for task 1" in guard.on_hello(4, {"task_fingerprints": [[0, fp[0]]]})
    assert guard.on_hello(4, {"task_fingerprints": "junk"}) is not None


# --------------------------------------------------------------------------- budget


def test_budget_frames_steps_time_and_return():
    with pytest.raises(ConfigError, match="needs a budget"):
        Budget(RunConfig(env="CartPole-v1"))
    frames = Budget(RunConfig(env="CartPole-v1", total_frames=100))
    assert not frames.spent(99, 10**9) and frames.spent(100, 0)
    steps = Budget(RunConfig(env="CartPole-v1", total_steps=10, stop_at_return=195.0, max_seconds=0.05))
    assert not steps.spent(10**9, 9) and steps.spent(0, 10)
    assert not steps.out_of_time()
    time.sleep(0.06)
    assert steps.out_of_time()
    assert not steps.return_reached(None) and not steps.return_reached(194.9) and not steps.reached_return
    assert steps.return_reached(195.0) and steps.reached_return


# --------------------------------------------------------------------------- checkpointer and resume


@dataclass
class _Trainer:
    """The state a trainer checkpoints: one tensor, so a test can make it non-finite."""

    weight: torch.Tensor
    frames_per_step: float = 1.0
    agent: ImpalaAgentSpec = ImpalaAgentSpec(model="mlp", use_lstm=False)

    def state_dict(self):
        return {"w": self.weight}

    def load_state_dict(self, state):
        self.weight = state["w"]


def _checkpointer(tmp_path, cartpole, *, resuming=False, progress=None, trainer=None):
    config = RunConfig(env="CartPole-v1", logdir=str(tmp_path), total_frames=1000)
    run_info = RunInfo("r", cartpole.spec, ImpalaAgentSpec(model="mlp", use_lstm=False), 8, 1)
    trainer = trainer or _Trainer(torch.ones(3))
    return (
        config,
        trainer,
        Checkpointer(config, trainer, run_info, {"lr": 1}, progress or Progress(), resuming=resuming),
    )


def test_checkpointer_writes_resume_restores_and_time_stays_monotone(tmp_path, cartpole):
    config, trainer, cp = _checkpointer(tmp_path, cartpole)
    cp.progress.env_frames, cp.progress.agent_steps, cp.progress.version = 640, 640, 3
    assert cp.final(finished=False) == config.checkpoint_path
    saved = load_checkpoint(config.checkpoint_path)
    assert (saved["env_frames"], saved["version"], saved["config"]) == (640, 3, {"lr": 1}) and saved[
        "elapsed_s"
    ] >= 0
    fresh = _Trainer(torch.zeros(3))
    progress = resume(fresh, dataclasses_replace(config, resume=True), [cartpole])
    assert (progress.env_frames, progress.agent_steps, progress.version) == (640, 640, 3)
    assert torch.equal(fresh.weight, torch.ones(3))


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_nothing_trained_writes_no_checkpoint_and_says_so(tmp_path, cartpole):
    _, _, cp = _checkpointer(tmp_path, cartpole)
    assert cp.final(finished=False) == ""  # version did not move: no checkpoint, and none is named
    assert not os.path.exists(tmp_path / "checkpoint.pt")


def test_a_directory_at_the_checkpoint_path_is_one_warning_and_the_next_write_retries(
    tmp_path, cartpole, caplog
):
    config, _, cp = _checkpointer(tmp_path, cartpole)
    os.makedirs(config.checkpoint_path)
    cp.progress.version = 1
    with caplog.at_level("WARNING"):
        assert cp.save() is False
    assert "not written (IsADirectoryError" in caplog.text and "training goes on" in caplog.text
    os.rmdir(config.checkpoint_path)
    assert cp.save() is True and os.path.isfile(config.checkpoint_path)


def test_non_finite_weights_keep_the_previous_checkpoint(tmp_path, cartpole, caplog):
    config, trainer, cp = _checkpointer(tmp_path, cartpole)
    cp.progress.version = 1
    assert cp.save()
    trainer.weight = torch.tensor([float("nan"), 1.0, 2.0])
    with caplog.at_level("ERROR"):
        assert cp.save() is False
    assert "previous checkpoint is kept" in caplog.text
    assert torch.equal(load_checkpoint(config.checkpoint_path)["trainer"]["w"], torch.ones(3))


def test_a_full_disk_is_survived_and_said_loudly_after_a_while(tmpfs, cartpole, caplog, monkeypatch):
    mount = tmpfs("tiny", "64k")
    big = _Trainer(torch.ones(200_000))  # 800 KB: cannot fit in 64 KiB
    config, _, cp = _checkpointer(mount, cartpole, trainer=big)
    cp.progress.version = 1
    with caplog.at_level("WARNING"):
        assert cp.save() is False
    assert "No space left on device" in caplog.text or "ENOSPC" in caplog.text, caplog.text
    monkeypatch.setattr(ckpt_module, "LOUD_AFTER_S", 0.0)  # as if the disk had been full for half an hour
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert cp.save() is False
    assert "no checkpoint could be written for" in caplog.text
    assert not [f for f in os.listdir(mount) if f != "lost+found"]  # nothing half-written left behind


def test_a_finished_run_is_marked_and_resuming_it_does_nothing_unless_the_budget_grew(tmp_path, cartpole):
    config, _, cp = _checkpointer(tmp_path, cartpole)
    cp.progress.env_frames, cp.progress.agent_steps, cp.progress.version = 1000, 1000, 5
    cp.final(finished=True)
    assert (tmp_path / FINISHED_MARKER).exists()
    with pytest.raises(RunFinished, match="finished at 1,000 env frames"):
        resume(_Trainer(torch.zeros(3)), dataclasses_replace(config, resume=True), [cartpole])
    more = resume(
        _Trainer(torch.zeros(3)), dataclasses_replace(config, resume=True, total_frames=2000), [cartpole]
    )
    assert more.env_frames == 1000
    _checkpointer(tmp_path, cartpole, resuming=False)  # a new run in the same folder is not finished
    assert not (tmp_path / FINISHED_MARKER).exists()


# --------------------------------------------------------------------------- log rows, actor configs


def test_log_rows_measure_fps_lag_and_tasks():
    rows = LogRows(0.0, ("PongDeterministic-v4", "BreakoutDeterministic-v4"), env_frames=0)
    rows.lags += [1, 3]
    progress = Progress(env_frames=400, agent_steps=100, version=7, task_frames=[300, 100])
    time.sleep(0.01)
    row = rows.row(
        progress, {"losses/total": 1.5}, {"transport/queue": 2}, {"PongDeterministic-v4": -21.0}, 1
    )
    assert row["losses/total"] == 1.5 and row["transport/queue"] == 2 and row["charts/policy_lag"] == 2.0
    assert 0 < row["charts/fps"] <= 400 / 0.01 and row["charts/policy_version"] == 7
    assert (
        row["tasks/PongDeterministic-v4/frames"] == 300
        and row["tasks/PongDeterministic-v4/human_normalized"] < 0.01
    )
    assert rows.lags == [] and rows.due()


def test_actor_configs_deal_tasks_and_seeds_by_id(cartpole):
    acrobot = probe_env(EnvSpec("Acrobot-v1"), seed=0)
    run = RunInfo(
        "r",
        cartpole.spec,
        ImpalaAgentSpec(model="mlp", use_lstm=False, num_tasks=2),
        20,
        3,
        (cartpole.spec, acrobot.spec),
    )
    configs = actor_configs(
        run,
        range(1000, 1003),
        trajectory_endpoint="tcp://a",
        params_endpoint="tcp://b",
        seed=7,
        local_token="t",
    )
    assert [c.actor_id for c in configs] == [1000, 1001, 1002]
    assert [c.seed for c in configs] == [7 + 1000 * i for i in (1000, 1001, 1002)]
    # the run's 2 tasks dealt over every actor's 3 envs in turn (env slot 3 * id + k plays task slot % 2)
    assert [c.tasks for c in configs] == [(0, 1, 0), (1, 0, 1), (0, 1, 0)] and configs[1].env == acrobot.spec
    assert configs[1].env_specs == (acrobot.spec, cartpole.spec, acrobot.spec)
    assert all(c.unroll_length == 20 and c.num_envs == 3 and c.local_token == "t" for c in configs)


# --------------------------------------------------------------------------- the one flag mechanism


@dataclass(frozen=True)
class _Opts:
    lr: float = 0.1
    name: str = "x"
    on: bool = False


def _parser():
    parser = FlagParser(prog="t")
    add_flags(parser, _Opts)
    return parser


def test_given_tells_a_flag_given_at_its_default_value_from_a_flag_not_given():
    args = _parser().parse_args(["--lr", "0.1", "--no-on"])
    assert args.given == {"lr", "on"}
    assert given_flags(_Opts, args) == {"lr": 0.1, "on": False}
    assert _parser().parse_args([]).given == set()


def test_given_also_for_repeatable_and_counting_flags():
    parser = FlagParser(prog="t")
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("-v", action="count", default=0)
    args = parser.parse_args(["--env", "a", "--env", "b"])
    assert (args.env, args.v, args.given) == (["a", "b"], 0, {"env"})
    assert parser.parse_args(["-vv"]).given == {"v"}


def test_a_preset_yields_to_given_flags_and_is_named():
    args = apply_preset(_parser().parse_args(["--lr", "0.5"]), {"lr": 0.9, "name": "preset"})
    assert (args.lr, args.name, args.on, args.preset) == (0.5, "preset", False, {"lr", "name"})


def test_bad_flag_is_one_capped_line(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--lr", "x" * 100_000])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and len(err) < 700
    assert capped("a\n b" + "c" * 1000, 20).endswith("…") and len(capped("c" * 1000, 20)) == 20


# --------------------------------------------------------------------------- strict YAML


@pytest.mark.parametrize(
    "text, error",
    [
        ("model: deep\nlr: 1\nmodel: shallow\n", "key 'model' appears twice (lines 1 and 3)"),
        ("a: &x [1, 2]\nb: *x\n", "anchors and aliases are not accepted"),
        ("a: &a [x,x,x]\nb: &b [*a,*a,*a]\nc: [*b,*b,*b]\n", "anchors and aliases are not accepted"),
        ("[" * 20_000, "nested"),
        ("key: [unclosed\n", "not valid YAML"),
    ],
)
def test_read_yaml_refuses_with_one_line(tmp_path, text, error):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")) as e:
        read_yaml(str(path), "--config")
    assert "\n" not in str(e.value) and len(str(e.value)) < 700


def test_read_yaml_refuses_binary_directories_and_huge_files(tmp_path):
    (tmp_path / "b.yaml").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="not a text file"):
        read_yaml(str(tmp_path / "b.yaml"), "--config")
    with pytest.raises(ConfigError, match="is a directory"):
        read_yaml(str(tmp_path), "--config")
    (tmp_path / "h.yaml").write_text("a: 1\n" * 300_000)
    with pytest.raises(ConfigError, match="larger than"):
        read_yaml(str(tmp_path / "h.yaml"), "--config")
    with pytest.raises(ConfigError, match="no such file"):
        read_yaml(str(tmp_path / "missing.yaml"), "--config")
    (tmp_path / "ok.yaml").write_text("a: {b: [1, 2]}\nc: 1e-3\n")
    assert read_yaml(str(tmp_path / "ok.yaml"), "--config") == {"a": {"b": [1, 2]}, "c": "1e-3"}


def test_argparse_namespace_without_flagparser_has_no_given():
    # given_flags on a plain namespace (a caller building args by hand) means nothing was given
    assert given_flags(_Opts, argparse.Namespace(lr=1.0)) == {}


def test_resume_says_exactly_what_differs(tmp_path, cartpole):
    config, _, cp = _checkpointer(tmp_path, cartpole)
    cp.progress.version = 1
    cp.final(finished=False)
    v0 = probe_env(EnvSpec("CartPole-v0"), seed=0)
    with pytest.raises(CheckpointError, match=r"env 'CartPole-v1' there, 'CartPole-v0' here"):
        resume(_Trainer(torch.zeros(3)), dataclasses_replace(config, resume=True), [v0])
    lstm = _Trainer(torch.zeros(3), agent=ImpalaAgentSpec(model="mlp", use_lstm=True))
    with pytest.raises(CheckpointError, match="use_lstm False there, True here"):
        resume(lstm, dataclasses_replace(config, resume=True), [cartpole])


def test_best_pt_holds_the_evaluated_weights_not_later_ones(tmp_path, cartpole):
    config, trainer, cp = _checkpointer(tmp_path, cartpole)
    cp.remember_evaluated(100)
    trainer.weight = torch.full((3,), 5.0)  # training went on while the evaluation played
    cp.consider_best(10.0, 100)
    best = load_checkpoint(str(tmp_path / "best.pt"))
    assert torch.equal(best["trainer"]["w"], torch.ones(3)) and best["eval_mean_return"] == 10.0
    cp.remember_evaluated(200)
    cp.consider_best(9.0, 200)  # worse: best.pt stays
    assert load_checkpoint(str(tmp_path / "best.pt"))["eval_mean_return"] == 10.0
    cp.consider_best(11.0, 300)  # not the evaluation remembered: ignored
    assert load_checkpoint(str(tmp_path / "best.pt"))["eval_mean_return"] == 10.0


def test_run_folder_names_and_refusals(tmp_path):
    auto = RunConfig(env="CartPole-v1", runs_dir=str(tmp_path)).with_run_folder("CartPole-v1")
    assert os.path.dirname(auto.logdir) == str(tmp_path) and os.path.basename(auto.logdir).startswith(
        "CartPole-v1-20"
    )
    named = RunConfig(env="CartPole-v1", runs_dir=str(tmp_path), run_id="mine").with_run_folder("x")
    assert named.logdir == str(tmp_path / "mine") and named.checkpoint_path == str(
        tmp_path / "mine" / "checkpoint.pt"
    )
    with pytest.raises(ConfigError, match="not resolved yet"):  # a name made now would not be the run's
        RunConfig(env="CartPole-v1").checkpoint_path
    for bad, error in (
        (dict(run_id="../up"), "--run-id must be a plain name"),
        (dict(run_id="a", logdir="b"), "not both"),
        (dict(resume=True), "--resume needs the run"),
        (dict(resume=True, force=True, run_id="a"), "give one"),
    ):
        with pytest.raises(ConfigError, match=error):
            RunConfig(env="CartPole-v1", **bad)


def test_a_folder_holding_a_run_is_refused_unless_resume_or_force(tmp_path):
    folder = tmp_path / "run"
    prepare_run_folder(str(folder), resume=False, force=False)  # new: created
    (folder / "metrics.csv").write_text("step\n")
    (folder / "checkpoint.pt").write_bytes(b"x")
    (folder / "events.out.tfevents.1.host").write_bytes(b"x")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(
        ConfigError,
        match=r"holds a run \(checkpoint.pt, events.out.tfevents.1.host, metrics.csv\): pass --resume",
    ):
        prepare_run_folder(str(folder), resume=False, force=False)
    prepare_run_folder(str(folder), resume=True, force=False)  # continuing it: untouched
    assert (folder / "metrics.csv").exists()
    prepare_run_folder(str(folder), resume=False, force=True)
    assert sorted(os.listdir(folder)) == [LOCK_FILE, "notes.txt"]  # only the run's own files went
    release_run_folders()
    assert sorted(os.listdir(folder)) == ["notes.txt"]


def test_a_run_that_trained_nothing_gives_its_folder_up_without_force(tmp_path):
    folder = tmp_path / "run"
    prepare_run_folder(str(folder), resume=False, force=False)
    (folder / "config.yaml").write_text("env: CartPole-v1\n")  # what a run that never updated leaves
    (folder / "events.out.tfevents.1.host").write_bytes(b"x")
    release_run_folders()
    prepare_run_folder(str(folder), resume=False, force=False)  # no checkpoint: started over in it
    assert sorted(os.listdir(folder)) == [LOCK_FILE]
    release_run_folders()


def test_a_folder_in_use_by_a_live_run_is_refused_to_a_second_process(tmp_path):
    folder = tmp_path / "run"
    prepare_run_folder(str(folder), resume=False, force=False)  # this process holds it, as a live run does
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from impala.run.checkpoint import prepare_run_folder as p; "
         "from impala.options import ConfigError\n"
         "try:\n p(sys.argv[1], resume=True, force=False)\nexcept ConfigError as e:\n print(e); sys.exit(2)",
         str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode == 2 and "is in use by a run that is still going" in other.stdout, other
    release_run_folders()  # the run ended: the folder is free again
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from impala.run.checkpoint import prepare_run_folder as p; "
         "p(sys.argv[1], resume=True, force=False)", str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode == 0, other.stderr


def test_a_failed_start_takes_away_only_the_empty_folders_it_made(tmp_path):
    made = tmp_path / "made"
    assert prepare_run_folder(str(made), resume=False, force=False) == (str(made),)
    assert prepare_run_folder(str(made), resume=False, force=False) == ()  # there now: not made again
    drop_unused_run_folder(())
    assert made.is_dir()  # not this start's folder: it stays
    drop_unused_run_folder((str(made),))
    assert not made.exists()
    written = tmp_path / "written"
    created = prepare_run_folder(str(written), resume=False, force=False)
    (written / "config.yaml").write_text("env: CartPole-v1\n")
    drop_unused_run_folder(created)  # something was written: nothing is removed
    assert (written / "config.yaml").read_text() == "env: CartPole-v1\n"


def test_a_failed_start_takes_away_the_new_parents_too_and_stops_at_one_that_holds_anything(tmp_path):
    # mlagents-learn's RESULTS_DIR/RUN_ID/<behaviour>, all three new: all three go
    run = tmp_path / "results" / "crawler" / "Crawler"
    created = prepare_run_folder(str(run), resume=False, force=False)
    assert created == (str(run), str(run.parent), str(run.parent.parent))
    drop_unused_run_folder(created)
    assert sorted(os.listdir(tmp_path)) == []
    # RUN_ID new, RESULTS_DIR there before: RESULTS_DIR stays
    (tmp_path / "results").mkdir()
    created = prepare_run_folder(str(run), resume=False, force=False)
    assert created == (str(run), str(run.parent))
    drop_unused_run_folder(created)
    assert os.listdir(tmp_path / "results") == []
    # something written into a new parent (another behaviour's folder): it and everything above it stay
    created = prepare_run_folder(str(run), resume=False, force=False)
    (run.parent / "Walker").mkdir()
    drop_unused_run_folder(created)
    assert not run.exists() and sorted(os.listdir(run.parent)) == ["Walker"]
