"""The project as a wheel: built from the clone, it holds every module, the presets and the console scripts;
installed into a fresh virtualenv (its dependencies taken from this one's site-packages, none of the clone),
the quick start's launcher, a preset by bare name, the Python API and impala-eval run from an empty folder."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a copy of the tracked files (a clean clone): setuptools' build/ stays out of the tree
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        path = REPO / name
        if name and path.is_file() and not path.is_symlink():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    built = subprocess.run(
        [sys.executable, *"-m pip wheel --no-deps --no-build-isolation -q -w".split(), str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("impala_rl-*.whl")
    return path


def test_the_wheel_holds_every_module_the_presets_and_the_scripts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    modules = [
        p for p in tracked.split() if p.endswith(".py") and p.split("/")[0] in ("impala", "actors", "learner")
    ]
    presets = [p for p in tracked.split() if p.startswith("impala/configs/") and p.endswith(".yaml")]
    assert modules and presets
    assert [m for m in modules if m not in names] == []
    assert [p for p in presets if p not in names] == []
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = configparser.ConfigParser()
    scripts.read_string(zipfile.ZipFile(wheel).read(info).decode())
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert dict(scripts["console_scripts"]) == declared


def test_installed_from_the_wheel_it_runs_outside_the_clone(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = Path(
        sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})
    )  # the new venv's site-packages: this venv's packages for the dependencies, by path (no .pth of theirs
    # is read there, so the clone's editable install stays out)
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    def run(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    where = run(str(python), "-c", "import impala, learner; print(impala.__file__, learner.__file__)")
    assert where.returncode == 0 and str(site) in where.stdout and str(REPO) not in where.stdout, where
    help_ = run(str(env_dir / "bin" / "launch_impala"), "--config", "atari", "--help")
    assert help_.returncode == 0 and "usage: launch_impala" in help_.stdout, help_.stderr[-2000:]
    job = (
        "import impala\n"
        "if __name__ == '__main__':\n"
        "    r = impala.train(env='CartPole-v1', workers=1, total_frames=3000, unroll_length=8,\n"
        "                     batch_size=4, minibatches=2, logdir='run', progress=False)\n"
        "    print('FOLDER', r.run_folder, r.updates)\n"
    )
    (work / "job.py").write_text(job)
    trained = run(str(python), "job.py")
    assert trained.returncode == 0 and f"FOLDER {work / 'run'}" in trained.stdout, trained.stderr[-3000:]
    played = run(str(env_dir / "bin" / "impala-eval"), "run", "--episodes", "2", "--workers", "0")
    assert played.returncode == 0 and (work / "run" / "eval-train-sample-2.json").is_file(), played.stderr[
        -2000:
    ]
