"""The actor loop: step K envs with one batched forward pass, send unrolls, pick up weights.

Runs inside the actor's child process (``Actor.run``), or in the calling
process in serial/debug use. Every message is one complete ZeroMQ multipart
message, which ZeroMQ delivers whole or not at all, so an actor killed
mid-unroll can never deliver a partial unroll.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import zmq

from actors.agents import make_agent
from impala.envs import EnvSpec
from impala.envs.probe import measure_env_fingerprint
from impala.envs.vector import EpisodeTracker, GymVecEnv
from impala.run.metrics import log_this_one
from impala.run.orphans import exit_if_orphaned
from impala.transport import wire
from impala.transport.curve import make_client_socket
from impala.transport.messages import AgentSpec, RunInfo

log = logging.getLogger(__name__)

LEARNER_GONE_EXIT = 3
REFUSED_EXIT = 4  # the learner refused this actor's own hello: restarting would not change its answer


@dataclass(frozen=True)
class ActorConfig:
    """Everything a child needs, as plain picklable data.

    actor_id: this actor's index (also its Unity ``worker_id``).
    env: what to build inside ``run()`` (a multi-task actor: its first env's task).
    num_envs: envs stepped together with one batched forward pass.
    tasks / task_envs: a multi-task run's task of each env (``RunInfo.actor_tasks``) and the run's
        envs in task order; env ``k`` plays ``task_envs[tasks[k]]``. Empty in a single-task run.
    unroll_length: steps per env per unroll (T).
    trajectory_endpoint / params_endpoint: the learner's ZeroMQ endpoints.
    agent: which agent adapter to run, with its settings (``impala.transport.messages``).
    seed: base seed of this incarnation (restarts get a new one).
    fingerprint_steps: random steps used to measure the env fingerprint.
    """

    actor_id: int
    env: EnvSpec
    num_envs: int
    unroll_length: int
    trajectory_endpoint: str
    params_endpoint: str
    agent: AgentSpec
    seed: int = 0
    fingerprint_steps: int = 300
    send_hwm: int = 2
    params_timeout_s: float = 120.0
    curve: Any = None  # impala.transport.curve.ClientKeys when the learner requires CURVE
    local_token: str = ""  # handed to the learner's own actors at spawn; proves a hello is theirs
    learner_timeout_s: float = 60.0  # no weights heartbeat for this long: the learner is gone, exit
    tasks: tuple[int, ...] = ()  # multi-task runs: each env's task index, sent with each of its unrolls
    task_envs: tuple[EnvSpec, ...] = ()
    cpus: tuple[int, ...] = ()  # --cpu-affinity split: the CPUs this actor's process pins itself to
    nice: int = 0  # --actor-nice: added to this actor process's niceness when it starts

    @property
    def env_specs(self) -> tuple[EnvSpec, ...]:
        """What each of the ``num_envs`` envs plays."""
        if not self.tasks:
            return (self.env,) * self.num_envs
        return tuple(self.task_envs[t] for t in self.tasks)

    def distinct_tasks(self) -> list[tuple[int, EnvSpec]]:
        """(task, spec) of each task this actor plays, in task order (one ``(0, env)`` without tasks)."""
        if not self.tasks:
            return [(0, self.env)]
        return [(t, self.task_envs[t]) for t in sorted(set(self.tasks))]


def actor_configs(
    run: RunInfo,
    actor_ids: Iterable[int],
    *,
    trajectory_endpoint: str,
    params_endpoint: str,
    seed: int,
    **settings: Any,
) -> list[ActorConfig]:
    """The one place an actor's configuration is made (the learner's own actors, ``impala-actors`` on other
    machines, ``frameskip_check``'s worker check). A multi-task run deals its tasks over the actors' envs
    (``RunInfo.task_of``), and actor ``i`` seeds its envs with ``seed + 1000 * i``: by id, so machines started
    alike (other ids, same seed) never share seeds.
    ``settings`` are further :class:`ActorConfig` fields (CURVE keys, the local token, timeouts)."""
    return [
        ActorConfig(
            actor_id=i,
            env=run.task_envs[run.task_of(i)],
            tasks=run.actor_tasks(i) if run.tasks else (),
            task_envs=run.tasks,
            num_envs=run.envs_per_worker,
            unroll_length=run.unroll_length,
            trajectory_endpoint=trajectory_endpoint,
            params_endpoint=params_endpoint,
            agent=run.agent,
            seed=seed + 1000 * i,
            **settings,
        )
        for i in actor_ids
    ]


class LearnerGone(Exception):
    """No weights heartbeat from the learner for ``learner_timeout_s``."""


def build_vec_env(config: ActorConfig):
    """The actor's K envs, built here in the child process: a Unity build's agents or K gymnasium envs."""
    if config.env.is_unity:
        # here, not at the top: mlagents-envs (and its protobuf) is only needed for Unity builds
        from impala.envs.unity import UnityVecEnv

        kw = dict(config.env.kwargs)
        return UnityVecEnv(kw.pop("file_name"), worker_id=config.actor_id, seed=config.seed, **kw)
    return GymVecEnv(config.env_specs, config.num_envs, seed=config.seed)


class ActorLink:
    """The actor's two sockets: PUSH trajectories, SUB parameters."""

    def __init__(
        self,
        config: ActorConfig,
        parent_pid: int | None,
        stop_event: threading.Event | None = None,
        message_bytes: int = 0,
    ) -> None:
        self.config = config
        self.parent_pid = parent_pid
        self.stop_event = stop_event or threading.Event()
        self.last_weights: float | None = None  # None until the first weights arrive
        self.bad_params = 0
        self.ctx = zmq.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.sub = self.ctx.socket(zmq.SUB)
        if config.curve is not None:
            make_client_socket(self.push, config.curve)
            make_client_socket(self.sub, config.curve)
        self.push.setsockopt(zmq.SNDHWM, config.send_hwm)
        self.push.setsockopt(zmq.LINGER, 2000)
        # Bound what the OS queues to about two unrolls: tiny unrolls (CartPole) would otherwise
        # pile up by the hundred in kernel buffers, each many policy versions old when read.
        self.push.setsockopt(zmq.SNDBUF, max(8192, 2 * message_bytes))
        self.push.connect(config.trajectory_endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.CONFLATE, 1)  # keep only the newest weights
        self.sub.connect(config.params_endpoint)

    def _alive(self) -> None:
        if self.parent_pid is not None:
            exit_if_orphaned(self.parent_pid)
        if (
            self.last_weights is not None
            and time.monotonic() - self.last_weights > self.config.learner_timeout_s
        ):
            raise LearnerGone(
                f"no weights from {self.config.params_endpoint} for {self.config.learner_timeout_s:.0f}s"
            )

    def send(self, frames: list) -> bool:
        """Send one message; False when stopped while blocked by backpressure."""
        # Block under backpressure (the learner's high-water mark), but keep checking the learner lives.
        while not self.push.poll(200, zmq.POLLOUT):
            self._alive()
            if self.stop_event.is_set():
                return False
        self.push.send_multipart(frames, copy=False)
        return True

    def latest_params(self, schema, timeout_ms: int = 0) -> wire.Message | None:
        """Drain the SUB socket and return the newest valid params message (or None)."""
        newest = None
        while self.sub.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            frame = self.sub.recv(copy=False)
            self.last_weights = time.monotonic()
            try:
                msg = wire.decode_packed(frame, schema=schema, expect_kind="params")
            except wire.WireError as e:
                self.bad_params += 1
                if log_this_one(self.bad_params):
                    log.error(
                        "actor %d: dropping bad params message (#%d): %s",
                        self.config.actor_id,
                        self.bad_params,
                        str(e)[:300],
                    )
                continue
            if newest is None or msg.version > newest.version:
                newest = msg
        return newest

    def close(self) -> None:
        self.push.close()
        self.sub.close()


def _unknown_actors(msg: wire.Message) -> list:
    ids = msg.info.get("unknown_actors")
    return ids if isinstance(ids, list) else []


def _refusals(msg: wire.Message, actor_id: int) -> list[tuple[Any, str]]:
    """(nonce, reason) of each refused hello in ``actor_id``'s name that the weights message reports."""
    rows = msg.info.get("refused_actors")
    if not isinstance(rows, list):
        return []
    return [
        (row[1], str(row[2])[:300])
        for row in rows
        if isinstance(row, list) and len(row) == 3 and row[0] == actor_id
    ]


def _run_id(msg: wire.Message) -> Any:
    run = msg.info.get("run")
    return run.get("run_id") if isinstance(run, dict) else None


def run_actor(
    config: ActorConfig,
    parent_pid: int | None = None,
    max_unrolls: int | None = None,
    stop_event: threading.Event | None = None,
) -> str:
    """Build envs, say hello, wait for weights, then stream unrolls.

    Runs until ``max_unrolls`` unrolls were sent, ``stop_event`` is set (thread
    mode), the learner stops sending weights (``learner_timeout_s``), or the
    process is terminated, or the learner refuses this actor's hello. Returns why it stopped:
    "max_unrolls", "stopped", "no_weights", "learner_gone" or "refused".
    """
    stop_event = stop_event or threading.Event()
    fingerprints = _measure_fingerprints(config)
    envs = build_vec_env(config)
    link: ActorLink | None = None
    try:
        obs = envs.reset()
        agent = make_agent(
            config.agent, envs=envs, first_obs=obs, unroll_length=config.unroll_length, seed=config.seed
        )
        link = ActorLink(config, parent_pid, stop_event, message_bytes=agent.schema.nbytes)
        # The nonce tells this actor's own hellos apart from anyone else's in its name: when the learner
        # reports a refused hello for our id with our nonce, the refusal is ours.
        nonce = secrets.token_hex(8)
        hello, rehello = _hellos(config, fingerprints, envs.num_envs, nonce)
        link.send(hello)
        params = _first_params(config, link, agent, stop_event)
        if isinstance(params, str):
            return params
        agent.load_params(params.arrays)
        weights = _Weights(version=params.version, run_id=_run_id(params), nonce=nonce, rehello=rehello)
        stream = _Stream(config, agent, envs, obs)
        unrolls = 0
        while (max_unrolls is None or unrolls < max_unrolls) and not stop_event.is_set():
            buf = stream.unroll()
            if not _send_unroll(config, link, buf, stream.K, stream.episodes.pop(), weights):
                return "stopped"
            unrolls += 1
            weights.sent_with_version += 1
            newest = _newest_params(link, agent, weights, stop_event)
            if newest is not None and _follow_the_learner(config, link, agent, newest, weights) == "refused":
                return "refused"
        return "stopped" if stop_event.is_set() else "max_unrolls"
    except LearnerGone as e:
        log.warning("actor %d: %s; exiting", config.actor_id, e)
        return "learner_gone"
    finally:
        envs.close()
        if link is not None:
            link.close()


def _measure_fingerprints(config: ActorConfig) -> list:
    """[task, fingerprint] of each game this actor plays, measured on a probe env built from the same spec
    (Unity builds have none)."""
    if config.env.is_unity:
        return []
    return [
        [task, measure_env_fingerprint(spec, seed=config.seed, steps=config.fingerprint_steps).to_dict()]
        for task, spec in config.distinct_tasks()
    ]


def _hellos(config: ActorConfig, fingerprints: list, num_envs: int, nonce: str) -> tuple[list, list]:
    """The hello this actor says first, and the one it says again mid-run."""
    hello_info = {
        "fingerprint": fingerprints[0][1] if fingerprints else None,
        "pid": os.getpid(),
        "num_envs": num_envs,
        "nonce": nonce,
    }
    if config.tasks:
        hello_info["task_fingerprints"] = fingerprints
    if config.local_token:
        hello_info["local_token"] = config.local_token
    hello = wire.encode("hello", actor=config.actor_id, version=-1, info=hello_info)
    # Said mid-run (the learner forgot us or restarted): our envs are mid-episode, and the learner
    # must not count the rest of those episodes as whole ones.
    rehello = wire.encode("hello", actor=config.actor_id, version=-1, info={**hello_info, "resumed": True})
    return hello, rehello


def _first_params(
    config: ActorConfig, link: ActorLink, agent: Any, stop_event: threading.Event
) -> wire.Message | str:
    """The learner's first weights, or why none came ("stopped", "no_weights")."""
    params = None
    deadline = time.monotonic() + config.params_timeout_s
    while params is None:
        link._alive()
        if stop_event.is_set():
            return "stopped"
        if time.monotonic() > deadline:
            log.error(
                "actor %d: no parameters from %s after %.0fs; exiting",
                config.actor_id,
                config.params_endpoint,
                config.params_timeout_s,
            )
            return "no_weights"
        params = link.latest_params(agent.params_schema, timeout_ms=200)
    return params


@dataclass
class _Weights:
    """The weights this actor acts with (their version and the learner process that made them), how many
    unrolls it sent with them, and its hellos: what it needs to follow the learner."""

    version: int
    run_id: Any
    nonce: str
    rehello: list
    sent_with_version: int = 0  # unrolls sent with the current weights
    last_rehello: float = 0.0


class _Stream:
    """K envs stepped with one batched forward pass: each :meth:`unroll` fills one unroll's buffers."""

    def __init__(self, config: ActorConfig, agent: Any, envs: Any, obs: Any):
        self.config, self.agent, self.envs, self.obs = config, agent, envs, obs
        self.K, self.T = envs.num_envs, config.unroll_length
        self.masked = getattr(agent, "masked", False) and hasattr(envs, "action_masks")
        self.first = np.ones(self.K, dtype=bool)
        self.episodes = EpisodeTracker(self.K)

    def unroll(self) -> dict[str, np.ndarray]:
        """Step the envs for one unroll; its arrays, [K, T(+1), ...] each."""
        agent, envs, K, T = self.agent, self.envs, self.K, self.T
        obs, first, episodes = self.obs, self.first, self.episodes
        # Fresh buffers each unroll: ZeroMQ sends them zero-copy and may still hold the last ones.
        buf = {a.name: np.empty((K, *a.shape), dtype=a.dtype) for a in agent.schema.arrays}
        for name, value in agent.unroll_start(obs).items():
            buf[name][:] = value
        if "task" in buf:
            buf["task"][:] = np.asarray(self.config.tasks or (0,) * K).reshape(K, *buf["task"].shape[1:])
        for t in range(T):
            for name, value in agent.observation(obs, first).items():
                buf[name][:, t] = value
            if self.masked:  # the env's allowed discrete actions for this decision (Unity)
                agent.set_action_mask(envs.action_masks())
            env_actions, recorded = agent.act(obs, first)
            result = envs.step(env_actions)
            for name, value in {**recorded, **agent.transition(result)}.items():
                buf[name][:, t] = value
            obs = result.obs
            first = result.terminated | result.truncated
            episodes.record(result.reward, first)
        for name, value in agent.observation(obs, first).items():
            buf[name][:, T] = value
        self.obs, self.first = obs, first
        return buf


def _send_unroll(
    config: ActorConfig,
    link: ActorLink,
    buf: dict[str, np.ndarray],
    K: int,
    episodes: tuple,
    weights: _Weights,
) -> bool:
    """Send the unroll as one message per env stream (of K); False when the actor was stopped meanwhile."""
    returns, lengths = episodes
    for k in range(K):
        # The actor's own episode count rides on the first env's message, for logs and checks
        # only: the learner sums its statistics from the rewards and ends of what it accepted.
        info = wire.episode_info(returns, lengths) if k == 0 else {}
        info["env"] = k  # which env stream this unroll continues (PPO's per-env reward normalization)
        info["run_id"] = weights.run_id  # the learner process whose weights made it; another one drops it
        if config.local_token:
            info["local_token"] = config.local_token
        message = wire.encode(
            "unroll",
            actor=config.actor_id,
            version=weights.version,
            arrays={n: buf[n][k] for n in buf},
            info=info,
        )
        if not link.send(message):
            return False
    return True


def _newest_params(
    link: ActorLink, agent: Any, weights: _Weights, stop_event: threading.Event
) -> wire.Message | None:
    """The newest weights message after an unroll, if any came."""
    newest = link.latest_params(agent.params_schema)
    link._alive()
    # On-policy adapters (PPO) may ask to wait for newer weights once they sent their share
    # of an update: an unroll collected meanwhile with the old weights would be dropped as stale.
    wait_s = agent.params_wait_s(weights.sent_with_version)
    wait_until = time.monotonic() + wait_s
    while (
        (newest is None or newest.version <= weights.version)
        and time.monotonic() < wait_until
        and not stop_event.is_set()
    ):
        link._alive()
        newest = link.latest_params(agent.params_schema, timeout_ms=100)
    return newest


def _follow_the_learner(
    config: ActorConfig, link: ActorLink, agent: Any, newest: wire.Message, weights: _Weights
) -> str | None:
    """Answer what a weights message says about this actor (refused, unknown, a new learner) and take its
    weights when they are newer; "refused" when the learner refused this actor's own hello."""
    refusals = _refusals(newest, config.actor_id)
    mine = [reason for theirs, reason in refusals if theirs == weights.nonce]
    if mine:
        log.error("actor %d: the learner refused this actor: %s; exiting", config.actor_id, mine[0])
        return "refused"
    if refusals and time.monotonic() - weights.last_rehello > 5.0:
        # Someone else's hello in our name was refused, and the learner dropped us with it.
        log.warning(
            "actor %d: a hello in this actor's name from elsewhere was refused (%s); saying hello again",
            config.actor_id,
            refusals[0][1],
        )
        link.send(weights.rehello)
        weights.last_rehello = time.monotonic()
    elif config.actor_id in _unknown_actors(newest) and time.monotonic() - weights.last_rehello > 5.0:
        # The learner dropped our unrolls as unknown (it forgot us, or never got our hello).
        log.warning(
            "actor %d: the learner does not know this actor (its unrolls were dropped); saying hello again",
            config.actor_id,
        )
        link.send(weights.rehello)
        weights.last_rehello = time.monotonic()
    if _run_id(newest) != weights.run_id:
        # A new learner process (say, resumed after a crash) knows nothing of us: say hello
        # again and take its weights, whatever their version number.
        log.warning("actor %d: the learner restarted; saying hello again", config.actor_id)
        link.send(weights.rehello)
        weights.run_id, weights.version = _run_id(newest), -1
    if newest.version > weights.version:
        agent.load_params(newest.arrays)
        weights.version = newest.version
        weights.sent_with_version = 0
    return None
