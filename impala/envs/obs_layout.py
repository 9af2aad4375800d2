"""How a PPO policy cuts its flat observation back into sensors (docs/PPO.md, visual observations).

Observations travel flat: every unroll stores ``obs`` as float32 [T+1, obs_dim], the concatenation of the
sensors' values in spec order, each flattened in C order (Unity's ``UnityVecEnv`` already sends them so;
a gymnasium image env's frame is one sensor). The policy reads the layout from here and reshapes each
rank-3 sensor into an image. The cost: images travel as float32, four bytes a pixel where uint8 would
take one (an 84x84x4 Atari frame is 113 KB a step, twice with ``final_obs``), which suits the small
cameras of ML-Agents' examples and tiny image envs, not Atari-scale runs.

It lives with the envs because an env's probe is what finds the layout (``impala.envs.probe``); the
networks and the messages read it from here, so imports between the rooms point one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class ObsLayout:
    """``shapes``: each sensor's shape as the env gives it, in the flat observation's order (empty: one
    vector of the policy's ``obs_dim``). Rank-1 shapes are vectors, rank-3 ones images: channels last
    (HWC, as Unity sends cameras and most gymnasium image envs) when ``channels_last``, else CHW. Images
    are multiplied by ``image_scale`` (1/255 for uint8 images in [0, 255], as SB3's ``preprocess_obs``
    does; 1 for Unity's cameras, already in [0, 1])."""

    shapes: tuple[tuple[int, ...], ...] = ()
    channels_last: bool = True
    image_scale: float = 1.0

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(n) for n in s) for s in self.shapes)
        object.__setattr__(self, "shapes", shapes)
        for s in shapes:
            if len(s) not in (1, 3) or min(s) < 1:
                raise ValueError(
                    f"observation layout: each sensor is a vector (rank 1) or an image (rank 3) of positive "
                    f"sizes, got {s}"
                )
        if not (np.isfinite(self.image_scale) and self.image_scale > 0):
            raise ValueError(f"observation layout: image_scale must be > 0, got {self.image_scale}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s)) for s in self.shapes)

    @property
    def visual(self) -> bool:
        return any(len(s) == 3 for s in self.shapes)

    def chw(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """An image sensor's (channels, height, width)."""
        if self.channels_last:
            return (shape[2], shape[0], shape[1])
        return (shape[0], shape[1], shape[2])

    def to_dict(self) -> dict[str, Any]:
        return {
            "shapes": [list(s) for s in self.shapes],
            "channels_last": self.channels_last,
            "image_scale": self.image_scale,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ObsLayout":
        shapes = d.get("shapes", [])
        if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(type(n) is int for n in s) for s in shapes
        ):
            raise ValueError("observation layout: shapes must be lists of integers")
        if not isinstance(d.get("channels_last", True), bool) or not isinstance(
            d.get("image_scale", 1.0), (int, float)
        ):
            raise ValueError("observation layout: channels_last must be a bool and image_scale a number")
        return cls(
            tuple(tuple(s) for s in shapes), d.get("channels_last", True), float(d.get("image_scale", 1.0))
        )


def image_layout(shape: tuple[int, ...], dtype: str) -> ObsLayout:
    """The layout of a gymnasium env whose observation is one image of ``shape``: channels first when the
    first side is the smallest (SB3's ``is_image_space_channels_first`` rule; SB3 transposes the others
    with ``VecTransposeImage``), uint8 scaled by 1/255."""
    channels_last = int(np.argmin(shape)) != 0
    return ObsLayout((tuple(shape),), channels_last, 1.0 / 255.0 if dtype == "uint8" else 1.0)
