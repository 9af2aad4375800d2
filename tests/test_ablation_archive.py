"""scripts/ablation_ppo.py's committed run archive: the table is made from it, so its pooling must be the
statistics of the seeds it holds, whichever records they come from."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation_ppo", ROOT / "scripts" / "ablation_ppo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def finished_run(ablation, runs: Path, v, seed: int, steps: int, returns: list[float]) -> None:
    """A run directory as run_one leaves it: launch_ppo's metrics.csv and the run.json that marks it
    finished."""
    d = ablation.run_dir(runs, v, seed)
    d.mkdir(parents=True)
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "charts/agent_steps", "charts/mean_return_100"])
        w.writerow([0, 0, ""])  # before the first finished episode
        for i, r in enumerate(returns, 1):
            w.writerow([i, i * steps // len(returns), r])
    (d / "run.json").write_text(
        json.dumps({"steps": steps, "steps_per_s": 1000.0, "wall_s": steps / 1000.0, "cmd": "launch_ppo ..."})
    )


def args_for(tmp_path: Path, steps: int) -> argparse.Namespace:
    return argparse.Namespace(
        runs_dir=str(tmp_path / "runs"), archive=str(tmp_path / "archive.json"), steps=steps
    )


def test_pooled_statistics_over_a_two_seed_record_and_a_run(ablation, tmp_path):
    steps = 3000
    base, switched = ablation.Variant("mlagents", ablation.BASE), ablation.Variant("mlagents", "adam_eps")
    pair = [
        {
            "base": v.base,
            "switch": v.switch,
            "seeds": [0, 1],
            "steps": steps,
            "finals": finals,
            "run_mean": rm,
            "steps_per_s": 900.0,
            "source": "a table",
        }
        for v, finals, rm in ((base, [10.0, 30.0], 5.0), (switched, [1.0, 2.0], 0.5))
    ]
    args = args_for(tmp_path, steps)
    Path(args.archive).write_text(json.dumps(pair))
    finished_run(ablation, Path(args.runs_dir), base, 2, steps, [4.0, 8.0, 50.0])
    finished_run(ablation, Path(args.runs_dir), switched, 2, steps, [0.0, 3.0])

    records = ablation.archive_runs([base, switched], [0, 1, 2], args)
    rows = {r["switch"]: r for r in ablation.summarize([base, switched], [0, 1, 2], args, records)}
    b = rows[ablation.BASE]
    assert b["seeds"] == 3
    assert b["final_mean"] == pytest.approx(np.mean([10, 30, 50]))
    assert b["final_std"] == pytest.approx(np.std([10, 30, 50], ddof=1))
    assert (b["final_min"], b["final_max"]) == (10.0, 50.0)
    assert b["run_mean"] == pytest.approx((2 * 5.0 + np.mean([4, 8, 50])) / 3)  # per seed, not per record
    assert b["steps_per_s"] == pytest.approx((2 * 900 + 1000) / 3)
    s = rows["adam_eps"]
    assert s["delta"] == pytest.approx(np.mean([1, 2, 3]) - 30.0)
    pooled = np.sqrt((np.var([1, 2, 3], ddof=1) + np.var([10, 30, 50], ddof=1)) / 2)
    assert s["effect"] == pytest.approx(s["delta"] / pooled)
    assert s["verdict"] == "maybe"  # ranges apart, but |effect| < 2

    # Asking for seeds 0 and 1 only leaves seed 2's record out; the curve of the archived run is kept thinned.
    only01 = {r["switch"]: r for r in ablation.summarize([base, switched], [0, 1], args, records)}
    assert only01[ablation.BASE]["finals"] == [10.0, 30.0]
    run2 = next(r for r in records if r["seeds"] == [2] and r["switch"] == ablation.BASE)
    assert run2["curves"]["2"][-1] == [steps, 50.0]


def test_archiving_again_replaces_and_never_splits_a_multi_seed_record(ablation, tmp_path):
    steps = 3000
    v = ablation.Variant("sb3", "ratio")
    args = args_for(tmp_path, steps)
    finished_run(ablation, Path(args.runs_dir), v, 2, steps, [1.0, 2.0])
    first = ablation.archive_runs([v], [2], args)
    again = ablation.archive_runs([v], [2], args)
    assert first == again and len(again) == 1  # the same run once, not twice
    on_disk = json.loads(Path(args.archive).read_text())
    assert on_disk == again

    finished_run(ablation, Path(args.runs_dir), v, 0, steps, [5.0])
    Path(args.archive).write_text(
        json.dumps(
            [
                {
                    "base": "sb3",
                    "switch": "ratio",
                    "seeds": [0, 1],
                    "steps": steps,
                    "finals": [1.0, 2.0],
                    "run_mean": 1.5,
                    "steps_per_s": 1.0,
                    "source": "a table",
                }
            ]
        )
    )
    with pytest.raises(SystemExit, match="multi-seed record"):
        ablation.archive_runs([v], [0], args)


def test_committed_archive_holds_each_variant_once_per_seed(ablation):
    """docs/data/ppo_ablation_runs.json, what docs/PPO_ABLATION.md's table is made from: every record well
    formed, no seed of a variant counted twice."""
    records = json.loads((ROOT / "docs" / "data" / "ppo_ablation_runs.json").read_text())
    seen: dict[tuple, list[int]] = {}
    for r in records:
        assert r["base"] in ablation.PRESETS and (
            r["switch"] == ablation.BASE or r["switch"] in ablation.SWITCHES
        )
        assert len(r["finals"]) == len(r["seeds"]) and all(np.isfinite(r["finals"]))
        assert r.get("curves") or r.get("source"), "a record without curves must say where it comes from"
        seen.setdefault((r["base"], r["switch"], r["steps"]), []).extend(r["seeds"])
    for key, seeds in seen.items():
        assert len(seeds) == len(set(seeds)), key
    assert {k[:2] for k in seen} == {
        (b, s) for b in ablation.PRESETS for s in [ablation.BASE, *ablation.SWITCHES]
    }
