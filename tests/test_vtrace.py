"""V-trace checked three ways: a naive NumPy sum written like eq. (1) of Espeholt et al.
2018, hand-computed cases, and invariants."""

import numpy as np
import pytest
import torch

from impala.algos import vtrace


def naive_vtrace(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho=1.0, clip_pg_rho=1.0):
    """Eq. (1) as a double sum, element by element, in float64. Independent of the
    recursion in the implementation on purpose."""
    log_rhos, discounts, rewards, values = (
        np.asarray(a, np.float64) for a in (log_rhos, discounts, rewards, values)
    )
    bootstrap_value = np.asarray(bootstrap_value, np.float64)
    T = values.shape[0]
    rhos = np.exp(log_rhos)
    vs = np.zeros_like(values)
    pg = np.zeros_like(values)
    for idx in np.ndindex(values.shape[1:]):
        v = [values[(t,) + idx] for t in range(T)] + [bootstrap_value[idx]]
        rho = [rhos[(t,) + idx] for t in range(T)]
        g = [discounts[(t,) + idx] for t in range(T)]
        r = [rewards[(t,) + idx] for t in range(T)]
        for s in range(T):
            total = v[s]
            for t in range(s, T):
                # gamma^{t-s} with per-step discounts, times prod_{i=s}^{t-1} c_i
                coef = 1.0
                for i in range(s, t):
                    coef *= g[i] * min(1.0, rho[i])
                rho_t = rho[t] if clip_rho is None else min(clip_rho, rho[t])
                delta = rho_t * (r[t] + g[t] * v[t + 1] - v[t])
                total += coef * delta
            vs[(s,) + idx] = total
        for s in range(T):
            v_next = vs[(s + 1,) + idx] if s + 1 < T else bootstrap_value[idx]
            rho_pg = rho[s] if clip_pg_rho is None else min(clip_pg_rho, rho[s])
            pg[(s,) + idx] = rho_pg * (r[s] + g[s] * v_next - v[s])
    return vs, pg


def random_inputs(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = shape[0]
    # log_rhos in [-2.5, 2.5] so rho ranges over ~[0.08, 12]: both sides of 1 (c and rho_bar)
    # and of the pg clip used below.
    log_rhos = torch.rand(shape, generator=g, dtype=dtype) * 5 - 2.5
    log_rhos.view(-1)[0], log_rhos.view(-1)[-1] = 2.4, -2.4  # always both sides of every clip
    discounts = torch.full(shape, 0.9, dtype=dtype)
    discounts[torch.rand(shape, generator=g) < 0.1] = 0.0  # episode ends inside the unroll
    rewards = torch.randn(shape, generator=g, dtype=dtype)
    values = torch.randn(shape, generator=g, dtype=dtype)
    bootstrap = torch.randn(shape[1:], generator=g, dtype=dtype)
    assert T >= 1
    return log_rhos, discounts, rewards, values, bootstrap


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b) / (np.abs(b) + 1e-8))


@pytest.mark.parametrize(
    "shape,clip_rho,clip_pg",
    [
        ((7, 5), 1.0, 1.0),
        ((7, 1), 1.0, 1.0),  # B = 1
        ((6, 3, 2, 2), 1.0, 1.0),  # extra trailing dims
        ((6, 4), 3.7, 2.2),  # rho on both sides of non-unit clips
        ((6, 4), None, None),
        ((6, 4), None, 1.0),
        ((1, 3), 1.0, 1.0),  # T = 1
    ],
)
def test_matches_naive_sum(shape, clip_rho, clip_pg):
    inputs = random_inputs(shape, seed=hash(shape) % 1000)
    rhos = inputs[0].exp()
    assert (rhos < 1).any() and (rhos > 3.7).any()
    got = vtrace.from_importance_weights(*inputs, clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg)
    vs, pg = naive_vtrace(*(x.numpy() for x in inputs), clip_rho=clip_rho, clip_pg_rho=clip_pg)
    assert got.vs.shape == shape and got.pg_advantages.shape == shape
    assert rel_err(got.vs.numpy(), vs) <= 1e-5
    assert rel_err(got.pg_advantages.numpy(), pg) <= 1e-5


def test_float32_close_to_float64_reference():
    inputs = random_inputs((20, 8), seed=3)
    got = vtrace.from_importance_weights(*(x.float() for x in inputs))
    vs, pg = naive_vtrace(*(x.numpy() for x in inputs))
    assert got.vs.dtype == torch.float32
    np.testing.assert_allclose(got.vs.numpy(), vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got.pg_advantages.numpy(), pg, rtol=1e-4, atol=1e-4)


def test_hand_computed_two_steps():
    # T=2, B=1, gamma=0.5, rho_0 = 2 (clipped to 1, c_0 = 1), rho_1 = 0.5 (unclipped).
    log_rhos = torch.log(torch.tensor([[2.0], [0.5]], dtype=torch.float64))
    discounts = torch.full((2, 1), 0.5, dtype=torch.float64)
    rewards = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    values = torch.tensor([[3.0], [4.0]], dtype=torch.float64)
    bootstrap = torch.tensor([10.0], dtype=torch.float64)
    out = vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap)
    # delta_1 = 0.5 * (2 + 0.5*10 - 4) = 1.5         -> v_1 = 4 + 1.5 = 5.5
    # delta_0 = 1.0 * (1 + 0.5*4 - 3) = 0            -> v_0 = 3 + 0 + 0.5*1*1.5 = 3.75
    # pg_0 = min(1, 2) * (1 + 0.5*5.5 - 3) = 0.75;  pg_1 = 0.5 * (2 + 0.5*10 - 4) = 1.5
    torch.testing.assert_close(out.vs, torch.tensor([[3.75], [5.5]], dtype=torch.float64))
    torch.testing.assert_close(out.pg_advantages, torch.tensor([[0.75], [1.5]], dtype=torch.float64))


def test_on_policy_equals_discounted_return_with_bootstrap():
    T, B = 9, 4
    _, discounts, rewards, values, bootstrap = random_inputs((T, B), seed=5)
    out = vtrace.from_importance_weights(
        torch.zeros(T, B, dtype=torch.float64),
        discounts,
        rewards,
        values,
        bootstrap,
        clip_rho_threshold=None,
        clip_pg_rho_threshold=None,
    )
    # rho = c = 1: v_s is the (T-s)-step return bootstrapped from V(x_T); values cancel.
    expected = torch.empty(T, B, dtype=torch.float64)
    ret = bootstrap.clone()
    for t in reversed(range(T)):
        ret = rewards[t] + discounts[t] * ret
        expected[t] = ret
    torch.testing.assert_close(out.vs, expected)
    next_vs = torch.cat([expected[1:], bootstrap[None]])
    torch.testing.assert_close(out.pg_advantages, rewards + discounts * next_vs - values)


def test_split_at_episode_boundary_changes_nothing():
    # A zero discount cuts the trace: the part before it must not depend on what follows.
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((8, 3), seed=7)
    discounts[3] = 0.0
    full = vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap)
    head = vtrace.from_importance_weights(log_rhos[:4], discounts[:4], rewards[:4], values[:4], values[4])
    torch.testing.assert_close(full.vs[:4], head.vs)
    torch.testing.assert_close(full.pg_advantages[:4], head.pg_advantages)


def _logits_inputs(T=6, B=4, A=5, trailing=(), seed=11, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    shape = (T, B, *trailing)
    behaviour = torch.randn(*shape, A, generator=g, dtype=torch.float64) * 1.5
    target = (torch.randn(*shape, A, generator=g, dtype=torch.float64) * 1.5).requires_grad_(requires_grad)
    actions = torch.randint(0, A, shape, generator=g)
    discounts = torch.full(shape, 0.95, dtype=torch.float64)
    rewards = torch.randn(shape, generator=g, dtype=torch.float64)
    values = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
    bootstrap = torch.randn(shape[1:], generator=g, dtype=torch.float64).requires_grad_(requires_grad)
    return behaviour, target, actions, discounts, rewards, values, bootstrap


@pytest.mark.parametrize("trailing", [(), (2,)])
def test_from_logits_agrees_with_importance_weights(trailing):
    behaviour, target, actions, discounts, rewards, values, bootstrap = _logits_inputs(trailing=trailing)
    out = vtrace.from_logits(behaviour, target, actions, discounts, rewards, values, bootstrap)
    # log-probs computed independently from softmax probabilities
    p_target = torch.softmax(target, -1).gather(-1, actions[..., None]).squeeze(-1)
    p_behaviour = torch.softmax(behaviour, -1).gather(-1, actions[..., None]).squeeze(-1)
    torch.testing.assert_close(out.target_action_log_probs, p_target.log())
    torch.testing.assert_close(out.behaviour_action_log_probs, p_behaviour.log())
    torch.testing.assert_close(out.log_rhos, (p_target / p_behaviour).log())
    ref = vtrace.from_importance_weights(out.log_rhos, discounts, rewards, values, bootstrap)
    torch.testing.assert_close(out.vs, ref.vs)
    torch.testing.assert_close(out.pg_advantages, ref.pg_advantages)


def test_targets_stop_gradient_but_log_probs_keep_it():
    behaviour, target, actions, discounts, rewards, values, bootstrap = _logits_inputs(requires_grad=True)
    out = vtrace.from_logits(behaviour, target, actions, discounts, rewards, values, bootstrap)
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
    assert out.target_action_log_probs.requires_grad and out.log_rhos.requires_grad
    (out.target_action_log_probs * out.pg_advantages).sum().backward()
    assert target.grad is not None and target.grad.abs().sum() > 0
    assert values.grad is None  # nothing flowed into the critic through the targets

    log_rhos = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    r = vtrace.from_importance_weights(
        log_rhos, discounts[:5, :2], rewards[:5, :2], values[:5, :2], bootstrap[:2]
    )
    assert not r.vs.requires_grad and not r.pg_advantages.requires_grad


def test_action_log_probs_trailing_dims():
    logits = torch.randn(3, 2, 4, 6)
    actions = torch.randint(0, 6, (3, 2, 4))
    out = vtrace.action_log_probs(logits, actions)
    assert out.shape == (3, 2, 4)
    torch.testing.assert_close(
        out,
        torch.log_softmax(logits, -1)[
            torch.arange(3)[:, None, None],
            torch.arange(2)[None, :, None],
            torch.arange(4)[None, None],
            actions,
        ],
    )


def _inputs(discount: float) -> dict[str, torch.Tensor]:
    """Valid inputs of ``from_importance_weights`` for T=5, B=3: zeros, and ``discount`` everywhere."""
    return dict(
        log_rhos=torch.zeros(5, 3),
        discounts=torch.full((5, 3), discount),
        rewards=torch.zeros(5, 3),
        values=torch.zeros(5, 3),
        bootstrap_value=torch.zeros(3),
    )


@pytest.mark.parametrize(
    "arg,bad,message",
    [
        ("rewards", torch.zeros(5, 4), "rewards has shape (5, 4) but values has shape (5, 3)"),
        ("discounts", torch.zeros(5, 3, 1), "discounts has shape (5, 3, 1)"),
        ("log_rhos", torch.zeros(3), "log_rhos has shape (3,)"),
        ("bootstrap_value", torch.zeros(5, 3), "bootstrap_value has shape (5, 3)"),
        ("values", torch.zeros(5), "values must have rank >= 2"),
    ],
)
def test_bad_shapes_name_the_argument(arg, bad, message):
    kwargs = _inputs(discount=0.0)
    kwargs[arg] = bad
    with pytest.raises(ValueError, match=arg) as e:
        vtrace.from_importance_weights(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("arg", ["rewards", "values", "bootstrap_value", "discounts"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_name_the_argument(arg, bad):
    kwargs = _inputs(discount=1.0)
    kwargs[arg] = kwargs[arg].clone()
    kwargs[arg].view(-1)[1] = bad
    with pytest.raises(ValueError, match=f"^{arg} contains NaN or inf"):
        vtrace.from_importance_weights(**kwargs)
    behaviour, target, actions, *_ = _logits_inputs(T=5, B=3)
    kwargs = {k: v.double() for k, v in kwargs.items() if k != "log_rhos"}
    with pytest.raises(ValueError, match=f"^{arg} contains NaN or inf"):
        vtrace.from_logits(behaviour, target, actions, **kwargs)


def test_from_logits_bad_inputs():
    behaviour, target, actions, discounts, rewards, values, bootstrap = _logits_inputs(T=5, B=3, A=4)
    with pytest.raises(ValueError, match="target_policy_logits has shape"):
        vtrace.from_logits(behaviour, target[:, :2], actions, discounts, rewards, values, bootstrap)
    with pytest.raises(ValueError, match="behaviour_policy_logits has shape .* but target_policy_logits"):
        vtrace.from_logits(behaviour[..., :3], target, actions, discounts, rewards, values, bootstrap)
    with pytest.raises(ValueError, match=r"actions must lie in \[0, 4\)"):
        vtrace.from_logits(behaviour, target, actions + 4, discounts, rewards, values, bootstrap)
    with pytest.raises(ValueError, match="actions must be an integer tensor"):
        vtrace.from_logits(behaviour, target, actions.double(), discounts, rewards, values, bootstrap)
    with pytest.raises(ValueError, match="rewards has shape"):
        vtrace.from_logits(behaviour, target, actions, discounts, rewards[:4], values, bootstrap)
    nan_logits = target.detach().clone()
    nan_logits[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="target_policy_logits contains NaN"):
        vtrace.from_logits(behaviour, nan_logits, actions, discounts, rewards, values, bootstrap)
    with pytest.raises(ValueError, match="clip_rho_threshold"):
        vtrace.from_logits(
            behaviour, target, actions, discounts, rewards, values, bootstrap, clip_rho_threshold=0.0
        )


def test_lambda_on_policy_equals_gae_and_lambda_returns():
    """With rho = 1, V-trace(lambda) is GAE(lambda) (Schulman et al. 2016): A_s = sum_k (gamma lambda)^k
    delta_{s+k},
    and v_s = V(x_s) + A_s... computed here as the forward sum of TD errors, independently of the
    recursion."""
    T, B, lam, gamma = 9, 3, 0.9, 0.97
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    values = torch.randn(T, B, generator=g, dtype=torch.float64)
    bootstrap = torch.randn(B, generator=g, dtype=torch.float64)
    discounts = torch.full((T, B), gamma, dtype=torch.float64)
    discounts[4, 1] = 0.0  # an episode ends inside the unroll
    out = vtrace.from_importance_weights(
        torch.zeros(T, B, dtype=torch.float64), discounts, rewards, values, bootstrap, lambda_=lam
    )
    v_next = torch.cat([values[1:], bootstrap[None]])
    delta = (rewards + discounts * v_next - values).numpy()
    d = discounts.numpy()
    gae = np.zeros((T, B))
    for s in range(T):
        coef = np.ones(B)
        for t in range(s, T):
            gae[s] += coef * delta[t]
            coef = coef * d[t] * lam
    np.testing.assert_allclose(out.vs.numpy(), values.numpy() + gae, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.pg_advantages.numpy(), gae, rtol=1e-10, atol=1e-12)


def test_lambda_off_policy_matches_the_double_sum_with_lambda_traces():
    log_rhos, discounts, rewards, values, bootstrap = random_inputs((6, 4), seed=9)
    lam = 0.8
    got = vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap, lambda_=lam)
    rho = np.exp(log_rhos.numpy())
    d, r, v, b = discounts.numpy(), rewards.numpy(), values.numpy(), bootstrap.numpy()
    T = v.shape[0]
    v_next = np.concatenate([v[1:], b[None]])
    delta = np.minimum(1.0, rho) * (r + d * v_next - v)
    vs = v.copy()
    for s in range(T):
        coef = np.ones_like(b)
        for t in range(s, T):
            vs[s] += coef * delta[t]
            coef = coef * d[t] * lam * np.minimum(1.0, rho[t])
    np.testing.assert_allclose(got.vs.numpy(), vs, rtol=1e-10, atol=1e-12)
    vs_next = np.concatenate([vs[1:], b[None]])
    q = r + d * (lam * vs_next + (1 - lam) * v_next)
    np.testing.assert_allclose(
        got.pg_advantages.numpy(), np.minimum(1.0, rho) * (q - v), rtol=1e-10, atol=1e-12
    )
    with pytest.raises(ValueError, match="lambda_"):
        vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap, lambda_=1.5)
