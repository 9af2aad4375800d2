"""The APPO options of the IMPALA loss: PPO's clipped surrogate against the behaviour policy,
batch-standardized advantages, and several passes over one batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala.algos import impala_losses, popart
from impala.run.config import ConfigError, ImpalaConfig, RunConfig
from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo
from impala.nets.impala_net import build_model
from learner.vtrace_learner import VTraceLearner


# CartPole's spaces, as probe_env reports them (built here without stepping an env).
CARTPOLE = EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2)


def test_clipped_surrogate_matches_the_ppo_formula_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    logp_mu = torch.log(torch.rand(50, generator=g) * 0.8 + 0.1)
    # ratios from 0.5 to 1.5 so both clip edges are crossed for both signs of A
    logp_pi = (logp_mu + torch.linspace(np.log(0.5), np.log(1.5), 50)).requires_grad_(True)
    adv = torch.randn(50, generator=g)
    eps = 0.2
    loss = impala_losses.clipped_surrogate_loss(logp_pi, logp_mu, adv, eps, "sum")
    loss.backward()
    ratio = np.exp(logp_pi.detach().numpy() - logp_mu.numpy())
    a = adv.numpy()
    want = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a).sum()
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    # d/dlogpi of rho*A is rho*A; it is zero where the clipped branch is the minimum.
    clipped = ((a > 0) & (ratio > 1 + eps)) | ((a < 0) & (ratio < 1 - eps))
    want_grad = np.where(clipped, 0.0, -ratio * a)
    np.testing.assert_allclose(logp_pi.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)
    assert clipped.any() and (~clipped).any()
    with pytest.raises(ValueError, match="clip must be > 0"):
        impala_losses.clipped_surrogate_loss(logp_pi, logp_mu, adv, 0.0)


def test_normalized_advantages():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    n = impala_losses.normalized(x)
    assert float(n.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(n.std()) == pytest.approx(1.0, rel=1e-5)
    assert float(impala_losses.normalized(torch.tensor([3.0]))) == 0.0


def _loss_inputs(seed=0, T=6, B=4, A=3):
    g = torch.Generator().manual_seed(seed)
    behaviour = torch.randn(T, B, A, generator=g)
    target = (behaviour + 0.3 * torch.randn(T, B, A, generator=g)).requires_grad_(True)
    actions = torch.randint(0, A, (T, B), generator=g)
    discounts = torch.full((T, B), 0.9)
    rewards = torch.randn(T, B, generator=g)
    values = torch.randn(T, B, generator=g, requires_grad=True)
    bootstrap = torch.randn(B, generator=g)
    return behaviour, target, actions, discounts, rewards, values, bootstrap


def test_surrogate_uses_advantages_without_the_rho_factor():
    behaviour, target, actions, discounts, rewards, values, bootstrap = _loss_inputs()
    out = impala_losses.impala_loss(
        behaviour, target, actions, discounts, rewards, values, bootstrap, pg_clip=0.1
    )
    vs_tp1 = torch.cat([out.vtrace.vs[1:], bootstrap[None]])
    want = rewards + discounts * vs_tp1 - values.detach()
    torch.testing.assert_close(out.pg_advantages, want)
    plain = impala_losses.impala_loss(behaviour, target, actions, discounts, rewards, values, bootstrap)
    rho_bar = out.vtrace.log_rhos.exp().clamp(max=1.0)
    torch.testing.assert_close(plain.pg_advantages, rho_bar * want)


def test_popart_surrogate_advantages_are_divided_by_sigma():
    behaviour, target, actions, discounts, rewards, values, bootstrap = _loss_inputs(seed=1)
    state = popart.PopArtState(
        mu=torch.tensor([0.5], dtype=torch.float64),
        nu=torch.tensor([4.25], dtype=torch.float64),
        sigma=torch.tensor([2.0], dtype=torch.float64),
    )
    out = impala_losses.popart_impala_loss(
        behaviour,
        target,
        actions,
        discounts,
        rewards,
        values,
        bootstrap,
        state,
        pg_clip=0.2,
        normalize_advantages=False,
    )
    v = values.detach() * 2.0 + 0.5
    boot = bootstrap * 2.0 + 0.5
    vs_tp1 = torch.cat([out.vtrace.vs[1:], boot[None]])
    torch.testing.assert_close(out.pg_advantages, (rewards + discounts * vs_tp1 - v) / 2.0)
    normed = impala_losses.popart_impala_loss(
        behaviour,
        target,
        actions,
        discounts,
        rewards,
        values,
        bootstrap,
        state,
        pg_clip=0.2,
        normalize_advantages=True,
    )
    torch.testing.assert_close(normed.pg_advantages, impala_losses.normalized(out.pg_advantages))


def test_epochs_and_clip_are_validated():
    with pytest.raises(ConfigError, match="--epochs"):
        ImpalaConfig(epochs=0)
    with pytest.raises(ConfigError, match="--pg-clip"):
        ImpalaConfig(pg_clip=1.5)


def test_each_epoch_is_an_optimizer_step_on_the_same_batch():
    from learner.vtrace_learner import ImpalaTrainer

    config = ImpalaConfig(
        batch_size=2, minibatches=1, epochs=3, pg_clip=0.2, loss_reduction="mean", optimizer="adam"
    )
    trainer = ImpalaTrainer(
        config, RunConfig(env="CartPole-v1", unroll_length=5, total_frames=1000, device="cpu"), CARTPOLE
    )
    g = np.random.default_rng(0)
    for _ in range(2):
        trainer._pending.append(
            {
                "obs": g.standard_normal((6, 4)).astype(np.float32),
                "first": np.zeros(6, bool),
                "actions": g.integers(0, 2, 5),
                "rewards": g.standard_normal(5).astype(np.float32),
                "dones": np.zeros(5, bool),
                "behaviour_logits": np.zeros((5, 2), np.float32),
            }
        )
    trainer.update(frames_done=0)
    state = trainer.learner.optimizer.state[next(trainer.learner.model.parameters())]
    assert int(state["step"]) == 3
    assert trainer.learner.updates == 3


def test_minibatches_split_whole_unrolls_and_cover_the_batch_each_epoch():
    torch.manual_seed(0)
    config = ImpalaConfig(batch_size=4, epochs=2, minibatches=2, loss_reduction="mean", optimizer="adam")
    learner = VTraceLearner(build_model("mlp", (4,), 2), config, torch.device("cpu"), total_frames=1000)
    g = torch.Generator().manual_seed(1)
    batch = {
        "obs": torch.randn(6, 4, 4, generator=g),
        "first": torch.zeros(6, 4, dtype=torch.bool),
        "actions": torch.randint(0, 2, (5, 4), generator=g),
        "rewards": torch.randn(5, 4, generator=g),
        "dones": torch.zeros(5, 4, dtype=torch.bool),
        "behaviour_logits": torch.zeros(5, 4, 2),
    }
    seen: list[torch.Tensor] = []
    real_step = learner.step

    def recording_step(sub, *, frames_done):
        assert sub["obs"].shape[:2] == (6, 2) and sub["actions"].shape == (5, 2)
        seen.append(sub["rewards"][0])
        return real_step(sub, frames_done=frames_done)

    learner.step = recording_step
    learner.train(batch, frames_done=0)
    assert len(seen) == 4 and learner.updates == 4
    for epoch in (seen[:2], seen[2:]):
        got = torch.cat(epoch).sort().values
        torch.testing.assert_close(got, batch["rewards"][0].sort().values)  # every unroll once per epoch
    with pytest.raises(ConfigError, match="--minibatches"):
        ImpalaConfig(batch_size=6, minibatches=4)
