"""A fake Unity ML-Agents player: a stand-in for a Unity build in tests.

mlagents-envs runs the gRPC *server*; a Unity player is a *client* that calls
the single RPC ``Exchange(UnityMessageProto) -> UnityMessageProto``. This module
is such a client, written against the real protobuf messages of mlagents-envs
0.28 (communication version "1.5.0"). It goes through the same sequence as the
C# player:

1. handshake: a message carrying ``rl_initialization_output`` (name,
   communication_version, package_version, capabilities); the reply carries
   ``rl_initialization_input`` (seed, ...);
2. an empty message; its reply is the first real input (normally RESET);
3. agent infos; the first one also carries ``brain_parameters`` (in
   ``rl_initialization_output``), as the C# communicator does;
4. every reply (RESET / STEP, with the actions and the side-channel bytes)
   is answered with the next agent infos;
5. a reply with header status 400 means "close": the player exits. If the
   server is torn down before the 400 arrives, the player sees a cancelled
   RPC and exits too (``FakeUnityPlayer.shutdown`` says which).

What it simulates (``FakeUnityConfig``): one behavior (plus optional extra
ones), N agents, a list of vector observation specs, a continuous action size
and/or discrete branches with action masks (or a visual spec, to test errors), and scripted episodes
per agent (``AgentScript``). Like the real Agent.cs, an agent gets a **new
agent id for every episode** (``AgentInfo.id`` is the episode id), reports its
terminal row and, unless delayed, the first decision of its next episode in
the same exchange (Crawler does this).

Observation of agent ``i`` in episode ``e`` after ``t`` actions: a flat vector
of ``sum(obs_sizes)`` floats, split into the specs in order::

    [t*0.01, i*0.1, e*0.01, target_0 .. target_{A-1}, sin features ...]

where ``target_j = 0.6*sin(0.05*t + 0.9*j + 1.3*i + 0.4*e)``. The reward of an
action ``a`` taken on that observation is ``1 - mean((a - target)**2)``
(``step_reward``), plus ``terminal_reward`` on the step that ends an episode
with ``end="terminate"``. With discrete branches the targets are followed by a
one-hot of each branch's target action ``(i + e + t // 3) % n_b`` (with a camera: drawn in the image
instead, ``image``); each step
masks one other action per branch (``blocked``), and the discrete part of the
reward is the fraction of branches whose target was chosen (the mean of both
parts for hybrid actions). An action the mask blocked is a protocol error. So
rewards depend on the actions received (tests can check that actions reached
the player) and a PPO learner can improve on it.

Two ways to use it
------------------
1. In-process (fast, inspectable): patch only
   ``mlagents_envs.env_utils.launch_executable`` so that, instead of starting a
   binary, it starts a ``FakeUnityPlayer`` thread on the port from the
   ``--mlagents-port`` argument::

       import fake_unity
       players = fake_unity.install_in_process(monkeypatch, fake_unity.FakeUnityConfig(n_agents=3))
       env = UnityVecEnv("FakeUnity", base_port=16000, worker_id=1)  # any file name
       ...
       env.close(); players[0].join(5); assert players[0].shutdown == "quit"

   (environment.py calls ``env_utils.launch_executable`` through the module,
   so patching the module attribute is enough.)

2. As a real executable "Unity build" (no patching at all; mlagents-envs
   starts it as a subprocess and passes ``-nographics -batchmode
   --mlagents-port PORT [-logFile PATH]``, which are accepted)::

       from fake_unity import write_fake_build
       build = write_fake_build(tmp_path / "FakeCrawler.x86_64", preset="crawler",
                                record=tmp_path / "player.json")
       env = UnityVecEnv(str(build), base_port=16100, worker_id=0, timeout_wait=20)

   or for a PPO run: ``launch_ppo --unity-build /tmp/x/FakeCrawler.x86_64``.
   ``write_fake_build`` writes a small ``#!<python>`` script (mode 755) that
   runs ``main()`` of this file with the given options. The same options work on
   the command line: ``python tests/fake_unity.py --mlagents-port 5005
   --preset crawler``. ``--record PATH`` writes a JSON summary when the
   player exits (engine config received, seed, number of steps, 400 seen...).

Presets: ``crawler`` = 2 vector specs 126 + 32 (obs_dim 158), 20 continuous
actions, 5 agents; agent i's episodes last ``100 + 20*i`` decisions, even
agents are interrupted at max step (truncation), odd agents terminate with
terminal reward -1. ``small`` = specs 5 + 3, 2 actions, 3 agents (episodes 4, 6,
never ending; agent 0 terminates with reward +5, agent 1 is interrupted).
``basic`` = one spec of 8, one discrete branch of 3 actions (masked), 4 agents
with episodes of 20-35 decisions (like ML-Agents' Basic / GridWorld: discrete
only). ``hybrid`` = one spec of 12, 2 continuous actions and branches 3 + 2. ``visual`` = a vector spec
of 2 and a 20x20x3 camera (HWC, like ML-Agents' GridWorld), one masked branch of 3, 4 agents as in
``basic``: the target action is seen only in the image (``image``: the lit band), not in the vector.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import struct
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import grpc
import numpy as np

# mlagents-envs 0.28's messages from the current protobuf's compiled runtime (its own _pb2 files
# need protobuf<3.21): the hook must be in place before the first communicator import.
from impala.envs.mlagents_proto import install as _install_mlagents_proto

_install_mlagents_proto()
from mlagents_envs.communicator_objects.agent_info_pb2 import AgentInfoProto  # noqa: E402
from mlagents_envs.communicator_objects.brain_parameters_pb2 import ActionSpecProto, BrainParametersProto  # noqa: E402
from mlagents_envs.communicator_objects.capabilities_pb2 import UnityRLCapabilitiesProto  # noqa: E402
from mlagents_envs.communicator_objects.command_pb2 import QUIT, RESET  # noqa: E402
from mlagents_envs.communicator_objects.observation_pb2 import ObservationProto  # noqa: E402
from mlagents_envs.communicator_objects.unity_message_pb2 import UnityMessageProto  # noqa: E402
from mlagents_envs.communicator_objects.unity_to_external_pb2_grpc import UnityToExternalProtoStub  # noqa: E402

COMMUNICATION_VERSION = "1.5.0"
PACKAGE_VERSION = "2.2.1-exp.1"  # the C# package released with mlagents-envs 0.28
ENGINE_CHANNEL_ID = uuid.UUID("e951342c-4f7e-11ea-b238-784f4387d1f7")
_ENGINE_KEYS = {
    0: "screen_resolution",
    1: "quality_level",
    2: "time_scale",
    3: "target_frame_rate",
    4: "capture_frame_rate",
}


@dataclass
class AgentScript:
    """How one physical agent's episodes go.

    episode_length: number of actions per episode (None: never ends).
    end: "terminate" (done, terminal_reward added) or "interrupt" (done with
        max_step_reached, i.e. truncation).
    respawn_delay: after an episode ends, the new episode's first decision
        comes this many exchanges later (0: in the same exchange as the
        terminal row, like Crawler).
    lone_terminal: the terminal row is sent alone in its own exchange (the
        other agents' rows follow in the next one), like a Unity agent that
        ends mid decision period.
    """

    episode_length: int | None = None
    end: str = "terminate"
    terminal_reward: float = 5.0
    respawn_delay: int = 0
    lone_terminal: bool = False


@dataclass
class FakeUnityConfig:
    agents: list[AgentScript] = field(default_factory=lambda: [AgentScript() for _ in range(3)])
    obs_sizes: tuple[int, ...] = (5, 3)
    action_size: int = 2
    discrete_branches: tuple[int, ...] = ()
    visual_shape: tuple[int, int, int] | None = None  # adds a rank-3 (HWC) spec after the vector ones
    behavior_name: str = "FakeBehavior?team=0"
    extra_behaviors: tuple[str, ...] = ()  # each gets one never-ending agent, same specs
    first_agent_id: int = 0

    @property
    def n_agents(self) -> int:
        return len(self.agents)


def preset(name: str) -> FakeUnityConfig:
    if name == "crawler":
        return FakeUnityConfig(
            agents=[
                AgentScript(100 + 20 * i, "interrupt" if i % 2 == 0 else "terminate", terminal_reward=-1.0)
                for i in range(5)
            ],
            obs_sizes=(126, 32),
            action_size=20,
            behavior_name="CrawlerFake?team=0",
        )
    if name == "small":
        return FakeUnityConfig(
            agents=[AgentScript(4, "terminate"), AgentScript(6, "interrupt"), AgentScript(None)]
        )
    if name == "basic":
        return FakeUnityConfig(
            agents=[AgentScript(20 + 5 * i, "interrupt" if i % 2 else "terminate", 0.0) for i in range(4)],
            obs_sizes=(8,),
            action_size=0,
            discrete_branches=(3,),
            behavior_name="BasicFake?team=0",
        )
    if name == "visual":
        return FakeUnityConfig(
            agents=[AgentScript(20 + 5 * i, "interrupt" if i % 2 else "terminate", 0.0) for i in range(4)],
            obs_sizes=(2,),
            action_size=0,
            discrete_branches=(3,),
            visual_shape=(20, 20, 3),
            behavior_name="VisualFake?team=0",
        )
    if name == "hybrid":
        return FakeUnityConfig(
            agents=[AgentScript(20 + 5 * i, "interrupt" if i % 2 else "terminate", 0.0) for i in range(3)],
            obs_sizes=(12,),
            action_size=2,
            discrete_branches=(3, 2),
            behavior_name="HybridFake?team=0",
        )
    raise ValueError(f"unknown preset {name!r} (known: crawler, small, basic, hybrid, visual)")


def observation(cfg: FakeUnityConfig, i: int, e: int, t: int) -> np.ndarray:
    """The flat vector observation (all vector specs concatenated) of agent i, episode e, step t."""
    n = sum(cfg.obs_sizes)
    k = np.arange(n, dtype=np.float64)
    out = 0.5 * np.sin(0.37 * (k + 1) + 1.3 * i + 0.71 * e + 0.11 * t)
    head = [t * 0.01, i * 0.1, e * 0.01] + list(target(cfg, i, e, t))
    for b, size in enumerate(cfg.discrete_branches if cfg.visual_shape is None else ()):
        head += list(np.eye(size)[discrete_target(cfg, i, e, t)[b]])
    m = min(n, len(head))
    out[:m] = head[:m]
    return out.astype(np.float32)


def image(cfg: FakeUnityConfig, i: int, e: int, t: int) -> np.ndarray:
    """The camera observation [H, W, C] in [0, 1]: for the first branch's target action g of n, the g-th of n
    vertical bands is lit (channel g % C, value 1) on a dim background; nothing else tells the target."""
    h, w, c = cfg.visual_shape  # type: ignore[misc]
    img = np.full((h, w, c), 0.1, np.float32)
    if cfg.discrete_branches:
        n, g = cfg.discrete_branches[0], discrete_target(cfg, i, e, t)[0]
        img[:, g * w // n : (g + 1) * w // n, g % c] = 1.0
    return img


def target(cfg: FakeUnityConfig, i: int, e: int, t: int) -> np.ndarray:
    j = np.arange(cfg.action_size, dtype=np.float64)
    return (0.6 * np.sin(0.05 * t + 0.9 * j + 1.3 * i + 0.4 * e)).astype(np.float32)


def discrete_target(cfg: FakeUnityConfig, i: int, e: int, t: int) -> list[int]:
    """The rewarded action of each discrete branch."""
    return [(i + e + t // 3) % n for n in cfg.discrete_branches]


def blocked(cfg: FakeUnityConfig, i: int, e: int, t: int) -> list[int | None]:
    """The action each branch's mask blocks at this decision (never the target; None for 1-action
    branches)."""
    goal = discrete_target(cfg, i, e, t)
    return [None if n < 2 else (goal[b] + 1 + t % (n - 1)) % n for b, n in enumerate(cfg.discrete_branches)]


def step_reward(
    cfg: FakeUnityConfig, i: int, e: int, t: int, action: np.ndarray, picks: Sequence[int] = ()
) -> float:
    """Reward of `action` (continuous) and `picks` (one per branch) taken on observation(cfg, i, e, t)
    (float32 arithmetic, as sent)."""
    parts = []
    if cfg.action_size:
        a = np.asarray(action, dtype=np.float32)
        parts.append(np.float32(1.0) - np.mean((a - target(cfg, i, e, t)) ** 2, dtype=np.float32))
    if cfg.discrete_branches:
        hits = [int(p) == g for p, g in zip(picks, discrete_target(cfg, i, e, t))]
        parts.append(np.float32(np.mean(hits)))
    return float(np.mean(np.asarray(parts, np.float32), dtype=np.float32))


class _Agent:
    def __init__(self, index: int, script: AgentScript, agent_id: int) -> None:
        self.index, self.script, self.id = index, script, agent_id
        self.episode, self.t = 0, 0
        self.silent_for = 0  # exchanges to wait before the first decision of the episode


class FakeUnityPlayer:
    """A fake Unity player talking gRPC to mlagents-envs' server on `port`.

    Records what it receives: ``init_input`` (seed...), ``engine_config``
    (time_scale...), ``side_channel_ids``, ``commands``, ``actions`` (one dict
    agent_id -> action array per STEP exchange of the main behavior),
    ``shutdown`` ("quit" when the 400 arrived, "cancelled" when the server
    went away first, "error"), ``error`` (any exception in the thread).
    """

    def __init__(
        self, cfg: FakeUnityConfig, port: int, *, connect_timeout: float = 30.0, args: Sequence[str] = ()
    ) -> None:
        self.cfg, self.port, self.connect_timeout = cfg, port, connect_timeout
        self.args = list(args)
        self.init_input = None
        self.engine_config: dict[str, object] = {}
        self.side_channel_ids: list[str] = []
        self.commands: list[int] = []
        self.actions: list[dict[int, np.ndarray]] = []
        self.n_exchanges = 0
        self.shutdown: str | None = None
        self.error: BaseException | None = None
        self.protocol_errors: list[str] = []
        self.discrete_actions: list[list[int]] = []  # every discrete action received, in order
        self._next_id = cfg.first_agent_id
        self._agents: list[_Agent] = []
        self._extra_ids: dict[str, int] = {}
        self._awaiting: list[int] = []  # agent indices in the last decision rows, in row order
        self._deferred: list[tuple[_Agent, AgentInfoProto]] | None = None
        self._sent_brain_params = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "FakeUnityPlayer":
        self._thread = threading.Thread(target=self.run_safely, name=f"fake-unity-{self.port}", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the player to exit; True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run_safely(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc
            self.shutdown = self.shutdown or "error"

    def run(self) -> None:
        channel = grpc.insecure_channel(f"localhost:{self.port}")
        try:
            stub = UnityToExternalProtoStub(channel)
            hello = UnityMessageProto()
            hello.header.status = 200
            init = hello.unity_output.rl_initialization_output
            init.name = "FakeUnity"
            init.communication_version = COMMUNICATION_VERSION
            init.package_version = PACKAGE_VERSION
            init.capabilities.CopyFrom(
                UnityRLCapabilitiesProto(
                    baseRLCapabilities=True,
                    concatenatedPngObservations=True,
                    compressedChannelMapping=True,
                    hybridActions=True,
                    trainingAnalytics=True,
                    variableLengthObservation=True,
                    multiAgentGroups=True,
                )
            )
            reply = self._exchange(stub, hello, timeout=self.connect_timeout, wait_for_ready=True)
            if reply is None:
                return
            self.init_input = reply.unity_input.rl_initialization_input
            empty = UnityMessageProto()
            empty.header.status = 200
            message = empty
            while True:
                reply = self._exchange(stub, message)
                if reply is None:
                    return
                if reply.header.status == 400:
                    self.shutdown = "quit"
                    return
                message = self._handle_input(reply)
                if message is None:  # QUIT command
                    self.shutdown = "quit"
                    return
        finally:
            channel.close()

    def _exchange(self, stub, message, *, timeout=None, wait_for_ready=None):
        try:
            reply = stub.Exchange(message, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            self.shutdown = "cancelled"
            self.last_rpc_error = exc
            return None
        self.n_exchanges += 1
        return reply

    # -- simulation --------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _handle_input(self, reply: UnityMessageProto) -> UnityMessageProto | None:
        rl_in = reply.unity_input.rl_input
        self._read_side_channel(bytes(rl_in.side_channel))
        self.commands.append(rl_in.command)
        if rl_in.command == QUIT:
            return None
        if rl_in.command == RESET or not self._agents:
            rows = self._reset()
        else:
            rows = self._step(rl_in)
        return self._output(rows)

    def _reset(self) -> list[tuple[_Agent, AgentInfoProto]]:
        cfg = self.cfg
        if not self._agents:
            self._agents = [_Agent(i, s, self._new_id()) for i, s in enumerate(cfg.agents)]
        else:  # a reset ends everything silently and starts new episodes with new ids
            for ag in self._agents:
                ag.id, ag.t, ag.silent_for = self._new_id(), 0, 0
                ag.episode += 1
        for name in cfg.extra_behaviors:
            self._extra_ids[name] = self._new_id()
        self._deferred = None
        return [(ag, self._info(ag, 0.0)) for ag in self._agents]

    def _step(self, rl_in) -> list[tuple[_Agent, AgentInfoProto]]:
        cfg = self.cfg
        got = rl_in.agent_actions[cfg.behavior_name].value if cfg.behavior_name in rl_in.agent_actions else []
        if len(got) != len(self._awaiting):
            self.protocol_errors.append(
                f"exchange {self.n_exchanges}: {len(got)} actions for {len(self._awaiting)} decisions"
            )
        if self._deferred is not None:  # the exchange after a lone terminal row
            rows, self._deferred = self._deferred, None
            return rows
        by_index: dict[int, np.ndarray] = {}
        picks_of: dict[int, list[int]] = {}
        record: dict[int, np.ndarray] = {}
        for idx, act in zip(self._awaiting, got):
            a = np.array(act.continuous_actions, dtype=np.float32)
            by_index[idx] = a
            picks_of[idx] = [int(x) for x in act.discrete_actions]
            record[self._agents[idx].id] = a
            if cfg.discrete_branches:
                ag = self._agents[idx]
                no = blocked(cfg, ag.index, ag.episode, ag.t)
                if len(picks_of[idx]) != len(cfg.discrete_branches) or any(
                    p == b for p, b in zip(picks_of[idx], no)
                ):
                    self.protocol_errors.append(
                        f"exchange {self.n_exchanges}: agent {ag.id} chose {picks_of[idx]}, blocked {no}"
                    )
                self.discrete_actions.append(picks_of[idx])
        self.actions.append(record)
        rows: list[tuple[_Agent, AgentInfoProto]] = []
        lone: list[tuple[_Agent, AgentInfoProto]] = []
        for ag in self._agents:
            if ag.index not in by_index:
                if ag.silent_for > 0:
                    ag.silent_for -= 1
                    if ag.silent_for == 0:
                        rows.append((ag, self._info(ag, 0.0)))
                continue
            r = step_reward(
                cfg, ag.index, ag.episode, ag.t, by_index[ag.index][: cfg.action_size], picks_of[ag.index]
            )
            ag.t += 1
            s = ag.script
            if s.episode_length is not None and ag.t >= s.episode_length:
                interrupted = s.end == "interrupt"
                if not interrupted:
                    r += s.terminal_reward
                term = self._info(ag, r, done=True, max_step=interrupted)
                (lone if s.lone_terminal else rows).append((ag, term))
                ag.id, ag.t, ag.episode = self._new_id(), 0, ag.episode + 1
                ag.silent_for = s.respawn_delay
                if s.respawn_delay == 0:
                    rows.append((ag, self._info(ag, 0.0)))
            else:
                rows.append((ag, self._info(ag, r)))
        if lone:
            self._deferred = rows
            return lone
        return rows

    def _info(self, ag: _Agent, reward: float, *, done=False, max_step=False) -> AgentInfoProto:
        cfg = self.cfg
        flat = observation(cfg, ag.index, ag.episode, ag.t)
        info = AgentInfoProto(reward=reward, done=done, max_step_reached=max_step, id=ag.id)
        off = 0
        for n in cfg.obs_sizes:
            obs = ObservationProto(shape=[n], name=f"VectorSensor_size{n}_{off}")
            obs.float_data.data.extend(flat[off : off + n].tolist())
            info.observations.append(obs)
            off += n
        if cfg.visual_shape is not None:
            obs = ObservationProto(shape=list(cfg.visual_shape), name="CameraSensor")
            obs.float_data.data.extend(image(cfg, ag.index, ag.episode, ag.t).reshape(-1).tolist())
            info.observations.append(obs)
        if cfg.discrete_branches:  # True: blocked (the protocol's sense)
            no = blocked(cfg, ag.index, ag.episode, ag.t)
            info.action_mask.extend(
                [k == no[b] for b, n in enumerate(cfg.discrete_branches) for k in range(n)]
            )
        return info

    def _output(self, rows: list[tuple[_Agent, AgentInfoProto]]) -> UnityMessageProto:
        cfg = self.cfg
        msg = UnityMessageProto()
        msg.header.status = 200
        out = msg.unity_output
        lst = out.rl_output.agentInfos[cfg.behavior_name]
        lst.value.extend([info for _, info in rows])
        self._awaiting = [ag.index for ag, info in rows if not info.done]
        for name in cfg.extra_behaviors:
            extra = _Agent(0, AgentScript(), self._extra_ids[name])
            out.rl_output.agentInfos[name].value.append(self._info(extra, 0.0))
        if not self._sent_brain_params:
            self._sent_brain_params = True
            init = out.rl_initialization_output
            init.name = "FakeUnity"
            init.communication_version = COMMUNICATION_VERSION
            init.package_version = PACKAGE_VERSION
            for name in (cfg.behavior_name, *cfg.extra_behaviors):
                spec = ActionSpecProto(
                    num_continuous_actions=cfg.action_size,
                    num_discrete_actions=len(cfg.discrete_branches),
                    discrete_branch_sizes=list(cfg.discrete_branches),
                )
                init.brain_parameters.append(
                    BrainParametersProto(brain_name=name, is_training=True, action_spec=spec)
                )
        return msg

    def _read_side_channel(self, data: bytes) -> None:
        off = 0
        while off < len(data):
            cid = uuid.UUID(bytes_le=data[off : off + 16])
            (n,) = struct.unpack_from("<i", data, off + 16)
            body = data[off + 20 : off + 20 + n]
            off += 20 + n
            self.side_channel_ids.append(str(cid))
            if cid != ENGINE_CHANNEL_ID:
                continue
            (kind,) = struct.unpack_from("<i", body, 0)
            key = _ENGINE_KEYS.get(kind, f"unknown_{kind}")
            if kind == 2:
                self.engine_config[key] = struct.unpack_from("<f", body, 4)[0]
            elif kind == 0:
                self.engine_config[key] = struct.unpack_from("<ii", body, 4)
            else:
                self.engine_config[key] = struct.unpack_from("<i", body, 4)[0]

    def summary(self) -> dict:
        init = self.init_input
        return {
            "port": self.port,
            "args": self.args,
            "seed": None if init is None else init.seed,
            "python_communication_version": None if init is None else init.communication_version,
            "engine_config": self.engine_config,
            "n_exchanges": self.n_exchanges,
            "n_steps": len(self.actions),
            "shutdown": self.shutdown,
            "protocol_errors": self.protocol_errors,
            "n_discrete_actions": len(self.discrete_actions),
            "error": None if self.error is None else repr(self.error),
        }


# -- in-process mode ----------------------------------------------------------------------------
def install_in_process(
    monkeypatch, cfg: FakeUnityConfig, *, connect_timeout: float = 30.0
) -> list[FakeUnityPlayer]:
    """Patch ``mlagents_envs.env_utils.launch_executable`` to start a FakeUnityPlayer thread.

    Returns the list that receives every player started (one per UnityEnvironment built).
    """
    from mlagents_envs import env_utils

    players: list[FakeUnityPlayer] = []

    def fake_launch(file_name: str, args: list[str]):
        port = int(args[args.index("--mlagents-port") + 1])
        players.append(
            FakeUnityPlayer(cfg, port, connect_timeout=connect_timeout, args=[file_name, *args]).start()
        )
        return None  # no process: UnityEnvironment then skips process polling

    monkeypatch.setattr(env_utils, "launch_executable", fake_launch)
    return players


# -- executable mode ----------------------------------------------------------------------------
def write_fake_build(
    path: str | os.PathLike,
    *,
    preset: str | None = "small",
    args: Sequence[str] = (),
    record: str | os.PathLike | None = None,
) -> Path:
    """Write an executable fake Unity build at `path` (e.g. tmp/"FakeCrawler.x86_64").

    The file is a `#!<this python>` script running this module's main() with
    `--preset <preset>` (if given), `args`, `--record <record>` (if given) and
    whatever mlagents-envs appends (``-nographics -batchmode --mlagents-port N``).
    """
    path = Path(path)
    fixed = ([] if preset is None else ["--preset", preset]) + [str(a) for a in args]
    if record is not None:
        fixed += ["--record", str(record)]
    here = str(Path(__file__).resolve().parent)
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {here!r})\n"
        "from fake_unity import main\n"
        f"sys.exit(main({fixed!r} + sys.argv[1:]))\n"
    )
    path.chmod(
        path.stat().st_mode
        | stat.S_IXUSR
        | stat.S_IXGRP
        | stat.S_IXOTH
        | stat.S_IRUSR
        | stat.S_IRGRP
        | stat.S_IROTH
    )
    return path


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fake_unity", allow_abbrev=False, description="Fake Unity ML-Agents player (gRPC client)."
    )
    p.add_argument("--mlagents-port", type=int, required=True)
    # Unity player flags that mlagents-envs passes; accepted and ignored.
    p.add_argument("-nographics", action="store_true")
    p.add_argument("-batchmode", action="store_true")
    p.add_argument("-logFile", "-logfile", dest="log_file")
    p.add_argument("--preset", choices=["crawler", "small", "basic", "hybrid", "visual"])
    p.add_argument("--agents", type=int, help="number of agents (overrides the preset)")
    p.add_argument("--obs-sizes", type=_ints, help="comma-separated vector spec sizes, e.g. 126,32")
    p.add_argument("--action-size", type=int)
    p.add_argument("--episode-length", type=int, help="decisions per episode for every agent")
    p.add_argument(
        "--end",
        choices=["terminate", "interrupt", "mixed"],
        default=None,
        help="how episodes end (mixed: even agents interrupted, odd terminate)",
    )
    p.add_argument("--terminal-reward", type=float)
    p.add_argument("--discrete", type=_ints, help="discrete branch sizes, e.g. 3 or 3,2")
    p.add_argument("--visual", type=_ints, help="add a visual spec, e.g. 8,8,3")
    p.add_argument("--behavior", help="behavior name")
    p.add_argument("--extra-behaviors", default="", help="comma-separated extra behavior names")
    p.add_argument("--hang", action="store_true", help="never connect (to test timeouts)")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--record", help="write a JSON summary here when exiting")
    return p


def config_from_args(ns: argparse.Namespace) -> FakeUnityConfig:
    cfg = preset(ns.preset) if ns.preset else FakeUnityConfig()
    agents = cfg.agents
    if ns.agents is not None:
        agents = [agents[i % len(agents)] for i in range(ns.agents)]
    agents = [AgentScript(**asdict(a)) for a in agents]
    for i, a in enumerate(agents):
        if ns.episode_length is not None:
            a.episode_length = ns.episode_length
        if ns.end is not None:
            a.end = ns.end if ns.end != "mixed" else ("interrupt" if i % 2 == 0 else "terminate")
        if ns.terminal_reward is not None:
            a.terminal_reward = ns.terminal_reward
    cfg.agents = agents
    if ns.obs_sizes:
        cfg.obs_sizes = ns.obs_sizes
    if ns.action_size is not None:
        cfg.action_size = ns.action_size
    if ns.discrete:
        cfg.discrete_branches = ns.discrete
    if ns.visual:
        cfg.visual_shape = tuple(ns.visual)  # type: ignore[assignment]
    if ns.behavior:
        cfg.behavior_name = ns.behavior
    cfg.extra_behaviors = tuple(x for x in ns.extra_behaviors.split(",") if x)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    ns, _unknown = build_parser().parse_known_args(argv)
    if ns.hang:
        while True:
            time.sleep(3600)
    player = FakeUnityPlayer(
        config_from_args(ns),
        ns.mlagents_port,
        connect_timeout=ns.connect_timeout,
        args=list(sys.argv[1:] if argv is None else argv),
    )
    player.run_safely()
    if ns.record:
        Path(ns.record).write_text(json.dumps(player.summary(), indent=1, default=str))
    if player.error is not None:
        print(f"fake_unity: {player.error!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
