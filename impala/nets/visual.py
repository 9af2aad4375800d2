"""Visual encoders for PPO, layer for layer as ML-Agents 0.28 and SB3 build them (docs/PPO.md, visual
observations).

``vis_encode_type`` names the encoder of every camera / image sensor:

- ``simple``, ``nature_cnn``, ``resnet``: ML-Agents' ``SimpleVisualEncoder``, ``NatureVisualEncoder`` and
  ``ResNetVisualEncoder`` (``mlagents/trainers/torch/encoders.py``): LeakyReLU convolutions (ResNet: Swish
  residual blocks and max-pools) and a dense layer of ``hidden_units`` outputs. The convolutions keep
  torch's default initialization, the dense layer is Kaiming-normal (linear) x 1.41 with zero bias, as
  ``linear_layer(..., KaimingHeNormal, kernel_gain=1.41)`` does.
- ``sb3_nature_cnn``: SB3's ``NatureCNN`` (``stable_baselines3/common/torch_layers.py``): ReLU convolutions
  and a dense ReLU layer of ``features_dim`` outputs (512 when the image is the only observation, as
  ``CnnPolicy`` has; 256 beside other sensors, ``CombinedExtractor``'s ``cnn_output_dim``), initialized
  as SB3's ``ortho_init`` does a features extractor: orthogonal, gain sqrt(2), zero biases.

Every encoder here takes channel-first float images [B, C, H, W]; the policy
(:class:`impala.nets.ppo_policy.ActorCritic`) cuts each sensor out of the flat observation, moves the
channels first (Unity sends HWC) and scales uint8 images by 1/255. Module and attribute names follow the
originals, so their ``state_dict`` keys are the same (the parity tests load ML-Agents' and SB3's weights
straight into ours).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from impala.options import ConfigError

MLAGENTS_ENCODERS = ("simple", "nature_cnn", "resnet")
VIS_ENCODE_TYPES = (*MLAGENTS_ENCODERS, "sb3_nature_cnn")
# ML-Agents' ModelUtils.MIN_RESOLUTION_FOR_ENCODER; NatureCNN's three valid convolutions need the same 36.
MIN_RESOLUTION = {"simple": 20, "nature_cnn": 36, "resnet": 15, "sb3_nature_cnn": 36}
MLAGENTS_DENSE_GAIN = 1.41  # "Use ReLU gain"
SB3_FEATURES_DIM = 512  # NatureCNN(features_dim=512): CnnPolicy
SB3_COMBINED_CNN_DIM = 256  # CombinedExtractor(cnn_output_dim=256): MultiInputPolicy


def conv_output_shape(hw: tuple[int, int], kernel: int, stride: int, padding: int = 0) -> tuple[int, int]:
    """Height and width after a convolution (ML-Agents' ``conv_output_shape``)."""
    return tuple((x + 2 * padding - (kernel - 1) - 1) // stride + 1 for x in hw)  # type: ignore[return-value]


def pool_out_shape(hw: tuple[int, int], kernel: int) -> tuple[int, int]:
    """Height and width after a stride-2 max-pool (ML-Agents' ``pool_out_shape``)."""
    return tuple((x - kernel) // 2 + 1 for x in hw)  # type: ignore[return-value]


def _mlagents_dense(in_dim: int, out_dim: int, generator: torch.Generator | None) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim)
    nn.init.kaiming_normal_(layer.weight, nonlinearity="linear", generator=generator)
    with torch.no_grad():
        layer.weight.mul_(MLAGENTS_DENSE_GAIN)
    nn.init.zeros_(layer.bias)
    return layer


def _torch_default_conv_init(module: nn.Module, generator: torch.Generator | None) -> None:
    """``nn.Conv2d.reset_parameters`` drawn from ``generator`` (so a seeded policy is reproducible)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=generator)
            bound = 1.0 / math.sqrt(m.weight[0].numel())
            nn.init.uniform_(m.bias, -bound, bound, generator=generator)


class SimpleVisualEncoder(nn.Module):
    """ML-Agents' ``simple``: conv 8x8/4 (16), conv 4x4/2 (32), dense; LeakyReLU after each."""

    def __init__(self, height: int, width: int, channels: int, output_size: int, generator=None):
        super().__init__()
        hw = conv_output_shape(conv_output_shape((height, width), 8, 4), 4, 2)
        self.final_flat = hw[0] * hw[1] * 32
        self.conv_layers = nn.Sequential(
            nn.Conv2d(channels, 16, [8, 8], [4, 4]),
            nn.LeakyReLU(),
            nn.Conv2d(16, 32, [4, 4], [2, 2]),
            nn.LeakyReLU(),
        )
        self.dense = nn.Sequential(_mlagents_dense(self.final_flat, output_size, generator), nn.LeakyReLU())
        _torch_default_conv_init(self, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.conv_layers(x).reshape(-1, self.final_flat))


class NatureVisualEncoder(nn.Module):
    """ML-Agents' ``nature_cnn``: conv 8x8/4 (32), 4x4/2 (64), 3x3/1 (64), dense; LeakyReLU after each."""

    def __init__(self, height: int, width: int, channels: int, output_size: int, generator=None):
        super().__init__()
        hw = conv_output_shape(conv_output_shape(conv_output_shape((height, width), 8, 4), 4, 2), 3, 1)
        self.final_flat = hw[0] * hw[1] * 64
        self.conv_layers = nn.Sequential(
            nn.Conv2d(channels, 32, [8, 8], [4, 4]),
            nn.LeakyReLU(),
            nn.Conv2d(32, 64, [4, 4], [2, 2]),
            nn.LeakyReLU(),
            nn.Conv2d(64, 64, [3, 3], [1, 1]),
            nn.LeakyReLU(),
        )
        self.dense = nn.Sequential(_mlagents_dense(self.final_flat, output_size, generator), nn.LeakyReLU())
        _torch_default_conv_init(self, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.conv_layers(x).reshape(-1, self.final_flat))


class ResNetBlock(nn.Module):
    """ML-Agents' residual block: x + conv(swish(conv(swish(x))))."""

    def __init__(self, channel: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.SiLU(),  # ML-Agents' Swish: x * sigmoid(x)
            nn.Conv2d(channel, channel, [3, 3], [1, 1], padding=1),
            nn.SiLU(),
            nn.Conv2d(channel, channel, [3, 3], [1, 1], padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class ResNetVisualEncoder(nn.Module):
    """ML-Agents' ``resnet`` (IMPALA's): three stacks (16, 32, 32 channels) of conv 3x3, max-pool 3/2 and two
    residual blocks, Swish, dense, ReLU."""

    def __init__(self, height: int, width: int, channels: int, output_size: int, generator=None):
        super().__init__()
        layers: list[nn.Module] = []
        last = channels
        for channel in (16, 32, 32):
            layers.append(nn.Conv2d(last, channel, [3, 3], [1, 1], padding=1))
            layers.append(nn.MaxPool2d([3, 3], [2, 2]))
            height, width = pool_out_shape((height, width), 3)
            layers += [ResNetBlock(channel), ResNetBlock(channel)]
            last = channel
        layers.append(nn.SiLU())
        self.final_flat_size = 32 * height * width
        self.dense = _mlagents_dense(self.final_flat_size, output_size, generator)
        self.sequential = nn.Sequential(*layers)
        _torch_default_conv_init(self, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.dense(self.sequential(x).reshape(-1, self.final_flat_size)))


class NatureCNN(nn.Module):
    """SB3's ``NatureCNN``: conv 8x8/4 (32), 4x4/2 (64), 3x3/1 (64), flatten, dense; ReLU after each."""

    def __init__(self, height: int, width: int, channels: int, features_dim: int, generator=None):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=8, stride=4, padding=0),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=4, stride=2, padding=0),
            nn.ReLU(),
            nn.Conv2d(64, 64, kernel_size=3, stride=1, padding=0),
            nn.ReLU(),
            nn.Flatten(),
        )
        hw = conv_output_shape(conv_output_shape(conv_output_shape((height, width), 8, 4), 4, 2), 3, 1)
        self.linear = nn.Sequential(nn.Linear(hw[0] * hw[1] * 64, features_dim), nn.ReLU())
        for m in self.modules():  # ActorCriticPolicy._build: features extractor gain sqrt(2)
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.orthogonal_(m.weight, gain=math.sqrt(2), generator=generator)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.cnn(x))


def check_image_shape(chw: tuple[int, int, int], vis_encode_type: str, what: str) -> None:
    """ConfigError (one line) when ``vis_encode_type`` is unknown or the image is below its minimum side."""
    if vis_encode_type not in VIS_ENCODE_TYPES:
        raise ConfigError(
            f"vis_encode_type: must be one of {', '.join(VIS_ENCODE_TYPES)}, got {vis_encode_type!r}"
        )
    c, h, w = chw
    need = MIN_RESOLUTION[vis_encode_type]
    if h < need or w < need or c < 1:
        source = (
            "its three valid convolutions"
            if vis_encode_type == "sb3_nature_cnn"
            else "ML-Agents' MIN_RESOLUTION_FOR_ENCODER"
        )
        fix = "--vis-encode-type resnet (15)" if min(h, w) >= 15 else "a larger camera"
        raise ConfigError(
            f"vis_encode_type: {what}, a {h}x{w} image ({c} channels), is too small for {vis_encode_type!r}, "
            f"whose minimum side is {need} ({source}); use {fix}"
        )


def make_encoder(
    vis_encode_type: str, chw: tuple[int, int, int], hidden_units: int, n_sensors: int, generator=None
) -> tuple[nn.Module, int]:
    """(encoder, its output size) for one image sensor of shape ``chw``; ``n_sensors`` counts all the
    policy's sensors (SB3's extractor width depends on whether the image is alone)."""
    check_image_shape(chw, vis_encode_type, "the observation")
    c, h, w = chw
    if vis_encode_type == "sb3_nature_cnn":
        dim = SB3_FEATURES_DIM if n_sensors == 1 else SB3_COMBINED_CNN_DIM
        return NatureCNN(h, w, c, dim, generator), dim
    cls = {"simple": SimpleVisualEncoder, "nature_cnn": NatureVisualEncoder, "resnet": ResNetVisualEncoder}
    return cls[vis_encode_type](h, w, c, hidden_units, generator), hidden_units
