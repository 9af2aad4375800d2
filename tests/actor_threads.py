"""A real actor loop in a thread of the test's own process, feeding a trajectory server the test holds:
what the transport tests that need an honest actor share."""

from __future__ import annotations

import threading


def cartpole_actor(server, num_envs: int, unroll_length: int, **run) -> threading.Thread:
    """Actor 3 (CartPole, the mlp agent) as a daemon thread, not yet started, that says hello to ``server``
    and streams unrolls to it; ``run``: ``run_actor``'s ``max_unrolls`` or ``stop_event``."""
    from actors.loop import ActorConfig, run_actor
    from impala.envs import EnvSpec
    from impala.transport.messages import ImpalaAgentSpec

    config = ActorConfig(
        actor_id=3,
        env=EnvSpec("CartPole-v1"),
        num_envs=num_envs,
        unroll_length=unroll_length,
        trajectory_endpoint=server.trajectory_endpoint,
        params_endpoint=server.params_endpoint,
        agent=ImpalaAgentSpec("mlp"),
        learner_timeout_s=30,
    )
    return threading.Thread(target=run_actor, args=(config,), kwargs=run, daemon=True)
