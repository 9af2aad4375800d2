"""``PixelCatch-v0``: a two-minute check that the image path learns (bsuite's Catch, drawn in pixels).

A ball falls one row per step from a random column of a 10 x 5 grid; the agent moves a
paddle on the bottom row left, not at all, or right. When the ball reaches the bottom,
the episode ends with reward +1 (caught) or -1 (missed). Random play scores about -0.5,
perfect play +1, and the right move depends only on where the ball and paddle are, so
the policy must read the image.

It is drawn like an Atari observation after DeepMind preprocessing: uint8
``[4, 84, 84]`` (four stacked frames), each grid cell an 8 x 16-pixel block, on a
mid-gray background (Pong's frames are a constant field too; an all-zero background
would hide a first layer that cannot cope with one). So it goes through the same CNN
torso, wire schema and learner as Pong, in ~1/100 of the frames. Issue 8: Pong did not
learn at all and the CartPole test could not tell; this env can.
"""

from __future__ import annotations

from collections import deque

import gymnasium as gym
import numpy as np

ENV_ID = "PixelCatch-v0"
ROWS, COLS = 10, 5
CELL_H, CELL_W = 8, 16
SIZE = 84
STACK = 4
BACKGROUND, OBJECT = 90, 230
_TOP = (SIZE - ROWS * CELL_H) // 2
_LEFT = (SIZE - COLS * CELL_W) // 2


class PixelCatch(gym.Env):
    """bsuite's Catch drawn as 84x84 frames: a ball falls, the paddle must be under it (+1, else -1)."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (STACK, SIZE, SIZE), np.uint8)
        self.action_space = gym.spaces.Discrete(3)  # left, stay, right
        self.render_mode = render_mode
        self._frames: deque[np.ndarray] = deque(maxlen=STACK)
        self.ball_row = self.ball_col = self.paddle = 0

    def _draw(self) -> np.ndarray:
        frame = np.full((SIZE, SIZE), BACKGROUND, np.uint8)
        for row, col in ((self.ball_row, self.ball_col), (ROWS - 1, self.paddle)):
            top, left = _TOP + row * CELL_H, _LEFT + col * CELL_W
            frame[top : top + CELL_H, left : left + CELL_W] = OBJECT
        return frame

    def _obs(self) -> np.ndarray:
        return np.stack(self._frames, axis=0)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.ball_row = 0
        self.ball_col = int(self.np_random.integers(COLS))
        self.paddle = COLS // 2
        frame = self._draw()
        for _ in range(STACK):
            self._frames.append(frame)
        return self._obs(), {}

    def step(self, action: int):
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 0, COLS - 1))
        self.ball_row += 1
        terminated = self.ball_row == ROWS - 1
        reward = (1.0 if self.paddle == self.ball_col else -1.0) if terminated else 0.0
        self._frames.append(self._draw())
        return self._obs(), reward, terminated, False, {}

    def render(self) -> np.ndarray:
        return np.repeat(self._draw()[..., None], 3, axis=-1)


def register() -> None:
    """Register ``PixelCatch-v0`` with gymnasium (once)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point=f"{__name__}:PixelCatch")
