"""Shims that let ML-Agents 0.28's trainer code (``mlagents==0.28.0``) import on this stack.

Import this module before anything from ``mlagents.trainers`` or ``mlagents.torch_utils``;
:func:`require_mlagents` does it and skips the calling test module when the trainer package
is absent. ``scripts/setup.sh`` installs it with ``--no-deps`` (its metadata asks for torch<1.9
and numpy<2, and for h5py, so ``pip check`` lists those three and nothing else), plus the
pure-Python ``attrs`` and ``cattrs`` (its pin, <1.7) it imports at module level.

What breaks without the shims, and what each shim does (nothing else is patched):

1. ``mlagents/torch_utils/torch.py`` does ``import pkg_resources`` to check the torch version;
   current setuptools (84 here) no longer ships ``pkg_resources``. Shim: a stand-in module with
   ``get_distribution(name).version`` / ``DistributionNotFound`` read from
   ``importlib.metadata``, used only while mlagents is imported (a pkg_resources already
   imported is left as it is).
2. ``mlagents/trainers/buffer.py`` does ``import h5py`` (a compiled package) at module level for
   ``AgentBuffer.save_to_file`` / ``load_from_file`` only. Shim: an empty stand-in module while
   mlagents is imported, unless h5py is installed; the parity tests never save a buffer.
3. ``mlagents/trainers/settings.py`` registers a cattrs structure hook for the typing alias
   ``Dict[RewardSignalType, RewardSignalSettings]``; cattrs < 1.7 (ML-Agents' pin) hands it to
   ``functools.singledispatch.register``, which refuses non-classes since Python 3.11. Shim:
   such aliases are registered as an exact-match function dispatch instead, which is the lookup
   ``singledispatch`` did for them before 3.11.
4. Importing ``mlagents.torch_utils`` calls ``torch.set_num_threads(max(min(cpus // 2, 4), 1))`` and
   ``torch.set_default_tensor_type(...)`` (deprecated in torch 2.x), with the CUDA tensor type
   when a GPU is visible. Shim: during that import ``torch.cuda.is_available()`` reads False (so
   ML-Agents stays on the CPU, its default tensor type is torch's own, and its deprecation
   warning is silenced), and the process's torch thread count is restored afterwards, so
   importing ML-Agents changes nothing for other tests.
5. ``mlagents/trainers/buffer.py`` annotates ``pad_value: np.float`` (evaluated when the module
   is imported); numpy 2 removed that alias. Shim: ``np.float = float`` while that module is
   imported, removed again afterwards (no ML-Agents code reads it at run time).
6. ML-Agents imports mlagents-envs' communicator messages, whose protoc-3.x modules need
   protobuf<3.21; this stack has a current protobuf. Shim: ``impala.envs.mlagents_proto``'s import
   hook, which builds those modules from the descriptors they ship (what ``impala.envs.unity``
   installs for the Unity client too).
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import types
import warnings
from unittest import mock

MLAGENTS_VERSION = "0.28.0"


def _pkg_resources_stand_in() -> types.ModuleType:
    mod = types.ModuleType("pkg_resources")

    class DistributionNotFound(Exception):
        pass

    def get_distribution(name: str) -> types.SimpleNamespace:
        try:
            return types.SimpleNamespace(project_name=name, version=importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            raise DistributionNotFound(name) from None

    mod.DistributionNotFound = DistributionNotFound
    mod.get_distribution = get_distribution
    mod.__mlagents_shim__ = True
    return mod


def _patch_cattrs_dispatch() -> None:
    from cattr import dispatch

    cls = dispatch.MultiStrategyDispatch
    if getattr(cls.register_cls_list, "__mlagents_shim__", False):
        return
    original = cls.register_cls_list

    @functools.wraps(original)
    def register_cls_list(self, cls_and_handler, direct: bool = False):
        plain = []
        for typ, handler in cls_and_handler:
            if direct or isinstance(typ, type):
                plain.append((typ, handler))
            else:  # a typing alias such as Dict[K, V]: exact match, as singledispatch did before 3.11
                self.register_func_list([(lambda t, _typ=typ: t == _typ, handler)])
        if plain:
            original(self, plain, direct)

    register_cls_list.__mlagents_shim__ = True
    cls.register_cls_list = register_cls_list


@functools.cache
def install() -> None:
    """Apply the shims and import ML-Agents' torch utilities once; idempotent."""
    import numpy as np
    import torch

    from impala.envs.mlagents_proto import install as install_mlagents_proto

    install_mlagents_proto()

    # The stand-in whether or not this setuptools still ships pkg_resources (a fresh venv's does):
    # the same code path everywhere, and none of the real one's deprecation warnings.
    installed_pkg_resources = "pkg_resources" not in sys.modules
    if installed_pkg_resources:
        sys.modules["pkg_resources"] = _pkg_resources_stand_in()
    try:
        import h5py  # noqa: F401

        installed_h5py = False
    except ImportError:
        stub = types.ModuleType("h5py")
        stub.__mlagents_shim__ = True
        sys.modules["h5py"] = stub
        installed_h5py = True
    _patch_cattrs_dispatch()

    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings(), mock.patch.object(torch.cuda, "is_available", lambda: False):
            warnings.simplefilter("ignore", UserWarning)  # set_default_tensor_type() is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)  # distutils LooseVersion
            import mlagents.torch_utils  # noqa: F401 - runs the module-level torch set-up once

            had_float = "float" in vars(np)
            if not had_float:
                np.float = float
            try:
                import mlagents.trainers.buffer  # noqa: F401

                # ppo/trainer.py and trainer/__init__.py import each other; mlagents-learn enters
                # through the package, which is the order that works.
                import mlagents.trainers.trainer  # noqa: F401
            finally:
                if not had_float:
                    del np.float
    finally:
        torch.set_num_threads(threads)
        # Stand-ins leave sys.modules again, so no other import finds them.
        if installed_pkg_resources:
            del sys.modules["pkg_resources"]
        if installed_h5py:
            del sys.modules["h5py"]


def require_mlagents() -> None:
    """Apply the shims, or skip the calling test module when ``mlagents==0.28.0`` is missing.

    Under CI (``CI`` set, as ``.ci/run`` runs) a missing or different mlagents is an error,
    not a skip: ``scripts/setup.sh`` installs it, and the parity tests must run there.
    """
    import os

    import pytest

    try:
        version = importlib.metadata.version("mlagents")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != MLAGENTS_VERSION:
        why = (
            f"the ML-Agents parity tests need mlagents=={MLAGENTS_VERSION} (found {version}); "
            "scripts/setup.sh installs it"
        )
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why, allow_module_level=True)
    install()


def vector_observation_specs(sizes: list[int] | tuple[int, ...]) -> list:
    """ML-Agents' ``ObservationSpec`` of each vector observation a behaviour with these sizes declares
    (``vector0``, ``vector1``, ...), as its players send them. Call it after :func:`require_mlagents`."""
    from mlagents_envs.base_env import DimensionProperty, ObservationSpec, ObservationType

    return [
        ObservationSpec(
            shape=(n,),
            dimension_property=(DimensionProperty.NONE,),
            observation_type=ObservationType.DEFAULT,
            name=f"vector{i}",
        )
        for i, n in enumerate(sizes)
    ]
