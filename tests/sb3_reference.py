"""What the tests comparing our PPO learner with SB3's own ``PPO.train()`` share: where SB3's MlpPolicy
keeps each of our layers, and the comparison after one update."""

from __future__ import annotations

import numpy as np
import pytest


def sb3_layer_names(action_head: str) -> dict[str, str]:
    """Our layer -> SB3 MlpPolicy's (``action_head``: ``mu_head`` for Box actions, ``branch_head`` for
    Discrete ones; both are SB3's ``action_net``)."""
    return {
        "actor_body.0": "mlp_extractor.policy_net.0",
        "actor_body.2": "mlp_extractor.policy_net.2",
        "critic_body.0": "mlp_extractor.value_net.0",
        "critic_body.2": "mlp_extractor.value_net.2",
        action_head: "action_net",
        "value_head": "value_net",
    }


def sb3_weights_for_us(sb3_state: dict, mapping: dict[str, str]) -> dict:
    """SB3's weights under our layer names."""
    return {f"{k}.{p}": sb3_state[f"{v}.{p}"].clone() for k, v in mapping.items() for p in ("weight", "bias")}


def assert_same_step(learner, model, mapping: dict[str, str], metrics: dict[str, float]) -> None:
    """After one update on each side: the same weights (1e-6) and the same logged policy loss and entropy."""
    after = model.policy.state_dict()
    ours = learner.policy.state_dict()
    for k, v in mapping.items():
        for p in ("weight", "bias"):
            np.testing.assert_allclose(
                ours[f"{k}.{p}"].numpy(), after[f"{v}.{p}"].numpy(), atol=1e-6, err_msg=k
            )
    logged = model.logger.name_to_value
    assert metrics["policy_loss"] == pytest.approx(logged["train/policy_gradient_loss"], abs=1e-5)
    assert -metrics["entropy"] == pytest.approx(logged["train/entropy_loss"], abs=1e-5)


def fill_rollout_buffer(
    buf, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, starts: np.ndarray, out
):
    """SB3's rollout buffer (one env) emptied and refilled step by step with our policy's output ``out``
    (its values and per-dimension log-probs) for ``obs`` and ``actions``, as SB3's own rollouts add them."""
    buf.reset()
    for t in range(len(obs)):
        buf.add(
            obs[t : t + 1],
            actions[t : t + 1],
            rewards[t : t + 1],
            starts[t : t + 1],
            out.value[t : t + 1],
            out.log_prob[t : t + 1].sum(-1),
        )
