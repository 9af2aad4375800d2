"""Actor-critic for PPO, ML-Agents or SB3 style (docs/PPO.md #9-#12).

Both styles use *separate* actor and critic MLP bodies. Continuous actions are a Gaussian with a
state-independent log-std parameter initialized to 0; discrete actions are one categorical per branch
(``Discrete``: one branch; ``MultiDiscrete`` / Unity: several), with optional action masks; a policy
may have both (Unity's hybrid actions). Activation, initialization, observation
normalization and the log-prob form are independent switches:

- ``init="mlagents"``: every linear ``kaiming_normal_(nonlinearity="linear") * gain``
  with zero bias; hidden gain 1.0, mean head 0.2, branch heads 0.1; the value head is
  Xavier-uniform gain 1 (``torch_entities/layers.py::linear_layer`` defaults).
- ``init="sb3"``: orthogonal, extractor gain sqrt(2), action heads 0.01, value
  head 1, zero bias (``common/policies.py::ActorCriticPolicy._build``).
- ``obs_norm="mlagents"``: one in-network normalizer per body (actor and critic
  each own a copy, as ML-Agents does), updated by :meth:`update_normalizer`.
- ``obs_norm="vecnormalize"``: one frozen RunningMeanStd snapshot shared by
  both bodies; the learner owns the live statistics.
- ``log_prob_form="mlagents"``: ML-Agents' epsilon-padded Gaussian and categorical formulas;
  ``"exact"``: ``torch.distributions.Normal`` / ``Categorical`` (masked: sb3-contrib's
  ``MaskableCategorical``).

Log-probabilities are flat per action element, as ML-Agents' ``ActionLogProbs.flatten`` lays them
out: the continuous dimensions, then one column per branch (the taken action's).

Actions are returned raw (unclipped); :func:`env_action` maps them to what the
environment receives (#10).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from impala.algos import ppo
from impala.algos.normalizers import FrozenObsNormalizer, MLAgentsNormalizer
from impala.envs.obs_layout import ObsLayout
from impala.nets.visual import make_encoder
from impala.options import ConfigError
from impala.run.ppo_config import PPOConfig

ACTIVATIONS = {"swish": nn.SiLU, "tanh": nn.Tanh, "relu": nn.ReLU}
INITS = ("mlagents", "sb3")
OBS_NORMS = ("mlagents", "vecnormalize", "none")
LOG_PROB_FORMS = ("mlagents", "exact")
ACTION_CLIPS = ("mlagents", "bounds")

MLAGENTS_HIDDEN_GAIN = 1.0
MLAGENTS_MEAN_GAIN = 0.2
MLAGENTS_BRANCH_GAIN = 0.1  # MultiCategoricalDistribution's branch layers (KaimingHeNormal, gain 0.1)
MLAGENTS_VALUE_GAIN = 1.0
SB3_HIDDEN_GAIN = math.sqrt(2.0)
SB3_ACTION_GAIN = 0.01
SB3_VALUE_GAIN = 1.0
MLAGENTS_ACTION_LIMIT = 3.0


class ActOutput(NamedTuple):
    """An action for each env of a batch, its log-probability and the value."""

    action: torch.Tensor  # [B, A] raw continuous sample (store this; send env_action(action) to the env)
    log_prob: torch.Tensor  # [B, A + nb] per-element log-probabilities (continuous dims, then branches)
    value: torch.Tensor  # [B]
    discrete_action: torch.Tensor | None = None  # [B, nb] int64 indices, one per branch


class EvalOutput(NamedTuple):
    """Log-probabilities, entropy and values of given actions (the update's forward pass)."""

    log_prob: torch.Tensor  # [B, A + nb]
    entropy: torch.Tensor  # [B, A] per-dimension entropy of the continuous actions
    value: torch.Tensor  # [B]
    discrete_entropy: torch.Tensor | None = None  # [B, nb] per-branch entropy


def init_linear_mlagents(layer: nn.Linear, gain: float, generator: torch.Generator | None = None) -> None:
    """``kaiming_normal_(nonlinearity="linear")`` (std 1/sqrt(fan_in)) times ``gain``; zero bias."""
    nn.init.kaiming_normal_(layer.weight, nonlinearity="linear", generator=generator)
    with torch.no_grad():
        layer.weight.mul_(gain)
    nn.init.zeros_(layer.bias)


def init_linear_xavier(layer: nn.Linear, gain: float, generator: torch.Generator | None = None) -> None:
    """Xavier-uniform weights with ``gain`` and zero biases (ML-Agents' initialization)."""
    nn.init.xavier_uniform_(layer.weight, gain=gain, generator=generator)
    nn.init.zeros_(layer.bias)


def init_linear_orthogonal(layer: nn.Linear, gain: float, generator: torch.Generator | None = None) -> None:
    """Orthogonal weights with ``gain`` and zero biases (SB3's initialization)."""
    nn.init.orthogonal_(layer.weight, gain=gain, generator=generator)
    nn.init.zeros_(layer.bias)


def mlp_body(in_dim: int, hidden_units: int, num_layers: int, activation: str) -> nn.Sequential:
    """``in->h`` then ``(num_layers-1)`` x ``h->h``, each followed by the activation."""
    act = ACTIVATIONS[activation]
    layers: list[nn.Module] = [nn.Linear(in_dim, hidden_units), act()]
    for _ in range(num_layers - 1):
        layers += [nn.Linear(hidden_units, hidden_units), act()]
    return nn.Sequential(*layers)


def env_action(action: torch.Tensor | np.ndarray, *, mode: str, low=None, high=None):
    """What the env receives for a raw sample (#10).

    mode="mlagents": ``clamp(a, -3, 3) / 3`` (``AgentAction.to_action_tuple(clip=True)``).
    mode="bounds": ``clip(a, low, high)`` (SB3).
    Works on numpy arrays and tensors; the stored action stays raw.
    """
    is_t = isinstance(action, torch.Tensor)
    if mode == "mlagents":
        if is_t:
            return torch.clamp(action, -MLAGENTS_ACTION_LIMIT, MLAGENTS_ACTION_LIMIT) / MLAGENTS_ACTION_LIMIT
        return np.clip(action, -MLAGENTS_ACTION_LIMIT, MLAGENTS_ACTION_LIMIT) / MLAGENTS_ACTION_LIMIT
    if mode == "bounds":
        if low is None or high is None:
            raise ValueError("env_action(mode='bounds') needs the action space's low and high")
        if is_t:
            lo = torch.as_tensor(low, dtype=action.dtype, device=action.device)
            hi = torch.as_tensor(high, dtype=action.dtype, device=action.device)
            return torch.maximum(torch.minimum(action, hi), lo)
        return np.clip(action, low, high)
    raise ValueError(f"action_clip must be one of {ACTION_CLIPS}, got {mode!r}")


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs; a state-independent Gaussian over ``action_dim`` continuous
    actions and/or one categorical per entry of ``branches``.

    Attributes of interest: ``actor_body``, ``mu_head`` and ``log_sigma`` [A] (continuous actions),
    ``branch_head`` (discrete: one linear layer whose outputs are the branches' logits side by side),
    ``critic_body``, ``value_head``, and the normalizers ``actor_norm`` / ``critic_norm`` (ML-Agents)
    or ``obs_norm`` (vecnormalize).
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        *,
        hidden_units: int,
        num_layers: int,
        activation: str = "swish",
        init: str = "mlagents",
        obs_norm: str = "mlagents",
        log_prob_form: str = "mlagents",
        seed: int | None = None,
        branches: tuple[int, ...] = (),
        obs_layout: ObsLayout | None = None,
        vis_encode_type: str = "simple",
    ):
        super().__init__()
        for name, value, choices in (
            ("activation", activation, sorted(ACTIVATIONS)),
            ("init", init, INITS),
            ("obs_norm", obs_norm, OBS_NORMS),
            ("log_prob_form", log_prob_form, LOG_PROB_FORMS),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        branches = tuple(int(n) for n in branches)
        if action_dim < 0 or any(n < 1 for n in branches) or not (action_dim or branches):
            raise ValueError(
                f"a policy needs continuous actions (action_dim >= 1) and/or discrete branches of >= 1 "
                f"action each, got action_dim {action_dim}, branches {branches}"
            )
        self.obs_dim, self.action_dim, self.branches = obs_dim, action_dim, branches
        self.obs_norm_kind, self.log_prob_form = obs_norm, log_prob_form
        layout = obs_layout if obs_layout is not None else ObsLayout()
        if layout.shapes and sum(layout.sizes) != obs_dim:
            raise ValueError(f"observation layout {layout.shapes} does not add up to obs_dim {obs_dim}")
        self.obs_layout, self.visual, self.vis_encode_type = layout, layout.visual, vis_encode_type
        norm_dim, body_in = obs_dim, obs_dim
        if self.visual:
            if obs_norm == "vecnormalize":
                raise ConfigError(
                    "obs_norm: 'vecnormalize' does not take image observations (SB3's image setups run "
                    "without VecNormalize); use --obs-norm none (uint8 images are scaled by 1/255) or "
                    "mlagents"
                )
            is_vec = [len(s) == 1 for s in layout.shapes]
            offsets = np.cumsum((0,) + layout.sizes)
            vec_index = [i for k, v in enumerate(is_vec) if v for i in range(offsets[k], offsets[k + 1])]
            # ML-Agents normalizes vector sensors only; images reach the encoders as they are (scaled).
            self.register_buffer("vector_index", torch.tensor(vec_index, dtype=torch.long), persistent=False)
            norm_dim = len(vec_index)
            body_in = norm_dim

        if obs_norm == "mlagents" and norm_dim:
            self.actor_norm = MLAgentsNormalizer(norm_dim)
            self.critic_norm = MLAgentsNormalizer(norm_dim)
        elif obs_norm == "vecnormalize":
            self.obs_norm = FrozenObsNormalizer(obs_dim)
        self._norms = obs_norm == "mlagents" and norm_dim > 0

        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        if self.visual:
            body_in += self._add_encoders(layout, vis_encode_type, hidden_units, gen)

        self.actor_body = mlp_body(body_in, hidden_units, num_layers, activation)
        self.critic_body = mlp_body(body_in, hidden_units, num_layers, activation)
        self.value_head = nn.Linear(hidden_units, 1)
        # Continuous-only policies keep their state-dict keys (checkpoints from before discrete actions load).
        self.mu_head = nn.Linear(hidden_units, action_dim) if action_dim else None
        self.log_sigma = nn.Parameter(torch.zeros(action_dim)) if action_dim else None
        self.branch_head = nn.Linear(hidden_units, sum(branches)) if branches else None
        self._init_weights(init, gen)

    def _add_encoders(
        self, layout: ObsLayout, vis_encode_type: str, hidden_units: int, gen: torch.Generator | None
    ) -> int:
        """One encoder per image sensor and per body (ML-Agents' actor and critic each own an
        ObservationEncoder; SB3's share_features_extractor=False); encodings are concatenated with the vector
        sensors in spec order and feed the body MLP. Returns the encodings' total size."""
        self.actor_encoders, self.critic_encoders = nn.ModuleList(), nn.ModuleList()
        total = 0
        for shape in layout.shapes:
            if len(shape) == 3:
                chw = layout.chw(shape)
                n = len(layout.shapes)
                enc, size = make_encoder(vis_encode_type, chw, hidden_units, n, gen)
                self.actor_encoders.append(enc)
                self.critic_encoders.append(make_encoder(vis_encode_type, chw, hidden_units, n, gen)[0])
                total += size
        return total

    def _init_weights(self, init: str, gen: torch.Generator | None) -> None:
        """The bodies' and heads' weights as ML-Agents or SB3 initialize them (``init``), from ``gen``."""
        hidden = [m for body in (self.actor_body, self.critic_body) for m in body if isinstance(m, nn.Linear)]
        if init == "mlagents":
            for layer in hidden:
                init_linear_mlagents(layer, MLAGENTS_HIDDEN_GAIN, gen)
            if self.mu_head is not None:
                init_linear_mlagents(self.mu_head, MLAGENTS_MEAN_GAIN, gen)
            if self.branch_head is not None:
                # One layer for all branches: Kaiming-normal depends on fan-in only, so its blocks are
                # distributed as ML-Agents' separate branch layers are.
                init_linear_mlagents(self.branch_head, MLAGENTS_BRANCH_GAIN, gen)
            init_linear_xavier(self.value_head, MLAGENTS_VALUE_GAIN, gen)
        else:
            for layer in hidden:
                init_linear_orthogonal(layer, SB3_HIDDEN_GAIN, gen)
            # SB3's action_net: one orthogonal layer (MultiDiscrete: all branches' logits side by side).
            for head in (self.mu_head, self.branch_head):
                if head is not None:
                    init_linear_orthogonal(head, SB3_ACTION_GAIN, gen)
            init_linear_orthogonal(self.value_head, SB3_VALUE_GAIN, gen)

    # ---------------------------------------------------------------- pieces

    def _actor_in(self, obs: torch.Tensor, normalized: bool) -> torch.Tensor:
        if self.visual:
            return self._encode(obs, self.actor_norm if self._norms else None, self.actor_encoders)
        if normalized or self.obs_norm_kind == "none":
            return obs
        if self.obs_norm_kind == "mlagents":
            return self.actor_norm(obs)
        return self.obs_norm(obs)

    def _critic_in(self, obs: torch.Tensor, normalized: bool) -> torch.Tensor:
        if self.visual:
            return self._encode(obs, self.critic_norm if self._norms else None, self.critic_encoders)
        if normalized or self.obs_norm_kind == "none":
            return obs
        if self.obs_norm_kind == "mlagents":
            return self.critic_norm(obs)
        return self.obs_norm(obs)

    def images(self, obs: torch.Tensor) -> list[torch.Tensor]:
        """Each image sensor of flat observations [B, obs_dim] as channel-first, scaled [B, C, H, W]."""
        layout, out = self.obs_layout, []
        for shape, part in zip(layout.shapes, obs.split(layout.sizes, dim=-1)):
            if len(shape) == 3:
                img = part.reshape(-1, *shape)
                if layout.channels_last:
                    img = img.permute(0, 3, 1, 2)
                out.append(img * layout.image_scale if layout.image_scale != 1.0 else img)
        return out

    def _encode(self, obs: torch.Tensor, norm: nn.Module | None, encoders: nn.ModuleList) -> torch.Tensor:
        """ML-Agents' ObservationEncoder: every sensor processed (vectors normalized, images encoded), the
        results concatenated in spec order."""
        vec = obs.index_select(-1, self.vector_index)
        if norm is not None:
            vec = norm(vec)
        vec_sizes = [n for s, n in zip(self.obs_layout.shapes, self.obs_layout.sizes) if len(s) == 1]
        vecs, imgs = iter(vec.split(vec_sizes, dim=-1)), iter(self.images(obs))
        parts = [
            next(vecs) if len(s) == 1 else enc(next(imgs))
            for s, enc in zip(self.obs_layout.shapes, self._per_sensor(encoders))
        ]
        return torch.cat(parts, dim=-1)

    def _per_sensor(self, encoders: nn.ModuleList) -> list[nn.Module | None]:
        it = iter(encoders)
        return [None if len(s) == 1 else next(it) for s in self.obs_layout.shapes]

    def actor_features(self, obs: torch.Tensor, *, normalized: bool = False) -> torch.Tensor:
        """The actor body's output [B, hidden] for observations [B, obs_dim]."""
        return self.actor_body(self._actor_in(obs, normalized))

    def mean(self, obs: torch.Tensor, *, normalized: bool = False) -> torch.Tensor:
        """Continuous action mean [B, A] for observations [B, obs_dim]."""
        return self.mu_head(self.actor_features(obs, normalized=normalized))

    def branch_logits(self, features: torch.Tensor, action_mask: torch.Tensor | None) -> list[torch.Tensor]:
        """Each branch's masked logits [B, n_i] from actor features; ``action_mask`` [B, sum(n)] bool
        (True: allowed) or None."""
        logits = self.branch_head(features).split(self.branches, dim=-1)
        masks = (None,) * len(self.branches) if action_mask is None else action_mask.split(self.branches, -1)
        return [ppo.mask_logits(x, m) for x, m in zip(logits, masks)]

    def discrete_log_probs(self, logits: list[torch.Tensor], actions: torch.Tensor) -> torch.Tensor:
        """The taken actions' log-probabilities [B, nb] (``actions`` [B, nb] indices)."""
        f = (
            ppo.categorical_log_prob_mlagents
            if self.log_prob_form == "mlagents"
            else ppo.categorical_log_prob_exact
        )
        return torch.stack([f(x, actions[:, i]) for i, x in enumerate(logits)], dim=-1)

    def discrete_entropy(self, logits: list[torch.Tensor], action_mask: torch.Tensor | None) -> torch.Tensor:
        """Each branch's entropy [B, nb]."""
        if self.log_prob_form == "mlagents":
            return torch.stack([ppo.categorical_entropy_mlagents(x) for x in logits], dim=-1)
        masks = (None,) * len(logits) if action_mask is None else action_mask.split(self.branches, -1)
        return torch.stack([ppo.categorical_entropy_exact(x, m) for x, m in zip(logits, masks)], dim=-1)

    def value(self, obs: torch.Tensor, *, normalized: bool = False) -> torch.Tensor:
        """State value [B] for observations [B, obs_dim]."""
        return self.value_head(self.critic_body(self._critic_in(obs, normalized))).squeeze(-1)

    def log_prob_per_dim(self, actions: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        if self.log_prob_form == "mlagents":
            return ppo.gaussian_log_prob_mlagents(actions, mu, self.log_sigma)
        return ppo.gaussian_log_prob_exact(actions, mu, self.log_sigma)

    def entropy_per_dim(self, batch: int) -> torch.Tensor:
        if not self.action_dim:
            return self.value_head.weight.new_zeros(batch, 0)
        log_sigma = self.log_sigma.expand(batch, self.action_dim)
        if self.log_prob_form == "mlagents":
            return ppo.gaussian_entropy_mlagents(log_sigma)
        return ppo.gaussian_entropy_exact(log_sigma)

    # ------------------------------------------------------------ public API

    @torch.no_grad()
    def act(
        self,
        obs: torch.Tensor,
        *,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
        action_mask: torch.Tensor | None = None,
    ) -> ActOutput:
        """Sample actions for raw observations [B, obs_dim] (with ``value``: see ``ActOutput``).

        Continuous: the raw sample [B, A] (unclipped), or the mean if ``deterministic``. Discrete: one
        index per branch drawn from the masked softmax (``torch.multinomial``, as ML-Agents and torch's
        ``Categorical`` sample), or its argmax.
        """
        features = self.actor_features(obs)
        parts = self.sample_from_features(features, deterministic, generator, action_mask)
        return ActOutput(parts[0], parts[1], self.value(obs), parts[2])

    def sample_from_features(
        self,
        features: torch.Tensor,
        deterministic: bool,
        generator: torch.Generator | None,
        action_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(continuous action [B, A], log-probs [B, A + nb], discrete action [B, nb] or None)."""
        batch = features.shape[0]
        action = features.new_zeros(batch, 0)
        log_probs = [features.new_zeros(batch, 0)]
        if self.mu_head is not None:
            mu = self.mu_head(features)
            action = mu
            if not deterministic:
                noise = torch.randn(mu.shape, dtype=mu.dtype, device=mu.device, generator=generator)
                action = mu + torch.exp(self.log_sigma) * noise
            log_probs = [self.log_prob_per_dim(action, mu)]
        discrete = None
        if self.branch_head is not None:
            logits = self.branch_logits(features, action_mask)
            if deterministic:
                picks = [x.argmax(-1) for x in logits]
            else:
                picks = [
                    torch.multinomial(torch.softmax(x, -1), 1, generator=generator)[:, 0] for x in logits
                ]
            discrete = torch.stack(picks, dim=-1)
            log_probs.append(self.discrete_log_probs(logits, discrete))
        return action, torch.cat(log_probs, dim=-1), discrete

    def evaluate(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        *,
        normalized: bool = False,
        discrete_actions: torch.Tensor | None = None,
        action_mask: torch.Tensor | None = None,
    ) -> EvalOutput:
        """Per-element log-probs [B, A + nb], continuous per-dimension entropy [B, A], per-branch entropy
        [B, nb] and values [B], for continuous ``actions`` [B, A] and ``discrete_actions`` [B, nb]
        taken under ``action_mask`` [B, sum(n)].

        ``normalized=True`` when ``obs`` already went through the (vecnormalize)
        obs transform, as SB3's buffer stores them.
        """
        features = self.actor_features(obs, normalized=normalized)
        batch = obs.shape[0]
        log_probs = [features.new_zeros(batch, 0)]
        if self.mu_head is not None:
            log_probs = [self.log_prob_per_dim(actions, self.mu_head(features))]
        discrete_entropy = features.new_zeros(batch, 0)
        if self.branch_head is not None:
            logits = self.branch_logits(features, action_mask)
            log_probs.append(self.discrete_log_probs(logits, discrete_actions))
            discrete_entropy = self.discrete_entropy(logits, action_mask)
        return EvalOutput(
            torch.cat(log_probs, dim=-1),
            self.entropy_per_dim(batch),
            self.value(obs, normalized=normalized),
            discrete_entropy,
        )

    @torch.no_grad()
    def update_normalizer(self, obs: torch.Tensor) -> None:
        """Fold one trajectory's raw obs [T, obs_dim] into both ML-Agents normalizers.

        A no-op for other obs_norm kinds: the vecnormalize snapshot is set by
        the learner, which owns the running statistics.
        """
        if self._norms:
            if self.visual:
                obs = obs.index_select(-1, self.vector_index)
            self.actor_norm.update(obs)
            self.critic_norm.update(obs)

    def normalize_obs(self, obs: torch.Tensor) -> torch.Tensor:
        """The vecnormalize transform (identity for other kinds), as the buffer stores obs."""
        if self.obs_norm_kind == "vecnormalize":
            return self.obs_norm(obs)
        return obs


def make_policy(
    config: PPOConfig,
    obs_dim: int,
    action_dim: int,
    branches: tuple[int, ...] = (),
    obs_layout: ObsLayout | None = None,
) -> ActorCritic:
    """The actor-critic a learner and its actors share (same layout, same state_dict keys). ``obs_layout``
    says which parts of the flat observation are images (None: one vector)."""
    return ActorCritic(
        obs_dim,
        action_dim,
        branches=branches,
        obs_layout=obs_layout,
        vis_encode_type=config.vis_encode_type,
        hidden_units=config.hidden_units,
        num_layers=config.num_layers,
        activation=config.activation,
        init=config.init,
        obs_norm=config.obs_norm,
        log_prob_form=config.log_prob_form,
        seed=config.seed,
    )
