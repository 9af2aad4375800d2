"""How the learner uses this machine's CPU: its torch threads, and whether bf16 pays in an image torso here.
Heuristics measured on the boxes named in each docstring, kept apart from the update they tune."""

from __future__ import annotations

import logging

import torch

from impala.envs.probe import EnvInfo
from impala.nets.impala_net import ImpalaNet
from impala.options import ConfigError
from impala.run.config import RunConfig

log = logging.getLogger(__name__)


# The learner's torch threads where --torch-threads is not given: the cores its local actors leave, and for
# image observations with actors at the learner's own priority (--actor-nice 0) at least this many
# (RunConfig.cpu_threads says why; launch_impala makes idle threads sleep, not spin).
LEARNER_THREADS = 2


def learner_threads(run: RunConfig, env: EnvInfo, ranks_here: int | None = None) -> int:
    """Torch threads for one learner rank. Image observations (a conv net, whose update parallelizes) get
    at least LEARNER_THREADS unless the actors were niced below the learner by ``--actor-nice`` alone: with
    ``--cpu-affinity learner-first`` (opt-in) the second thread takes the actors' core
    whenever the update can use it (Pong, 2 actors on 2 cores: 0.75-0.89 of the cost model's ceiling,
    four runs of five at 0.83 or above, against 0.75-0.80 for one pinned thread, BENCHMARKS.md).
    Vector observations (an MLP of small layers) keep the cores the actors leave, at least 1: there a
    second thread only adds synchronization (CartPole, 2 actors on 2 cores: 18% fewer frames/s).
    ``ranks_here``: the group's ranks that share this machine's CPUs (all --learners on one machine; a
    group across hosts has one per host)."""
    at_least = LEARNER_THREADS if len(env.obs_shape) == 3 else 1
    return max(1, run.cpu_threads(at_least=at_least) // (ranks_here or run.learners))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where oneDNN's bf16
    convolutions beat float32 (2-core AMD EPYC: 14-16 vs 20-22 ms per minibatch step); elsewhere they
    are emulated (on the 2-core Intel Xeon of the earlier benchmarks bf16 autocast was slower, 416 vs
    336 ms per update)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own CPUID checks
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def bf16_torso_cost(model: ImpalaNet, frames: int = 32, repeats: int = 3) -> tuple[float, float]:
    """(fp32 ms, bf16 ms): the best of ``repeats`` forward and backward passes of ``model``'s image torso over
    ``frames`` observations on this CPU, in float32 and under bf16 autocast. A second or less at start, and
    the real figure: whether torso bf16 pays depends on the kernels torch has for this CPU (oneDNN's native
    bf16 with AVX512-BF16 or AMX; emulated bf16 elsewhere with AVX-512; ATen's slow convolution path on an
    AVX2-only CPU, measured 7.8x slower than fp32 per minibatch step), more than on its flags."""
    import copy
    import time

    torso = copy.deepcopy(model.torso).cpu()
    obs = torch.randint(0, 256, (frames, *model.torso.obs_shape), dtype=torch.uint8)
    times = {}
    for dtype in (None, torch.bfloat16):
        torso.compute_dtype = dtype
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass of each also warms up
            torso.zero_grad(set_to_none=True)
            start = time.perf_counter()
            torso(obs).sum().backward()
            best = min(best, time.perf_counter() - start)
        times[dtype] = best * 1e3
    return times[None], times[torch.bfloat16]


def torso_precision(choice: str, device: torch.device, model: ImpalaNet) -> str:
    """``--precision`` checked for this learner: bf16 covers an image torso only; asking for it with any
    other torso is a :class:`ConfigError`. On a CPU, bf16 is timed against fp32 at start and a warning says
    what it costs where it is slower (the user asked for it: it stays)."""
    if choice == "bf16" and not hasattr(model.torso, "compute_dtype"):
        raise ConfigError(
            f"--precision bf16 runs an image torso's convolutions in bf16; this run's network has a "
            f"{type(model.torso).__name__} torso (vector observations): use --precision fp32"
        )
    if choice == "bf16" and device.type == "cpu":
        fp32_ms, bf16_ms = bf16_torso_cost(model)
        native = cpu_has_native_bf16()
        if bf16_ms > fp32_ms:
            log.warning(
                "--precision bf16 is slower than fp32 on this CPU: the torso's forward and backward pass "
                "took %.1f ms in bf16 against %.1f ms in fp32 (%.1fx)%s; --precision fp32 trains faster here",
                bf16_ms,
                fp32_ms,
                bf16_ms / fp32_ms,
                "" if native else " (no native bf16, AVX512-BF16 or AMX)",
            )
        else:
            log.info(
                "learner precision: bf16 in the image torso (%.1f ms against %.1f ms in fp32 per forward and "
                "backward pass on this CPU)",
                bf16_ms,
                fp32_ms,
            )
    elif choice == "bf16":
        log.info("learner precision: bf16 in the image torso")
    return choice
