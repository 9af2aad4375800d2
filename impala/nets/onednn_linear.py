"""The image torsos' fc layer in float32 on CPU through oneDNN instead of the BLAS behind ``torch.mm``.

PyTorch's CPU build runs float32 ``F.linear`` and its backward on MKL's sgemm. MKL picks its kernels by
CPU vendor: on AMD processors it runs a generic path, and on the 2-core AMD EPYC box (AVX-512) its three
GEMMs of the shallow torso's fc layer (128 frames x 2592 -> 256, and the two of its backward) ran at
80-90 GFLOP/s, 2.0-2.1 ms each, a quarter of a minibatch update. oneDNN, which already runs the
convolutions, dispatches on the instruction set: the same three products took 0.87-0.94 ms each (about
190 GFLOP/s). The values are the same products summed in another order (float32 rounding apart:
tests/test_onednn_linear.py checks forward and gradients against ``F.linear``).

:func:`linear` is ``F.linear`` with that routing where it applies (a CPU float32 2-D input, outside
autocast, tracing and ``torch.compile``); anywhere else, or on a torch without the operator, it is
``F.linear`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear", "available"]

_available: bool | None = None


def _matmul_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` by oneDNN's inner-product primitive (``b`` may be a transposed view: oneDNN reads
    strided operands directly, which measured faster than making them contiguous first)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def available() -> bool:
    """Whether this torch has oneDNN's linear operator and it computes ``F.linear`` (checked once)."""
    global _available
    if _available is None:
        try:
            x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
            w = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 11
            b = torch.arange(5, dtype=torch.float32)
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            # the backward's operands are transposed views: check that oneDNN reads those strides
            strided = _matmul_t(x.t().contiguous().t(), w.t().contiguous().t())
            _available = bool(torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)) and bool(
                torch.allclose(strided, x @ w.t(), rtol=1e-5, atol=1e-5)
            )
        except (AttributeError, RuntimeError, NotImplementedError):
            _available = False
    return _available


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _matmul_t(grad, weight.t())  # [N, out] @ [out, in]
        if ctx.needs_input_grad[1]:
            grad_w = _matmul_t(grad.t(), x.t())  # [out, N] @ [N, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CPU in float32 through oneDNN (see the module's docstring)."""
    if (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not _autocast_on()
        and not torch.jit.is_tracing()
        and not torch.jit.is_scripting()
        and not torch.compiler.is_compiling()
        and available()
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
