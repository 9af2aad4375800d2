"""Model parameters as named numpy arrays: what a weights message carries.

The learner publishes ``state_dict_arrays(model)``; an actor checks the message against
``state_dict_schema(its_model)`` (exact names, dtypes and shapes) before
``load_state_arrays`` copies it in. Shared by every learner and agent adapter.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from impala.transport.trajectory import ArraySpec, TrajectorySchema


def state_dict_schema(module: torch.nn.Module) -> TrajectorySchema:
    """The exact layout a params message for ``module`` must have."""
    return TrajectorySchema(
        tuple(ArraySpec(k, str(v.numpy().dtype), tuple(v.shape)) for k, v in module.state_dict().items())
    )


def state_dict_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A module's state dict as named CPU arrays (what a weights message carries)."""
    return {k: v.detach().to("cpu").contiguous().numpy() for k, v in module.state_dict().items()}


def load_state_arrays(module: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    # Copy: the arrays are views over received ZeroMQ frames. Tensors (a checkpoint's) are cloned directly:
    # np.array(tensor) goes through Tensor.__array__, which numpy 2 deprecates for lacking a copy keyword.
    """Load named arrays (or tensors) into ``module``, copying them."""
    module.load_state_dict(
        {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
            for k, v in arrays.items()
        }
    )
