import csv

from impala.checkpoint import load_checkpoint, save_checkpoint
from impala.metrics import MetricsLogger


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
