"""Pure env audits for the frameskip regression check (docs/FRAMESKIP.md): no processes, no sockets.

* ``check_pickle_roundtrip``: pickle a raw env in this process, unpickle it, measure
  the copy and compare it with the configured settings and with the original (the
  historical failure: gym <= 0.10.5's pickling dropped frameskip and sticky actions).
* ``check_actor_builds_no_env``: walk a constructed, never started actor for any env
  object (envs must be built in ``run()``, in the child, never in ``__init__``).
* ``obs_mismatches``: a measured fingerprint's observation against the expected one.

``learner/cli/frameskip_check.py`` runs these next to its real-process worker check.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from typing import Any, Iterable

import gymnasium as gym

from impala.envs import check_env_id
from impala.envs.fingerprint import (
    EnvFingerprint,
    Mismatch,
    check_against_config,
    compare_fingerprints,
    configured_settings,
    measure_fingerprint,
)

ENV_IN_INIT = (
    "actor holds an environment object built in the parent (in __init__); build envs inside run() "
    "from an EnvSpec"
)


def obs_mismatches(expected: tuple[tuple[int, ...], str], fp: EnvFingerprint) -> list[Mismatch]:
    """The observation shape and dtype ``fp`` measured against ``expected`` (shape, dtype)."""
    shape, dtype = expected
    cause = (
        "the worker's env was not built from the same EnvSpec as the parent's (different "
        "wrappers/preprocessing)"
    )
    out = []
    if tuple(fp.obs_shape) != tuple(shape):
        out.append(Mismatch("obs_shape", str(tuple(shape)), str(tuple(fp.obs_shape)), cause))
    if fp.obs_dtype != dtype:
        out.append(Mismatch("obs_dtype", dtype, fp.obs_dtype, cause))
    return out


# ---------------------------------------------------------------------------
# The pickle round trip
# ---------------------------------------------------------------------------


def _resolve(entry_point: Any) -> type:
    if not isinstance(entry_point, str):
        return entry_point
    module, _, name = entry_point.partition(":")
    return getattr(importlib.import_module(module), name)


def check_pickle_roundtrip(
    env_id: str,
    *,
    env_class: type | None = None,
    overrides: dict[str, Any] | None = None,
    steps: int = 300,
    seed: int = 0,
) -> list[Mismatch]:
    """Pickle the raw env (the registry's class and kwargs, or ``env_class``) in this process,
    unpickle it, measure the copy and compare it with the configured settings and with the original.

    The raw env has no TimeLimit (that wrapper is gymnasium.make's), so the
    episode step limit is not compared here; the worker check covers it.
    """
    check_env_id(env_id)
    spec = gym.registry[env_id]
    kwargs = {**spec.kwargs, **(overrides or {})}
    kwargs.pop("max_episode_steps", None)
    if isinstance(kwargs.get("frameskip"), list):
        kwargs["frameskip"] = tuple(kwargs["frameskip"])
    cls = env_class or _resolve(spec.entry_point)
    original = cls(**kwargs)
    try:
        try:
            # A local round trip of an env built just above (the historical failure mode), never bytes from a
            # socket.
            clone = pickle.loads(pickle.dumps(original))
        except Exception as e:  # noqa: BLE001 - any failure to pickle is the finding
            return [
                Mismatch(
                    "pickle",
                    "picklable",
                    f"{type(e).__name__}: {e}",
                    "the env cannot cross a process boundary by pickling; build it in the child from an "
                    "EnvSpec",
                )
            ]
        try:
            fp_clone = measure_fingerprint(clone, steps=steps, seed=seed)
            fp_orig = measure_fingerprint(original, steps=steps, seed=seed)
        finally:
            clone.close()
    finally:
        original.close()
    cfg = configured_settings(env_id, overrides)
    out = (
        check_against_config(fp_clone, dataclasses.replace(cfg, max_episode_steps=None))
        if cfg is not None
        else []
    )
    # Then anything else the copy does differently from the original (obs, action count, ...).
    seen = {"num_actions" if m.field == "action_set" else m.field for m in out}
    cause = (
        "unpickling rebuilt the env with different settings than the original (its pickling drops "
        "constructor arguments)"
    )
    out += [
        Mismatch(m.field, m.configured, m.measured, cause)
        for m in compare_fingerprints(fp_orig, fp_clone)
        if m.field not in seen
    ]
    return out


# ---------------------------------------------------------------------------
# No env object in an actor built in the parent
# ---------------------------------------------------------------------------


def _is_env(obj: Any) -> bool:
    if isinstance(obj, (gym.Env, gym.vector.VectorEnv)):
        return True
    try:
        import ale_py

        return isinstance(obj, ale_py.ALEInterface)
    except ImportError:  # pragma: no cover
        return False


def _walk(obj: Any, path: str, seen: set[int], depth: int) -> Iterable[tuple[str, Any]]:
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if _is_env(obj):
        yield path, obj
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name, None), f"{path}.{f.name}", seen, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}[{k!r}]", seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", seen, depth + 1)


def envs_held_by(actor: Any) -> list[tuple[str, Any]]:
    """(attribute path, env object) for every env ``actor`` holds.

    Walks the actor's ``__dict__`` and, recursively, its config through
    dataclasses, dicts, lists, tuples and sets, looking for a ``gymnasium.Env``,
    a vector env or an ALE interface.
    """
    seen: set[int] = set()
    return [
        found
        for name, value in vars(actor).items()
        for found in _walk(value, f"{type(actor).__name__}.{name}", seen, 0)
    ]


def check_actor_builds_no_env(actor: Any) -> list[str]:
    """Flag every environment object held by a (not yet started) actor.

    Anything ``envs_held_by`` finds was built in the parent (in ``__init__``) and
    would be pickled into the child, which is how Pong lost its frame skip.
    """
    return [f"{path} is a {type(obj).__name__}: {ENV_IN_INIT}" for path, obj in envs_held_by(actor)]
