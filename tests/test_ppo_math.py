"""PPO math parity: impala.algos.ppo / impala.algos.normalizers / impala.nets.ppo_policy against

1. naive NumPy restatements of docs/PPO.md, written here like the
   equations (float64, tolerance 1e-6);
2. stable-baselines3's installed code where it is pure (RunningMeanStd,
   RolloutBuffer GAE, VecNormalize rewards, explained_variance, one PPO train step);
3. hand-computed cases and invariants.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from impala.algos import ppo
from impala.algos.normalizers import (
    RewardNormalizer,
    RunningMeanStd,
    mlagents_normalizer_apply,
    mlagents_normalizer_init,
    mlagents_normalizer_update,
    vecnormalize_obs,
)
from impala.nets.ppo_policy import ActorCritic, env_action
from sb3_reference import assert_same_step, fill_rollout_buffer, sb3_layer_names, sb3_weights_for_us

TOL = 1e-6
RNG = np.random.default_rng(1234)


def t64(x):
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


# ------------------------------------------------------------------ references


def ref_mlagents_gae(r, v, v_next, gamma, lambd):
    T = len(r)
    v_ext = list(v) + [v_next]
    delta = [r[t] + gamma * v_ext[t + 1] - v_ext[t] for t in range(T)]
    adv = [0.0] * T
    running = 0.0
    for t in reversed(range(T)):
        running = delta[t] + gamma * lambd * running
        adv[t] = running
    adv = np.array(adv)
    return adv, adv + np.array(v)


def ref_sb3_gae(r, v, starts, last_v, last_done, gamma, lam):
    T, B = r.shape
    adv = np.zeros((T, B))
    for b in range(B):
        gae = 0.0
        for t in reversed(range(T)):
            if t == T - 1:
                nonterm, v_next = 1.0 - float(last_done[b]), last_v[b]
            else:
                nonterm, v_next = 1.0 - float(starts[t + 1, b]), v[t + 1, b]
            delta = r[t, b] + gamma * v_next * nonterm - v[t, b]
            gae = delta + gamma * lam * nonterm * gae
            adv[t, b] = gae
    return adv, adv + v


def ref_log_prob_mlagents(x, mu, log_sigma):
    s = np.exp(log_sigma)
    return -((x - mu) ** 2) / (2 * s**2 + 1e-7) - np.log(s + 1e-7) - np.log(np.sqrt(2 * np.pi))


def ref_entropy_mlagents(log_sigma):
    return 0.5 * np.log(2 * np.pi * np.e * np.exp(log_sigma) ** 2 + 1e-7)


def ref_log_prob_normal(x, mu, log_sigma):
    s = np.exp(log_sigma)
    return -((x - mu) ** 2) / (2 * s**2) - np.log(s) - 0.5 * np.log(2 * np.pi)


def ref_entropy_normal(log_sigma):
    return 0.5 + 0.5 * np.log(2 * np.pi) + log_sigma


def ref_policy_loss(logp, logp_old, adv, eps, per_dim):
    if per_dim:
        r = np.exp(logp - logp_old)
        a = adv[:, None] * np.ones_like(r)
    else:
        r = np.exp(logp.sum(1) - logp_old.sum(1))
        a = adv
    vals = np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
    return -vals.mean(), r


# ------------------------------------------------------------------------- GAE


def test_mlagents_gae_hand_case():
    out = ppo.mlagents_gae(t64([1.0, 2.0]), t64([0.5, 1.0]), 2.0, gamma=0.5, lambd=0.5)
    # delta_1 = 2 + 0.5*2 - 1 = 2; delta_0 = 1 + 0.5*1 - 0.5 = 1; A_0 = 1 + 0.25*2.
    np.testing.assert_allclose(out.advantages.numpy(), [1.5, 2.0], atol=TOL)
    np.testing.assert_allclose(out.returns.numpy(), [2.0, 3.0], atol=TOL)


@pytest.mark.parametrize("T", [1, 7, 50])
@pytest.mark.parametrize("v_next", [0.0, 1.7])
def test_mlagents_gae_matches_reference(T, v_next):
    r, v = RNG.normal(size=T), RNG.normal(size=T)
    out = ppo.mlagents_gae(t64(r), t64(v), v_next, gamma=0.995, lambd=0.95)
    adv, ret = ref_mlagents_gae(r, v, v_next, 0.995, 0.95)
    np.testing.assert_allclose(out.advantages.numpy(), adv, atol=TOL)
    np.testing.assert_allclose(out.returns.numpy(), ret, atol=TOL)


def test_mlagents_gae_lambda1_is_discounted_return():
    r, v = RNG.normal(size=20), RNG.normal(size=20)
    out = ppo.mlagents_gae(t64(r), t64(v), 0.3, gamma=0.9, lambd=1.0)
    disc = ppo.discount_cumsum(t64(r), discount=0.9, bootstrap=0.3)
    np.testing.assert_allclose(out.returns.numpy(), disc.numpy(), atol=TOL)


@pytest.mark.parametrize("B", [1, 3])
def test_sb3_gae_matches_reference(B):
    T = 40
    r, v = RNG.normal(size=(T, B)), RNG.normal(size=(T, B))
    starts = RNG.random((T, B)) < 0.1
    last_v, last_done = RNG.normal(size=B), RNG.random(B) < 0.5
    out = ppo.sb3_gae(
        t64(r),
        t64(v),
        torch.as_tensor(starts),
        t64(last_v),
        torch.as_tensor(last_done),
        gamma=0.99,
        gae_lambda=0.9,
    )
    adv, ret = ref_sb3_gae(r, v, starts, last_v, last_done, 0.99, 0.9)
    np.testing.assert_allclose(out.advantages.numpy(), adv, atol=TOL)
    np.testing.assert_allclose(out.returns.numpy(), ret, atol=TOL)


def test_sb3_gae_matches_installed_rollout_buffer():
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer

    T, B = 32, 2
    buf = RolloutBuffer(
        T,
        spaces.Box(-1, 1, (3,)),
        spaces.Box(-1, 1, (1,)),
        device="cpu",
        gamma=0.97,
        gae_lambda=0.9,
        n_envs=B,
    )
    r = RNG.normal(size=(T, B)).astype(np.float32)
    v = RNG.normal(size=(T, B)).astype(np.float32)
    starts = (RNG.random((T, B)) < 0.15).astype(np.float32)
    buf.rewards[:], buf.values[:], buf.episode_starts[:] = r, v, starts
    last_v = RNG.normal(size=B).astype(np.float32)
    dones = np.array([True, False])
    buf.compute_returns_and_advantage(torch.as_tensor(last_v), dones)
    out = ppo.sb3_gae(
        t64(r), t64(v), t64(starts).bool(), t64(last_v), torch.as_tensor(dones), gamma=0.97, gae_lambda=0.9
    )
    np.testing.assert_allclose(out.advantages.numpy(), buf.advantages, atol=1e-5)
    np.testing.assert_allclose(out.returns.numpy(), buf.returns, atol=1e-5)


def test_truncation_bootstrap_forms_agree():
    """Invariant: ML-Agents' value_next bootstrap == SB3's r += gamma V(terminal) with done set."""
    T, gamma, lam, v_term = 12, 0.99, 0.95, 2.5
    r, v = RNG.normal(size=T), RNG.normal(size=T)
    ml = ppo.mlagents_gae(t64(r), t64(v), v_term, gamma=gamma, lambd=lam)
    trunc = torch.zeros(T, dtype=torch.bool)
    trunc[-1] = True
    r_b = ppo.sb3_bootstrap_truncated(
        t64(r), trunc, torch.full((T,), v_term, dtype=torch.float64), gamma=gamma
    )
    np.testing.assert_allclose(r_b.numpy()[:-1], r[:-1], atol=TOL)
    np.testing.assert_allclose(r_b.numpy()[-1], r[-1] + gamma * v_term, atol=TOL)
    sb = ppo.sb3_gae(
        r_b[:, None],
        t64(v)[:, None],
        torch.zeros(T, 1, dtype=torch.bool),
        t64([123.0]),
        torch.tensor([True]),
        gamma=gamma,
        gae_lambda=lam,
    )
    np.testing.assert_allclose(sb.advantages[:, 0].numpy(), ml.advantages.numpy(), atol=TOL)


def test_gae_split_at_episode_boundary_changes_nothing():
    """Invariant: SB3 masks at an episode start == two independent ML-Agents segments."""
    r, v = RNG.normal(size=10), RNG.normal(size=10)
    starts = np.zeros(10, bool)
    starts[4] = True  # step 3 terminated
    sb = ppo.sb3_gae(
        t64(r)[:, None],
        t64(v)[:, None],
        torch.as_tensor(starts)[:, None],
        t64([0.7]),
        torch.tensor([False]),
        gamma=0.9,
        gae_lambda=0.8,
    )
    a1 = ppo.mlagents_gae(t64(r[:4]), t64(v[:4]), 0.0, gamma=0.9, lambd=0.8).advantages
    a2 = ppo.mlagents_gae(t64(r[4:]), t64(v[4:]), 0.7, gamma=0.9, lambd=0.8).advantages
    np.testing.assert_allclose(sb.advantages[:, 0].numpy(), np.concatenate([a1, a2]), atol=TOL)


# --------------------------------------------------------- advantage normalization


def test_advantage_normalization_forms():
    a = RNG.normal(2.0, 3.0, size=33)
    np.testing.assert_allclose(
        ppo.normalize_advantages_mlagents(t64(a)).numpy(), (a - a.mean()) / (a.std() + 1e-10), atol=TOL
    )
    np.testing.assert_allclose(
        ppo.normalize_advantages_sb3(t64(a)).numpy(), (a - a.mean()) / (a.std(ddof=1) + 1e-8), atol=TOL
    )
    # SB3 leaves a 1-sample minibatch alone.
    np.testing.assert_allclose(ppo.normalize_advantages_sb3(t64([3.5])).numpy(), [3.5])
    # The two forms differ by the population/unbiased std.
    assert not np.allclose(
        ppo.normalize_advantages_mlagents(t64(a)).numpy(), ppo.normalize_advantages_sb3(t64(a)).numpy()
    )


# ------------------------------------------------------------------- Gaussians


def test_gaussian_log_prob_and_entropy_both_forms():
    B, A = 16, 5
    x, mu = RNG.normal(size=(B, A)), RNG.normal(size=(B, A))
    ls = RNG.normal(scale=0.5, size=A)
    np.testing.assert_allclose(
        ppo.gaussian_log_prob_mlagents(t64(x), t64(mu), t64(ls)).numpy(),
        ref_log_prob_mlagents(x, mu, ls),
        atol=TOL,
    )
    np.testing.assert_allclose(
        ppo.gaussian_log_prob_exact(t64(x), t64(mu), t64(ls)).numpy(),
        ref_log_prob_normal(x, mu, ls),
        atol=TOL,
    )
    np.testing.assert_allclose(
        ppo.gaussian_entropy_mlagents(t64(ls)).numpy(), ref_entropy_mlagents(ls), atol=TOL
    )
    np.testing.assert_allclose(ppo.gaussian_entropy_exact(t64(ls)).numpy(), ref_entropy_normal(ls), atol=TOL)
    # The ML-Agents padding matters for small sigma only.
    tiny = t64([-8.0])
    assert abs(float(ppo.gaussian_entropy_mlagents(tiny)) - float(ppo.gaussian_entropy_exact(tiny))) > 1e-3


def test_policy_act_and_evaluate_agree():
    for form in ("mlagents", "exact"):
        pol = ActorCritic(4, 3, hidden_units=16, num_layers=2, log_prob_form=form, seed=0).double()
        obs = t64(RNG.normal(size=(6, 4)))
        out = pol.act(obs, generator=torch.Generator().manual_seed(0))
        ev = pol.evaluate(obs, out.action)
        np.testing.assert_allclose(out.log_prob.numpy(), ev.log_prob.detach().numpy(), atol=TOL)
        np.testing.assert_allclose(out.value.numpy(), ev.value.detach().numpy(), atol=TOL)
        assert out.log_prob.shape == (6, 3) and ev.entropy.shape == (6, 3) and out.value.shape == (6,)


def test_env_action_forms():
    a = np.array([[-5.0, -1.5, 0.3, 2.9, 7.0]])
    np.testing.assert_allclose(env_action(a, mode="mlagents"), np.clip(a, -3, 3) / 3)
    np.testing.assert_allclose(env_action(a, mode="bounds", low=-2.0, high=2.0), np.clip(a, -2, 2))
    np.testing.assert_allclose(env_action(torch.tensor(a), mode="mlagents").numpy(), np.clip(a, -3, 3) / 3)


# ----------------------------------------------------------------------- losses


@pytest.mark.parametrize("per_dim", [True, False])
def test_policy_loss_matches_reference_both_sides_of_clip(per_dim):
    B, A, eps = 64, 4, 0.2
    logp_old = RNG.normal(size=(B, A))
    logp = logp_old + RNG.uniform(-0.6, 0.6, size=(B, A))  # ratios well inside and outside 1 +- eps
    adv = RNG.normal(size=B)
    out = ppo.clipped_policy_loss(t64(logp), t64(logp_old), t64(adv), epsilon=eps, per_dim=per_dim)
    ref, r = ref_policy_loss(logp, logp_old, adv, eps, per_dim)
    assert out.ratio.shape == ((B, A) if per_dim else (B,))
    assert (r < 1 - eps).any() and (r > 1 + eps).any() and (np.abs(r - 1) < eps).any()
    np.testing.assert_allclose(float(out.loss), ref, atol=TOL)
    np.testing.assert_allclose(float(out.clip_fraction), np.mean(np.abs(r - 1) > eps), atol=TOL)
    np.testing.assert_allclose(float(out.approx_kl), np.mean((r - 1) - np.log(r)), atol=TOL)


def test_policy_loss_per_dim_differs_from_summed():
    logp_old = RNG.normal(size=(8, 3))
    logp = logp_old + RNG.uniform(-0.5, 0.5, size=(8, 3))
    adv = RNG.normal(size=8)
    a = ppo.clipped_policy_loss(t64(logp), t64(logp_old), t64(adv), epsilon=0.2, per_dim=True).loss
    b = ppo.clipped_policy_loss(t64(logp), t64(logp_old), t64(adv), epsilon=0.2, per_dim=False).loss
    assert abs(float(a) - float(b)) > 1e-3


@pytest.mark.parametrize("per_dim", [True, False])
def test_policy_loss_gradient(per_dim):
    logp_old = t64(RNG.normal(size=(5, 2)))
    logp = (logp_old + t64(RNG.uniform(-0.4, 0.4, size=(5, 2)))).requires_grad_(True)
    adv = t64(RNG.normal(size=5))
    assert torch.autograd.gradcheck(
        lambda lp: ppo.clipped_policy_loss(lp, logp_old, adv, epsilon=0.2, per_dim=per_dim).loss, (logp,)
    )
    # Unclipped region: d/dlogp of -mean(r*A) is -r*A/N.
    lp = logp_old.clone().requires_grad_(True)
    ppo.clipped_policy_loss(lp, logp_old, adv, epsilon=0.2, per_dim=per_dim).loss.backward()
    expect = -(adv[:, None] * torch.ones(5, 2)) / (10 if per_dim else 5)
    np.testing.assert_allclose(lp.grad.numpy(), expect.numpy(), atol=TOL)


def test_value_losses_match_reference():
    B, eps = 50, 0.2
    v_old, R = RNG.normal(size=B), RNG.normal(size=B)
    v = v_old + RNG.uniform(-0.6, 0.6, size=B)  # both sides of the clip
    vc = v_old + np.clip(v - v_old, -eps, eps)
    np.testing.assert_allclose(
        float(ppo.value_loss_mlagents_intended(t64(v), t64(v_old), t64(R), epsilon=eps)),
        np.mean(np.maximum((R - v) ** 2, (R - vc) ** 2)),
        atol=TOL,
    )
    # As ML-Agents 0.28 runs it (#6281): the clip is centred on the returns.
    vr = R + np.clip(v - R, -eps, eps)
    np.testing.assert_allclose(
        float(ppo.value_loss_mlagents_as_run(t64(v), t64(R), epsilon=eps)),
        np.mean(np.maximum((R - v) ** 2, (R - vr) ** 2)),
        atol=TOL,
    )
    np.testing.assert_allclose(float(ppo.value_loss_mse(t64(v), t64(R))), np.mean((R - v) ** 2), atol=TOL)
    np.testing.assert_allclose(
        float(ppo.value_loss_sb3_clipped(t64(v), t64(v_old), t64(R), clip_range_vf=eps)),
        np.mean((R - vc) ** 2),
        atol=TOL,
    )


@pytest.mark.parametrize("eps", [0.05, 0.2, 10.0])
def test_mlagents_value_loss_as_run_is_unclipped_mse(eps):
    """Clipping around the returns never binds: the as-run loss is mse(R, V) in value and gradient,
    while the intended clip around V_old differs wherever |V - V_old| > eps and the clipped side is larger."""
    B = 64
    v_old, R = RNG.normal(size=B), RNG.normal(size=B)
    v0 = v_old + RNG.uniform(-1.0, 1.0, size=B)
    grads = {}
    for name, fn in {
        "as_run": lambda v: ppo.value_loss_mlagents_as_run(v, t64(R), epsilon=eps),
        "mse": lambda v: ppo.value_loss_mse(v, t64(R)),
        "intended": lambda v: ppo.value_loss_mlagents_intended(v, t64(v_old), t64(R), epsilon=eps),
    }.items():
        v = t64(v0).requires_grad_(True)
        loss = fn(v)
        loss.backward()
        grads[name] = (float(loss.detach()), v.grad.numpy().copy())
    assert grads["as_run"][0] == pytest.approx(grads["mse"][0], rel=1e-12)
    np.testing.assert_allclose(grads["as_run"][1], grads["mse"][1], rtol=1e-12, atol=1e-15)
    vc = v_old + np.clip(v0 - v_old, -eps, eps)
    if np.any((R - vc) ** 2 > (R - v0) ** 2):
        assert grads["intended"][0] > grads["mse"][0]


def test_entropy_reduce_and_totals():
    H = RNG.normal(size=(7, 3))
    mean_h = float(ppo.reduce_entropy(t64(H), over_dims="mean"))
    sum_h = float(ppo.reduce_entropy(t64(H), over_dims="sum"))
    np.testing.assert_allclose(mean_h, H.mean(1).mean(), atol=TOL)
    np.testing.assert_allclose(sum_h, H.sum(1).mean(), atol=TOL)
    pl, vl = t64(0.3), t64(1.7)
    ml = ppo.total_loss_mlagents(pl, vl, t64(mean_h), beta=0.005)
    np.testing.assert_allclose(float(ml.loss), 0.3 + 0.5 * 1.7 - 0.005 * mean_h, atol=TOL)
    sb = ppo.total_loss_sb3(pl, vl, t64(sum_h), ent_coef=0.01, vf_coef=0.5)
    np.testing.assert_allclose(float(sb.loss), 0.3 + 0.01 * (-sum_h) + 0.5 * 1.7, atol=TOL)


# ------------------------------------------------------------------- schedules


def test_schedules():
    def ref_poly(init, floor, step, max_step):
        return (init - floor) * (1 - min(step, max_step) / max_step) + floor

    for step in (0, 1, 2_500_000, 9_999_999, 10_000_000, 20_000_000):
        for init, floor in (
            (3e-4, ppo.MLAGENTS_LR_FLOOR),
            (0.2, ppo.MLAGENTS_EPSILON_FLOOR),
            (0.005, ppo.MLAGENTS_BETA_FLOOR),
        ):
            assert (
                abs(
                    ppo.polynomial_decay(init, floor, step, 10_000_000)
                    - ref_poly(init, floor, step, 10_000_000)
                )
                < 1e-12
            )
            assert ppo.scheduled_value("constant", init, floor, step, 10_000_000) == init
    assert ppo.polynomial_decay(0.2, 0.1, 10**9, 10**7) == pytest.approx(0.1)
    # SB3: progress_remaining; floor 0 linear == init * progress.
    for step in (0, 300, 1000):
        prog = ppo.progress_remaining(step, 1000)
        assert prog == pytest.approx(1 - step / 1000)
        assert ppo.scheduled_value("linear", 1e-3, 0.0, step, 1000) == pytest.approx(
            ppo.sb3_linear_schedule(1e-3, prog)
        )


# ------------------------------------------------------------------ diagnostics


def test_explained_variance_matches_sb3():
    from stable_baselines3.common.utils import explained_variance as sb3_ev

    y, p = RNG.normal(size=100), RNG.normal(size=100)
    assert ppo.explained_variance(t64(p), t64(y)) == pytest.approx(float(sb3_ev(p, y)), abs=TOL)
    assert math.isnan(ppo.explained_variance(t64(p), t64(np.ones(100))))


# ------------------------------------------------------------------ normalizers


def test_mlagents_normalizer_matches_reference():
    D = 6
    state = mlagents_normalizer_init(D, torch.float64)
    steps, mean, m2 = 1.0, np.zeros(D), np.ones(D)
    for n in (1, 5, 40, 3):
        x = RNG.normal(1.5, 2.0, size=(n, D))
        state = mlagents_normalizer_update(state, t64(x))
        steps_new = steps + n
        mean_new = mean + np.sum(x - mean, axis=0) / steps_new
        m2 = m2 + np.sum((x - mean_new) * (x - mean), axis=0)
        steps, mean = steps_new, mean_new
        np.testing.assert_allclose(float(state.steps), steps, atol=TOL)
        np.testing.assert_allclose(state.mean.numpy(), mean, atol=TOL)
        np.testing.assert_allclose(state.m2.numpy(), m2, atol=TOL)
    x = RNG.normal(0, 30.0, size=(10, D))
    out = mlagents_normalizer_apply(state, t64(x)).numpy()
    np.testing.assert_allclose(out, np.clip((x - mean) / np.sqrt(m2 / steps), -5, 5), atol=TOL)
    assert (np.abs(out) == 5).any()


def test_running_mean_std_matches_sb3():
    from stable_baselines3.common.running_mean_std import RunningMeanStd as SB3RMS

    ours, theirs = RunningMeanStd(shape=(4,)), SB3RMS(shape=(4,))
    for n in (1, 7, 100, 2):
        x = RNG.normal(3.0, 5.0, size=(n, 4))
        ours.update(x)
        theirs.update(x)
    np.testing.assert_allclose(ours.mean, theirs.mean, atol=TOL)
    np.testing.assert_allclose(ours.var, theirs.var, atol=TOL)
    assert ours.count == pytest.approx(theirs.count)
    x = RNG.normal(3.0, 50.0, size=(5, 4))
    np.testing.assert_allclose(
        vecnormalize_obs(x, ours.mean, ours.var),
        np.clip((x - theirs.mean) / np.sqrt(theirs.var + 1e-8), -10, 10),
        atol=TOL,
    )


def test_reward_normalizer_matches_vecnormalize():
    import gymnasium as gym
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    K, T, gamma = 2, 60, 0.9
    rewards = RNG.normal(1.0, 3.0, size=(T, K))
    dones = RNG.random((T, K)) < 0.1

    class Scripted(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,))
        action_space = gym.spaces.Box(-1, 1, (1,))

        def __init__(self, k):
            self.k, self.t = k, 0

        def reset(self, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            r, d = float(rewards[self.t, self.k]), bool(dones[self.t, self.k])
            self.t += 1
            return np.zeros(1, np.float32), r, d, False, {}

    venv = VecNormalize(
        DummyVecEnv([lambda k=k: Scripted(k) for k in range(K)]),
        norm_obs=False,
        norm_reward=True,
        gamma=gamma,
    )
    venv.reset()
    ours = RewardNormalizer(gamma)
    for t in range(T):
        _, r_sb3, _, _ = venv.step(np.zeros((K, 1), np.float32))
        r_ours = ours.step(rewards[t], dones[t], list(range(K)))
        np.testing.assert_allclose(r_ours, r_sb3, atol=1e-6)

    # One stream, piece at a time == K=1 steps.
    a, b = RewardNormalizer(gamma), RewardNormalizer(gamma)
    piece = a.normalize_piece(rewards[:, 0], dones[:, 0], "s")
    steps = np.concatenate([b.step(rewards[t : t + 1, 0], dones[t : t + 1, 0], ["s"]) for t in range(T)])
    np.testing.assert_allclose(piece, steps, atol=TOL)


# ---------------------------------------------------------------- initialization


def _linears(seq):
    return [m for m in seq if isinstance(m, torch.nn.Linear)]


@torch.no_grad()
def test_mlagents_init_statistics():
    torch.manual_seed(0)
    pol = ActorCritic(256, 64, hidden_units=512, num_layers=3, activation="swish", init="mlagents", seed=3)
    for body in (pol.actor_body, pol.critic_body):
        lins = _linears(body)
        assert [tuple(l.weight.shape) for l in lins] == [(512, 256), (512, 512), (512, 512)]
        assert all(isinstance(m, torch.nn.SiLU) for m in body if not isinstance(m, torch.nn.Linear))
        for l in lins:
            fan_in = l.weight.shape[1]
            assert float(l.weight.std()) == pytest.approx(1.0 / math.sqrt(fan_in), rel=0.02)
            assert abs(float(l.weight.mean())) < 3e-3
            assert torch.all(l.bias == 0)
    assert float(pol.mu_head.weight.std()) == pytest.approx(0.2 / math.sqrt(512), rel=0.03)
    bound = math.sqrt(6.0 / (512 + 1))
    w = pol.value_head.weight
    assert float(w.abs().max()) <= bound
    assert float(w.var()) == pytest.approx(bound**2 / 3, rel=0.2)
    assert torch.all(pol.mu_head.bias == 0) and torch.all(pol.value_head.bias == 0)
    assert torch.all(pol.log_sigma == 0)
    # Separate normalizer copies in actor and critic.
    assert pol.actor_norm is not pol.critic_norm


@torch.no_grad()
def test_sb3_init_singular_values():
    pol = ActorCritic(17, 6, hidden_units=64, num_layers=2, activation="tanh", init="sb3", seed=5)
    for body in (pol.actor_body, pol.critic_body):
        assert all(isinstance(m, torch.nn.Tanh) for m in body if not isinstance(m, torch.nn.Linear))
        for l in _linears(body):
            s = torch.linalg.svdvals(l.weight.double())
            np.testing.assert_allclose(s.numpy(), math.sqrt(2.0), atol=1e-5)
            assert torch.all(l.bias == 0)
    np.testing.assert_allclose(torch.linalg.svdvals(pol.mu_head.weight.double()).numpy(), 0.01, atol=1e-7)
    np.testing.assert_allclose(torch.linalg.svdvals(pol.value_head.weight.double()).numpy(), 1.0, atol=1e-6)
    assert torch.all(pol.log_sigma == 0)


def test_activation_and_init_are_independent():
    pol = ActorCritic(3, 1, hidden_units=8, num_layers=2, activation="relu", init="sb3", seed=0)
    assert any(isinstance(m, torch.nn.ReLU) for m in pol.actor_body)
    pol = ActorCritic(3, 1, hidden_units=8, num_layers=1, activation="tanh", init="mlagents", seed=0)
    assert len(_linears(pol.actor_body)) == 1


# ----------------------------------------------------- SB3 PPO train step parity


def test_one_update_matches_sb3_train_step():
    """Our learner's sb3 preset and SB3's PPO.train() take the same Adam step on the same data."""
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import configure

    from impala.run.ppo_config import PPOConfig
    from learner.ppo_learner import PPOLearner

    N = 16
    env = gym.make("Pendulum-v1")
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=N,
        batch_size=N,
        n_epochs=1,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        learning_rate=3e-4,
        clip_range=0.2,
        gamma=0.9,
        gae_lambda=0.95,
        seed=0,
        device="cpu",
    )
    model.set_logger(configure(None, []))
    cfg = PPOConfig.preset(
        "sb3",
        buffer_size=N,
        batch_size=N,
        num_epoch=1,
        beta=0.01,
        obs_norm="none",
        reward_norm=False,
        time_horizon=N,
        gamma=0.9,
    )
    learner = PPOLearner(cfg, 3, 1, env.action_space.low, env.action_space.high)
    sd = model.policy.state_dict()
    mapping = sb3_layer_names("mu_head")
    ours = sb3_weights_for_us(sd, mapping)
    ours["log_sigma"] = sd["log_std"].clone()
    learner.policy.load_state_dict(ours)

    obs = RNG.normal(size=(N, 3)).astype(np.float32)
    with torch.no_grad():
        out = learner.policy.act(torch.as_tensor(obs), generator=torch.Generator().manual_seed(1))
        sb_actions, sb_values, sb_logp = model.policy.forward(torch.as_tensor(obs))
        _, sb_logp_eval, _ = model.policy.evaluate_actions(torch.as_tensor(obs), out.action)
    np.testing.assert_allclose(out.log_prob.sum(-1).numpy(), sb_logp_eval.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.value.numpy(), sb_values.flatten().numpy(), atol=1e-5)
    rewards = RNG.normal(size=N).astype(np.float32)
    starts = np.zeros(N, np.float32)
    starts[0] = 1.0
    starts[9] = 1.0
    buf = model.rollout_buffer
    fill_rollout_buffer(buf, obs, out.action.numpy(), rewards, starts, out)
    last_v = torch.tensor([0.4])
    buf.compute_returns_and_advantage(last_v, np.array([False]))
    # Feed our buffer the same processed data (one piece, T = N, B = 1).
    learner.buffer.add(
        obs=torch.as_tensor(obs),
        actions=out.action.float(),
        log_probs=out.log_prob.float(),
        advantages=torch.as_tensor(buf.advantages[:, 0]),
        returns=torch.as_tensor(buf.returns[:, 0]),
        values=out.value.float(),
    )
    model.train()
    metrics = learner.update()
    assert_same_step(learner, model, mapping, metrics)
    np.testing.assert_allclose(
        learner.policy.log_sigma.detach().numpy(), model.policy.state_dict()["log_std"].numpy(), atol=1e-6
    )
    assert metrics["value_loss"] == pytest.approx(model.logger.name_to_value["train/value_loss"], abs=1e-4)
