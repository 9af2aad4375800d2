"""PopArt (van Hasselt et al. 2016; Hessel et al. 2018): invariants of art/pop, the
value head, and the (PopArt-)IMPALA losses."""

import numpy as np
import pytest
import torch

from impala.algos import popart, vtrace
from step_loss import step_loss

BOUNDS = dict(sigma_min=popart.DEFAULT_SIGMA_MIN, sigma_max=popart.DEFAULT_SIGMA_MAX)


def test_normalize_unnormalize_identity():
    state = popart.PopArtState(
        mu=torch.tensor([3.0, -200.0], dtype=torch.float64),
        nu=torch.tensor([25.0, 5e4], dtype=torch.float64),
        sigma=torch.tensor([4.0, 100.0], dtype=torch.float64),
    )
    x = torch.randn(6, 5, dtype=torch.float64) * 300
    task = torch.randint(0, 2, (6, 5))
    torch.testing.assert_close(popart.unnormalize(state, popart.normalize(state, x, task), task), x)
    torch.testing.assert_close(popart.normalize(state, popart.unnormalize(state, x, 1), 1), x)
    torch.testing.assert_close(popart.normalize(state, x, 1), (x + 200.0) / 100.0)
    with pytest.raises(ValueError, match="task has shape"):
        popart.normalize(state, x, task[:3])


def test_update_stats_is_one_ema_step_on_the_batch_mean():
    state = popart.init_state(3)
    targets = torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0], dtype=torch.float64)
    tasks = torch.tensor([0, 0, 2, 2, 2])
    new = popart.update_stats(state, targets, tasks, beta=0.1, **BOUNDS)
    # Task 0: mean 2, mean square 5; task 1 absent (unchanged); task 2: mean 20, mean sq 1400/3.
    torch.testing.assert_close(new.mu, torch.tensor([0.2, 0.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(new.nu, torch.tensor([0.9 + 0.5, 1.0, 0.9 + 140.0 / 3], dtype=torch.float64))
    torch.testing.assert_close(new.sigma, (new.nu - new.mu**2).sqrt())
    assert state.mu.eq(0).all()  # the input state is untouched (immutable API)
    # Batch size does not change the step: repeating the batch gives the same state.
    torch.testing.assert_close(
        popart.update_stats(state, targets.repeat(7), tasks.repeat(7), beta=0.1, **BOUNDS), new
    )


def test_pop_preserves_unnormalized_outputs_across_scale_shift():
    torch.manual_seed(0)
    in_features, num_tasks = 16, 2
    weight = torch.randn(num_tasks, in_features)
    bias = torch.randn(num_tasks)
    state = popart.init_state(num_tasks)
    h = torch.randn(64, in_features, dtype=torch.float64)
    for step in range(100):
        scale = 1000.0 ** (step / 99)  # target scale shifts 1 -> 1000
        targets = torch.randn(256, dtype=torch.float64) * scale + 0.5 * scale
        tasks = torch.randint(0, num_tasks, (256,))
        new = popart.update_stats(state, targets, tasks, beta=0.05, **BOUNDS)
        before = (h @ weight.double().T + bias.double()) * state.sigma + state.mu
        weight, bias = popart.rescale_linear(weight, bias, state, new)
        after = (h @ weight.double().T + bias.double()) * new.sigma + new.mu
        np.testing.assert_allclose(
            after.numpy(), before.numpy(), rtol=1e-5, atol=1e-5 * before.abs().max().item()
        )
        state = new
    assert state.sigma.min() > 100  # the statistics did follow the shift


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_head_update_preserves_outputs(dtype):
    torch.manual_seed(1)
    head = popart.PopArtValueHead(32, num_tasks=1, beta=0.05).to(dtype)
    h = torch.randn(128, 32, dtype=dtype)
    for step in range(100):
        scale = 1000.0 ** (step / 99)
        before = head.unnormalized(h).double()
        head.update(torch.randn(80, 32) * scale + scale, task_ids=0)
        after = head.unnormalized(h).double()
        if dtype == torch.float64:
            rel = ((after - before).abs() / before.abs()).max().item()
        else:
            # In float32, sigma * n + mu carries rounding of order eps * (|mu| + sigma):
            # here the preserved outputs stay O(1) while mu and sigma grow to ~1e3, so that
            # scale (not each near-zero output) is what float32 can be held to.
            scale_ref = max(before.abs().max().item(), (head.mu.abs() + head.sigma).max().item())
            rel = (after - before).abs().max().item() / scale_ref
        assert rel <= 1e-5, (step, rel)
    assert head.sigma.item() > 100 and head.mu.item() > 100
    torch.testing.assert_close(head(h) * head.sigma.to(dtype) + head.mu.to(dtype), head.unnormalized(h))


@pytest.mark.parametrize("scale,lo,hi", [(1e-9, 1e-3, 1e2), (1e9, 1e-3, 1e2), (1.0, 0.5, 0.6)])
def test_sigma_stays_in_bounds(scale, lo, hi):
    state = popart.init_state(1)
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        targets = torch.randn(64, generator=g, dtype=torch.float64) * scale
        state = popart.update_stats(state, targets, 0, beta=0.1, sigma_min=lo, sigma_max=hi)
        assert lo * (1 - 1e-12) <= state.sigma.item() <= hi * (1 + 1e-12)
        assert torch.isfinite(state.mu).all() and torch.isfinite(state.nu).all()


def test_converges_to_stationary_stream_moments():
    g = torch.Generator().manual_seed(3)
    head = popart.PopArtValueHead(4, num_tasks=2, beta=1e-2)
    means, stds = torch.tensor([5.0, -300.0]), torch.tensor([2.0, 40.0])
    for _ in range(3000):
        tasks = torch.randint(0, 2, (64,), generator=g)
        targets = torch.randn(64, generator=g) * stds[tasks] + means[tasks]
        head.update(targets, tasks)
    np.testing.assert_allclose(head.mu.numpy(), means.numpy(), rtol=0.03)
    np.testing.assert_allclose(head.sigma.numpy(), stds.numpy(), rtol=0.05)


@pytest.mark.parametrize("beta", [0.0, -1e-3, 1.5])
def test_bad_beta_raises(beta):
    with pytest.raises(ValueError, match="beta"):
        popart.PopArtValueHead(8, beta=beta)
    with pytest.raises(ValueError, match="beta"):
        popart.update_stats(popart.init_state(1), torch.zeros(3), 0, beta=beta, **BOUNDS)


def test_value_head_is_float32_under_autocast_and_in_state_dict():
    head = popart.PopArtValueHead(8, num_tasks=3, beta=3e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(torch.randn(5, 8).bfloat16())
    assert out.dtype == torch.float32 and out.shape == (5, 3)
    assert {"mu", "nu", "sigma", "linear.weight", "linear.bias"} <= set(head.state_dict())


def _loss_inputs(T=7, B=5, A=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    behaviour = torch.randn(T, B, A, generator=g)
    target = torch.randn(T, B, A, generator=g, requires_grad=True)
    actions = torch.randint(0, A, (T, B), generator=g)
    discounts = torch.full((T, B), 0.99)
    rewards = torch.randn(T, B, generator=g) * 50
    n_values = torch.randn(T, B, generator=g, requires_grad=True)
    n_boot = torch.randn(B, generator=g)
    return behaviour, target, actions, discounts, rewards, n_values, n_boot


def test_popart_loss_matches_paper_formulas():
    behaviour, target, actions, discounts, rewards, n_values, n_boot = _loss_inputs()
    state = popart.PopArtState(
        mu=torch.tensor([20.0]), nu=torch.tensor([400.0 + 9.0]), sigma=torch.tensor([3.0])
    )
    out = step_loss(
        behaviour,
        target,
        actions,
        discounts,
        rewards,
        n_values,
        n_boot,
        state,
        baseline_cost=0.25,
        entropy_cost=0.1,
    )
    mu, sigma = 20.0, 3.0
    values = sigma * n_values.detach() + mu
    ref = vtrace.from_logits(behaviour, target, actions, discounts, rewards, values, sigma * n_boot + mu)
    torch.testing.assert_close(out.vtrace.vs, ref.vs)
    # Advantage as written in Hessel et al.: rho_pg * ((r + gamma v_{s+1} - mu)/sigma - n(x_s)).
    vs_tp1 = torch.cat([ref.vs[1:], (sigma * n_boot + mu)[None]])
    rho_pg = ref.log_rhos.detach().exp().clamp(max=1.0)
    adv = rho_pg * ((rewards + discounts * vs_tp1 - mu) / sigma - n_values.detach())
    torch.testing.assert_close(out.pg_advantages, adv)
    logp = ref.target_action_log_probs
    torch.testing.assert_close(out.pg_loss, -(logp * adv).mean())
    torch.testing.assert_close(out.baseline_loss, 0.5 * (((ref.vs - mu) / sigma) - n_values).pow(2).mean())
    p = torch.softmax(target, -1)
    ent = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(out.entropy, ent)
    torch.testing.assert_close(out.total, out.pg_loss + 0.25 * out.baseline_loss - 0.1 * ent)
    out.total.backward()
    assert target.grad.abs().sum() > 0 and n_values.grad.abs().sum() > 0


def test_at_identity_statistics_the_loss_is_impalas():
    """A run without PopArt trains with the same loss at mu 0, sigma 1: IMPALA's terms, from V-trace on the
    critic's values as they are."""
    behaviour, target, actions, discounts, rewards, values, boot = _loss_inputs(seed=4)
    out = step_loss(
        behaviour, target, actions, discounts, rewards, values, boot, baseline_cost=0.5, entropy_cost=0.01
    )
    ref = vtrace.from_logits(behaviour, target, actions, discounts, rewards, values.detach(), boot)
    torch.testing.assert_close(out.vtrace.vs, ref.vs)
    torch.testing.assert_close(out.pg_loss, -(ref.target_action_log_probs * ref.pg_advantages).mean())
    torch.testing.assert_close(out.baseline_loss, 0.5 * (ref.vs - values).pow(2).mean())
    p = torch.softmax(target, -1)
    ent = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(out.total, out.pg_loss + 0.5 * out.baseline_loss - 0.01 * ent)
    for dtype in (torch.float32, torch.float64):  # the state's dtype changes no bit
        same = step_loss(
            behaviour, target, actions, discounts, rewards, values, boot, popart.init_state(1, dtype=dtype)
        )
        assert torch.equal(same.total, out.total)


def test_popart_loss_with_task_ids():
    behaviour, target, actions, discounts, rewards, n_values, n_boot = _loss_inputs(B=4)
    state = popart.PopArtState(
        mu=torch.tensor([0.0, 100.0]), nu=torch.tensor([1.0, 1e4 + 100.0]), sigma=torch.tensor([1.0, 10.0])
    )
    tasks = torch.tensor([0, 1, 1, 0]).expand(7, 4)
    out = step_loss(behaviour, target, actions, discounts, rewards, n_values, n_boot, state, tasks)
    for b in range(4):
        single = step_loss(
            behaviour[:, b : b + 1],
            target[:, b : b + 1],
            actions[:, b : b + 1],
            discounts[:, b : b + 1],
            rewards[:, b : b + 1],
            n_values[:, b : b + 1],
            n_boot[b : b + 1],
            state,
            int(tasks[0, b]),
        )
        torch.testing.assert_close(out.vtrace.vs[:, b : b + 1], single.vtrace.vs)
        torch.testing.assert_close(out.pg_advantages[:, b : b + 1], single.pg_advantages)
