import os
import sys

# Tests import small helper modules from this folder (procs, fake_unity, legacy_env);
# spawned children inherit sys.path, so they can import them too.
sys.path.insert(0, os.path.dirname(__file__))

import subprocess  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, size) -> a folder on a tmpfs of that size (e.g. "64k"), unmounted after the test; the test
    skips, saying why, where mounting is not possible (it needs root)."""
    mounted = []

    def mount(name: str, size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / name
        path.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "--lazy", str(path)], check=False)  # lazy: a dead writer may hold a file
