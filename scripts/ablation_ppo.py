"""PPO ablation on Ant-v5 (the Crawler stand-in) with Crawler's hyperparameters: which semantics switch
matters.

Every run is a real ``launch_ppo`` training run (actor process + learner over ZeroMQ). The Crawler
hyperparameters come from configs/Crawler.yaml; buffer and batch are shrunk by the same factor (default 8:
20480/2048 -> 2560/256, so the buffer still holds 10 minibatches) and the schedules decay over the
shortened run (``max_steps`` = the budget), so a short run on a small machine goes through the same *shape*
of training. The script prints what it shrank.

Two modes:

- ``leave-one-out`` (default): start from the ``mlagents`` preset and switch one semantics option (a row of
  docs/PPO.md; the schedule row's six options together) to its ``sb3`` value, one at a time; and
  the reverse from ``sb3``. ``--seeds`` seeds per variant, the same for every variant.
- ``presets``: only the two presets (the earlier two-curve plot).

    .venv/bin/python scripts/ablation_ppo.py --steps 300000 --seeds 0 1 2            # the full leave-one-out
    .venv/bin/python scripts/ablation_ppo.py --steps 4000 --seeds 0 --bases mlagents --switches action_clip
    # smoke
    .venv/bin/python scripts/ablation_ppo.py --plot-only ...                        # re-plot existing runs

Output: per run ``RUNS/<base>/<variant>/seed<s>/`` with launch_ppo's ``metrics.csv`` and ``curve.csv``
(agent steps, mean return of the last 100 episodes); one figure (``--out``: final return per variant,
mean and min..max over seeds, one panel per base preset); a markdown table (``--table``) for
docs/PPO_ABLATION.md; ``summary.json``. Runs that exist are reused (``--rerun`` to redo them).

Every finished run is also kept, small, in the committed archive (``--archive``,
docs/data/ppo_ablation_runs.json: final return, mean over the run, speed, the curve thinned to 120 points),
and the table and figures are made from the archive, so they survive the loss of ``runs/`` (which is not
committed) and can be redone with ``--plot-only`` on any clone. A record covers one or more seeds
(``seeds``, ``finals``); a record without per-seed curves comes from an earlier table (its ``source`` says
which) and enters the table but not the curve figure.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import resource
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from impala.run.ppo_config import PPOConfig, from_mlagents_yaml  # noqa: E402

CRAWLER_BUFFER, CRAWLER_BATCH = 20480, 2048
PRESETS = ("mlagents", "sb3")

# One switch per row of docs/PPO.md that differs between the presets (#n), with the options it
# flips. Not here: clip_range_vf, target_kl, bootstrap_truncated and vf_coef (the same in both presets).
SWITCHES: dict[str, tuple[str, ...]] = {
    "advantage_norm": ("advantage_norm",),  # 1
    "ratio": ("ratio",),  # 2
    "value_loss": (
        "value_loss",
    ),  # 3: mlagents <-> mse are the same loss (#6281): a control for run-to-run noise
    "entropy_reduce": ("entropy_reduce",),  # 4
    "schedules": (
        "lr_schedule",
        "epsilon_schedule",
        "beta_schedule",
        "lr_floor",
        "epsilon_floor",
        "beta_floor",
    ),  # 6
    "max_grad_norm": ("max_grad_norm",),  # 7
    "adam_eps": ("adam_eps",),  # 7
    "update_trigger": ("update_trigger",),  # 8
    "minibatch_remainder": ("minibatch_remainder",),  # 8
    "log_prob_form": ("log_prob_form",),  # 9
    "action_clip": ("action_clip",),  # 10
    "init": ("init",),  # 11
    "activation": ("activation",),  # 11
    "obs_norm": ("obs_norm",),  # 12
    "reward_norm": ("reward_norm",),  # 12
    "gae_form": ("gae_form",),  # 13
    "trajectory_handling": ("trajectory_handling",),  # 15
}
BASE = "base"


@functools.cache
def crawler_config(semantics: str) -> PPOConfig:
    """What launch_ppo runs for ``--semantics X --mlagents-config configs/Crawler.yaml`` (before the size
    flags)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ML-Agents keys the trainer does not use
        return from_mlagents_yaml(str(ROOT / "configs" / "Crawler.yaml"), semantics=semantics)


def flag_value(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, "none" if value is None else str(value)]


@dataclass(frozen=True)
class Variant:
    base: str  # the preset it starts from
    switch: str  # BASE or a SWITCHES key: these options take the other preset's values

    @property
    def overrides(self) -> dict[str, object]:
        """The switch's options as the *other* preset's run has them (its preset read with
        configs/Crawler.yaml:
        e.g. the yaml's linear learning_rate_schedule applies to both)."""
        if self.switch == BASE:
            return {}
        other = crawler_config("sb3" if self.base == "mlagents" else "mlagents")
        return {name: getattr(other, name) for name in SWITCHES[self.switch]}

    @property
    def label(self) -> str:
        if self.switch == BASE:
            return f"{self.base} preset"
        other = "sb3" if self.base == "mlagents" else "mlagents"
        values = self.overrides
        return (
            f"{self.switch} -> {next(iter(values.values())) if len(values) == 1 else other + chr(39) + 's'}"
        )

    def option(self, name: str) -> object:
        """The variant's value of a PPOConfig option (preset, then the switch)."""
        return self.overrides.get(name, getattr(crawler_config(self.base), name))


def unroll_length(v: Variant, args: argparse.Namespace) -> int:
    """0 (launch_ppo's default) when the learner cuts trajectories (#15 'mlagents'). For 'rollout': one round
    of
    unrolls (every env once) fills one update, with no unroll left over to go stale: buffer_full updates at
    exactly buffer_size steps (T = buffer / envs), over_buffer_size at MORE than buffer_size (one step more
    per env)."""
    if args.unroll_length:
        return args.unroll_length
    if v.option("trajectory_handling") == "mlagents":
        return 0
    T = (CRAWLER_BUFFER // args.shrink) // (args.workers * args.envs_per_worker)
    return T + 1 if v.option("update_trigger") == "over_buffer_size" else T


def run_dir(runs: Path, v: Variant, seed: int) -> Path:
    return runs / v.base / v.switch / f"seed{seed}"


def command(v: Variant, seed: int, args: argparse.Namespace, logdir: Path) -> list[str]:
    buffer, batch = CRAWLER_BUFFER // args.shrink, CRAWLER_BATCH // args.shrink
    cmd = [
        str(Path(sys.executable).parent / "launch_ppo"),
        "--env",
        args.env,
        "--mlagents-config",
        str(ROOT / "configs" / "Crawler.yaml"),
        "--semantics",
        v.base,
        "--seed",
        str(seed),
        "--buffer-size",
        str(buffer),
        "--batch-size",
        str(batch),
        "--max-steps",
        str(args.steps),
        "--total-steps",
        str(args.steps),
        "--workers",
        str(args.workers),
        "--envs-per-worker",
        str(args.envs_per_worker),
        "--unroll-length",
        str(unroll_length(v, args)),
        "--device",
        "cpu",
        "--logdir",
        str(logdir),
        "--log-interval",
        "0",
        "--no-progress",
        "--torch-threads",
        str(args.torch_threads if args.torch_threads is not None else (0 if args.jobs == 1 else 1)),
    ]
    for name, value in v.overrides.items():
        cmd += flag_value(name, value)
    return cmd


def read_curve(logdir: Path) -> tuple[np.ndarray, np.ndarray]:
    steps, returns = [], []
    with open(logdir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            v = row.get("charts/mean_return_100", "")
            if v not in ("", None) and math.isfinite(float(v)):
                steps.append(int(float(row.get("charts/agent_steps") or row["step"])))
                returns.append(float(v))
    return np.asarray(steps), np.asarray(returns)


def run_one(v: Variant, seed: int, args: argparse.Namespace) -> dict:
    logdir = run_dir(Path(args.runs_dir), v, seed)
    done = logdir / "run.json"
    if done.exists() and not args.rerun:
        return json.loads(done.read_text())
    logdir.mkdir(parents=True, exist_ok=True)
    for f in logdir.iterdir():
        f.unlink()
    cmd = command(v, seed, args, logdir)
    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the run's processes (exact one run at a time; with --jobs > 1 it mixes the runs that end
    # meanwhile)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    (logdir / "stdout.txt").write_text(out.stdout)
    (logdir / "stderr.txt").write_text(out.stderr)
    if out.returncode != 0:
        raise SystemExit(
            f"run {v.base}/{v.switch} seed {seed} failed ({out.returncode}); see "
            f"{logdir}/stderr.txt:\n{out.stderr[-2000:]}"
        )
    steps, returns = read_curve(logdir)
    with open(logdir / "curve.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["agent_steps", "mean_return_100"])
        w.writerows(zip(steps.tolist(), returns.tolist()))
    info = {
        "base": v.base,
        "switch": v.switch,
        "seed": seed,
        "overrides": {k: v2 for k, v2 in v.overrides.items()},
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "steps_per_s": round(args.steps / wall, 1),
        "cpu_s": round(cpu, 1),
        "final_return": float(returns[-1]) if len(returns) else None,
        "cmd": " ".join(cmd[1:]),
    }
    done.write_text(json.dumps(info, indent=1))
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    print(
        f"  {v.base:8s} {v.switch:20s} seed {seed}: {wall:6.0f}s {args.steps / wall:6.0f} steps/s, "
        f"{cpu:6.0f} CPU s  ({last})",
        flush=True,
    )
    return info


CURVE_POINTS = 120


def record_of(v: Variant, seed: int, logdir: Path) -> dict:
    """A finished run as an archive record: what the table and figures need, small enough to commit."""
    info = json.loads((logdir / "run.json").read_text())
    steps, returns = read_curve(logdir)
    keep = (
        np.unique(np.linspace(0, len(steps) - 1, min(CURVE_POINTS, len(steps))).round().astype(int))
        if len(steps)
        else []
    )
    return {
        "base": v.base,
        "switch": v.switch,
        "seeds": [seed],
        "steps": info["steps"],
        "finals": [float(returns[-1])] if len(returns) else [],
        "run_mean": float(np.mean(returns)) if len(returns) else None,
        "steps_per_s": info["steps_per_s"],
        "wall_s": info["wall_s"],
        "date": time.strftime("%Y-%m-%d", time.gmtime((logdir / "run.json").stat().st_mtime)),
        "curves": {str(seed): [[int(steps[i]), round(float(returns[i]), 3)] for i in keep]},
        "cmd": info["cmd"],
    }


def load_archive(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def archive_runs(variants: list[Variant], seeds: list[int], args: argparse.Namespace) -> list[dict]:
    """Add every finished run under RUNS_DIR to the archive (a run replaces an earlier record of the same
    base, switch, steps and seed) and write it back; returns the whole archive."""
    path = Path(args.archive)
    records = load_archive(path)
    for v in variants:
        for seed in seeds:
            d = run_dir(Path(args.runs_dir), v, seed)
            if not (d / "run.json").exists():
                continue
            new = record_of(v, seed, d)
            if not new["finals"]:
                continue
            for r in records:
                if (r["base"], r["switch"], r["steps"]) == (v.base, v.switch, new["steps"]) and seed in r[
                    "seeds"
                ]:
                    if len(r["seeds"]) > 1:
                        raise SystemExit(
                            f"{path}: seed {seed} of {v.base}/{v.switch} is in a multi-seed record "
                            f"({r.get('source', '?')}); remove that record before re-running its seeds"
                        )
                    records.remove(r)
                    break
            records.append(new)
    records.sort(
        key=lambda r: (
            PRESETS.index(r["base"]),
            r["switch"] != BASE,
            r["switch"],
            r["steps"],
            min(r["seeds"]),
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # one record per line: a new run shows in a diff as the lines it changed
    tmp.write_text("[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in records) + "\n]\n")
    tmp.replace(path)
    return records


def records_for(records: list[dict], v: Variant, seeds: list[int], steps: int) -> list[dict]:
    """The archive records of a variant at this budget that cover only requested seeds."""
    return [
        r
        for r in records
        if (r["base"], r["switch"], r["steps"]) == (v.base, v.switch, steps) and set(r["seeds"]) <= set(seeds)
    ]


def summarize(
    variants: list[Variant], seeds: list[int], args: argparse.Namespace, records: list[dict]
) -> list[dict]:
    rows = []
    for v in variants:
        finals, means, rates = [], [], []  # per seed; a record of n seeds counts n times in the means
        for r in records_for(records, v, seeds, args.steps):
            n = len(r["finals"])
            finals += r["finals"]
            means += [r["run_mean"]] * n
            rates += [r["steps_per_s"]] * n
        if not finals:
            continue
        rows.append(
            {
                "base": v.base,
                "switch": v.switch,
                "label": v.label,
                "overrides": v.overrides,
                "seeds": len(finals),
                "final_mean": float(np.mean(finals)),
                "final_min": float(np.min(finals)),
                "final_max": float(np.max(finals)),
                "final_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0,
                "finals": finals,
                "run_mean": float(np.mean(means)),
                "steps_per_s": float(np.mean(rates)) if rates else float("nan"),
            }
        )
    for r in rows:  # difference to its base preset, and whether it stands out of the seed-to-seed spread
        base = next((b for b in rows if b["base"] == r["base"] and b["switch"] == BASE), None)
        r["delta"] = r["final_mean"] - base["final_mean"] if base else float("nan")
        r["effect"], r["verdict"] = verdict(r, base)
    return rows


def verdict(row: dict, base: dict | None) -> tuple[float, str]:
    """(standardized difference, word) of a variant against its preset.

    effect = delta / pooled seed std (sample std of the final returns, both sides). 'moves': every seed of
    the variant lies beyond every seed of the preset (the ranges do not overlap) AND |effect| >= 2;
    'maybe': one of the two; 'no': neither. With 3 seeds a side no claim is finer than that."""
    if base is None or row["switch"] == BASE or row["seeds"] < 2 or base["seeds"] < 2:
        return float("nan"), ""
    n1, n2 = row["seeds"], base["seeds"]
    pooled = math.sqrt(((n1 - 1) * row["final_std"] ** 2 + (n2 - 1) * base["final_std"] ** 2) / (n1 + n2 - 2))
    if row["delta"] == 0:
        return 0.0, "no"
    effect = row["delta"] / pooled if pooled > 0 else math.copysign(math.inf, row["delta"])
    apart = row["final_min"] > base["final_max"] or row["final_max"] < base["final_min"]
    big = abs(effect) >= 2
    return effect, "moves" if apart and big else "maybe" if apart or big else "no"


def plot(rows: list[dict], out_png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = [b for b in PRESETS if any(r["base"] == b for r in rows)]
    n = max(len([r for r in rows if r["base"] == b]) for b in bases)
    fig, axes = plt.subplots(1, len(bases), figsize=(max(9, 7 * len(bases)), 0.38 * n + 2.2), squeeze=False)
    for ax, b in zip(axes[0], bases):
        mine = [r for r in rows if r["base"] == b]
        mine.sort(key=lambda r: (r["switch"] != BASE, r["final_mean"]))
        y = np.arange(len(mine))[::-1]
        colors = [
            "tab:gray" if r["switch"] == BASE else ("tab:blue" if b == "mlagents" else "tab:orange")
            for r in mine
        ]
        for yi, r, c in zip(y, mine, colors):
            ax.errorbar(
                [r["final_mean"]],
                [yi],
                xerr=[[r["final_mean"] - r["final_min"]], [r["final_max"] - r["final_mean"]]],
                fmt="o",
                color=c,
                ecolor=c,
                capsize=3,
                lw=1.5,
                ms=6,
            )
        base = next((r for r in mine if r["switch"] == BASE), None)
        if base:
            ax.axvspan(base["final_min"], base["final_max"], color="tab:gray", alpha=0.15)
            ax.axvline(base["final_mean"], color="tab:gray", lw=1, ls="--")
        ax.set_yticks(y, [r["label"] for r in mine], fontsize=8)
        ax.margins(y=0.5 / max(len(mine), 1))
        ax.set_xlabel(
            "final mean return of the last 100 episodes\n(dot: mean over seeds, whisker: min..max; grey: the "
            "preset)",
            fontsize=9,
        )
        other = "sb3" if b == "mlagents" else "mlagents"
        ax.set_title(f"from the {b} preset, one switch to its {other} value", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)


def mean_curve(
    records: list[dict], v: Variant, seeds: list[int], steps: int, grid: np.ndarray
) -> np.ndarray | None:
    """Per-seed curves in the archive, interpolated onto ``grid`` (agent steps): [n_seeds, len(grid)]."""
    curves = []
    for r in records_for(records, v, seeds, steps):
        for points in r.get("curves", {}).values():
            if len(points) > 1:
                s, ret = np.asarray(points, dtype=float).T
                curves.append(np.interp(grid, s, ret, left=np.nan))
    return np.asarray(curves) if curves else None


def plot_curves(
    rows: list[dict], records: list[dict], seeds: list[int], args: argparse.Namespace, out_png: Path
) -> None:
    """Small multiples: for every switch, the preset's curve (grey) and the switched variant's (colour), mean
    over
    seeds with a min..max band: where two curves separate, and whether they come back together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, args.steps, 120)
    bases = [b for b in PRESETS if any(r["base"] == b for r in rows)]
    switched = {b: [r for r in rows if r["base"] == b and r["switch"] != BASE] for b in bases}
    ncol = min(6, max((len(v) for v in switched.values()), default=0))
    if not ncol:
        return
    rows_of = {b: max(1, math.ceil(len(switched[b]) / ncol)) for b in bases}  # panel rows per base preset
    fig, axes = plt.subplots(
        sum(rows_of.values()), ncol, figsize=(2.2 * ncol, 2.0 * sum(rows_of.values())), squeeze=False
    )
    top = 0
    for b in bases:
        base = mean_curve(records, Variant(b, BASE), seeds, args.steps, grid)
        color = "tab:blue" if b == "mlagents" else "tab:orange"
        panels = axes[top : top + rows_of[b]].ravel()
        top += rows_of[b]
        for j, ax in enumerate(panels):
            if j >= len(switched[b]):
                ax.axis("off")
                continue
            r = switched[b][j]
            for curves, c, lw in (
                (base, "tab:gray", 1.0),
                (mean_curve(records, Variant(b, r["switch"]), seeds, args.steps, grid), color, 1.4),
            ):
                if curves is None:
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter(
                        "ignore", RuntimeWarning
                    )  # all-NaN columns before the first episode
                    ax.plot(grid / 1e3, np.nanmean(curves, 0), color=c, lw=lw)
                    ax.fill_between(
                        grid / 1e3, np.nanmin(curves, 0), np.nanmax(curves, 0), color=c, alpha=0.2, lw=0
                    )
            ax.set_title(
                f"{b}: {r['switch']}" + (f" ({r['verdict']})" if r["verdict"] else ""),
                fontsize=7,
                color=color,
            )
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
            if j % ncol == 0:
                ax.set_ylabel("mean return (100 ep.)", fontsize=7)
            ax.set_xlabel("agent steps (k)", fontsize=6)
    with_curves = sorted(
        {int(k) for r in records if r["steps"] == args.steps for k in r.get("curves", {}) if int(k) in seeds}
    )
    fig.suptitle(
        f"{args.env}: each preset (grey) vs the same preset with one switch flipped to the other's value\n"
        f"(blue: from mlagents, orange: from sb3); mean over seeds {with_curves} (the archived curves), band "
        "min..max; "
        "(verdict) as in the table, over all seeds",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def table(rows: list[dict], seeds: list[int], args: argparse.Namespace) -> str:
    lines = [
        f"Ant-v5, Crawler hyperparameters shrunk x{args.shrink}, {args.steps:,} agent steps per run, seeds "
        f"{seeds}; "
        "final = mean return of the last 100 episodes at the end of the run.",
        "",
        "| from | switch (options set to the other preset's values) | final return: mean ± std | min..max | "
        "Δ vs preset | Δ / pooled std | moves? | mean over the run | steps/s |",
        "|---|---|---:|---:|---:|---:|:-:|---:|---:|",
    ]
    for r in rows:
        what = (
            "— (the preset)"
            if r["switch"] == BASE
            else f"`{r['switch']}`: " + ", ".join(f"{k}={v}" for k, v in r["overrides"].items())
        )
        delta = "" if r["switch"] == BASE else f"{r['delta']:+.1f}"
        effect = "" if not math.isfinite(r["effect"]) else f"{r['effect']:+.1f}"
        spread = f" ± {r['final_std']:.1f}" if r["seeds"] > 1 else " (1 seed)"
        lines.append(
            f"| {r['base']} | {what} | {r['final_mean']:.1f}{spread} | "
            f"{r['final_min']:.1f}..{r['final_max']:.1f} | "
            f"{delta} | {effect} | {r['verdict']} | {r['run_mean']:.1f} | {r['steps_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def dry_run(variants: list[Variant], args: argparse.Namespace) -> int:
    """Parse each variant's command with launch_ppo's own parser and build its PPOConfig: a typo'd option or
    an
    invalid combination fails here, not hours into the ablation."""
    from impala.run.ppo_config import config_from_args
    from learner.cli.launch_ppo import build_parser

    for v in variants:
        cmd = command(v, args.seeds[0], args, Path(args.runs_dir) / "dry")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ML-Agents keys the trainer does not use
            cfg = config_from_args(build_parser().parse_args(cmd[1:]))
        for name, value in v.overrides.items():
            assert getattr(cfg, name) == value, (v, name, getattr(cfg, name), value)
        print(f"{v.base:8s} {v.switch:20s} ok: {' '.join(cmd[1:])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--mode", choices=("leave-one-out", "presets"), default="leave-one-out")
    p.add_argument("--env", default="Ant-v5")
    p.add_argument(
        "--steps",
        type=int,
        default=300_000,
        help="Agent steps per run (the same for every run; also max_steps).",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--bases", nargs="+", choices=PRESETS, default=list(PRESETS), help="Presets to start from."
    )
    p.add_argument(
        "--switches",
        nargs="+",
        choices=sorted(SWITCHES),
        default=None,
        help="Switches to flip (default: all).",
    )
    p.add_argument(
        "--shrink", type=int, default=8, help="Divide Crawler's buffer (20480) and batch (2048) by this."
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument(
        "--unroll-length",
        type=int,
        default=0,
        help="Steps per env per unroll; 0 = launch_ppo's default for trajectory_handling 'mlagents', one "
        "round of unrolls per update for 'rollout'.",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="Runs at once (each is an actor process and a learner)."
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="Learner threads per run (launch_ppo --torch-threads); default 0 (all cores) with --jobs 1, "
        "else 1.",
    )
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "ablation_ppo"))
    p.add_argument("--out", default=str(ROOT / "docs" / "ppo_ablation.png"))
    p.add_argument("--table", default=None, help="Markdown table path (default: RUNS_DIR/table.md).")
    p.add_argument(
        "--archive",
        default=str(ROOT / "docs" / "data" / "ppo_ablation_runs.json"),
        help="Committed record of every finished run (finished runs under RUNS_DIR are added); the table and "
        "figures are made from it.",
    )
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--rerun", action="store_true", help="Run again even where a finished run exists.")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Check every variant's launch_ppo options and print the commands; run nothing.",
    )
    args = p.parse_args(argv)
    runs = Path(args.runs_dir)
    switches = [BASE] if args.mode == "presets" else [BASE, *(args.switches or SWITCHES)]
    variants = [Variant(b, s) for b in args.bases for s in switches]
    buffer, batch = CRAWLER_BUFFER // args.shrink, CRAWLER_BATCH // args.shrink
    print(
        f"Ablation ({args.mode}) on {args.env}: Crawler hyperparameters (configs/Crawler.yaml) with buffer "
        f"{CRAWLER_BUFFER}->{buffer}, "
        f"batch {CRAWLER_BATCH}->{batch} (shrunk x{args.shrink}), max_steps 1e7->{args.steps} (schedules "
        "decay over the run); "
        f"{args.workers} actor x {args.envs_per_worker} envs; {len(variants)} variants x {len(args.seeds)} "
        f"seeds x {args.steps:,} steps",
        flush=True,
    )
    if args.dry_run:
        return dry_run(variants, args)
    if not args.plot_only:
        t0 = time.monotonic()
        # Seed-major, variants interleaved: machine-load drifts hit every variant alike.
        jobs = [(v, seed) for seed in args.seeds for v in variants]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            infos = list(pool.map(lambda job: run_one(job[0], job[1], args), jobs))
        total = time.monotonic() - t0
        rate = float(np.mean([i["steps_per_s"] for i in infos]))
        cpu_ms = 1000 * sum(i.get("cpu_s", 0.0) for i in infos) / sum(i["steps"] for i in infos)
        print(
            f"all runs: {total:.0f}s; mean {rate:.0f} agent steps/s per run, {cpu_ms:.1f} CPU ms per agent "
            "step",
            flush=True,
        )
    records = archive_runs(variants, args.seeds, args)
    rows = summarize(variants, args.seeds, args, records)
    title = (
        f"{args.env}: PPO leave-one-out between ML-Agents and SB3 semantics\nCrawler hyperparameters "
        f"(buffer {buffer}, batch {batch}, 3x512), {args.steps:,} steps, seeds {args.seeds}"
    )
    plot(rows, Path(args.out), title)
    curves_png = Path(args.out).with_name(Path(args.out).stem + "_curves.png")
    plot_curves(rows, records, args.seeds, args, curves_png)
    md = table(rows, args.seeds, args)
    table_path = Path(args.table) if args.table else runs / "table.md"
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(md)
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    print(md)
    print(f"wrote {args.out}, {curves_png}, {table_path}, {runs / 'summary.json'}, {args.archive}")
    rates = [r["steps_per_s"] for r in rows if math.isfinite(r["steps_per_s"])]
    if rates:
        full = len(SWITCHES) + 1
        est = 2 * full * 3 * 300_000 / float(np.mean(rates))
        print(
            f"a full leave-one-out ({2 * full} variants x 3 seeds x 300,000 steps) at {np.mean(rates):.0f} "
            "steps/s per run: "
            f"{est / 3600:.1f} h one run at a time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
