"""Learning-health metrics (docs/PONG.md): each one checked against a case whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala.nets.impala_net import build_model, initialize
from impala.run.config import ImpalaConfig
from learner.update.health import logit_spread, step_fraction
from learner.vtrace_learner import VTraceLearner


def _frames(n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, n, 4, 84, 84), generator=g, dtype=torch.uint8)


def test_orthogonal_init_gains_and_zero_biases():
    torch.manual_seed(0)
    model = build_model("shallow", (4, 84, 84), 6)
    for layer in (model.torso.conv1, model.torso.conv2, model.torso.fc):
        w = layer.weight.detach().flatten(1)
        rows = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        torch.testing.assert_close(
            rows, 2.0 * torch.eye(rows.shape[0]), atol=1e-4, rtol=0
        )  # orthogonal, gain sqrt(2)
        assert layer.bias.abs().max() == 0
    p = model.policy.weight.detach()
    torch.testing.assert_close(p @ p.T, 1e-4 * torch.eye(6), atol=1e-8, rtol=0)  # gain 0.01
    assert model.policy.bias.abs().max() == 0
    torch.manual_seed(0)
    default = build_model("shallow", (4, 84, 84), 6, init="torch")
    assert default.torso.conv1.bias.abs().max() > 0  # PyTorch's init keeps its uniform biases
    with pytest.raises(ValueError, match="unknown init scheme"):
        initialize(default, "xavier")


def test_alive_fraction_counts_channels_positive_somewhere():
    torch.manual_seed(0)
    model = build_model("shallow", (4, 84, 84), 6)
    torso = model.torso
    with torch.no_grad():
        torso.conv1.bias[:4] = -1e6  # four channels that no input can switch on
    torso.track_activity = True
    model(_frames(), torch.zeros(1, 6, dtype=torch.bool))
    alive = torso.activity
    x = _frames()[0].float() / 255
    pre = torch.nn.functional.conv2d(x, torso.conv1.weight, torso.conv1.bias, stride=4)
    want = float((pre > 0).flatten(2).any(-1).any(0).float().mean())
    assert alive["conv1"] == pytest.approx(want)
    assert alive["conv1"] <= 12 / 16
    assert set(alive) == {"conv1", "conv2", "fc"}
    torso.track_activity = False
    torso.activity.clear()
    model(_frames(), torch.zeros(1, 6, dtype=torch.bool))
    assert torso.activity == {}  # actors never pay for it


def test_logit_spread_is_zero_for_a_state_independent_policy():
    same = torch.tensor([1.0, 2.0, 3.0]).expand(5, 4, 3)
    assert logit_spread(same) == 0.0
    shifted = same + torch.arange(20.0).view(5, 4, 1)  # a per-state shift is the same policy
    assert logit_spread(shifted) == pytest.approx(0.0, abs=1e-6)
    varied = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    log_p = torch.log_softmax(varied.reshape(20, 3), -1)
    assert logit_spread(varied) == pytest.approx(float(log_p.std(0).mean()))


@pytest.mark.parametrize("kind", ["rmsprop", "adam"])
def test_step_fraction_matches_the_optimizer_state(kind):
    w = torch.nn.Parameter(torch.zeros(4))
    eps = 1e-3
    opt = (
        torch.optim.RMSprop([w], lr=0.1, eps=eps, alpha=0.9)
        if kind == "rmsprop"
        else torch.optim.Adam([w], lr=0.1, eps=eps, betas=(0.9, 0.99))
    )
    grads = [torch.tensor([1.0, 1e-2, 1e-4, 0.0]), torch.tensor([2.0, 1e-2, 1e-4, 0.0])]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    if kind == "rmsprop":
        v = 0.1 * (0.9 * grads[0] ** 2) + 0.1 * grads[1] ** 2
    else:
        v = (0.01 * (0.99 * grads[0] ** 2) + 0.01 * grads[1] ** 2) / (1 - 0.99**2)
    want = float((v.sqrt() / (v.sqrt() + eps)).mean())
    assert step_fraction(opt) == pytest.approx(want, rel=1e-6)
    assert 0.25 < want < 0.75  # the cases span eps-dominated and eps-negligible weights


def test_learner_reports_health_every_update():
    torch.manual_seed(0)
    config = ImpalaConfig(batch_size=3, minibatches=1, loss_reduction="mean", optimizer="adam")
    learner = VTraceLearner(
        build_model("shallow", (4, 84, 84), 6), config, torch.device("cpu"), total_frames=1000
    )
    g = torch.Generator().manual_seed(1)
    batch = {
        "obs": torch.randint(0, 256, (6, 3, 4, 84, 84), generator=g, dtype=torch.uint8),
        "first": torch.zeros(6, 3, dtype=torch.bool),
        "actions": torch.randint(0, 6, (5, 3), generator=g),
        "rewards": torch.randn(5, 3, generator=g),
        "dones": torch.zeros(5, 3, dtype=torch.bool),
        "behaviour_logits": torch.zeros(5, 3, 6),
    }
    m = learner.step(batch, frames_done=0)
    for key in (
        "health/step_fraction",
        "health/logit_spread",
        "health/alive_conv1",
        "health/alive_conv2",
        "health/alive_fc",
    ):
        assert np.isfinite(m[key]), key
    assert 0 < m["health/step_fraction"] <= 1
    assert 0 < m["health/alive_conv1"] <= 1
    assert m["losses/entropy"] == pytest.approx(np.log(6), abs=0.05)  # per-step entropy, near uniform at init
    assert learner.model.torso.track_activity is False
