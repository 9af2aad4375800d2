"""impala.nets.onednn_linear: the image torsos' fc layer through oneDNN on CPU computes F.linear and its
gradients (float32 summation order apart), and leaves autocast, tracing and other inputs to F.linear."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from impala.nets import impala_net
from impala.nets.onednn_linear import available, linear


def _routed(out: torch.Tensor) -> bool:
    return out.grad_fn is not None and "OneDNNLinear" in type(out.grad_fn).__name__


def test_available_wherever_torch_has_onednn():
    # the probe itself once had a shape bug that turned the fast path off without a word
    assert available() == torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("x_grad", [True, False])
def test_forward_and_gradients_are_f_linear(with_bias, x_grad):
    """The shallow torso's fc shape (2592 -> 256) on 128 frames, against F.linear's forward and autograd
    gradients, from the same leaves; oneDNN sums in another order, so float32 rounding apart."""
    torch.manual_seed(0)
    x0 = torch.randn(128, 2592)
    w0 = torch.randn(256, 2592) * 0.02
    b0 = torch.randn(256) if with_bias else None
    upstream = torch.randn(128, 256)
    results = []
    for fn in (linear, F.linear):
        x = x0.clone().requires_grad_(x_grad)
        w = w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if b0 is not None else None
        out = fn(x, w, b)
        out.backward(upstream)
        results.append((out.detach(), x.grad, w.grad, None if b is None else b.grad, out))
    (got, gx, gw, gb, out), (want, wx, ww, wb, _) = results
    assert _routed(out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-4)
    if x_grad:
        torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-5)
    else:
        assert gx is None
    if with_bias:
        torch.testing.assert_close(gb, wb, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_strided_input_and_no_grad():
    """A transposed (non-contiguous) input and a no-grad call (the actors' inference, the learner's
    targets pass) give F.linear's values."""
    torch.manual_seed(1)
    x = torch.randn(300, 6).t()  # [6, 300], strided
    w, b = torch.randn(40, 300), torch.randn(40)
    with torch.no_grad():
        got = linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_other_inputs_take_f_linear():
    """Under autocast the result is autocast's (bf16); a 3-D input, float64 and a traced call go to
    F.linear, so the ONNX exporter sees an ordinary linear layer."""
    torch.manual_seed(2)
    x, w, b = torch.randn(8, 32), torch.randn(16, 32), torch.randn(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w, b).dtype == torch.bfloat16
    x3 = torch.randn(2, 8, 32, requires_grad=True)
    assert not _routed(linear(x3, w, b))
    x64 = x.double().requires_grad_(True)
    out64 = linear(x64, w.double(), b.double())
    assert out64.dtype == torch.float64 and not _routed(out64)
    with warnings.catch_warnings():  # torch.jit.trace is deprecated, and what the ONNX exporter runs
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(lambda t: linear(t, w, b), (x,))
    assert "mkldnn" not in str(traced.graph)
    torch.testing.assert_close(traced(x), F.linear(x, w, b))


def test_the_torso_fc_runs_through_it_and_prescaled_frames_match_uint8():
    """The shallow torso's fc layer takes the oneDNN path in a float32 CPU update, and the frames the
    learner scales once per batch (lay_out) give bit for bit the outputs of the uint8 frames."""
    torch.manual_seed(3)
    net = impala_net.build_model("shallow", (4, 84, 84), 6)
    net.torso.to_channels_last()
    obs = torch.randint(0, 256, (3, 2, 4, 84, 84), dtype=torch.uint8)
    first = torch.zeros(3, 2, dtype=torch.bool)
    frames = net.torso.lay_out(obs)
    assert frames.dtype == torch.float32 and frames[0].is_contiguous(memory_format=torch.channels_last)
    from_uint8, _ = net(obs, first)
    from_frames, _ = net(frames, first)
    assert torch.equal(from_uint8.policy_logits, from_frames.policy_logits)
    assert torch.equal(from_uint8.values, from_frames.values)
    seen = []
    hook = net.torso.register_forward_hook(lambda mod, inp, out: seen.append(out))
    net(frames, first)
    hook.remove()
    fc_out = seen[0].grad_fn.next_functions[0][0]  # relu(fc(...)): the fc's backward node
    assert torch.backends.mkldnn.is_available() is False or "OneDNNLinear" in type(fc_out).__name__
