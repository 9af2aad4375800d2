"""Each task's part of a multi-task update's gradient (impala.algos.task_gradients) and the learner's per-task
gradient share and cosine, against references computed the plain way: one backward pass of the loss over
only that task's steps."""

from __future__ import annotations

import math

import pytest
import torch

from impala.algos.task_gradients import task_gradient_stats, task_gradients
from impala.nets.impala_net import build_model
from impala.run.config import ImpalaConfig
from learner.vtrace_learner import VTraceLearner


def _net():
    torch.manual_seed(0)
    torso = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh())
    policy, value = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)  # 2 tasks: one value output each
    return torso, policy, value


def _loss(torso, policy, value, obs, task_ids, actions, targets, keep=None):
    """A per-step loss of the kind the learner sums (log-probability x advantage, squared value error,
    entropy), each step reading its own task's value output; ``keep`` masks steps out of the sum (not out
    of the mean's count, as the learner's masks do not change its minibatch)."""
    h = torso(obs)
    logits, values = policy(h), value(h).gather(-1, task_ids.unsqueeze(-1)).squeeze(-1)
    log_p = torch.log_softmax(logits, -1)
    per_step = (
        -log_p.gather(-1, actions.unsqueeze(-1)).squeeze(-1) * 1.7
        + 0.5 * (targets - values) ** 2
        + 0.01 * (log_p.exp() * log_p).sum(-1)
    )
    if keep is not None:
        per_step = per_step * keep
    return per_step.mean(), logits, values


def test_each_row_is_the_gradient_of_that_tasks_steps_alone_and_the_rows_sum_to_the_whole():
    torso, policy, value = _net()
    T, B = 6, 5
    obs = torch.randn(T, B, 3)
    task_ids = torch.tensor([0, 1, 1, 0, 1]).expand(T, B)  # one task per unroll, as in a batch
    actions, targets = torch.randint(0, 4, (T, B)), torch.randn(T, B) * 3
    shared = [*torso.parameters(), *policy.parameters()]

    def reference(keep):
        for p in [*shared, *value.parameters()]:
            p.grad = None
        _loss(torso, policy, value, obs, task_ids, actions, targets, keep)[0].backward()
        return torch.cat([p.grad.reshape(-1) for p in shared])

    expected = [reference((task_ids == k).float()) for k in range(2)]
    whole = reference(None)
    for p in [*shared, *value.parameters()]:
        p.grad = None
    loss, logits, values = _loss(torso, policy, value, obs, task_ids, actions, targets)
    rows = task_gradients(loss, (logits, values), task_ids, 3, shared)  # task 2 has no step here
    assert rows.shape == (3, sum(p.numel() for p in shared))
    for k in range(2):
        torch.testing.assert_close(rows[k], expected[k], rtol=1e-5, atol=1e-7)
    assert not rows[2].any()
    torch.testing.assert_close(rows.sum(0), whole, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in shared)  # left every .grad alone ...
    loss.backward()  # ... and the graph usable by the update's own backward pass
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in shared]), whole)


def test_shares_and_cosines_from_the_definitions():
    rows = torch.tensor([[3.0, 0.0], [0.0, 2.0], [-1.0, 0.0], [0.0, 0.0]])
    share, cosine = task_gradient_stats(rows)
    torch.testing.assert_close(share, torch.tensor([3 / 6, 2 / 6, 1 / 6, 0.0]))
    # task 0 against (-1, 2): -3 / (3 sqrt 5); task 1 against (2, 0): 0; task 2 against (3, 2): -3 / sqrt 13
    torch.testing.assert_close(cosine[:3], torch.tensor([-1 / math.sqrt(5), 0.0, -3 / math.sqrt(13)]))
    assert math.isnan(float(cosine[3]))  # no step of task 3: no direction to compare
    share, cosine = task_gradient_stats(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert math.isnan(float(cosine[0]))  # the others add nothing: alone


def _batch(T, B, task):
    rewards = torch.zeros(T, B)
    rewards[:, task[0] == 1] = 100.0
    return {
        "obs": torch.randn(T + 1, B, 3),
        "first": torch.zeros(T + 1, B, dtype=torch.bool),
        "actions": torch.randint(0, 2, (T, B)),
        "rewards": rewards,
        "dones": torch.zeros(T, B, dtype=torch.bool),
        "behaviour_logits": torch.zeros(T, B, 2),
        "task": task,
    }


@pytest.mark.parametrize("popart", [True, False])
def test_the_learner_reports_them_and_the_update_is_unchanged(popart):
    """A real update on a two-task batch: the per-task gradient shares sum to 1 and each cosine is in
    [-1, 1]; the weights after it are those of the same update unmeasured."""
    cfg = ImpalaConfig(popart=popart, reward_clip=0.0, epochs=1, minibatches=1, batch_size=4)
    names = ("A-v0", "B-v0")
    torch.manual_seed(0)
    batch = _batch(5, 4, torch.tensor([[0, 1, 0, 1]]))
    after = []
    for every in (1, 0):
        torch.manual_seed(1)
        model = build_model("mlp", (3,), 2, num_tasks=2, beta=cfg.popart_beta)
        learner = VTraceLearner(model, cfg, torch.device("cpu"), total_frames=10_000, task_names=names)
        learner.health.TASK_GRADIENTS_EVERY = every
        metrics = learner.step(batch, frames_done=0)
        after.append([p.detach().clone() for p in learner.model.parameters()])
        if every == 1:
            shares = [metrics[f"tasks/{n}/grad_share"] for n in names]
            assert sum(shares) == pytest.approx(1.0) and min(shares) > 0, metrics
            assert all(-1.0 <= metrics[f"tasks/{n}/grad_cosine"] <= 1.0 for n in names), metrics
        else:
            assert not any(k.endswith(("grad_share", "grad_cosine")) for k in metrics), metrics
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
