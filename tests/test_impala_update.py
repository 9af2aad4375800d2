"""One learner update equals the update IMPALA / TorchBeast make with the same hyperparameters.

The reference below is written from TorchBeast's ``monobeast.learn`` equations, not from our
code: V-trace from eq. (1) of Espeholt et al. 2018 as explicit sums in float64 NumPy; the
policy-gradient, baseline and entropy terms *summed* over T x B; ``baseline_cost * 0.5 *
sum((vs - V)^2)``; ``entropy_cost * sum(p log p)``; rewards clipped to [-1, 1]; global
grad-norm clip 40; ``torch.optim.RMSprop(lr, alpha, eps, momentum)``. The batch is
Pong-shaped (T=80, B=32, 4x84x84 uint8 frames, 6 actions).

Before the small-box recipe (docs/PONG.md) our losses were averaged over T x B while lr 6e-4 / eps 0.01 / clip
40 stayed
the summed-loss numbers, so every step was ~1% of the published one; the ``mean`` case below
shows the check can tell the two apart.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from impala.nets.impala_net import build_model
from impala.options import load_preset
from impala.run.config import ImpalaConfig, RunConfig
from learner.vtrace_learner import VTraceLearner

T, B, A = 80, 32, 6
OBS = (4, 84, 84)

# The IMPALA paper's Atari settings as shipped in the preset file (what `--config` reads),
# with a Pong-shaped batch: T=80 as TorchBeast's default unroll.
PRESET = os.path.join(os.path.dirname(__file__), "..", "configs", "atari.yaml")
PAPER = {**load_preset(PRESET, (RunConfig, ImpalaConfig)), "unroll_length": T, "batch_size": B}
IMPALA_FIELDS = {f.name for f in dataclasses.fields(ImpalaConfig)}


def test_the_preset_holds_the_papers_numbers():
    want = dict(
        learning_rate=6e-4,
        rmsprop_alpha=0.99,
        rmsprop_eps=0.01,
        rmsprop_momentum=0.0,
        grad_norm_clip=40.0,
        entropy_cost=0.01,
        baseline_cost=0.5,
        discount=0.99,
        reward_clip=1.0,
        loss_reduction="sum",
        optimizer="rmsprop",
        epochs=1,
        minibatches=1,
        pg_clip=0.0,
        advantage_norm=False,
        vtrace_lambda=1.0,
    )
    assert {k: PAPER[k] for k in want} == want


def vtrace_from_equation(log_rhos, discounts, rewards, values, bootstrap):
    """Eq. (1): v_s = V(x_s) + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t V,
    with rho_t = min(1, pi/mu), c_i = min(1, pi/mu); and the policy-gradient advantage
    min(1, pi/mu)_s (r_s + gamma_s v_{s+1} - V(x_s)). Float64, vectorized over B only."""
    log_rhos, discounts, rewards, values = (
        np.asarray(a, np.float64) for a in (log_rhos, discounts, rewards, values)
    )
    bootstrap = np.asarray(bootstrap, np.float64)
    n = values.shape[0]
    rho = np.minimum(1.0, np.exp(log_rhos))
    c = np.minimum(1.0, np.exp(log_rhos))
    v_next = np.concatenate([values[1:], bootstrap[None]], axis=0)
    delta = rho * (rewards + discounts * v_next - values)
    vs = np.array(values)
    for s in range(n):
        coef = np.ones_like(bootstrap)
        for t in range(s, n):
            vs[s] += coef * delta[t]
            coef = coef * discounts[t] * c[t]
    vs_next = np.concatenate([vs[1:], bootstrap[None]], axis=0)
    pg_adv = rho * (rewards + discounts * vs_next - values)
    return vs, pg_adv


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randint(0, 256, (T + 1, B, *OBS), generator=g, dtype=torch.uint8)
    dones = torch.rand(T, B, generator=g) < 0.02
    first = torch.zeros(T + 1, B, dtype=torch.bool)
    first[1:] = dones
    return {
        "obs": obs,
        "first": first,
        "actions": torch.randint(0, A, (T, B), generator=g),
        # Pong's rewards are +-1; a few larger ones exercise the clip.
        "rewards": torch.where(
            torch.rand(T, B, generator=g) < 0.05, torch.randn(T, B, generator=g) * 3, torch.zeros(T, B)
        ),
        "dones": dones,
        "behaviour_logits": torch.randn(T, B, A, generator=g) * 0.5,
    }


def torchbeast_update(model: torch.nn.Module, batch: dict[str, torch.Tensor], hp: dict) -> None:
    """TorchBeast's learn() restated: forward, V-trace, summed losses, clip, RMSprop step."""
    optimizer = torch.optim.RMSprop(
        model.parameters(),
        lr=hp["learning_rate"],
        alpha=hp["rmsprop_alpha"],
        eps=hp["rmsprop_eps"],
        momentum=hp["rmsprop_momentum"],
    )
    out, _ = model(batch["obs"], batch["first"])
    logits_all, values_all = out.policy_logits, out.values  # at identity PopArt statistics n(x) == V(x)
    logits, values, bootstrap = logits_all[:-1], values_all[:-1], values_all[-1]
    actions = batch["actions"]
    rewards = batch["rewards"].clamp(-1.0, 1.0)
    discounts = (~batch["dones"]).double() * hp["discount"]
    with torch.no_grad():
        target_lp = F.log_softmax(logits, -1).gather(-1, actions[..., None])[..., 0]
        behaviour_lp = F.log_softmax(batch["behaviour_logits"], -1).gather(-1, actions[..., None])[..., 0]
        vs, pg_adv = vtrace_from_equation(
            (target_lp - behaviour_lp).double(),
            discounts,
            rewards.double(),
            values.double(),
            bootstrap.double(),
        )
    vs, pg_adv = torch.from_numpy(vs).float(), torch.from_numpy(pg_adv).float()
    cross_entropy = F.nll_loss(
        F.log_softmax(logits.reshape(T * B, A), -1), actions.reshape(-1), reduction="none"
    )
    pg_loss = (cross_entropy.view(T, B) * pg_adv).sum()
    baseline_loss = hp["baseline_cost"] * 0.5 * ((vs - values) ** 2).sum()
    p = F.softmax(logits, -1)
    entropy_loss = hp["entropy_cost"] * (p * F.log_softmax(logits, -1)).sum()
    optimizer.zero_grad()
    (pg_loss + baseline_loss + entropy_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), hp["grad_norm_clip"])
    optimizer.step()
    return vs


def _learner(popart: bool, **overrides) -> tuple[VTraceLearner, torch.nn.Module]:
    torch.manual_seed(3)
    model = build_model("shallow", OBS, A)
    reference = copy.deepcopy(model)
    config = ImpalaConfig(
        **{k: v for k, v in {**PAPER, **overrides, "popart": popart}.items() if k in IMPALA_FIELDS}
    )
    return VTraceLearner(model, config, torch.device("cpu"), total_frames=10_000_000), reference


def _deltas(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() - before[k] for k, v in model.state_dict().items() if k in before}


@pytest.mark.parametrize("popart", [False, True])
def test_update_equals_torchbeast_with_the_papers_settings(popart):
    learner, reference = _learner(popart)
    before = {
        k: v.detach().clone().float() for k, v in reference.state_dict().items() if v.dtype.is_floating_point
    }
    batch = make_batch(seed=11)
    vs = torchbeast_update(reference, batch, PAPER)
    learner.step(batch, frames_done=0)

    ours, theirs = _deltas(learner.model, before), _deltas(reference, before)
    value_head = {"baseline.linear.weight", "baseline.linear.bias"}
    for name, want in theirs.items():
        if name in ("baseline.mu", "baseline.nu", "baseline.sigma") or (popart and name in value_head):
            continue
        got = ours[name]
        assert want.abs().max() > 1e-5, f"{name}: the reference update did not move it"
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-3, f"{name}: update differs from TorchBeast's by {err:.2e} of its size"

    if popart:
        # ART: one EMA step on the batch mean of the targets; POP: W' = W sigma/sigma', b' = (sigma b + mu -
        # mu')/sigma'.
        beta = learner.model.baseline.beta
        v = vs.double()
        mu = beta * v.mean()
        nu = (1 - beta) * 1.0 + beta * (v * v).mean()
        sigma = (nu - mu * mu).sqrt()
        head = learner.model.baseline
        torch.testing.assert_close(head.mu[0], mu, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(head.sigma[0], sigma, rtol=1e-5, atol=1e-9)
        want_w = reference.baseline.linear.weight.double() / sigma
        want_b = (reference.baseline.linear.bias.double() - mu) / sigma
        moved = (want_w - before["baseline.linear.weight"].double()).abs().max()
        assert (head.linear.weight.double() - want_w).abs().max() < 2e-3 * moved
        torch.testing.assert_close(
            head.linear.bias.detach().double(), want_b.detach(), rtol=1e-4, atol=2e-3 * float(moved.detach())
        )


def test_mean_reduction_is_not_the_papers_update():
    """The check above can fail: the same numbers on mean-reduced losses move weights far less."""
    learner, reference = _learner(False, loss_reduction="mean")
    before = {
        k: v.detach().clone().float() for k, v in reference.state_dict().items() if v.dtype.is_floating_point
    }
    batch = make_batch(seed=11)
    torchbeast_update(reference, batch, PAPER)
    learner.step(batch, frames_done=0)
    ours, theirs = _deltas(learner.model, before), _deltas(reference, before)
    ratio = ours["torso.fc.weight"].abs().mean() / theirs["torso.fc.weight"].abs().mean()
    assert ratio < 0.2, f"mean-reduced step is {ratio:.2f} of the paper's"


def test_bf16_torso_update_is_the_float32_update_to_within_its_rounding():
    """--precision bf16 rounds the torso's activations and its weight
    gradients to 8 significant bits; the step it takes must still be float32's step: every tensor's change
    points the same way (cosine > 0.99) at the same size (within 5%). Both on the preset's Pong batch."""
    fp32, _ = _learner(False)
    bf16, _ = _learner(False)
    bf16.model.torso.compute_dtype = torch.bfloat16  # what --precision bf16 sets
    assert fp32.model.torso.compute_dtype is None
    before = {
        k: v.detach().clone().float() for k, v in fp32.model.state_dict().items() if v.dtype.is_floating_point
    }
    batch = make_batch(seed=11)
    for learner in (fp32, bf16):
        learner.step({k: v.clone() for k, v in batch.items()}, frames_done=0)
    want, got = _deltas(fp32.model, before), _deltas(bf16.model, before)
    for name, w in want.items():
        if name.startswith("baseline.") and name not in ("baseline.linear.weight", "baseline.linear.bias"):
            continue
        g = got[name]
        assert w.norm() > 0, name
        cosine = float((w * g).sum() / (w.norm() * g.norm()))
        assert cosine > 0.99 and abs(float(g.norm() / w.norm()) - 1) < 0.05, (name, cosine)
    assert not torch.equal(got["torso.conv1.weight"], want["torso.conv1.weight"])  # bf16 did run


def test_precision_bf16_is_for_an_image_torso_and_fp32_is_the_default():
    from impala.options import ConfigError
    from learner.vtrace_learner import cpu_has_native_bf16, torso_precision

    image, vector = build_model("shallow", OBS, A), build_model("mlp", (4,), 2)
    cpu = torch.device("cpu")
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert cpu_has_native_bf16() == bool(
        {"avx512_bf16", "amx_bf16"} & flags
    )  # torch's CPUID, read another way
    assert torso_precision("fp32", cpu, image) == "fp32" and torso_precision("bf16", cpu, image) == "bf16"
    assert torso_precision("fp32", cpu, vector) == "fp32"
    with pytest.raises(ConfigError, match="--precision bf16 runs an image torso"):
        torso_precision("bf16", cpu, vector)
    default = VTraceLearner(build_model("shallow", OBS, A), ImpalaConfig(), cpu, total_frames=10**6)
    assert default.precision == "fp32" and default.model.torso.compute_dtype is None
    learner = VTraceLearner(
        build_model("shallow", OBS, A), ImpalaConfig(precision="bf16"), cpu, total_frames=10**6
    )
    assert learner.precision == "bf16" and learner.model.torso.compute_dtype == torch.bfloat16


@pytest.mark.serial  # it times bf16 against fp32: a busy neighbour would skew the pair
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's note on switching oneDNN
def test_bf16_on_a_cpu_where_it_is_slower_warns_with_what_it_costs(caplog):
    """With oneDNN off, torch runs bf16 convolutions on its slow path, as on an AVX2-only CPU (7.8x slower
    than fp32 per minibatch step there): the learner times both at start and warns with the figures; bf16
    stays, as asked. fp32 is never timed."""
    import logging

    from learner.vtrace_learner import bf16_torso_cost, torso_precision

    image, cpu = build_model("shallow", OBS, A), torch.device("cpu")
    with torch.backends.mkldnn.flags(enabled=False), caplog.at_level(logging.INFO, "learner.vtrace_learner"):
        fp32_ms, bf16_ms = bf16_torso_cost(image)
        assert (
            bf16_ms > fp32_ms > 0
        )  # the slow path, measured (7x alone on a 2-core AMD EPYC, 1.4x under load)
        assert torso_precision("bf16", cpu, image) == "bf16"
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "--precision bf16 is slower than fp32 on this CPU" in warning[0], warning
    assert re.search(r"took [\d.]+ ms in bf16 against [\d.]+ ms in fp32 \([\d.]+x\)", warning[0]), warning
    caplog.clear()
    with caplog.at_level(logging.INFO, "learner.vtrace_learner"):
        torso_precision("fp32", cpu, image)
    assert not caplog.records
