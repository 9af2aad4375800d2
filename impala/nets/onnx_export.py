"""Trained policies as ONNX files: PPO in ML-Agents 0.28's format (for Unity), IMPALA for serving.

PPO (:func:`ppo_onnx_model`, :func:`export_ppo_onnx`)
    The file Unity's ML-Agents package (model API 3, ``MLAgents2_0``) runs, with exactly what
    ML-Agents 0.28's own exporter (``ModelSerializer`` over ``SimpleActor.forward``) writes:

    - inputs ``obs_0`` .. ``obs_{n-1}`` [batch, size]: one per observation (sensor), in the
      order the behaviour spec lists them; our policy sees their concatenation;
    - input ``action_masks`` [batch, sum of branch sizes] float32 (1: allowed) when the policy
      has discrete branches;
    - outputs ``version_number`` [1] = 3, ``memory_size`` [1] = 0, ``continuous_actions``
      [batch, A] (a sample), ``continuous_action_output_shape`` [1] = A,
      ``deterministic_continuous_actions`` [batch, A] (the mean), all float32; with discrete
      branches ``discrete_actions`` [batch, branches] int64 (a sample per branch),
      ``discrete_action_output_shape`` [1, branches] float32 (each branch's size) and
      ``deterministic_discrete_actions`` [batch, branches] int64 (each branch's argmax);
    - opset 9, as ML-Agents' ``SerializationSettings.onnx_opset``.

    The graph is built node by node from the policy's weights (no tracing): the observation
    normalizer is folded in (ML-Agents' ``clamp((x - mean) / sqrt(M2 / N), -5, 5)``, or the
    frozen VecNormalize snapshot's ``clip((x - mean) / sqrt(var + eps), -10, 10)``), then the
    actor MLP, the mean head, and the Gaussian sample ``mean + RandomNormalLike * exp(log_sigma)``.
    Both action outputs go through what the env received in training (``env_action``):
    ``clamp(a, -3, 3) / 3`` for ``action_clip='mlagents'``, which is what ML-Agents' graph
    does (``ActionModel.get_action_out`` with ``_clip_action_on_export``); ``clip(a, low, high)``
    for ``'bounds'`` (SB3). Each discrete branch is masked as ML-Agents' graph masks it
    (``logits * mask - 1e8 * (1 - mask)``), then ``Softmax``; the sample is ``Multinomial`` of
    its log, the deterministic action its ``ArgMax``.

IMPALA (:func:`export_impala_onnx`)
    Input ``obs`` [batch, *obs_shape] (uint8 frames stay uint8: the scaling is in the graph);
    outputs ``policy_logits`` [batch, num_actions] and ``baseline`` [batch, num_tasks] (PopArt
    values in return units). Traced by torch's TorchScript ONNX exporter; feed-forward models only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from impala.algos.normalizers import MLAGENTS_CLIP, FrozenObsNormalizer, MLAgentsNormalizer
from impala.envs import EnvSpec
from impala.nets.ppo_policy import ACTION_CLIPS, MLAGENTS_ACTION_LIMIT, ActorCritic

# What ML-Agents 0.28 writes (mlagents/trainers/torch/model_serialization.py, networks.py).
MLAGENTS_OPSET = 9  # SerializationSettings.onnx_opset
MLAGENTS_IR_VERSION = 4  # what torch's exporter stamps on an opset-9 file
MODEL_EXPORT_VERSION = 3  # SimpleActor.MODEL_EXPORT_VERSION (ModelApiVersion.MLAgents2_0)
OBS_PREFIX = "obs_"
ACTION_MASKS = "action_masks"
VERSION_NUMBER = "version_number"
MEMORY_SIZE = "memory_size"
CONTINUOUS_ACTIONS = "continuous_actions"
CONTINUOUS_SHAPE = "continuous_action_output_shape"
DETERMINISTIC_CONTINUOUS = "deterministic_continuous_actions"
DISCRETE_ACTIONS = "discrete_actions"
DISCRETE_SHAPE = "discrete_action_output_shape"
DETERMINISTIC_DISCRETE = "deterministic_discrete_actions"
BATCH = "batch"

IMPALA_OPSET = 17
IMPALA_INPUT = "obs"
IMPALA_OUTPUTS = ("policy_logits", "baseline")


class ExportError(ValueError):
    """A policy, an option or an output path that cannot be exported (one line, for a CLI)."""


def onnx_file_name(env: EnvSpec) -> str:
    """``<behaviour>.onnx`` for a Unity build (behaviour name without ``?team=N``), else ``<env id>.onnx``.

    Unity's ML-Agents package matches a model to an agent by this name in the editor's inspector.
    """
    behaviour = env.kwargs.get("behavior_name") if env.is_unity else None
    name = str(behaviour).split("?", 1)[0] if behaviour else env.id.removeprefix("unity:")
    return name.replace("/", "_").replace(os.sep, "_") + ".onnx"


def require_onnx() -> Any:
    """The ``onnx`` module, or an ExportError saying how to install it."""
    try:
        import onnx
    except ImportError:
        raise ExportError(
            "the onnx package is not installed; install it with: pip install 'impala-rl[export]'"
        ) from None
    return onnx


@dataclass(frozen=True)
class ActionLayout:
    """The behaviour's actions as ML-Agents' ``ActionSpec`` has them."""

    continuous_size: int
    discrete_branches: tuple[int, ...] = ()

    def output_names(self) -> list[str]:
        """Graph outputs in ML-Agents' order (``ModelSerializer.output_names``, no memory)."""
        names = [VERSION_NUMBER, MEMORY_SIZE]
        if self.continuous_size > 0:
            names += [CONTINUOUS_ACTIONS, CONTINUOUS_SHAPE, DETERMINISTIC_CONTINUOUS]
        if self.discrete_branches:
            names += [DISCRETE_ACTIONS, DISCRETE_SHAPE, DETERMINISTIC_DISCRETE]
        return names


class _Graph:
    """A small ONNX graph builder: unique names, float32 constants as initializers."""

    def __init__(self, onnx: Any) -> None:
        self.onnx, self.h = onnx, onnx.helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def const(self, name: str, value: np.ndarray | float | Sequence[float]) -> str:
        array = np.asarray(value, dtype=np.float32)
        self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, **attrs: Any) -> str:
        self._count += 1
        out = output or f"{op_type.lower()}_{self._count}"
        self.nodes.append(
            self.h.make_node(op_type, list(inputs), [out], name=f"{op_type}_{self._count}", **attrs)
        )
        return out


def _float32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def _normalizer(g: _Graph, policy: ActorCritic, x: str) -> str:
    """The actor's observation normalizer, folded in as constants (identity for obs_norm='none')."""
    kind = policy.obs_norm_kind
    if kind == "mlagents":
        norm: MLAgentsNormalizer = policy.actor_norm
        # The same float32 ops as mlagents_normalizer_apply (M2 / N, then sqrt), done once here.
        std = torch.sqrt(norm.m2.float() / norm.steps)
        clip = MLAGENTS_CLIP
        mean = norm.mean
    elif kind == "vecnormalize":
        frozen: FrozenObsNormalizer = policy.obs_norm
        # The policy applies the snapshot in float64; the graph runs in float32 (Unity has no double).
        std = torch.sqrt(frozen.var + frozen.eps)
        clip, mean = frozen.clip_obs, frozen.mean
    elif kind == "none":
        return x
    else:
        raise ExportError(f"observation normalizer {kind!r} cannot be exported")
    x = g.op("Sub", [x, g.const("obs_norm.mean", _float32(mean))])
    x = g.op("Div", [x, g.const("obs_norm.std", _float32(std))])
    return g.op("Clip", [x], min=-float(clip), max=float(clip))  # opset 9: bounds are attributes


def _mlp(g: _Graph, body: nn.Sequential, x: str, prefix: str) -> str:
    for i, layer in enumerate(body):
        if isinstance(layer, nn.Linear):
            w = g.const(f"{prefix}.{i}.weight", _float32(layer.weight))
            b = g.const(f"{prefix}.{i}.bias", _float32(layer.bias))
            x = g.op("Gemm", [x, w, b], transB=1)
        elif isinstance(layer, nn.SiLU):  # Swish as ML-Agents' graph has it: x * sigmoid(x)
            x = g.op("Mul", [x, g.op("Sigmoid", [x])])
        elif isinstance(layer, nn.Tanh):
            x = g.op("Tanh", [x])
        elif isinstance(layer, nn.ReLU):
            x = g.op("Relu", [x])
        else:
            raise ExportError(f"layer {prefix}.{i} ({type(layer).__name__}) has no ONNX translation here")
    return x


def _to_env(
    g: _Graph, a: str, output: str, action_clip: str, low: np.ndarray | None, high: np.ndarray | None
) -> str:
    """``env_action`` in the graph: what the env received for raw action ``a`` in training."""
    if action_clip == "mlagents":
        limit = MLAGENTS_ACTION_LIMIT
        clipped = g.op("Clip", [a], min=-limit, max=limit)
        return g.op("Div", [clipped, g.const(f"{output}.limit", limit)], output)
    lo = g.const(f"{output}.low", low)
    hi = g.const(f"{output}.high", high)
    return g.op("Max", [g.op("Min", [a, hi]), lo], output)


def _discrete(g: _Graph, policy: ActorCritic, x: str, branches: tuple[int, ...], seed: float | None) -> None:
    """The discrete branches' outputs from actor features ``x``, as ML-Agents' graph computes them:
    each branch's logits masked by its slice of ``action_masks`` (``logits * mask - 1e8 * (1 - mask)``),
    ``Softmax``; ``Multinomial`` of the log-probabilities samples, ``ArgMax`` is the deterministic
    action; branches side by side (``Concat``)."""
    weights = policy.branch_head.weight.split(branches)
    biases = policy.branch_head.bias.split(branches)
    samples, argmaxes, start = [], [], 0
    for i, (n, w, b) in enumerate(zip(branches, weights, biases)):
        logits = g.op(
            "Gemm",
            [x, g.const(f"branch{i}.weight", _float32(w)), g.const(f"branch{i}.bias", _float32(b))],
            transB=1,
        )
        mask = g.op("Slice", [ACTION_MASKS], starts=[start], ends=[start + n], axes=[1])
        blocked = g.op("Sub", [g.const(f"branch{i}.one", 1.0), mask])
        masked = g.op(
            "Sub", [g.op("Mul", [logits, mask]), g.op("Mul", [blocked, g.const(f"branch{i}.big", 1e8)])]
        )
        log_probs = g.op("Log", [g.op("Softmax", [masked], axis=1)])
        attrs = {"sample_size": 1, "dtype": g.onnx.TensorProto.INT64}
        samples.append(
            g.op("Multinomial", [log_probs], **(attrs if seed is None else {**attrs, "seed": float(seed)}))
        )
        argmaxes.append(g.op("ArgMax", [masked], axis=1, keepdims=1))
        start += n
    for name, parts in ((DISCRETE_ACTIONS, samples), (DETERMINISTIC_DISCRETE, argmaxes)):
        if len(parts) == 1:
            g.op("Identity", parts, name)
        else:
            g.op("Concat", parts, name, axis=1)


def _checked_export_args(
    policy: ActorCritic,
    action_clip: str,
    obs_sizes: Sequence[int] | None,
    action_low: Sequence[float] | None,
    action_high: Sequence[float] | None,
) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
    """:func:`ppo_onnx_model`'s arguments checked: the observation sizes, and the action bounds (float32)
    when ``action_clip`` is 'bounds'."""
    if action_clip not in ACTION_CLIPS:
        raise ExportError(f"action_clip must be one of {ACTION_CLIPS}, got {action_clip!r}")
    sizes = [policy.obs_dim] if obs_sizes is None else [int(n) for n in obs_sizes]
    if not sizes or min(sizes) < 1 or sum(sizes) != policy.obs_dim:
        raise ExportError(
            f"observation sizes {sizes} must be positive and sum to the policy's {policy.obs_dim} inputs"
        )
    A = policy.action_dim
    low = high = None
    if action_clip == "bounds":
        if action_low is None or action_high is None:
            raise ExportError("action_clip='bounds' needs the action space's low and high")
        low = np.asarray(action_low, np.float32).reshape(-1)
        high = np.asarray(action_high, np.float32).reshape(-1)
        if (
            low.shape != (A,)
            or high.shape != (A,)
            or not (np.isfinite(low).all() and np.isfinite(high).all())
        ):
            raise ExportError(f"action bounds must be {A} finite values each")
    return sizes, low, high


def _continuous(
    g: _Graph,
    policy: ActorCritic,
    x: str,
    action_clip: str,
    low: np.ndarray | None,
    high: np.ndarray | None,
    seed: float | None,
) -> None:
    """The continuous head: the Gaussian's mean, a sample of it, and both as the env's actions."""
    tp, A = g.onnx.TensorProto, policy.action_dim
    w, b = (
        g.const("mu_head.weight", _float32(policy.mu_head.weight)),
        g.const("mu_head.bias", _float32(policy.mu_head.bias)),
    )
    mu = g.op("Gemm", [x, w, b], transB=1)
    # A state-independent sigma: exp(log_sigma) is a constant [1, A], broadcast over the batch.
    std = g.const("action_std", _float32(torch.exp(policy.log_sigma.detach())).reshape(1, A))
    noise_attrs = {"dtype": tp.FLOAT} if seed is None else {"dtype": tp.FLOAT, "seed": float(seed)}
    noise = g.op("RandomNormalLike", [mu], **noise_attrs)
    sample = g.op("Add", [mu, g.op("Mul", [noise, std])])
    _to_env(g, sample, CONTINUOUS_ACTIONS, action_clip, low, high)
    _to_env(g, mu, DETERMINISTIC_CONTINUOUS, action_clip, low, high)


def _output_shapes(tp: Any, A: int, num_branches: int) -> dict[str, tuple[Any, list]]:
    """Each output's element type and shape (``BATCH`` rows); the model lists those its layout has."""
    return {
        VERSION_NUMBER: (tp.FLOAT, [1]),
        MEMORY_SIZE: (tp.FLOAT, [1]),
        CONTINUOUS_SHAPE: (tp.FLOAT, [1]),
        CONTINUOUS_ACTIONS: (tp.FLOAT, [BATCH, A]),
        DETERMINISTIC_CONTINUOUS: (tp.FLOAT, [BATCH, A]),
        DISCRETE_ACTIONS: (tp.INT64, [BATCH, num_branches]),
        DISCRETE_SHAPE: (tp.FLOAT, [1, num_branches]),
        DETERMINISTIC_DISCRETE: (tp.INT64, [BATCH, num_branches]),
    }


def ppo_onnx_model(
    policy: ActorCritic,
    *,
    action_clip: str = "mlagents",
    action_low: Sequence[float] | None = None,
    action_high: Sequence[float] | None = None,
    obs_sizes: Sequence[int] | None = None,
    seed: float | None = None,
) -> Any:
    """The PPO policy as an ``onnx.ModelProto`` in ML-Agents 0.28's format (see the module doc).

    Args:
      policy: the actor-critic (``make_policy`` + the checkpoint's weights); only the actor is written.
      action_clip: the run's ``PPOConfig.action_clip``; 'bounds' needs ``action_low``/``action_high``.
      obs_sizes: sizes of the behaviour's observations in spec order (they sum to ``policy.obs_dim``);
        ``None``: one input ``obs_0`` of ``obs_dim`` values.
      seed: fixes ``RandomNormalLike``'s seed (tests); ``None`` leaves it unseeded, as ML-Agents does.
    """
    if getattr(policy, "visual", False):
        raise ExportError(
            f"ONNX export of policies with visual observations ({policy.vis_encode_type} encoders) is not "
            "written yet; the checkpoint holds the weights"
        )
    onnx = require_onnx()
    sizes, low, high = _checked_export_args(policy, action_clip, obs_sizes, action_low, action_high)
    A, branches = policy.action_dim, tuple(policy.branches)
    layout = ActionLayout(continuous_size=A, discrete_branches=branches)

    g = _Graph(onnx)
    h, tp = onnx.helper, onnx.TensorProto
    inputs = [h.make_tensor_value_info(f"{OBS_PREFIX}{i}", tp.FLOAT, [BATCH, n]) for i, n in enumerate(sizes)]
    x = inputs[0].name if len(inputs) == 1 else g.op("Concat", [v.name for v in inputs], axis=1)
    if branches:
        inputs.append(h.make_tensor_value_info(ACTION_MASKS, tp.FLOAT, [BATCH, sum(branches)]))
    x = _normalizer(g, policy, x)
    x = _mlp(g, policy.actor_body, x, "actor_body")
    # The three constants are parameters in ML-Agents' actor; its graph reads them through Identity.
    constants: list[tuple[str, Any]] = [(VERSION_NUMBER, [MODEL_EXPORT_VERSION]), (MEMORY_SIZE, [0])]
    if A:
        _continuous(g, policy, x, action_clip, low, high, seed)
        constants.append((CONTINUOUS_SHAPE, [A]))
    if branches:
        _discrete(g, policy, x, branches, seed)
        constants.append((DISCRETE_SHAPE, [list(branches)]))
    for name, value in constants:
        g.op("Identity", [g.const(f"{name}.value", np.asarray(value, np.float32))], name)

    shapes = _output_shapes(tp, A, len(branches))
    outputs = [h.make_tensor_value_info(name, *shapes[name]) for name in layout.output_names()]
    graph = h.make_graph(g.nodes, "impala-rl PPO policy", inputs, outputs, g.initializers)
    model = h.make_model(graph, producer_name="impala-rl", opset_imports=[h.make_opsetid("", MLAGENTS_OPSET)])
    model.ir_version = MLAGENTS_IR_VERSION
    onnx.checker.check_model(model)
    return model


def check_output_path(path: str, what: str = "output") -> None:
    """Raise :class:`ExportError` (naming ``what`` and ``path``) unless a file can be written at ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ExportError(f"{what} {path} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ExportError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"{what} {path}: cannot write into {folder}")


def _save(data: bytes, path: str) -> str:
    """Write atomically (a reader never sees half a file); one-line errors for unwritable paths."""
    check_output_path(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ExportError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def export_ppo_onnx(policy: ActorCritic, path: str, **kwargs: Any) -> str:
    """Write :func:`ppo_onnx_model` (same keyword arguments) to ``path``; returns ``path``."""
    return _save(ppo_onnx_model(policy, **kwargs).SerializeToString(), path)


class _ImpalaServing(nn.Module):
    """One step of a feed-forward :class:`ImpalaNet` for a batch: obs -> (logits, values in return units).

    Calls the torso and heads directly: ``ImpalaNet.forward`` reads T and B off the shapes in
    Python, which a trace would freeze into the graph.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.torso(obs)
        return self.model.policy(x), self.model.baseline.unnormalized(x)


def export_impala_onnx(
    model: nn.Module,
    obs_shape: Sequence[int],
    path: str,
    *,
    obs_dtype: str | np.dtype = "float32",
    opset: int = IMPALA_OPSET,
) -> str:
    """Write an IMPALA network (``build_model``) as ONNX: ``obs`` -> ``policy_logits``, ``baseline``.

    ``obs_dtype``: the env's observation dtype (Atari frames: uint8). LSTM models are refused:
    their core state would need inputs and outputs of its own.
    """
    require_onnx()
    if getattr(model, "core", None) is not None:
        raise ExportError("IMPALA models with an LSTM core cannot be exported yet (only feed-forward ones)")
    import io
    import warnings

    wrapper = _ImpalaServing(model).eval()
    dtype = torch.from_numpy(np.zeros(0, dtype=np.dtype(obs_dtype))).dtype
    dummy = torch.zeros((2, *[int(d) for d in obs_shape]), dtype=dtype)
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # The TorchScript exporter (dynamo=False) is deprecated in torch 2.x but needs no onnxscript.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            wrapper,
            (dummy,),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=[IMPALA_INPUT],
            output_names=list(IMPALA_OUTPUTS),
            dynamic_axes={n: {0: BATCH} for n in (IMPALA_INPUT, *IMPALA_OUTPUTS)},
        )
    return _save(buffer.getvalue(), path)
