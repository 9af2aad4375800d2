"""``UnityEnvironment`` with its per-step hot spots done in bulk; everything else is mlagents'.

``FastUnityEnvironment`` is mlagents-envs 0.28's ``UnityEnvironment`` (same constructor, same
low-level API, same gRPC server, same messages) with three methods replaced by equivalents
that produce the same results with less Python work per step:

``_generate_step_input`` (actions -> ``UnityInputProto``)
    mlagents extends two repeated float fields per agent from numpy rows (each numpy scalar is
    converted on its own); here each row goes in as one Python list. The encoded message is
    byte-for-byte the same (tests/test_unity_protobuf.py compares the bytes).
``_update_state`` -> :func:`steps_from_proto` (``AgentInfoProto`` list -> Decision/TerminalSteps)
    mlagents builds every observation with ``np.array`` over the repeated-float containers
    (one Python float per value). Here each agent's ``FloatData`` message is serialized (a
    copy of its packed floats in C), the pieces are checked and joined, and numpy reads the
    floats straight from the bytes. It applies only where mlagents' own code would read
    ``float_data`` for every observation (no rank-3 spec, no discrete actions, every agent's
    data exactly the spec's size); in any other case, including every malformed message, it
    calls mlagents' own ``steps_from_proto``, so results and errors are mlagents' own. The
    NaN / inf checks are mlagents' ``_raise_on_nan_and_inf``, called in mlagents' order.

``_get_communicator`` -> :class:`FastRpcCommunicator`
    mlagents' ``RpcCommunicator`` (same gRPC server, settings, timeouts and close message)
    hands each message between the gRPC handler thread and the caller through a
    ``multiprocessing.Pipe``, which pickles it: every step serializes and parses both messages
    once more than gRPC already does, and pays a socket round trip. Here the two threads
    share a pair of in-process queues with the Pipe's ``send/recv/poll/close`` behaviour (a
    closed end makes the other's ``recv`` raise ``EOFError`` and its ``send``
    ``BrokenPipeError``, so a handler thread never waits forever after ``close``). Its ``close``
    stops the server with a short grace, so the close message reaches the player (mlagents'
    aborts the handler's reply now and then, and the player sees a cancelled call instead).

Import this module only after :func:`impala.envs.mlagents_proto.install` (``impala.envs.unity``
does both).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import grpc
import numpy as np
from mlagents_envs import rpc_utils
from mlagents_envs.base_env import ActionTuple, BehaviorSpec, DecisionSteps, TerminalSteps
from mlagents_envs.communicator_objects.command_pb2 import STEP
from mlagents_envs.communicator_objects.unity_input_pb2 import UnityInputProto
from mlagents_envs.communicator_objects.unity_message_pb2 import UnityMessageProto
from mlagents_envs.communicator_objects.unity_rl_input_pb2 import UnityRLInputProto
from mlagents_envs.communicator_objects.unity_rl_output_pb2 import UnityRLOutputProto
from mlagents_envs.communicator_objects.unity_to_external_pb2_grpc import (
    add_UnityToExternalProtoServicer_to_server,
)
from mlagents_envs.environment import UnityEnvironment
from mlagents_envs.exception import UnityWorkerInUseException
from mlagents_envs.rpc_communicator import RpcCommunicator, UnityToExternalServicerImplementation

__all__ = ["FastRpcCommunicator", "FastUnityEnvironment", "steps_from_proto"]

_FLOAT_DATA_TAG = b"\x0a"  # FloatData.data: field 1, wire type 2 (packed)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _float_observations(index: int, shape: Tuple[int, ...], infos: list) -> Optional[np.ndarray]:
    """Observation ``index`` of every agent as float32 [len(infos), *shape], read from the bytes.

    None when mlagents' own code has to decide (an agent without that observation, or whose
    float data is not exactly ``prod(shape)`` values).
    """
    if not infos:
        return np.zeros((0,) + shape, dtype=np.float32)
    size = 1
    for d in shape:
        size *= d
    try:
        chunks = [info.observations[index].float_data.SerializeToString() for info in infos]
    except IndexError:
        return None
    if size == 0:
        if any(chunks):
            return None
        return np.zeros((len(infos),) + shape, dtype=np.float32)
    header = _FLOAT_DATA_TAG + _varint(4 * size)
    width = len(header) + 4 * size
    if any(len(c) != width for c in chunks):
        return None
    rows = np.frombuffer(b"".join(chunks), dtype=np.uint8).reshape(len(infos), width)
    if not (rows[:, : len(header)] == np.frombuffer(header, dtype=np.uint8)).all():
        return None
    # one copy out of the read-only byte rows (a fresh, aligned, writeable array, as mlagents'
    # np.array gives); protobuf floats are little-endian
    data = rows[:, len(header) :].copy().view("<f4")
    return data.astype(np.float32, copy=False).reshape((len(infos),) + shape)


def steps_from_proto(agent_info_list, behavior_spec: BehaviorSpec) -> Tuple[DecisionSteps, TerminalSteps]:
    """``mlagents_envs.rpc_utils.steps_from_proto``, reading float observations from the bytes."""
    specs = behavior_spec.observation_specs
    if behavior_spec.action_spec.discrete_size > 0 or any(len(s.shape) == 3 for s in specs):
        return rpc_utils.steps_from_proto(agent_info_list, behavior_spec)
    decision = [info for info in agent_info_list if not info.done]
    terminal = [info for info in agent_info_list if info.done]
    decision_obs: List[np.ndarray] = []
    terminal_obs: List[np.ndarray] = []
    for index, spec in enumerate(specs):
        shape = tuple(spec.shape)
        d = _float_observations(index, shape, decision)
        t = _float_observations(index, shape, terminal)
        if d is None or t is None:
            return rpc_utils.steps_from_proto(agent_info_list, behavior_spec)
        decision_obs.append(d)
        terminal_obs.append(t)
    check = rpc_utils._raise_on_nan_and_inf
    for d, t in zip(decision_obs, terminal_obs):  # mlagents' order: per spec, decision first
        check(d, "observations")
        check(t, "observations")
    decision_rewards = np.array([i.reward for i in decision], dtype=np.float32)
    terminal_rewards = np.array([i.reward for i in terminal], dtype=np.float32)
    decision_group_rewards = np.array([i.group_reward for i in decision], dtype=np.float32)
    terminal_group_rewards = np.array([i.group_reward for i in terminal], dtype=np.float32)
    check(decision_rewards, "rewards")
    check(terminal_rewards, "rewards")
    check(decision_group_rewards, "group_rewards")
    check(terminal_group_rewards, "group_rewards")
    return (
        DecisionSteps(
            decision_obs,
            decision_rewards,
            np.array([i.id for i in decision], dtype=np.int32),
            None,
            [i.group_id for i in decision],
            decision_group_rewards,
        ),
        TerminalSteps(
            terminal_obs,
            terminal_rewards,
            np.array([i.max_step_reached for i in terminal], dtype=np.bool_),
            np.array([i.id for i in terminal], dtype=np.int32),
            [i.group_id for i in terminal],
            terminal_group_rewards,
        ),
    )


_CLOSED = object()


class _End:
    """One end of an in-process two-way channel with the ``multiprocessing.Connection`` calls
    ``RpcCommunicator`` makes (``send``, ``recv``, ``poll``, ``close``); objects are passed by
    reference. As with a Pipe, what was sent before ``close`` is still received, after that
    ``recv`` raises ``EOFError`` and ``send`` raises ``BrokenPipeError``."""

    def __init__(
        self, inbox: "queue.SimpleQueue[Any]", outbox: "queue.SimpleQueue[Any]", closed: threading.Event
    ) -> None:
        self._inbox, self._outbox, self._closed = inbox, outbox, closed
        self._peeked: List[Any] = []

    def send(self, obj: Any) -> None:
        if self._closed.is_set():
            raise BrokenPipeError("the communicator is closed")
        self._outbox.put(obj)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        if self._peeked:
            return True
        try:
            if timeout is None:
                item = self._inbox.get()
            elif timeout > 0:
                item = self._inbox.get(timeout=timeout)
            else:
                item = self._inbox.get_nowait()
        except queue.Empty:
            return False
        self._peeked.append(item)
        return True

    def recv(self) -> Any:
        item = self._peeked.pop() if self._peeked else self._inbox.get()
        if item is _CLOSED:
            self._inbox.put(_CLOSED)  # every later recv fails too
            raise EOFError("the communicator is closed")
        return item

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._outbox.put(_CLOSED)
            self._inbox.put(_CLOSED)


class _QueueServicer(UnityToExternalServicerImplementation):
    """mlagents' servicer (its Initialize/Exchange) over an in-process channel, not a Pipe."""

    def __init__(self) -> None:  # no super().__init__(): it would open a Pipe
        a: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        b: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        closed = threading.Event()
        self.parent_conn = _End(a, b, closed)
        self.child_conn = _End(b, a, closed)


class FastRpcCommunicator(RpcCommunicator):
    """mlagents' ``RpcCommunicator`` with the handler-to-caller Pipe replaced by in-process queues,
    and a close that lets the close message reach the player."""

    CLOSE_GRACE_S = 1.0

    def create_server(self) -> None:
        # RpcCommunicator.create_server with _QueueServicer
        self.check_port(self.port)
        try:
            self.server = grpc.server(
                thread_pool=ThreadPoolExecutor(max_workers=10), options=(("grpc.so_reuseport", 1),)
            )
            self.unity_to_external = _QueueServicer()
            add_UnityToExternalProtoServicer_to_server(self.unity_to_external, self.server)
            self.server.add_insecure_port("[::]:" + str(self.port))
            self.server.start()
            self.is_open = True
        except Exception:
            raise UnityWorkerInUseException(self.worker_id)

    def close(self) -> None:
        """mlagents' close (the status-400 message, then the server stops), with a grace period.

        mlagents stops the server with no grace, which aborts in-flight RPCs at once: the handler
        thread that is returning the 400 to the player could be cut off first, and the player saw a
        cancelled RPC instead of the close message (about 1 close in 60 here). The grace lets that
        reply go out; a player that has no exchange in flight costs nothing, and a stuck one at most
        ``CLOSE_GRACE_S``."""
        if self.is_open:
            message = UnityMessageProto()
            message.header.status = 400
            self.unity_to_external.parent_conn.send(message)
            self.unity_to_external.parent_conn.close()
            self.server.stop(self.CLOSE_GRACE_S).wait(self.CLOSE_GRACE_S + 1.0)
            self.is_open = False


class FastUnityEnvironment(UnityEnvironment):
    """mlagents' ``UnityEnvironment`` with bulk action encoding and observation decoding, over
    :class:`FastRpcCommunicator`."""

    @staticmethod
    def _get_communicator(worker_id, base_port, timeout_wait):
        return FastRpcCommunicator(worker_id, base_port, timeout_wait)

    def _update_state(self, output: UnityRLOutputProto) -> None:
        # UnityEnvironment._update_state with this module's steps_from_proto
        for brain_name in self._env_specs.keys():
            if brain_name in output.agentInfos:
                self._env_state[brain_name] = steps_from_proto(
                    output.agentInfos[brain_name].value, self._env_specs[brain_name]
                )
            else:
                self._env_state[brain_name] = (
                    DecisionSteps.empty(self._env_specs[brain_name]),
                    TerminalSteps.empty(self._env_specs[brain_name]),
                )
        self._side_channel_manager.process_side_channel_message(output.side_channel)

    def _generate_step_input(self, vector_action: Dict[str, ActionTuple]) -> UnityInputProto:
        # UnityEnvironment._generate_step_input with one list per agent row instead of numpy scalars
        rl_in = UnityRLInputProto()
        for b, act in vector_action.items():
            n_agents = len(self._env_state[b][0])
            if n_agents == 0:
                continue
            cont = act.continuous.tolist() if act.continuous is not None else None
            disc = act.discrete.tolist() if act.discrete is not None else None
            value = rl_in.agent_actions[b].value
            for i in range(n_agents):
                c = cont[i] if cont is not None else []
                d = disc[i] if disc is not None else []
                value.add(vector_actions_deprecated=c + d, continuous_actions=c, discrete_actions=d)
            rl_in.command = STEP
        rl_in.side_channel = bytes(self._side_channel_manager.generate_side_channel_messages())
        return self._wrap_unity_input(rl_in)
