"""A Unity ML-Agents build as one vectorized env: all agents of one instance = K envs.

``UnityVecEnv`` drives one Unity instance through the low-level API of
``mlagents-envs`` 0.28 and exposes the agents of one behavior as ``K``
parallel envs with the project's ``StepResult`` (auto-reset) interface, like
``impala.envs.vector.GymVecEnv``. Running all agents of one instance this way
instead of one instance per agent is what made Crawler trainable in hours.

Construction
    The ``UnityEnvironment`` (and so the Unity process and its gRPC server on
    port ``base_port + worker_id``) is built in the constructor: build the env
    inside the process that uses it (an actor's ``run()``); it cannot be
    pickled. Like ``mlagents-learn``, an ``EngineConfigurationChannel`` sends
    the engine settings: ``width``/``height`` 84, ``quality_level`` 5,
    ``time_scale`` 20, ``target_frame_rate`` -1 and ``capture_frame_rate`` 60
    by default (mlagents-learn's defaults; ``launch_ppo --time-scale`` etc.).
    The constructor resets the environment once to
    learn the behavior spec and ``K`` (rows of the first non-empty
    DecisionSteps); the first ``reset()`` returns that observation without
    resetting Unity a second time.

Observations and actions
    ``obs`` is the concatenation of all observation specs in spec order,
    flattened (Crawler: 126 + 32 = 158), float32. Rank-3 (visual) specs are
    flattened too (HWC, C order; ``obs_specs`` gives the shapes back to the
    policy); other ranks (grid / variable-length sensors) are refused.
    Continuous actions, discrete branches or both: ``step`` takes a
    float array ``[K, action_dim]`` (continuous), an integer array
    ``[K, branches]`` (discrete) or the pair ``(continuous, discrete)``
    (hybrid) and sends them as they are (the PPO layer clips / rescales),
    after checking shapes, that floats are finite and that indices lie in
    their branches. ``action_masks()`` gives the allowed discrete actions of
    the agents' last decision ``[K, sum of branch sizes]`` (True: allowed;
    Unity's ``DecisionSteps.action_mask`` says the opposite).

Agent ids and slots
    Unity gives an agent a **new id at every episode** (``AgentInfo.id`` is
    Agent.cs' episode id), so ids cannot be a fixed key. A slot is bound to an
    agent id while its episode runs; when the episode ends (a TerminalSteps
    row), the slot is freed, and the next unknown id that shows up in
    DecisionSteps takes the lowest free slot (ids in row order). An unknown id
    when no slot is free (more agents than ``K``) is an error. A terminal row
    for an unknown id (an episode that ended before it ever asked for a
    decision) is ignored: the policy never acted in it.

One ``step``
    1. The actions go to the agents of the last DecisionSteps (which holds all
       K slots), and Unity steps.
    2. TerminalSteps rows end their slot's episode: their reward is added to
       the slot's reward (terminal rewards are kept), ``interrupted`` (max
       step reached) sets ``truncated`` (bootstrap), otherwise
       ``terminated``; their observation goes to ``final_obs``.
    3. DecisionSteps rows add their reward to a live slot's reward. Rewards of
       a slot's *next* episode received before the step returns (normally only
       the 0 of its first decision) are dropped, as the ML-Agents trainer drops
       the reward attached to an episode's first decision.
    4. Unity's decision requesters can skip steps (an agent that ends its
       episode between two decision steps reports its terminal row alone, or a
       respawned agent asks for its first decision later). Until one exchange
       has a decision for every slot, the env keeps stepping Unity: agents that
       ask for a decision meanwhile get their slot's action again (what
       ``TakeActionsBetweenDecisions`` does), or zeros for a slot whose episode
       already ended in this step (Unity clears an ended agent's stored
       action); rewards accumulate into this transition. After
       ``max_wait_steps`` exchanges without a full set of decisions it raises
       ``UnityEnvError`` (e.g. agents with different decision periods).
    5. ``obs`` holds every slot's observation from that last exchange (for a
       slot whose episode ended: the first observation of its next episode);
       ``final_obs`` equals ``obs`` except where an episode ended. If one slot
       ends twice within a step (its new episode ends before the step
       returns), the first end's reward, flags and final_obs are kept.

Other behaviors of the same build (when ``behavior_name`` picks one) receive
zero actions, as ``UnityEnvironment.step`` fills them.

Client cost
    mlagents-envs 0.28's generated message modules need protobuf<3.21, which is pure Python
    on Python 3.11 (~5 ms of client work per step for 10 Crawler agents). Importing this
    module installs ``impala.envs.mlagents_proto``, which serves those messages from the
    current protobuf's compiled upb runtime (same descriptors, same bytes on the wire), and
    ``fast_client=True`` (the default) uses ``impala.envs.unity_client.FastUnityEnvironment``:
    mlagents' ``UnityEnvironment`` with actions encoded and float observations decoded in bulk
    (numpy straight from the packed bytes) and no pickling Pipe behind its gRPC server.
    Together 0.22 ms of client CPU per step without transport, 0.76 ms through gRPC
    (BENCHMARKS.md, "Unity client"). ``fast_client=False`` runs mlagents' own
    ``UnityEnvironment`` (still on the compiled protobuf).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import numpy as np

from impala.envs import mlagents_proto
from impala.envs.vector import EpisodeTracker, StepResult  # one StepResult type for the whole project

# mlagents-envs' communicator messages from the current protobuf's compiled (upb) runtime instead
# of its protoc-3.x files, which need the pure-Python protobuf<3.21 (impala/envs/mlagents_proto.py).
mlagents_proto.install()

__all__ = ["UnityEnvError", "UnityVecEnv", "StepResult"]

# mlagents-learn's engine settings (mlagents/trainers/cli_utils.py defaults).
WIDTH = HEIGHT = 84
QUALITY_LEVEL = 5
TIME_SCALE = 20.0
TARGET_FRAME_RATE = -1
CAPTURE_FRAME_RATE = 60
UNITY_SUFFIXES = (".x86_64", ".x86", ".exe", ".app")


def unity_build_path(value: str) -> str | None:
    """``value`` (``launch_ppo --env``) as a Unity build path, or None for a gymnasium id.

    A build: an existing file or folder, or a name mlagents-envs completes to one (``builds/Crawler`` for
    ``builds/Crawler.x86_64``). A path to nothing (it ends in a Unity build suffix, or it starts with
    ``/``, ``.`` or ``~``, or has a ``/`` and is no registered gymnasium id such as ``ALE/Pong-v5``) is a
    ``ConfigError``."""
    from impala.options import ConfigError

    path = os.path.expanduser(value)
    if os.path.exists(path):
        return path
    try:
        from mlagents_envs.env_utils import validate_environment_path

        if validate_environment_path(path) is not None:
            return path
    except ImportError:  # pragma: no cover - depends on the install
        pass
    pathlike = value.endswith(UNITY_SUFFIXES) or value.startswith(("/", ".", "~"))
    if not pathlike and "/" in value:
        from impala.envs import UnknownEnvError, check_env_id

        try:
            check_env_id(value)
            return None
        except UnknownEnvError:
            pathlike = True
    if pathlike:
        raise ConfigError(
            f"--env {value}: no Unity build there (no such file or folder, resolved against {os.getcwd()}); "
            "pass the path of the build, e.g. builds/Crawler.x86_64, or a gymnasium id"
        )
    return None


class UnityEnvError(RuntimeError):
    """A Unity build could not be started, reached or used; the message says what to fix."""


def _flat_obs(obs_list: list[np.ndarray], n: int) -> np.ndarray:
    if n == 0 or not obs_list:
        return np.zeros((n, 0), dtype=np.float32)
    return np.concatenate([np.asarray(o, dtype=np.float32).reshape(n, -1) for o in obs_list], axis=1)


def _close_half_built(exc: BaseException, env_cls: type) -> None:
    """Close a UnityEnvironment whose constructor raised.

    mlagents-envs 0.28 closes itself on a launch failure or a timeout, but not
    when the build exits before the handshake (its process poll raises): its
    gRPC server would keep the port until the interpreter exits. Its atexit
    hook is dropped too (it raises AttributeError at exit when the port was
    taken). The instance is only reachable from the traceback.
    """
    tb = exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, env_cls):
            if hasattr(obj, "_communicator"):  # absent when the port was already taken
                try:
                    obj._close(0)
                except Exception:  # best effort: we are already reporting an error
                    pass
            # its atexit hook would fail (port in use) or do nothing: drop it
            atexit.unregister(obj._close)
            return
        tb = tb.tb_next


class UnityVecEnv:
    """All agents of one behavior of one Unity instance as ``num_envs`` envs.

    Attributes: ``num_envs`` (K), ``obs_dim``, ``action_dim``, ``action_branches``, ``obs_specs``
    (list of shapes), ``behavior_name``, ``port``, ``episodes``
    (``EpisodeTracker`` of finished episode returns/lengths per slot).
    """

    def __init__(
        self,
        file_name: str | None,
        *,
        worker_id: int = 0,
        base_port: int | None = None,
        seed: int = 0,
        no_graphics: bool = True,
        timeout_wait: int = 60,
        time_scale: float = TIME_SCALE,
        width: int = WIDTH,
        height: int = HEIGHT,
        quality_level: int = QUALITY_LEVEL,
        target_frame_rate: int = TARGET_FRAME_RATE,
        capture_frame_rate: int = CAPTURE_FRAME_RATE,
        additional_args: list[str] | tuple[str, ...] = (),
        behavior_name: str | None = None,
        max_wait_steps: int = 1000,
        fast_client: bool = True,
    ) -> None:
        try:
            from mlagents_envs.base_env import ActionTuple
            from mlagents_envs.environment import UnityEnvironment
            from mlagents_envs.exception import UnityException
            from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel

            from impala.envs.unity_client import FastUnityEnvironment
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise UnityEnvError(
                "UnityVecEnv needs mlagents-envs==0.28.0 and a protobuf>=6.31 "
                f"(pip install -e '.[unity]'): {exc}"
            ) from exc

        self._UnityException = UnityException
        self._action_tuple = ActionTuple
        self.file_name = file_name
        self.worker_id = worker_id
        self.timeout_wait = timeout_wait
        self.max_wait_steps = max_wait_steps
        if base_port is None:
            base_port = (
                UnityEnvironment.BASE_ENVIRONMENT_PORT if file_name else UnityEnvironment.DEFAULT_EDITOR_PORT
            )
        self.port = base_port + worker_id
        self._where = (
            f"Unity build {file_name!r} (port {self.port})"
            if file_name
            else f"Unity Editor (port {self.port})"
        )
        self._env: Any = None

        self._engine_channel = EngineConfigurationChannel()
        self._engine_channel.set_configuration_parameters(
            width=width,
            height=height,
            quality_level=quality_level,
            time_scale=time_scale,
            target_frame_rate=target_frame_rate,
            capture_frame_rate=capture_frame_rate,
        )
        env_cls = FastUnityEnvironment if fast_client else UnityEnvironment
        self._env = self._start(
            env_cls,
            file_name=file_name,
            worker_id=worker_id,
            base_port=base_port,
            seed=seed,
            no_graphics=no_graphics,
            timeout_wait=timeout_wait,
            additional_args=additional_args,
        )

        try:
            self._setup(behavior_name)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        env_cls: Any,
        *,
        file_name: str | None,
        worker_id: int,
        base_port: int,
        seed: int,
        no_graphics: bool,
        timeout_wait: int,
        additional_args: list[str] | tuple[str, ...],
    ) -> Any:
        """Start (or connect to) the Unity instance; each way it can fail is one UnityEnvError that says
        what to check, and a half-built environment is closed first."""
        from mlagents_envs import env_utils
        from mlagents_envs.environment import UnityEnvironment
        from mlagents_envs.exception import (
            UnityEnvironmentException,
            UnityException,
            UnityTimeOutException,
            UnityWorkerInUseException,
        )

        try:
            return env_cls(
                file_name=file_name,
                worker_id=worker_id,
                base_port=base_port,
                seed=seed,
                no_graphics=no_graphics,
                timeout_wait=timeout_wait,
                side_channels=[self._engine_channel],
                additional_args=list(additional_args) or None,
            )
        except UnityWorkerInUseException as exc:
            _close_half_built(exc, UnityEnvironment)
            raise UnityEnvError(
                f"port {self.port} (base_port {base_port} + worker_id {worker_id}) is already in "
                f"use, so {file_name!r} cannot be started there; give each Unity instance its own "
                "worker_id"
            ) from exc
        except UnityTimeOutException as exc:
            _close_half_built(exc, UnityEnvironment)
            raise UnityEnvError(
                f"{self._where} did not connect within timeout_wait={timeout_wait}s. Check that "
                "the build starts headless (no_graphics), needs no user input, has Behavior Type "
                "'Default', and matches mlagents-envs 0.28 (communication 1.5.0)"
            ) from exc
        except UnityEnvironmentException as exc:
            _close_half_built(exc, UnityEnvironment)
            if file_name is not None and env_utils.validate_environment_path(file_name) is None:
                raise UnityEnvError(
                    f"Unity build not found: {file_name!r} (resolved against cwd "
                    f"{os.getcwd()!r}); pass the path of the executable, e.g. "
                    "/path/to/Crawler.x86_64"
                ) from exc
            raise UnityEnvError(f"{self._where} failed to start or connect: {exc}") from exc
        except UnityException as exc:
            _close_half_built(exc, UnityEnvironment)
            raise UnityEnvError(f"{self._where}: {exc}") from exc

    # -- setup -------------------------------------------------------------------------------
    def _call(self, fn, *args):
        """Run an mlagents call, turning its errors into UnityEnvError naming the build/port."""
        try:
            return fn(*args)
        except self._UnityException as exc:
            raise UnityEnvError(f"{self._where}: {type(exc).__name__}: {exc}") from exc

    def _setup(self, behavior_name: str | None) -> None:
        env = self._env
        self._call(env.reset)
        for _ in range(self.max_wait_steps):
            if len(env.behavior_specs) > 0:
                break
            self._call(env.step)
        specs = dict(env.behavior_specs)
        if not specs:
            raise UnityEnvError(f"{self._where} reports no agent behavior")
        names = sorted(specs)
        if behavior_name is None:
            if len(names) > 1:
                raise UnityEnvError(
                    f"{self._where} has several behaviors {names}; choose one with behavior_name"
                )
            name = names[0]
        elif behavior_name in specs:
            name = behavior_name
        else:  # accept "Crawler" for "Crawler?team=0"
            matches = [n for n in names if n.split("?", 1)[0] == behavior_name]
            if len(matches) != 1:
                raise UnityEnvError(f"behavior {behavior_name!r} not found in {self._where}; it has {names}")
            name = matches[0]
        self.behavior_name = name
        spec = specs[name]

        act = spec.action_spec
        if act.continuous_size == 0 and act.discrete_size == 0:
            raise UnityEnvError(f"behavior {name!r} has no actions")
        for i, o in enumerate(spec.observation_specs):
            if len(o.shape) not in (1, 3):
                raise UnityEnvError(
                    f"behavior {name!r} has an observation of rank {len(o.shape)} (spec {i} {o.name!r}, "
                    f"shape {tuple(o.shape)}); vector (rank 1) and visual (rank 3, HWC) obs are taken"
                )
        self.obs_specs: list[tuple[int, ...]] = [tuple(o.shape) for o in spec.observation_specs]
        self.obs_dim = int(sum(int(np.prod(s)) for s in self.obs_specs))
        self.action_dim = int(act.continuous_size)
        self.action_branches = tuple(int(n) for n in act.discrete_branches)

        self.num_envs = 0
        obs = self._first_decisions()
        self.num_envs = len(obs)
        self.episodes = EpisodeTracker(self.num_envs)
        self._fresh_obs: np.ndarray | None = obs

    def _first_decisions(self) -> np.ndarray:
        """After a Unity reset: wait for decisions, bind ids to slots in row order."""
        dec = None
        for _ in range(self.max_wait_steps):
            dec, _term = self._call(self._env.get_steps, self.behavior_name)
            if len(dec) > 0:
                break
            self._call(self._env.step)
        if dec is None or len(dec) == 0:
            raise UnityEnvError(
                f"behavior {self.behavior_name!r} of {self._where} asked for no decision in "
                f"{self.max_wait_steps} steps after a reset"
            )
        if self.num_envs and len(dec) != self.num_envs:
            raise UnityEnvError(
                f"behavior {self.behavior_name!r} had {self.num_envs} agents, but {len(dec)} after "
                "a reset; UnityVecEnv needs a fixed number of agents"
            )
        self._slot_of: dict[int, int] = {int(a): s for s, a in enumerate(dec.agent_id)}
        self._dec = dec
        return _flat_obs(dec.obs, len(dec))

    # -- API ---------------------------------------------------------------------------------
    def reset(self) -> np.ndarray:
        """Reset Unity (all episodes restart); returns obs [K, obs_dim] float32."""
        self._check_open()
        if self._fresh_obs is not None:  # the constructor's reset, not stepped since
            obs, self._fresh_obs = self._fresh_obs, None
            return obs.copy()
        self._call(self._env.reset)
        self.episodes = EpisodeTracker(self.num_envs)
        return self._first_decisions()

    def action_masks(self) -> np.ndarray:
        """The discrete actions each slot's agent may take at its next decision [K, sum(branches)], True
        where allowed (all True when the build sets no masks)."""
        K = self.num_envs
        mask = np.ones((K, sum(self.action_branches)), dtype=bool)
        dec = self._dec
        if dec.action_mask is not None and len(dec) > 0:
            rows = np.fromiter((self._slot_of[int(a)] for a in dec.agent_id), np.int64, len(dec))
            mask[rows] = ~np.concatenate([np.asarray(m, bool) for m in dec.action_mask], axis=1)
        return mask

    def _split_actions(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """(continuous [K, A] float32, discrete [K, branches] int32) from what ``step`` was given, checked."""
        K, A, B = self.num_envs, self.action_dim, len(self.action_branches)
        if A and B:
            if not (isinstance(actions, tuple) and len(actions) == 2):
                raise ValueError(
                    f"behavior {self.behavior_name!r} has continuous and discrete actions: give (continuous, "
                    "discrete)"
                )
            cont, disc = actions
        elif B:
            cont, disc = np.zeros((K, 0), np.float32), actions
        else:
            cont, disc = actions, np.zeros((K, 0), np.int32)
        cont = np.asarray(cont, dtype=np.float32)
        if cont.shape != (K, A):
            raise ValueError(
                f"continuous actions must have shape ({K}, {A}) for behavior {self.behavior_name!r}, got "
                f"{cont.shape}"
            )
        bad = ~np.isfinite(cont).all(axis=1)
        if bad.any():
            raise ValueError(f"actions contain NaN or inf for envs {np.flatnonzero(bad).tolist()}")
        disc = np.asarray(disc)
        if disc.shape != (K, B) or (B and disc.dtype.kind not in "iu"):
            raise ValueError(
                f"discrete actions must be integers of shape ({K}, {B}) for behavior {self.behavior_name!r}, "
                f"got {disc.dtype} {disc.shape}"
            )
        if B and ((disc < 0).any() or (disc >= np.asarray(self.action_branches)).any()):
            raise ValueError(f"discrete actions outside the branches {list(self.action_branches)}")
        return cont, disc.astype(np.int32)

    def step(self, actions: Any) -> StepResult:
        self._check_open()
        K = self.num_envs
        acts, disc = self._split_actions(actions)
        self._fresh_obs = None

        reward = np.zeros(K, dtype=np.float32)
        terminated = np.zeros(K, dtype=bool)
        truncated = np.zeros(K, dtype=bool)
        ended = np.zeros(K, dtype=bool)
        final_obs: np.ndarray | None = None
        free: list[int] = []
        slot_of = self._slot_of
        dec = self._dec
        zeros, disc_zeros = np.zeros_like(acts), np.zeros_like(disc)

        for _ in range(self.max_wait_steps):
            if len(dec) > 0:  # actions for every agent that asked for a decision
                rows = np.fromiter((slot_of[int(a)] for a in dec.agent_id), np.int64, len(dec))
                cont = np.where(ended[rows][:, None], zeros[rows], acts[rows])
                picks = np.where(ended[rows][:, None], disc_zeros[rows], disc[rows])
                self._call(
                    self._env.set_actions,
                    self.behavior_name,
                    self._action_tuple(continuous=cont, discrete=picks),
                )
            self._call(self._env.step)
            dec, term = self._call(self._env.get_steps, self.behavior_name)

            if len(term) > 0:
                final_obs = self._end_episodes(term, free, reward, ended, terminated, truncated, final_obs)
            seen = self._place_decisions(dec, free, reward, ended)
            if seen.all():
                break
        else:
            missing = np.flatnonzero(~seen).tolist()
            raise UnityEnvError(
                f"behavior {self.behavior_name!r} of {self._where}: envs {missing} got no decision "
                f"in the same Unity step as the others within {self.max_wait_steps} steps; "
                "UnityVecEnv needs all agents to request decisions together (same "
                "DecisionRequester period) and a fixed number of agents"
            )

        self._dec = dec
        obs = np.empty((K, self.obs_dim), dtype=np.float32)
        rows = np.fromiter((slot_of[int(a)] for a in dec.agent_id), np.int64, len(dec))
        obs[rows] = _flat_obs(dec.obs, len(dec))
        if final_obs is None:
            final_obs = obs
        else:
            final_obs[~ended] = obs[~ended]
        self.episodes.record(reward, ended)
        return StepResult(obs, reward, terminated, truncated, final_obs)

    def _end_episodes(
        self,
        term: Any,
        free: list[int],
        reward: np.ndarray,
        ended: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        final_obs: np.ndarray | None,
    ) -> np.ndarray | None:
        """The agents whose episode ended in this Unity step: free their slots, add their last reward, say
        how it ended and keep their last observation (``final_obs``, made when first needed)."""
        term_obs = _flat_obs(term.obs, len(term))
        for j, aid in enumerate(term.agent_id):
            slot = self._slot_of.pop(int(aid), None)
            if slot is None:  # an episode the policy never acted in
                continue
            free.append(slot)
            if ended[slot]:  # its next episode ended too: keep the first end
                continue
            ended[slot] = True
            reward[slot] += term.reward[j]
            if term.interrupted[j]:
                truncated[slot] = True
            else:
                terminated[slot] = True
            if final_obs is None:
                final_obs = np.empty((self.num_envs, self.obs_dim), dtype=np.float32)
            final_obs[slot] = term_obs[j]
        return final_obs

    def _place_decisions(
        self, dec: Any, free: list[int], reward: np.ndarray, ended: np.ndarray
    ) -> np.ndarray:
        """The agents asking for a decision: each keeps its slot, a new agent id takes the lowest freed one;
        returns which slots asked."""
        seen = np.zeros(self.num_envs, dtype=bool)
        free.sort()
        for j, aid in enumerate(dec.agent_id):
            aid = int(aid)
            slot = self._slot_of.get(aid)
            if slot is None:
                if not free:
                    raise UnityEnvError(
                        f"behavior {self.behavior_name!r}: agent id {aid} appeared while all "
                        f"{self.num_envs} slots hold running agents; UnityVecEnv needs a fixed number of "
                        "agents (a new id takes the slot of an agent whose episode ended)"
                    )
                slot = free.pop(0)
                self._slot_of[aid] = slot
            if not ended[slot]:
                reward[slot] += dec.reward[j]
            seen[slot] = True
        return seen

    def close(self) -> None:
        """Send the close message (status 400) and stop the server and the Unity process."""
        env, self._env = self._env, None
        if env is not None:
            try:
                env.close()
            except self._UnityException:  # already closed / process gone: nothing left to free
                pass
            atexit.unregister(env._close)  # mlagents' exit hook would keep the object alive

    @property
    def closed(self) -> bool:
        return self._env is None

    def _check_open(self) -> None:
        if self._env is None:
            raise UnityEnvError(f"{self._where} is closed")

    def __enter__(self) -> "UnityVecEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        raise TypeError(
            "UnityVecEnv holds a live Unity connection and cannot be pickled; "
            "construct it inside the process that steps it (e.g. an actor's run())"
        )
