"""Every flag of every console script, walked with values that cannot work: exit 2, one line, no traceback.

The scripts come from pyproject.toml's ``[project.scripts]`` and the flags from each script's own
parser, so a new script or flag is walked without editing this file; a new free-text flag must be
given a bad value in ``TEXT_BAD`` (the walk fails until it is). Each case calls the real ``main``
in this process. The base arguments make a tiny run, so a bad value that slips through is caught as
exit 0 after a few seconds instead of a long run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]

# Base arguments per script: valid, and a short run if nothing else stops it.
TINY_IMPALA = (
    "--env CartPole-v1 --workers 1 --in-process --total-frames 64 --unroll-length 8 --batch-size 2 "
    "--minibatches 1 --no-progress --device cpu"
).split()
TINY_PPO = (
    "--env Pendulum-v1 --workers 1 --in-process --total-steps 64 --buffer-size 64 --batch-size 32 "
    "--hidden-units 8 --num-layers 1 --time-horizon 32 --no-progress --device cpu"
).split()
BASE = {
    "launch_impala": TINY_IMPALA,
    "launch_ppo": TINY_PPO,
    "frameskip_check": "--env CartPole-v1 --workers 1 --start-method fork --fingerprint-steps 20".split(),
    "impala-actors": ["--learner", "tcp://127.0.0.1:9", "--timeout", "0.5", "--workers", "1"],
    # No such file: every flag is checked before the checkpoint is read, so a bad value that slipped
    # through would fail on the file instead, with a message naming neither the flag nor the value.
    "impala-eval": ["/no/such/run/checkpoint.pt", "--episodes", "2", "--workers", "0"],
    "impala-export": ["/no/such/run/checkpoint.pt"],
}

# Free-text flags and a value each that cannot work (numbers and choices are generated).
TEXT_BAD = {
    "--env": "NoSuchEnv-v9",
    "--env-kwargs": "{not json",
    "--env-package": "no_such_env_package_here",
    "--logdir": "/proc/no-such-dir/run",
    "--runs-dir": "/proc/no-such-dir/runs",
    "--run-id": "../elsewhere",
    "--bind": "",
    "--curve": "/proc/no-such-dir/keys",
    "--device": "gpu7",
    "--track-project": "team/project",
    "--config": "/no/such/preset.yaml",
    "--unity-build": "/no/such/Crawler.x86_64",
    "--unity-behavior": None,  # only read with --unity-build (its own case above)
    "--trainer-config": "/no/such/trainer.yaml",
    "--mlagents-config": "/no/such/trainer.yaml",
    "--behavior": None,  # only read with --trainer-config
    "--learner": "udp://nowhere",
    "--actor-class": "no_such_module:Actor",
    "--start-method": "teleport",
    "--plot": "/proc/no-such-dir/plot.png",
    "--checkpoint": "/no/such/checkpoint.pt",
    "--out": "/proc/no-such-dir/eval.json",
    "--video": "/proc/no-such-dir/episode.mp4",
    "--task": "NoSuchEnv-v9",
    "--output": "/proc/no-such-dir/model.onnx",
    "--obs-sizes": "126,x",
    "--results-dir": "/proc/no-such-dir/results",
    "--torch-device": "gpu7",
    "--initialize-from": "no-such-run",
    "--rdzv-endpoint": "learner0-without-a-port",
}
# Numeric flags where a negative number is a legitimate value.
ANY_SIGN = {"--stop-at-return", "--target-frame-rate"}  # a target frame rate of -1: unlimited


def _flag_cases() -> list[tuple[str, str, str]]:
    cases = []
    for prog, target in SCRIPTS.items():
        module = importlib.import_module(target.split(":")[0])
        for action in module.build_parser()._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = max(action.option_strings, key=len)
            if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
                continue  # on/off switches take no value to get wrong
            if action.choices is not None:
                values = ["BOGUS"]
            elif action.type in (int, float) or getattr(action.type, "__name__", "") in ("int", "float"):
                kind = getattr(action.type, "__name__", "")
                values = ["x", "nan", "inf"] if kind == "float" else ["x", "1.5"]
                if flag not in ANY_SIGN:
                    values.append("-1")
            else:
                assert flag in TEXT_BAD, f"{prog} {flag}: a free-text flag without a bad value in TEXT_BAD"
                values = [] if TEXT_BAD[flag] is None else [TEXT_BAD[flag]]
            cases += [(prog, flag, v) for v in values]
    return cases


CASES = _flag_cases()


@pytest.mark.parametrize("prog,flag,value", CASES, ids=[f"{p}{f}={v}" for p, f, v in CASES])
def test_bad_flag_value_is_one_line_and_exit_2(prog, flag, value, tmp_path, capsys, monkeypatch):
    module = importlib.import_module(SCRIPTS[prog].split(":")[0])
    argv = list(BASE[prog])
    if prog in ("launch_impala", "launch_ppo") and flag not in (
        "--runs-dir",
        "--results-dir",
        "--run-id",
    ):  # those name the folder instead
        argv += ["--logdir", str(tmp_path / "run")]
    elif prog in ("launch_impala", "launch_ppo"):
        argv += ["--runs-dir", str(tmp_path / "runs")]
    monkeypatch.chdir(tmp_path)  # anything a slipped-through value writes stays in the test's folder
    try:
        rc = module.main([*argv, f"{flag}={value}"])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = [
        line for line in err.splitlines() if line.strip() and not re.match(r"^\d{4}-\d\d-\d\d ", line)
    ]  # log lines aside
    assert rc == 2, f"{prog} {flag}={value!r} was accepted (exit {rc}); stderr: {err[-1500:]}"
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    names = (
        flag,
        flag[2:].replace("-", "_"),
        value,
    )  # the flag, its option name (PPO's YAML-shared messages), or the value
    assert any(n and n in lines[0] for n in names), (
        f"the message names neither the flag nor the value: {lines[0]}"
    )
    # a start that failed leaves no empty run folder behind
    assert not (tmp_path / "run").exists(), (
        f"{prog} {flag}={value!r} left {sorted(os.listdir(tmp_path / 'run'))}"
    )


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_an_abbreviated_flag_is_refused_and_the_full_one_suggested(prog, tmp_path, capsys, monkeypatch):
    """Every script refuses a prefix of one of its flags (argparse would take --total-frame for
    --total-frames, and --lr for --lr-decay) in one line, exit 2, naming the flag it resembles."""
    module = importlib.import_module(SCRIPTS[prog].split(":")[0])
    flags = [
        max(a.option_strings, key=len)
        for a in module.build_parser()._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    flag = max(flags, key=len)  # the longest flag: its prefix is no other flag
    monkeypatch.chdir(tmp_path)
    try:
        rc = module.main([*BASE[prog], flag[:-1] + "=1"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err[-1500:]
    assert f"unrecognized arguments: {flag[:-1]}=1" in lines[0] and f"-> {flag}?" in lines[0], lines[0]


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_help_shows_each_default_once(prog):
    parser = importlib.import_module(SCRIPTS[prog].split(":")[0]).build_parser()
    for help_text in (parser.format_help(), parser.format_full_help()):
        text = " ".join(help_text.split())
        assert "[default: " in text or prog in ("frameskip_check", "impala-export")
        for chunk in re.split(r"\s(?=-{1,2}[a-z\[])", text):  # one chunk per option
            assert chunk.count("[default:") + chunk.count("(default:") <= 1, chunk


@pytest.mark.parametrize("prog", sorted(SCRIPTS))
def test_help_is_a_page_and_help_all_has_every_option_in_full(prog):
    """--help: one line or two per option, at most 150 lines; --help-all: every option's whole text."""
    module = importlib.import_module(SCRIPTS[prog].split(":")[0])
    brief, full = (
        subprocess.run(
            [sys.executable, "-m", module.__name__, flag],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )  # fmt: skip
        for flag in ("--help", "--help-all")
    )
    assert brief.returncode == 0 and full.returncode == 0, brief.stderr + full.stderr
    assert len(brief.stdout.splitlines()) <= 150, len(brief.stdout.splitlines())
    assert max(len(line) for line in brief.stdout.splitlines()) <= 110
    parser = module.build_parser()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    for flag in flags:
        assert flag in full.stdout and (flag in brief.stdout or f"--[no-]{flag[2:]}" in brief.stdout), flag
    # the whole text of each option is in --help-all (its first words at least), not only its first sentence
    for action in parser._actions:
        if action.help and len(action.help) > 200 and "%" not in action.help:
            assert " ".join(action.help.split()[-4:]) in " ".join(full.stdout.split()), action.option_strings


def test_the_two_launchers_speak_one_vocabulary():
    """The same idea has the same flag in both launchers; the other spelling (ML-Agents' key) is an alias."""
    from learner.cli import launch_impala, launch_ppo

    def flags(parser):
        return {o for a in parser._actions for o in a.option_strings}

    impala, ppo = flags(launch_impala.build_parser()), flags(launch_ppo.build_parser())
    for flag in ("--entropy-cost", "--discount", "--grad-norm-clip", "--epochs", "--batch-size"):
        assert flag in impala and flag in ppo, flag
    assert {"--beta", "--gamma", "--max-grad-norm", "--num-epoch"} <= ppo  # ML-Agents' names still work
    parsed = launch_ppo.build_parser().parse_args(["--beta", "0.01", "--discount", "0.9", "--epochs", "5"])
    assert (parsed.ppo__beta, parsed.ppo__gamma, parsed.ppo__num_epoch) == (0.01, 0.9, 5)
    assert not {"--overlap-updates", "--publish-delay"} & ppo  # IMPALA's alone


def _hostile_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """Values a hostile or careless user gave that once ended in a traceback, a huge error line or a hang."""
    (tmp / "binary.yaml").write_bytes(bytes(range(256)) * 64)
    (tmp / "deep.yaml").write_text("[" * 20_000)
    (tmp / "bomb.yaml").write_text(
        "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
        "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    )
    return [
        ("launch_impala", ["--seed", str(2**70)], "--seed"),
        ("launch_ppo", ["--seed", str(2**70)], "--seed"),
        ("launch_impala", ["--env-kwargs", "[" * 100_000], "--env-kwargs"),
        ("launch_impala", ["--env-kwargs", '{"max_episode_steps": 0}'], "max_episode_steps"),
        ("launch_impala", ["--max-abs-value", "1e-30"], "--max-abs-value"),
        ("launch_impala", ["--config", str(tmp / "binary.yaml")], "not a text file"),
        ("launch_impala", ["--config", str(tmp / "deep.yaml")], "nested"),
        ("launch_impala", ["--config", str(tmp / "bomb.yaml")], "aliases"),
        ("launch_ppo", ["--trainer-config", str(tmp / "bomb.yaml")], "aliases"),
        ("launch_impala", ["--config", str(tmp)], "is a directory"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_hostile_values_are_one_short_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    prog, extra, expected = _hostile_cases(tmp_path)[case]
    module = importlib.import_module(SCRIPTS[prog].split(":")[0])
    monkeypatch.chdir(tmp_path)
    try:
        rc = module.main([*BASE[prog], "--logdir", str(tmp_path / "run"), *extra])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not re.match(r"^\d{4}-\d\d-\d\d ", line)]
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and expected in lines[0], lines
    assert len(lines[0]) < 700  # the value is shown cut, not whole
