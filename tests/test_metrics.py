import csv

import pytest

from impala.run.checkpoint import load_checkpoint, save_checkpoint
from impala.run.metrics import MetricsLogger


def test_csv_widens_for_new_keys_and_appends_on_resume(tmp_path):
    m = MetricsLogger(str(tmp_path), progress=False)
    m.log(1, {"losses/total": 1.0})
    m.log(2, {"losses/total": 2.0, "transport/rejected_nan": 1.0})
    m.close()
    m = MetricsLogger(str(tmp_path), progress=False)  # a resumed run
    m.log(3, {"transport/rejected_nan": 2.0})
    m.close()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["transport/rejected_nan"] for r in rows] == ["", "1.0", "2.0"]
    assert rows[2]["losses/total"] == ""
    assert list((tmp_path).glob("events.out.tfevents.*"))


def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(tmp_path):
    """The killed run logged steps 300 and 400 after its checkpoint at 200; the resumed run redoes that
    training and logs 300 again: metrics.csv and TensorBoard hold each step once, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(str(tmp_path), progress=False)
    for step in (100, 200, 300, 400):
        m.log(step, {"charts/mean_return_100": step / 100})
    m.close()
    m = MetricsLogger(str(tmp_path), progress=False, resumed_at_step=200)
    m.log(300, {"charts/mean_return_100": 30.0})
    m.close()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["charts/mean_return_100"]) for r in rows] == [
        ("100", "1.0"),
        ("200", "2.0"),
        ("300", "30.0"),
    ]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("charts/mean_return_100")
    assert [(e.step, e.value) for e in scalars] == [(100, 1.0), (200, 2.0), (300, 30.0)]
    # nothing after the checkpoint: the file is left as it is
    before = (tmp_path / "metrics.csv").read_text()
    MetricsLogger(str(tmp_path), progress=False, resumed_at_step=300).close()
    assert (tmp_path / "metrics.csv").read_text() == before


def test_checkpoint_is_atomic_and_loads_weights_only(tmp_path):
    import torch

    path = tmp_path / "ck.pt"
    save_checkpoint(str(path), {"w": torch.ones(3), "n": 5, "cfg": {"env": "x"}})
    first = path.stat().st_ino
    save_checkpoint(str(path), {"w": torch.zeros(3), "n": 6, "cfg": {"env": "x"}})
    assert path.stat().st_ino != first  # replaced by rename, never rewritten in place
    assert not list(tmp_path.glob(".checkpoint-*"))  # no temporary left behind
    state = load_checkpoint(str(path))
    assert state["n"] == 6 and torch.equal(state["w"], torch.zeros(3))


def test_track_logs_rows_config_and_commit_to_wandb_offline(tmp_path, monkeypatch):
    """--track (Weights & Biases) in offline mode: the same scalars as metrics.csv, the resolved config
    and the git commit end up in the local run, with no network."""
    pytest.importorskip("wandb")
    from learner.cli.launch_impala import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logdir = tmp_path / "run"
    assert (
        main(
            [
                *(
                    "--env CartPole-v1 --workers 1 --in-process --total-frames 640 --unroll-length 8 "
                    "--batch-size 4 --minibatches 1 --log-interval 0 --no-progress --device cpu --track "
                    "--track-project test-project --logdir"
                ).split(),
                str(logdir),
            ]
        )
        == 0
    )
    runs = list((logdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((logdir / "wandb").iterdir())
    history, config = _read_offline_run(next(runs[0].glob("run-*.wandb")))
    with open(logdir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(history) == len(rows) == 20  # --log-interval 0: one row per update
    assert history[-1]["charts/env_frames"] == float(rows[-1]["charts/env_frames"]) == 640
    assert history[-1]["losses/policy_loss"] == pytest.approx(float(rows[-1]["losses/policy_loss"]))
    assert config["batch_size"] == 4 and config["env"] == "CartPole-v1"
    assert len(str(config["git_commit"])) >= 40
    assert (logdir / "wandb_id").read_text().strip() == runs[0].name.rsplit("-", 1)[-1]


def _read_offline_run(path, timeout: float = 30.0) -> tuple[list[dict], dict]:
    """History rows and config of an offline W&B run, read with wandb's own record reader.

    ``run.finish()`` can return before wandb's writer process has flushed the file (seen with
    wandb 0.19-0.29: an empty or half-written file for tens of ms), so the file is read again
    until it holds the run's closing ``exit`` record.
    """
    import json
    import time

    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    deadline = time.monotonic() + timeout
    while True:
        history, config, finished = [], {}, False
        store = DataStore()
        try:
            store.open_for_scan(str(path))
            while (data := store.scan_data()) is not None:
                record = wandb_internal_pb2.Record()
                record.ParseFromString(data)
                kind = record.WhichOneof("record_type")
                if kind == "history":
                    history.append(
                        {
                            item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item
                        }
                    )
                elif kind == "run":
                    config.update(
                        {item.key: json.loads(item.value_json) for item in record.run.config.update}
                    )
                elif kind == "exit":
                    finished = True
        except AssertionError:  # a header or block not fully written yet
            pass
        finally:
            if getattr(store, "_fp", None) is not None:
                store._fp.close()
        if finished or time.monotonic() > deadline:
            return history, config
        time.sleep(0.05)


def test_eval_video_is_recorded_and_tracked_offline(tmp_path, monkeypatch):
    """--eval-video: the periodic evaluation records its first episode from the raw Atari screen,
    and --track sends that video to the (offline) W&B run."""
    pytest.importorskip("wandb")
    import time

    import cv2

    from impala.envs import EnvSpec
    from impala.nets.impala_net import build_model
    from impala.run.config import RunConfig
    from impala.run.tracking import WandbTracker
    from impala.transport.messages import ImpalaAgentSpec, RunInfo
    from impala.transport.params import state_dict_arrays
    from learner.run.periodic_eval import PeriodicEval

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = RunConfig(
        env="PongDeterministic-v4", eval_every=1, eval_episodes=1, eval_video=True, logdir=str(tmp_path)
    )
    info = RunInfo(
        "r" * 32,
        EnvSpec("PongDeterministic-v4", {"max_num_frames_per_episode": 2000}),
        ImpalaAgentSpec("shallow", frame_stack=4),
        32,
        4,
    )
    evaluator = PeriodicEval(config, info)
    evaluator.maybe_start(1000, state_dict_arrays(build_model("shallow", (4, 84, 84), 6)))
    deadline, done = time.monotonic() + 180, None
    while done is None and time.monotonic() < deadline:
        done = evaluator.poll()
        time.sleep(0.5)
    evaluator.stop()
    assert done is not None, "the evaluation never reported"
    at, row, video = done
    assert at == 1000 and video == str(tmp_path / "eval-1000.mp4") and row["eval/frames"] <= 2000
    capture = cv2.VideoCapture(video)
    frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    ok, image = capture.read()
    capture.release()
    assert (
        ok and 0 < frames <= 600 and image.shape[0] >= 210
    )  # the raw screen (210 rows and a caption), not 84x84
    tracker = WandbTracker(project="test", logdir=str(tmp_path), name="video", config={}, resume=False)
    tracker.log_video(5000, "eval/video", video)
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/videos/eval/video_*.mp4"))


# ---------------------------------------------------------------------------- one naming scheme, the display


def _impala_step(popart: bool) -> dict:
    """One real V-trace update on a random batch: the metric keys launch_impala logs."""
    import torch

    from impala.nets.impala_net import build_model
    from impala.run.config import ImpalaConfig
    from learner.vtrace_learner import VTraceLearner

    torch.manual_seed(0)
    T, B = 5, 4
    cfg = ImpalaConfig(popart=popart, epochs=1, minibatches=1)
    learner = VTraceLearner(build_model("mlp", (3,), 2), cfg, torch.device("cpu"), total_frames=10_000)
    batch = {
        "obs": torch.randn(T + 1, B, 3),
        "first": torch.zeros(T + 1, B, dtype=torch.bool),
        "actions": torch.zeros(T, B, dtype=torch.long),
        "rewards": torch.randn(T, B),
        "dones": torch.zeros(T, B, dtype=torch.bool),
        "behaviour_logits": torch.zeros(T, B, 2),
    }
    return learner.step(batch, frames_done=0)


def test_both_launchers_log_one_set_of_loss_names():
    from impala.run.metrics import CONSOLE_KEYS
    from learner.ppo_learner import METRIC_KEYS

    impala = _impala_step(popart=False)
    shared = {"losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/total", "losses/grad_norm"}
    assert shared <= set(impala) and shared <= set(METRIC_KEYS.values()), sorted(impala)
    # every losses/ or health/ name IMPALA logs that PPO also measures has PPO's name
    both = {k for k in impala if k.startswith(("losses/", "health/"))} & set(METRIC_KEYS.values())
    assert both >= shared | {"health/explained_variance"}, both
    assert not any(k.startswith("popart/") for k in impala), sorted(impala)  # PopArt off: no popart/ columns
    assert {"popart/mu", "popart/sigma"} <= set(_impala_step(popart=True))
    for key, _, _ in CONSOLE_KEYS:  # what the display reads, each launcher logs
        if key.startswith("losses/"):
            assert key in impala and key in METRIC_KEYS.values(), key


ROW = {
    "charts/env_frames": 123_456_789,
    "charts/agent_steps": 30_864_197,
    "charts/fps": 123_456.7,
    "charts/mean_return_100": -12_345.6,
    "charts/episodes": 1_234_567,
    "charts/policy_lag": 12.5,
    "transport/queue_depth": 1024,
    "transport/dropped": 99_999,
    "losses/entropy": -12.789,
    "losses/grad_norm": 12_345.6,
}


@pytest.mark.parametrize(
    "record,unit,total",
    [
        ({"total_frames": 200_000_000, "total_steps": None}, "frames", "123M/200M"),  # launch_impala's record
        ({"run": {"total_frames": None, "total_steps": 50_000_000}}, "steps", "30.9M/50.0M"),  # launch_ppo's
    ],
)
def test_progress_display_has_total_and_eta_and_fits_80_columns(record, unit, total, tmp_path):
    from rich.console import Console

    from impala.run.metrics import MetricsLogger

    m = MetricsLogger(
        str(tmp_path), progress=False, title="impala PongNoFrameskip-v4 (a long title)", config_record=record
    )
    try:
        key = "charts/env_frames" if unit == "frames" else "charts/agent_steps"
        start = m._start
        m.progress_cells({key: ROW[key] / 2}, now=start + 100)  # this session's first row: the ETA's origin
        console = Console(width=80, record=True, color_system=None)
        console.print(m._table(ROW, now=start + 200))
        lines = console.export_text().splitlines()
        assert all(len(line) <= 80 for line in lines), lines
        header = next(line for line in lines if "ETA" in line)
        cells = next(line for line in lines if total in line).split()
        # one unwrapped row: half the run's count again in 100 s leaves (total - count) / rate to go
        rate = (ROW[key] / 2) / 100
        left = (float(total.split("/")[1][:-1]) * 1e6 - ROW[key]) / rate
        from impala.run.metrics import duration

        labels = [unit, "ETA", "fps", "return", "episodes", "lag", "queue", "dropped", "entropy", "grad"]
        assert header.split() == labels
        assert cells == [total, duration(left), *"123k -12.3k 1.2M 12.5 1.0k 100k -12.8 12.3k".split()], cells
    finally:
        m.close()


def test_plain_progress_line_has_total_and_eta(tmp_path, capsys):
    from impala.run.metrics import MetricsLogger

    m = MetricsLogger(str(tmp_path), progress=False, title="t", config_record={"total_frames": 1000})
    try:
        m.log(1, {"charts/env_frames": 100.0})
        m._first = (m._first[0] - 10, m._first[1])  # the first row 10 s ago: 100 more frames make 10/s
        m.log(2, {"charts/env_frames": 200.0})
    finally:
        m.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[t] frames=100/1.0k eta=-", lines
    assert lines[1] == "[t] frames=200/1.0k eta=1m20s", lines
