"""The APPO options of the IMPALA loss: PPO's clipped surrogate against the behaviour policy,
batch-standardized advantages, and several passes over one batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala.algos import impala_losses, popart
from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo
from impala.nets.impala_net import build_model
from impala.options import ConfigError
from impala.run.config import ImpalaConfig, RunConfig
from learner.vtrace_learner import VTraceLearner
from step_loss import step_loss

# CartPole's spaces, as probe_env reports them (built here without stepping an env).
CARTPOLE = EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2)


def test_clipped_surrogate_matches_the_ppo_formula_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    logp_mu = torch.log(torch.rand(50, generator=g) * 0.8 + 0.1)
    # ratios from 0.5 to 1.5 so both clip edges are crossed for both signs of A
    logp_pi = (logp_mu + torch.linspace(np.log(0.5), np.log(1.5), 50)).requires_grad_(True)
    adv = torch.randn(50, generator=g)
    eps = 0.2
    loss = impala_losses.clipped_surrogate_loss(logp_pi, logp_mu, adv, clip=eps, reduction="sum")
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
        impala_losses.clipped_surrogate_loss(logp_pi, logp_mu, adv, clip=0.0, reduction="mean")


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
    out = step_loss(behaviour, target, actions, discounts, rewards, values, bootstrap, pg_clip=0.1)
    vs_tp1 = torch.cat([out.vtrace.vs[1:], bootstrap[None]])
    want = rewards + discounts * vs_tp1 - values.detach()
    torch.testing.assert_close(out.pg_advantages, want)
    plain = step_loss(behaviour, target, actions, discounts, rewards, values, bootstrap)
    rho_bar = out.vtrace.log_rhos.exp().clamp(max=1.0)
    torch.testing.assert_close(plain.pg_advantages, rho_bar * want)


def test_popart_surrogate_advantages_are_divided_by_sigma():
    inputs = _loss_inputs(seed=1)
    behaviour, target, actions, discounts, rewards, values, bootstrap = inputs
    state = popart.PopArtState(
        mu=torch.tensor([0.5], dtype=torch.float64),
        nu=torch.tensor([4.25], dtype=torch.float64),
        sigma=torch.tensor([2.0], dtype=torch.float64),
    )
    out = step_loss(*inputs, state, pg_clip=0.2, normalize_advantages=False)
    v = values.detach() * 2.0 + 0.5
    boot = bootstrap * 2.0 + 0.5
    vs_tp1 = torch.cat([out.vtrace.vs[1:], boot[None]])
    torch.testing.assert_close(out.pg_advantages, (rewards + discounts * vs_tp1 - v) / 2.0)
    normed = step_loss(*inputs, state, pg_clip=0.2, normalize_advantages=True)
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


def _on_policy_batch(model, T=7, B=4, seed=2):
    """A CartPole-shaped batch whose behaviour logits are ``model``'s own (on-policy), with episode ends."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T + 1, B, 4, generator=g)
    dones = torch.zeros(T, B, dtype=torch.bool)
    dones[2, 0] = dones[5, 1] = dones[T - 1, 2] = True
    first = torch.zeros(T + 1, B, dtype=torch.bool)
    first[1:] = dones
    with torch.no_grad():
        out, _ = model(obs, first)
    return {
        "obs": obs,
        "first": first,
        "actions": torch.randint(0, 2, (T, B), generator=g),
        "rewards": torch.rand(T, B, generator=g) * 2 - 1,  # inside the reward clip
        "dones": dones,
        "behaviour_logits": out.policy_logits[:-1].clone(),
    }


@pytest.mark.parametrize("with_popart", [False, True])
def test_per_batch_targets_on_policy_are_sb3_gae_advantages_and_returns(with_popart):
    """On-policy, V-trace(lambda)'s fixed targets are PPO's: SB3's RolloutBuffer computes the same GAE
    advantages and returns from the same rewards, values and episode starts. Under PopArt (statistics
    away from identity) the targets are in return units: from sigma * n(x) + mu."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer

    torch.manual_seed(0)
    T, B, gamma, lam = 7, 4, 0.97, 0.9
    config = ImpalaConfig(
        batch_size=B, epochs=2, minibatches=2, discount=gamma, vtrace_lambda=lam, popart=with_popart
    )
    learner = VTraceLearner(build_model("mlp", (4,), 2), config, torch.device("cpu"), total_frames=1000)
    head = learner.model.baseline
    if with_popart:
        head.mu.fill_(0.7)
        head.nu.fill_(0.7**2 + 2.5**2)
        head.sigma.fill_(2.5)
    batch = _on_policy_batch(learner.model, T, B)
    got = learner._batch_targets(batch)

    with torch.no_grad():
        values = learner.model(batch["obs"], batch["first"])[0].values
        if with_popart:
            values = values * 2.5 + 0.7
    buf = RolloutBuffer(T, spaces.Box(-1, 1, (4,)), spaces.Discrete(2), "cpu", lam, gamma, n_envs=B)
    for t in range(T):
        buf.add(
            batch["obs"][t].numpy(),
            batch["actions"][t].numpy(),
            batch["rewards"][t].numpy(),
            (batch["first"][t].numpy() if t else np.zeros(B, bool)),
            values[t],
            torch.zeros(B),
        )
    buf.compute_returns_and_advantage(values[T], batch["dones"][T - 1].numpy())
    np.testing.assert_allclose(got["target_pg_adv"].numpy(), buf.advantages, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["target_vs"].numpy(), buf.returns, rtol=1e-5, atol=1e-6)


def _ppo_update_from_the_equations(model, batch, config, seed):
    """PPO's update restated: GAE(lambda) advantages and returns once, from the network before the
    update (explicit backward recursion, float64); then epochs x minibatches of whole unrolls (the
    learner's shuffle), each minibatch's advantages standardized, clipped surrogate against the
    behaviour policy, 0.5 * baseline_cost * MSE to the fixed returns, entropy bonus, grad-norm clip,
    Adam."""
    T, B = batch["actions"].shape
    with torch.no_grad():
        v = model(batch["obs"], batch["first"])[0].values.double()
    disc = (~batch["dones"]).double() * config.discount
    adv = torch.zeros(T, B, dtype=torch.float64)
    running = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(T)):
        delta = batch["rewards"][t].double() + disc[t] * v[t + 1] - v[t]
        running = delta + disc[t] * config.vtrace_lambda * running
        adv[t] = running
    returns = (adv + v[:-1]).float()
    adv = adv.float()
    opt = torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=config.adam_eps)
    shuffle = torch.Generator().manual_seed(seed)
    mu_lp = torch.log_softmax(batch["behaviour_logits"], -1).gather(-1, batch["actions"][..., None])[..., 0]
    for _ in range(config.epochs):
        for idx in torch.randperm(B, generator=shuffle).chunk(config.minibatches):
            out = model(batch["obs"][:, idx], batch["first"][:, idx])[0]
            log_p = torch.log_softmax(out.policy_logits[:-1], -1)
            lp = log_p.gather(-1, batch["actions"][:, idx][..., None])[..., 0]
            a = adv[:, idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            ratio = torch.exp(lp - mu_lp[:, idx])
            eps = config.pg_clip
            pg = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a).mean()
            vf = 0.5 * ((returns[:, idx] - out.values[:-1]) ** 2).mean()
            ent = -(log_p.exp() * log_p).sum(-1).mean()
            loss = pg + config.baseline_cost * vf - config.entropy_cost * ent
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            opt.step()


@pytest.mark.parametrize("targets", ["per_batch", "per_step"])
def test_per_batch_update_is_ppos_update_with_fixed_targets(targets):
    """--targets per_batch: the whole update on a batch (2 passes x 2 minibatches) equals PPO's, written
    from its equations, to float precision. per_step (targets recomputed with the moving network) is a
    different update, which shows the comparison can fail."""
    import copy

    torch.manual_seed(0)
    config = ImpalaConfig(
        batch_size=4, epochs=2, minibatches=2, learning_rate=3e-3, targets=targets, lr_decay=False
    )
    learner = VTraceLearner(build_model("mlp", (4,), 2), config, torch.device("cpu"), total_frames=1000)
    reference = copy.deepcopy(learner.model)
    before = copy.deepcopy(reference.state_dict())
    batch = _on_policy_batch(learner.model)
    learner.train(batch, frames_done=0)
    _ppo_update_from_the_equations(reference, batch, config, seed=0)
    got, want = learner.model.state_dict(), reference.state_dict()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    moved = max(float((want[k] - before[k]).abs().max()) for k in want)
    assert moved > 1e-3, moved  # four Adam steps of 3e-3: the weights did move
    if targets == "per_batch":
        assert worst < 1e-5, worst
    else:
        assert worst > 1e-4, worst


@pytest.mark.parametrize("use_lstm", [False, True])
def test_a_step_on_fixed_targets_never_reads_the_bootstrap_observation(use_lstm):
    """With the targets fixed per batch, a minibatch step needs no bootstrap value, so its forward pass
    skips step T: the update is the same whatever the last observation holds (NaN included), with and
    without an LSTM core (whose outputs at steps 0..T-1 do not depend on step T)."""
    import copy

    torch.manual_seed(0)
    config = ImpalaConfig(batch_size=4, epochs=2, minibatches=2, targets="per_batch", lr_decay=False)
    learner = VTraceLearner(
        build_model("mlp", (4,), 2, use_lstm=use_lstm), config, torch.device("cpu"), total_frames=1000
    )
    twin = copy.deepcopy(learner)
    batch = _on_policy_batch(learner.model)
    fixed = {**batch, **learner._batch_targets(batch)}
    poisoned = {**fixed, "obs": fixed["obs"].clone()}
    poisoned["obs"][-1] = float("nan")
    learner.step(fixed, frames_done=0)
    twin.step(poisoned, frames_done=0)
    assert learner.skipped_updates == twin.skipped_updates == 0
    got, want = learner.model.state_dict(), twin.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
