"""IMPALA networks (Espeholt et al. 2018, Fig. 3): shallow CNN, deep ResNet, MLP torso,
an optional LSTM core that resets at episode starts, a policy head and a PopArt value head.

All networks take time-major ``[T, B, *obs_shape]`` observations. Image frames are
uint8 ``[C, H, W]`` (e.g. ``[4, 84, 84]``) and are scaled by 1/255 inside the model,
so the wire and the actors keep the 4x smaller uint8; floating-point image inputs are
taken as already made into the torso's input (scaled to [0, 1], and with a
:class:`PixelNormalizer` normalized too: what :meth:`_ImageTorso.lay_out` returns).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from impala.algos.popart import PopArtValueHead
from impala.nets.onednn_linear import linear
from impala.run.config import POPART_BETA, model_for

__all__ = [
    "CoreState",
    "NetOutput",
    "ShallowCNN",
    "NatureCNN",
    "DeepResNet",
    "MLPTorso",
    "ImpalaNet",
    "PixelNormalizer",
    "build_model",
    "initialize",
    "INIT_SCHEMES",
    "MODEL_KINDS",
]

MODEL_KINDS = ("auto", "shallow", "nature", "deep", "mlp")

# (h, c), each [num_layers=1, B, hidden]; the empty tuple when there is no LSTM.
CoreState = tuple[torch.Tensor, ...]


class NetOutput(NamedTuple):
    """What :meth:`ImpalaNet.forward` returns (besides the new core state).

    policy_logits: shape [T, B, num_actions].
    values: normalized values of each step's task, shape [T, B] (multiply by the
      PopArt sigma and add mu for return units).
    task_values: normalized values for every task, shape [T, B, num_tasks].
    """

    policy_logits: torch.Tensor
    values: torch.Tensor
    task_values: torch.Tensor


class PixelNormalizer(nn.Module):
    """Each input element (pixel of each stacked frame) standardized by its own running mean and variance,
    then clipped to +-5: Sample Factory's ``normalize_input`` for images (its ``RunningMeanStdInPlace``, not
    per channel; count 1, mean 0, variance 1 to start; eps 1e-5 under the square root).

    Why it matters on Atari: most pixels of a frame are a background that barely changes, so after
    normalization the background is near 0 and the few moving objects (Pong's ball and paddles) stand out
    at several standard deviations, where 1/255 scaling leaves every conv1 filter a large shared
    background term to fit (docs/PONG.md, "the torso dies"). The statistics are buffers of the model:
    the learner updates them from each batch (:meth:`observe`) before training on it, and they reach the
    actors with the weights, so both sides normalize alike."""

    EPS = 1e-5
    CLIP = 5.0

    def __init__(self, obs_shape: Sequence[int]) -> None:
        super().__init__()
        shape = tuple(int(d) for d in obs_shape)
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.ones((), dtype=torch.float64))

    @torch.no_grad()
    def observe(
        self,
        frames: torch.Tensor,
        stride: int = 4,
        allreduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Merge the moments of ``frames`` ([T, ..., *obs_shape] or [N, *obs_shape], uint8 or [0, 1] floats)
        into the running ones (Chan et al.'s parallel update, as Sample Factory's). Every ``stride``-th step
        along the first axis is used: a Pong batch holds 1,056 observations of 28k elements, and a quarter
        of them gives the same statistics (they average over millions of frames) at a quarter of the cost.
        ``allreduce``: a learner group's sum over its ranks, each holding some of the batch's unrolls (the
        second axis), so every rank merges the moments of the whole batch, as one learner would."""
        x = frames[::stride].reshape(-1, *self.mean.shape).float()
        if frames.dtype == torch.uint8:
            x.mul_(1.0 / 255.0)
        # sums, not torch.var_mean over the batch axis: 7x faster on a CPU (a strided reduction there)
        sums = torch.stack([x.sum(0), x.square_().sum(0)])
        n = torch.tensor(float(x.shape[0]), dtype=torch.float64)
        if allreduce is not None:
            sums, n = allreduce(sums), allreduce(n)
        if n == 0:
            return
        # values in [0, 1] leave float32's cancellation in E[x^2] - mean^2 far below any variance that matters
        batch_mean = sums[0] / n.float()
        batch_var = (sums[1] / n.float() - batch_mean.square()).clamp_(min=0.0)
        total = self.count + n
        delta = batch_mean - self.mean
        old = (self.count / total).float()
        new = (n / total).float()
        self.mean.add_(delta * new)
        self.var.copy_(self.var * old + batch_var * new + delta.square() * old * new)
        self.count.copy_(total)

    @torch.no_grad()
    def normalize_(self, x: torch.Tensor, prescale: float = 1.0) -> torch.Tensor:
        """``x * prescale`` ([..., *obs_shape] floats; in [0, 1] after ``prescale``) standardized and clipped,
        in place: one multiply-add and one clamp pass over the frames."""
        channels_last = x.dim() > 3 and x.movedim(-3, -1).is_contiguous()
        scale, shift = self._affine(prescale, x.dtype, x.device, channels_last)
        if torch.onnx.is_in_onnx_export() or torch.jit.is_tracing():  # ONNX has no addcmul with out=
            return (x * scale + shift).clamp(-self.CLIP, self.CLIP)
        torch.addcmul(shift, x, scale, out=x)
        return x.clamp_(-self.CLIP, self.CLIP)

    def _affine(
        self, prescale: float, dtype: torch.dtype, device: torch.device, channels_last: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) with ``x * scale + shift == (x * prescale - mean) / sqrt(var + EPS)``, in ``x``'s
        dtype and memory order, kept until the statistics change (``observe``, or new weights loaded into
        the buffers: either bumps their version). An actor normalizes 4 frames a step: computing these
        every call (a few small operations over 28k elements) made its forward pass 1.7x as costly."""
        key = (self.mean._version, self.var._version, id(self.mean), prescale, dtype, device, channels_last)
        cached = getattr(self, "_cached_affine", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        scale = torch.rsqrt(self.var + self.EPS)
        shift = -self.mean * scale
        scale = scale * prescale
        if channels_last:  # the statistics in the frames' memory order, so every pass runs unit-stride
            scale, shift = (t.movedim(0, -1).contiguous().movedim(-1, 0) for t in (scale, shift))
        affine = (scale.to(device, dtype), shift.to(device, dtype))
        self._cached_affine = (key, affine)
        return affine


class _ActivityTracking:
    """Opt-in record of how many ReLU units are alive on the current batch.

    A unit (a conv channel, or an fc unit) is *alive* when its ReLU output is positive
    for at least one position of one sample. Dead units pass no gradient; a torso whose
    first layer dies is blind (measured on Pong, docs/PONG.md: 15 of 16 conv1 filters died on Pong). The
    learner
    switches tracking on for its forward pass and logs ``activity``; actors never do.
    """

    track_activity: bool = False

    def _track(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.track_activity:
            with torch.no_grad():
                positive = x.detach() > 0
                dims = [d for d in range(positive.dim()) if d != 1] if positive.dim() > 2 else [0]
                self.activity[name] = float(positive.amax(dim=dims).float().mean())
        return x

    @property
    def activity(self) -> dict[str, float]:
        if not hasattr(self, "_activity"):
            self._activity: dict[str, float] = {}
        return self._activity


class _ChannelsLastGradient(torch.autograd.Function):
    """The identity; its backward hands the gradient on in channels-last order.

    Flattening a channels-last feature map for the fc layer copies it to NCHW order, so the gradient
    coming back is NCHW too; every ReLU and convolution backward below then mixed NCHW gradients with
    channels-last activations, which oneDNN and PyTorch's elementwise kernels run on slow strided paths
    (the first ReLU's backward alone took 1-11 ms of a 21 ms minibatch update, 2-core AMD EPYC).
    Reordering the gradient once here keeps every layer below on its fast path; the values are the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous(memory_format=torch.channels_last)


class _ImageTorso(_ActivityTracking, nn.Module, abc.ABC):
    """Shared plumbing: frame scaling, channels_last input, flatten size from obs_shape, and the
    arithmetic the torso runs in (:attr:`compute_dtype`)."""

    out_features: int

    def __init__(self) -> None:
        super().__init__()
        self.channels_last = False
        # None: float32. torch.bfloat16: the convolutions and the fc layer run under bf16 autocast (the
        # learner's choice, ``--precision``); the weights stay float32 and the features leave as float32,
        # so the heads, the losses and the actors (which never set it) are float32 throughout.
        self.compute_dtype: torch.dtype | None = None
        # --obs-norm: per-pixel standardization after scaling (set by build_model)
        self.pixel_norm: PixelNormalizer | None = None

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """What the convolutions read: uint8 frames scaled to [0, 1] (and normalized with a
        :attr:`pixel_norm`); floats are taken as made so already (:meth:`lay_out`'s output)."""
        # Lay the (4x smaller) uint8 frames out first, then convert and scale in place: scaling a
        # float copy out of place and then reordering it took ~3x as long (a quarter of a small
        # CPU learner update).
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if x.dtype == torch.uint8:
            if self.pixel_norm is not None:
                return self.pixel_norm.normalize_(x.float(), prescale=1.0 / 255.0)
            return x.float().mul_(1.0 / 255.0)
        if self.compute_dtype is not None and x.dtype == self.compute_dtype:
            return x  # frames the learner scaled once per batch (_ImageTorso.lay_out)
        return x.float()

    def to_channels_last(self) -> "_ImageTorso":
        """Use NHWC for convolutions (faster with cuDNN/bf16 on recent GPUs)."""
        self.channels_last = True
        return self.to(memory_format=torch.channels_last)

    def lay_out(self, obs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``obs`` [..., C, H, W], same shape and values, in the memory order :meth:`forward` reads without
        reordering (channels innermost after :meth:`to_channels_last`; otherwise ``obs`` itself). With a
        :attr:`compute_dtype`, uint8 frames come back scaled to [0, 1] in that dtype: the values the
        forward pass's autocast would make of them, made once. In float32 on CPU they come back scaled
        too, the values :meth:`forward` makes of them (on a GPU they stay uint8: a batch of float32
        frames is 4x the memory, and there the conversion costs next to nothing).

        ``out``: what an earlier call returned for frames of the same shape, to be written over (the
        learner passes the previous batch's of the same staging slot). A fresh batch of float32 frames is
        120 MB on Pong's defaults, and the operating system hands fresh memory over a page at a time:
        29,000 page faults per batch, 60-80 ms of a 750 ms update (2-core AMD EPYC). Anything else in
        ``out`` (another shape, dtype or memory order) is ignored.

        The learner lays out each batch once: reordering the uint8 frames inside every minibatch's forward
        pass was a quarter of a CPU update (2-core Intel Xeon, 4 x 4 minibatches, BENCHMARKS.md), and
        scaling them there, then rounding to bf16, two copies of every frame in each of the 33
        forward passes a batch gets (about 7% of a bf16 update, 2-core AMD EPYC)."""
        if obs.dim() < 4:
            return obs
        scale_to = None
        if obs.dtype == torch.uint8:
            if self.compute_dtype is not None:
                scale_to = self.compute_dtype
            elif obs.device.type == "cpu":
                scale_to = torch.float32
        if scale_to is not None and out is not None and self._fits(out, obs, scale_to):
            target = out.movedim(-3, -1) if self.channels_last else out
            target.copy_(obs.movedim(-3, -1) if self.channels_last else obs)
            if self.pixel_norm is not None:
                self.pixel_norm.normalize_(out, prescale=1.0 / 255.0)
            else:
                target.mul_(1.0 / 255.0)
            return out
        nhwc = obs.movedim(-3, -1).contiguous() if self.channels_last else obs
        if scale_to is not None:
            # uint8 -> bf16 is exact, and bf16's in-place multiply computes in float32 and rounds once: the
            # values autocast makes of the float32 frames (tests/test_impala_net.py), at a third of the
            # time of converting through float32 and of a one-pass strided uint8 -> bf16 multiply. In
            # float32 these are _input's own operations: the same values.
            nhwc = nhwc.to(scale_to)
            if self.pixel_norm is not None:
                laid = nhwc.movedim(-1, -3) if self.channels_last else nhwc
                return self.pixel_norm.normalize_(laid, prescale=1.0 / 255.0)
            nhwc.mul_(1.0 / 255.0)
        return nhwc.movedim(-1, -3) if self.channels_last else nhwc

    def _fits(self, out: torch.Tensor, obs: torch.Tensor, dtype: torch.dtype) -> bool:
        if out.shape != obs.shape or out.dtype != dtype or out.device != obs.device:
            return False
        return (out.movedim(-3, -1) if self.channels_last else out).is_contiguous()

    @abc.abstractmethod
    def _conv_features(self, x: torch.Tensor) -> torch.Tensor:
        """The convolutional stack; subclasses define it."""

    def _flat_size(self, obs_shape: Sequence[int]) -> int:
        """The fc layer's input size for ``obs_shape``, which the torso records (:attr:`obs_shape`)."""
        if len(obs_shape) != 3:
            raise ValueError(
                f"{type(self).__name__} needs image observations [C, H, W], got shape {tuple(obs_shape)}"
            )
        self.obs_shape = tuple(int(d) for d in obs_shape)
        with torch.no_grad():
            return int(self._conv_features(torch.zeros(1, *obs_shape)).flatten(1).shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] uint8 (or float in [0, 1]) -> [N, out_features] float32."""
        x = self._input(x)
        # no autocast context at all in float32: the actors call this for every step (2.8 us vs 0.25 us)
        reduced = (
            torch.autocast(x.device.type, dtype=self.compute_dtype)
            if self.compute_dtype is not None
            else contextlib.nullcontext()
        )
        with reduced:
            x = self._conv_features(x)
            if self.channels_last and x.requires_grad:
                x = _ChannelsLastGradient.apply(x)
            x = self._track("fc", F.relu(linear(x.flatten(1), self.fc.weight, self.fc.bias)))
        return x.float()


class ShallowCNN(_ImageTorso):
    """IMPALA shallow torso: conv 16 8x8/4, ReLU, conv 32 4x4/2, ReLU, fc 256, ReLU."""

    def __init__(self, obs_shape: Sequence[int] = (4, 84, 84), out_features: int = 256) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(obs_shape[0], 16, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=4, stride=2)
        self.fc = nn.Linear(self._flat_size(obs_shape), out_features)
        self.out_features = out_features

    def _conv_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._track("conv1", F.relu(self.conv1(x)))
        return self._track("conv2", F.relu(self.conv2(x)))


class NatureCNN(_ImageTorso):
    """The DQN torso of Mnih et al. 2015 (baselines', SB3's and cleanrl's Atari default):
    conv 32 8x8/4, conv 64 4x4/2, conv 64 3x3/1, each ReLU, fc 512, ReLU. About 3x the
    compute of :class:`ShallowCNN` per frame."""

    def __init__(self, obs_shape: Sequence[int] = (4, 84, 84), out_features: int = 512) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(obs_shape[0], 32, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, stride=1)
        self.fc = nn.Linear(self._flat_size(obs_shape), out_features)
        self.out_features = out_features

    def _conv_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._track("conv1", F.relu(self.conv1(x)))
        x = self._track("conv2", F.relu(self.conv2(x)))
        return self._track("conv3", F.relu(self.conv3(x)))


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not in place: the skip path needs the un-activated input.
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class DeepResNet(_ImageTorso):
    """IMPALA deep torso: sections of (3x3 conv, 3x3/2 max-pool, 2 residual blocks) with
    channels (16, 32, 32), then ReLU, fc 256, ReLU."""

    def __init__(
        self,
        obs_shape: Sequence[int] = (4, 84, 84),
        channels: Sequence[int] = (16, 32, 32),
        out_features: int = 256,
    ) -> None:
        super().__init__()
        sections = []
        in_ch = obs_shape[0]
        for ch in channels:
            sections.append(
                nn.Sequential(
                    nn.Conv2d(in_ch, ch, kernel_size=3, padding=1),
                    nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                    _ResidualBlock(ch),
                    _ResidualBlock(ch),
                )
            )
            in_ch = ch
        self.sections = nn.Sequential(*sections)
        self.fc = nn.Linear(self._flat_size(obs_shape), out_features)
        self.out_features = out_features

    def _conv_features(self, x: torch.Tensor) -> torch.Tensor:
        for i, section in enumerate(self.sections):
            x = section(x)
            if self.track_activity:  # the residual stream is pre-activation; track what the next layer sees
                self._track(f"section{i + 1}", F.relu(x))
        return F.relu(x)


class MLPTorso(_ActivityTracking, nn.Module):
    """MLP for vector observations: [N, obs_dim] -> [N, hidden[-1]]."""

    def __init__(
        self, obs_dim: int, hidden: Sequence[int] = (64, 64), activation: type[nn.Module] = nn.ReLU
    ) -> None:
        super().__init__()
        if obs_dim < 1 or not hidden:
            raise ValueError(
                f"MLPTorso needs obs_dim >= 1 and at least one hidden layer, got {obs_dim}, {hidden}"
            )
        layers: list[nn.Module] = []
        in_dim = obs_dim
        for h in hidden:
            layers += [nn.Linear(in_dim, h), activation()]
            in_dim = h
        self.net = nn.Sequential(*layers)
        self.out_features = in_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        for i, layer in enumerate(self.net):
            x = layer(x)
            if isinstance(layer, nn.ReLU):
                self._track(f"fc{i // 2 + 1}", x)
        return x


class ImpalaNet(nn.Module):
    """Torso -> optional LSTM core -> policy logits + PopArt value head.

    Args:
      torso: maps [N, *obs_shape] to [N, torso.out_features].
      num_actions: size of the discrete action space.
      use_lstm: add a one-layer LSTM core (``core_size`` units) that is reset to zero
        at each step flagged ``first``.
      num_tasks: outputs of the PopArt value head.
      core_size: LSTM width.
      beta: PopArt's statistics step size (the value head moves its statistics only when the learner
        runs with --popart).
    """

    def __init__(
        self,
        torso: nn.Module,
        num_actions: int,
        *,
        use_lstm: bool = False,
        num_tasks: int = 1,
        core_size: int = 256,
        beta: float = POPART_BETA,
    ) -> None:
        super().__init__()
        if num_actions < 1:
            raise ValueError(f"num_actions must be >= 1, got {num_actions}")
        self.torso = torso
        self.num_actions = num_actions
        self.use_lstm = use_lstm
        out = torso.out_features
        self.core = nn.LSTM(out, core_size, num_layers=1) if use_lstm else None
        if use_lstm:
            out = core_size
        self.policy = nn.Linear(out, num_actions)
        self.baseline = PopArtValueHead(out, num_tasks, beta=beta)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> CoreState:
        """Zero LSTM state ``(h, c)``, each [1, batch_size, core_size]; ``()`` without LSTM."""
        if self.core is None:
            return ()
        if device is None:
            device = self.policy.weight.device
        return tuple(torch.zeros(1, batch_size, self.core.hidden_size, device=device) for _ in range(2))

    def forward(
        self,
        obs: torch.Tensor,
        first: torch.Tensor,
        core_state: CoreState | None = None,
        task_ids: torch.Tensor | None = None,
    ) -> tuple[NetOutput, CoreState]:
        """Run T steps for B environments.

        Args:
          obs: observations, shape [T, B, *obs_shape].
          first: bool, shape [T, B]; True where a new episode starts at this step
            (the LSTM state entering that step is zeroed, as TorchBeast's ``notdone``).
          core_state: LSTM state entering step 0; ``None`` = :meth:`initial_state`.
          task_ids: int64 [T, B] selecting the PopArt task for ``values``; None = task 0.

        Returns:
          ``(NetOutput, new_core_state)``; the state leaving step T-1.
        """
        if obs.dim() < 3:
            raise ValueError(f"obs must be time-major [T, B, *obs_shape], got shape {tuple(obs.shape)}")
        T, B = obs.shape[:2]
        if first.shape != (T, B):
            raise ValueError(f"first has shape {tuple(first.shape)} but obs is [T, B] = [{T}, {B}, ...]")
        x = self.torso(obs.reshape(T * B, *obs.shape[2:]))
        if self.core is not None:
            if core_state is None:
                core_state = self.initial_state(B, device=x.device)
            x, core_state = self._run_core(x.view(T, B, -1), first, core_state)
            x = x.reshape(T * B, -1)
        else:
            core_state = ()
        logits = self.policy(x).view(T, B, self.num_actions)
        task_values = self.baseline(x).view(T, B, -1)
        if task_ids is None:
            values = task_values[..., 0]
        else:
            values = task_values.gather(-1, task_ids.long().unsqueeze(-1)).squeeze(-1)
        return NetOutput(logits, values, task_values), core_state

    def _run_core(
        self, x: torch.Tensor, first: torch.Tensor, state: CoreState
    ) -> tuple[torch.Tensor, CoreState]:
        # Episodes are long compared to T, so split the unroll only at the steps where
        # some env starts a new episode and run each piece as one fused cuDNN call,
        # instead of T single-step calls. Inside a piece no state is reset, so this is
        # exactly the per-step masking.
        T = x.shape[0]
        notfirst = (~first.bool()).to(x.dtype).unsqueeze(-1)  # [T, B, 1]
        cuts = (first[1:].any(dim=1).nonzero().flatten() + 1).tolist()
        bounds = [0] + cuts + [T]
        h, c = state
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            mask = notfirst[start].unsqueeze(0)  # [1, B, 1]
            out, (h, c) = self.core(x[start:end], (h * mask, c * mask))
            outputs.append(out)
        return torch.cat(outputs, dim=0), (h, c)


INIT_SCHEMES = ("orthogonal", "torch")


@torch.no_grad()
def initialize(model: ImpalaNet, scheme: str = "orthogonal") -> ImpalaNet:
    """Initialize ``model`` in place.

    ``orthogonal`` (OpenAI baselines, cleanrl, SB3 for Atari): every conv and linear layer
    of the torso orthogonal with gain sqrt(2) (ReLU) and zero bias; the policy head with
    gain 0.01, so the first policy is near uniform whatever the features; the value head
    with gain 1. The LSTM keeps PyTorch's init. Measured on Pong (docs/PONG.md): PyTorch's default
    init (kaiming-uniform with a=sqrt(5) and uniform biases) left the policy independent of
    the state after 4M frames and let 15 of 16 first-layer filters die once steps grew.

    ``torch``: PyTorch's default init, as TorchBeast has it.
    """
    if scheme == "torch":
        return model
    if scheme != "orthogonal":
        raise ValueError(f"unknown init scheme {scheme!r}; choose one of {', '.join(INIT_SCHEMES)}")

    def ortho(layer: nn.Module, gain: float) -> None:
        nn.init.orthogonal_(layer.weight, gain=gain)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)

    for module in model.torso.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            ortho(module, 2**0.5)
    ortho(model.policy, 0.01)
    ortho(model.baseline.linear, 1.0)
    return model


def build_model(
    kind: str,
    obs_shape: Sequence[int],
    num_actions: int,
    use_lstm: bool = False,
    *,
    num_tasks: int = 1,
    init: str = "orthogonal",
    obs_norm: bool = False,
    **popart_kwargs: float,
) -> ImpalaNet:
    """Build an :class:`ImpalaNet`.

    Args:
      kind: "shallow", "nature", "deep", "mlp", or "auto" (mlp for 1-D obs, shallow for [C, H, W]).
      obs_shape: one observation's shape, e.g. (4, 84, 84) or (4,).
      num_actions: discrete action count.
      use_lstm: add the LSTM core.
      num_tasks: PopArt value-head outputs.
      init: weight initialization, see :func:`initialize`.
      obs_norm: an image torso standardizes each input pixel by running statistics
        (:class:`PixelNormalizer`); vector observations are not affected.
    """
    obs_shape = tuple(int(d) for d in obs_shape)
    kind = model_for(kind, obs_shape)  # "auto": a checkpoint written before runs recorded the network
    if kind in ("shallow", "nature", "deep") and len(obs_shape) != 3:
        raise ValueError(
            f"model kind {kind!r} needs image observations [C, H, W], got obs_shape {obs_shape}; use 'mlp'"
        )
    if kind == "shallow":
        torso: nn.Module = ShallowCNN(obs_shape)
    elif kind == "nature":
        torso = NatureCNN(obs_shape)
    elif kind == "deep":
        torso = DeepResNet(obs_shape)
    elif kind == "mlp":
        if len(obs_shape) != 1:
            raise ValueError(f"model kind 'mlp' needs 1-D observations, got obs_shape {obs_shape}")
        torso = MLPTorso(obs_shape[0])
    else:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)}")
    if obs_norm and isinstance(torso, _ImageTorso):
        torso.pixel_norm = PixelNormalizer(obs_shape)
    return initialize(
        ImpalaNet(torso, num_actions, use_lstm=use_lstm, num_tasks=num_tasks, **popart_kwargs), init
    )
