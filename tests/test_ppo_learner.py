"""PPOLearner: ingestion semantics, update mechanics, rejection of bad data, checkpoints."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from impala import ppo
from impala.ppo_config import PPOConfig
from learner.ppo_learner import PPOLearner, TrajectoryPiece

OBS, ACT = 5, 3


def make_piece(T, rng, policy=None, terminated_at=(), truncated_at=(), source=0, with_values=True):
    obs = rng.normal(size=(T, OBS)).astype(np.float32)
    if policy is not None:
        out = policy.act(torch.as_tensor(obs))
        actions, logp, values = out.action.numpy(), out.log_prob.numpy(), out.value.numpy()
    else:
        actions = rng.normal(size=(T, ACT)).astype(np.float32)
        logp = rng.normal(size=(T, ACT)).astype(np.float32) - 1.0
        values = rng.normal(size=T).astype(np.float32)
    term, trunc = np.zeros(T, bool), np.zeros(T, bool)
    term[list(terminated_at)] = True
    trunc[list(truncated_at)] = True
    next_obs = np.concatenate([obs[1:], rng.normal(size=(1, OBS)).astype(np.float32)])
    ended = term | trunc
    next_obs[ended] = rng.normal(size=(int(ended.sum()), OBS)).astype(np.float32)  # final obs of ended episodes
    return TrajectoryPiece(obs, actions, logp, rng.normal(size=T).astype(np.float32), term, trunc, next_obs,
                           values if with_values else None, source)


def small(semantics, **kw):
    base = dict(batch_size=4, buffer_size=10, num_epoch=2, hidden_units=16, num_layers=2, max_steps=1000)
    base.update(kw)
    return PPOConfig.preset(semantics, **base)


@pytest.mark.parametrize("semantics", ["mlagents", "sb3"])
def test_tiny_update_runs_and_metrics_finite(semantics):
    rng = np.random.default_rng(0)
    learner = PPOLearner(small(semantics), OBS, ACT, -np.ones(ACT), np.ones(ACT))
    before = [p.detach().clone() for p in learner.policy.parameters()]
    while not learner.ready():
        assert learner.ingest(make_piece(4, rng, learner.policy, terminated_at=[3] if rng.random() < 0.5 else []))
    m = learner.update()
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance",
              "learning_rate", "epsilon", "beta"):
        assert k in m and math.isfinite(m[k]), k
    assert learner.buffer.num_steps == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))


def test_update_trigger():
    rng = np.random.default_rng(1)
    ml = PPOLearner(small("mlagents"), OBS, ACT)
    sb = PPOLearner(small("sb3"), OBS, ACT)
    for learner in (ml, sb):
        learner.ingest(make_piece(5, rng))
        learner.ingest(make_piece(5, rng))
    assert not ml.ready()  # ML-Agents: needs MORE than buffer_size
    assert sb.ready()  # SB3: exactly n_steps * n_envs
    ml.ingest(make_piece(1, rng))
    assert ml.ready()


def test_nan_piece_rejected_and_counted():
    rng = np.random.default_rng(2)
    learner = PPOLearner(small("mlagents"), OBS, ACT)
    good = make_piece(6, rng)
    norm_before = learner.policy.actor_norm.steps.clone()
    for field, bad in (("obs", np.nan), ("rewards", np.inf), ("next_obs", -np.inf)):
        arr = getattr(good, field).copy()
        arr.flat[3] = bad
        assert not learner.ingest(good._replace(**{field: arr}))
    assert learner.rejected_batches == 3
    assert learner.buffer.num_steps == 0 and learner.total_steps == 0
    assert torch.equal(learner.policy.actor_norm.steps, norm_before)
    assert learner.ingest(good)
    assert learner.buffer.num_steps == 6


def test_bad_shapes_raise():
    rng = np.random.default_rng(3)
    learner = PPOLearner(small("mlagents"), OBS, ACT)
    p = make_piece(6, rng)
    with pytest.raises(ValueError, match="log_probs"):
        learner.ingest(p._replace(log_probs=p.log_probs.sum(-1)))  # summed instead of per-dim


@pytest.mark.parametrize("remainder, per_epoch", [("drop", 2), ("keep", 3)])
def test_minibatch_remainder(remainder, per_epoch):
    rng = np.random.default_rng(4)
    # 11 steps, batch 4: drop -> 11 // 4 = 2 minibatches, keep -> 3 (the last has 3 steps).
    learner = PPOLearner(small("mlagents", minibatch_remainder=remainder, num_epoch=3), OBS, ACT)
    learner.ingest(make_piece(11, rng))
    assert learner.ready()
    sizes = [s.stop - s.start for s in learner.minibatch_slices(11)]
    assert sizes == ([4, 4] if remainder == "drop" else [4, 4, 3])
    m = learner.update()
    assert m["n_minibatches"] == 3 * per_epoch and m["buffer_steps"] == 11


def test_mlagents_ingest_gae_segments_and_normalizer():
    """Per episode segment (an ML-Agents trajectory): normalizer update, then that segment's values;
    value_next = 0 at termination, V(final obs) at truncation/cut."""
    rng = np.random.default_rng(5)
    cfg = small("mlagents", gamma=0.9, lambd=0.8)
    learner = PPOLearner(cfg, OBS, ACT)
    ref = copy.deepcopy(learner.policy)
    p = make_piece(9, rng, terminated_at=[2], truncated_at=[5])
    learner.ingest(p)
    assert int(learner.policy.actor_norm.steps) == 1 + 9 == int(learner.policy.critic_norm.steps)
    assert learner.policy.actor_norm.steps.dtype == torch.int64
    r = torch.as_tensor(p.rewards, dtype=torch.float64)
    v, expect = [], []
    for a, b, bootstrap in [(0, 3, False), (3, 6, True), (6, 9, True)]:
        ref.update_normalizer(torch.as_tensor(p.obs[a:b]))  # this segment only, before its values
        with torch.no_grad():
            v_seg = ref.value(torch.as_tensor(p.obs[a:b])).double()
            nxt = ref.value(torch.as_tensor(p.next_obs[b - 1 : b])).double()[0] if bootstrap else 0.0
        v.append(v_seg)
        expect.append(ppo.mlagents_gae(r[a:b], v_seg, nxt, gamma=0.9, lambd=0.8).advantages)
    v, expect = torch.cat(v), torch.cat(expect)
    with torch.no_grad():  # one update with the whole piece would have given other values
        assert not torch.allclose(learner.policy.value(torch.as_tensor(p.obs[:3])).double(), v[:3], atol=1e-4)
    got = learner.buffer.stacked()
    np.testing.assert_allclose(got["advantages"].numpy(), expect.numpy(), atol=1e-5)
    np.testing.assert_allclose(got["values"].numpy(), v.numpy(), atol=1e-6)  # not the actor's stored values
    np.testing.assert_allclose(got["obs"].numpy(), p.obs)  # raw obs stored


def test_sb3_and_mlagents_gae_forms_agree_on_same_values():
    rng = np.random.default_rng(6)
    p = make_piece(12, rng, terminated_at=[3], truncated_at=[7], with_values=False)
    common = dict(obs_norm="none", reward_norm=False, gamma=0.95, lambd=0.9, init="sb3", activation="tanh")
    a = PPOLearner(small("mlagents", **common), OBS, ACT)
    b = PPOLearner(small("mlagents", gae_form="sb3", **common), OBS, ACT)
    b.policy.load_state_dict(a.policy.state_dict())
    a.ingest(p)
    b.ingest(p)
    np.testing.assert_allclose(a.buffer.stacked()["advantages"], b.buffer.stacked()["advantages"], atol=1e-5)
    np.testing.assert_allclose(a.buffer.stacked()["returns"], b.buffer.stacked()["returns"], atol=1e-5)


def test_bootstrap_truncated_off_treats_truncation_as_terminal():
    rng = np.random.default_rng(7)
    p = make_piece(6, rng, truncated_at=[5])
    on = PPOLearner(small("mlagents", obs_norm="none"), OBS, ACT)
    off = PPOLearner(small("mlagents", obs_norm="none", bootstrap_truncated=False), OBS, ACT)
    off.policy.load_state_dict(on.policy.state_dict())
    on.ingest(p)
    off.ingest(p)
    with torch.no_grad():
        v_final = float(on.policy.value(torch.as_tensor(p.next_obs[5:6])))
    diff = on.buffer.stacked()["returns"][-1] - off.buffer.stacked()["returns"][-1]
    assert float(diff) == pytest.approx(0.99 * v_final, abs=1e-5)


def test_sb3_uses_stored_values_and_normalized_obs():
    rng = np.random.default_rng(8)
    learner = PPOLearner(small("sb3"), OBS, ACT)
    p = make_piece(10, rng, learner.policy)
    p = p._replace(obs=p.obs * 10 + 3)
    learner.ingest(p)
    got = learner.buffer.stacked()
    np.testing.assert_allclose(got["values"].numpy(), p.values, atol=1e-6)
    # Stored with the snapshot the actor acted with (initial: mean 0, var 1 -> clip only).
    np.testing.assert_allclose(got["obs"].numpy(), np.clip(p.obs / np.sqrt(1 + 1e-8), -10, 10), atol=1e-5)
    learner.ingest(make_piece(10, rng, learner.policy))
    learner.update()
    np.testing.assert_allclose(learner.policy.obs_norm.mean.numpy(), learner.obs_rms.mean)


def test_value_loss_choices_in_the_update():
    """'mlagents' (as 0.28 runs, #6281) trains exactly as 'mse'; 'mlagents_intended' differs once the
    critic has moved past epsilon from the values stored at ingest."""
    rng = np.random.default_rng(5)
    pieces = [make_piece(6, rng, terminated_at=[5]) for _ in range(2)]
    after = {}
    for loss in ("mlagents", "mse", "mlagents_intended"):
        learner = PPOLearner(small("mlagents", value_loss=loss, buffer_size=12, batch_size=12, num_epoch=3,
                                   learning_rate=0.05, lr_schedule="constant"), OBS, ACT)
        for p in pieces:
            learner.ingest(p)
        learner.update()
        after[loss] = torch.cat([q.detach().flatten() for q in learner.policy.critic_body.parameters()])
    torch.testing.assert_close(after["mlagents"], after["mse"], rtol=0, atol=1e-6)
    assert not torch.allclose(after["mlagents_intended"], after["mse"], atol=1e-4)


def test_schedules_use_total_agent_steps():
    rng = np.random.default_rng(9)
    cfg = small("mlagents", max_steps=100)
    learner = PPOLearner(cfg, OBS, ACT)
    learner.ingest(make_piece(11, rng))
    m = learner.update()
    assert m["learning_rate"] == pytest.approx(ppo.polynomial_decay(3e-4, 1e-10, 11, 100))
    assert m["epsilon"] == pytest.approx(ppo.polynomial_decay(0.2, 0.1, 11, 100))
    assert m["beta"] == pytest.approx(ppo.polynomial_decay(5e-3, 1e-5, 11, 100))
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(m["learning_rate"])


def test_target_kl_stops_early():
    rng = np.random.default_rng(10)
    learner = PPOLearner(small("sb3", target_kl=1e-12, learning_rate=1e-2, reward_norm=False), OBS, ACT)
    learner.ingest(make_piece(10, rng, learner.policy))
    m = learner.update()
    # First minibatch: ratio == 1, kl == 0 -> step; the second sees kl > 0 and stops.
    assert m["early_stop"] == 1.0 and m["n_minibatches"] == 2


def test_env_action():
    cfg_ml, cfg_sb = small("mlagents"), small("sb3")
    a = np.array([[-4.0, 0.5, 9.0]], np.float32)
    np.testing.assert_allclose(PPOLearner(cfg_ml, OBS, ACT).env_action(a), np.clip(a, -3, 3) / 3)
    np.testing.assert_allclose(PPOLearner(cfg_sb, OBS, ACT, [-2, -1, 0], [2, 1, 1]).env_action(a), [[-2, 0.5, 1]])


@pytest.mark.parametrize("semantics", ["mlagents", "sb3"])
def test_state_dict_round_trip(semantics):
    rng = np.random.default_rng(11)
    cfg = small(semantics)
    a = PPOLearner(cfg, OBS, ACT)
    pieces = [make_piece(6, rng, a.policy, source=i % 2) for i in range(4)]
    for p in pieces[:2]:
        a.ingest(p)
    a.update()
    state = a.state_dict()
    b = PPOLearner(cfg.__class__.preset(semantics, **{**cfg.__dict__, "seed": 99}), OBS, ACT)
    b.load_state_dict(state)
    for k, v in a.policy.state_dict().items():
        assert torch.equal(v, b.policy.state_dict()[k]), k
    assert (b.total_steps, b.update_count, b.rejected_batches) == (a.total_steps, a.update_count, a.rejected_batches)
    # Same data after the restore -> identical next update (optimizer moments, normalizers, RNG all restored).
    for learner in (a, b):
        for p in pieces[2:]:
            learner.ingest(p)
        learner.update()
    for pa, pb in zip(a.policy.parameters(), b.policy.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
