"""Atomic checkpoints: write to an unnamed file beside the target (O_TMPFILE), fsync, name it, then rename.

A crash mid-write leaves the previous checkpoint intact; readers never see a
half-written file. A state holding a NaN or infinite float tensor is refused before
anything is written, so a diverged run never replaces a good checkpoint. Loading uses
``weights_only=True``: a checkpoint holds tensors and plain data only, so loading one
cannot execute code; a file that is not such a checkpoint is one ``CheckpointError``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import tempfile
from typing import Any

import torch

from impala.options import ConfigError

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names the file and the problem."""


def non_finite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a nested state that hold NaN or inf."""
    if isinstance(state, torch.Tensor):
        return (
            [prefix or "<tensor>"]
            if state.is_floating_point() and not bool(torch.isfinite(state).all())
            else []
        )
    items = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, (list, tuple))
        else ()
    )
    return [
        name
        for key, value in items
        for name in non_finite_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    ]


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically; CheckpointError (nothing written) if a tensor is not finite."""
    bad = non_finite_tensors(state)
    if bad:
        raise CheckpointError(
            f"not writing {path}: {len(bad)} tensor(s) hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        )
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if not _write_unnamed_then_place(directory, state, os.path.abspath(path)):
        # no O_TMPFILE or no usable /proc here: a named temp file, removed on any error we see
        fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                _write(f, state)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
    _fsync_directory(directory)


def _write(f: Any, state: dict[str, Any]) -> None:
    try:
        torch.save(state, f)
    except RuntimeError as e:
        # torch's zip writer turns a failed write (ENOSPC, EIO) into a RuntimeError raised while handling the
        # OSError: report the OSError, which says what happened
        cause = _os_error_in(e)
        if cause is None:
            raise
        raise cause from None
    f.flush()
    os.fsync(f.fileno())


def _os_error_in(error: BaseException) -> OSError | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _remove(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _write_unnamed_then_place(directory: str, state: dict[str, Any], path: str) -> bool:
    """Write and sync ``state`` into a nameless file in ``directory`` (Linux O_TMPFILE), then give it a
    temporary name and rename that over ``path`` in the next system call: a kill can strand a temp file
    only between those two calls, not during the whole write. False (nothing placed) where the
    filesystem, kernel or a missing /proc rule this out."""
    global _link_works
    fd = _unnamed_file(directory) if _link_works else None
    if fd is None:
        return False
    with os.fdopen(fd, "wb") as f:
        if not os.path.exists(f"/proc/self/fd/{f.fileno()}"):  # no /proc mounted: nothing to link from
            _link_works = False
            return False
        _write(f, state)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                name = _link_into(f.fileno(), dfd)
            except OSError:  # linkat refused (EPERM under some sandboxes): named files from now on
                _link_works = False
                return False
            try:
                os.replace(name, path, src_dir_fd=dfd)
            except BaseException:
                _remove(os.path.join(directory, name))
                raise
            return True
        finally:
            os.close(dfd)


_link_works = True  # False once naming an unnamed file failed in this process


def _unnamed_file(directory: str) -> int | None:
    """An open, nameless file in ``directory`` (Linux O_TMPFILE), or None where that is not supported."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY, 0o600)
    except OSError:  # EOPNOTSUPP / EISDIR / EINVAL: filesystem or kernel without O_TMPFILE
        return None


def _link_into(fd: int, dfd: int) -> str:
    """Give the unnamed file ``fd`` a fresh temporary name in the directory ``dfd``; returns the name.
    linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N (a directory fd makes os.link call linkat; plain link()
    would link the /proc symlink)."""
    while True:
        name = f".checkpoint-{secrets.token_hex(8)}.tmp"
        try:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dfd, follow_symlinks=True)
            return name
        except FileExistsError:
            continue


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (best effort: not every platform can open a directory)."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def load_checkpoint(
    path: str, map_location: str | torch.device = "cpu", *, keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Load a checkpoint this program wrote; ``keys`` must all be present at the top level."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path}; run without --resume, or point --logdir at a run that has one"
        )
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} is not a file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to parse means the same thing to the user
        # torch's own message suggests weights_only=False, i.e. running code from the file: never.
        kind = (
            "empty" if os.path.getsize(path) == 0 else f"truncated or not a checkpoint ({type(e).__name__})"
        )
        raise CheckpointError(f"checkpoint {path} cannot be read: {kind}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a checkpoint dict")
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: not a checkpoint of this program"
        )
    return state


FINISHED_MARKER = "finished.json"  # written when a run used up its step budget
# What a run writes into its folder; --force deletes exactly these (never anything else a user put there).
RUN_FILES = ("checkpoint.pt", "best.pt", "metrics.csv", "config.yaml", FINISHED_MARKER)
RUN_FILE_PATTERNS = ("events.out.tfevents.", "eval-")


# numbered checkpoints (launch_ppo's checkpoint_interval): <behaviour>-<agent steps>.pt and .onnx
NUMBERED_CHECKPOINT = re.compile(r".+-\d+\.(pt|onnx)")


def run_files(path: str) -> list[str]:
    """The files of a run in folder ``path`` (empty: no run there)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [
        n
        for n in names
        if n in RUN_FILES or n.startswith(RUN_FILE_PATTERNS) or NUMBERED_CHECKPOINT.fullmatch(n)
    ]


def prepare_run_folder(path: str, *, resume: bool, force: bool) -> tuple[str, ...]:
    """Make the run folder ready at start-up, not at the first checkpoint: created and writable, and never
    another run's folder by accident. A folder that holds a run is refused unless ``resume`` (continue it) or
    ``force`` (its run files are deleted first). Returns the folders it created, the run folder first, then
    each new parent (``runs/``, or mlagents-learn's RESULTS_DIR/RUN_ID), so that a start that fails later
    (a bad env id, a port in use) can take them away again (``drop_unused_run_folder``)."""
    missing = []  # the run folder, then each parent that is not there yet
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    created = tuple(missing)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--logdir {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--logdir {path}: not writable")
    _lock_run_folder(path)
    held = run_files(path)
    if not held or resume:
        return created
    trained = [n for n in held if n.endswith(".pt")]
    if not force and trained:
        raise ConfigError(
            f"run folder {path} holds a run ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): pass "
            "--resume to "
            "continue it, --force to start over in it, or another --run-id"
        )
    if not trained and not force:  # a run that trained nothing: nothing of it to keep, and no one writes it
        log.info("run folder %s holds a run that trained nothing (no checkpoint): starting over in it", path)
    for name in held:
        try:
            os.remove(os.path.join(path, name))
        except IsADirectoryError:
            raise ConfigError(
                f"--force: {os.path.join(path, name)} is a directory; move it away first"
            ) from None
        except OSError as e:
            raise ConfigError(f"--force: cannot delete {os.path.join(path, name)} ({e.strerror})") from None
    return created


LOCK_FILE = ".run.lock"  # held (flock) by the process whose run writes the folder, for as long as it runs
_held_locks: dict[str, int] = {}  # run folder -> the lock's file descriptor, open until this process ends


def _lock_run_folder(path: str) -> None:
    """Take the run folder's lock for the rest of this process: two processes writing one run folder would
    interleave their rows and checkpoints, and a second start must not take a live run's folder for one that
    trained nothing. The kernel drops the lock when the process ends, however it ends."""
    path = os.path.abspath(path)
    if path in _held_locks:
        return
    lock = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--logdir {path}: cannot create its lock file ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"run folder {path} is in use by a run that is still going (another launch_impala or "
            "launch_ppo): stop it first, or give this run another --run-id"
        ) from None
    _held_locks[path] = fd


def release_run_folders() -> None:
    """Give back every run folder lock this process holds and remove their files: a launcher's run ended
    (or its start failed), and a later start in this process or another may take the folder."""
    while _held_locks:
        path, fd = _held_locks.popitem()
        try:
            os.remove(os.path.join(path, LOCK_FILE))
        except OSError:
            pass
        os.close(fd)


def drop_unused_run_folder(created: tuple[str, ...]) -> None:
    """Remove the folders ``prepare_run_folder`` created for a start that then failed, innermost first, as
    long as each is empty: a run that never started leaves no empty folder behind. A folder that holds
    anything (or that was there before) stays, and so does every folder above it."""
    release_run_folders()
    for folder in created:
        try:
            os.rmdir(folder)
        except OSError:  # not empty, or gone: either way nothing of a run is lost
            return
