"""Random number generator states: captured when a step starts so an aborted step can be
recomputed with the same randomness, and sent to a replacement with the rest of the state."""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch and for us
    np = None  # type: ignore[assignment]


def capture() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def restore(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if np is not None and "numpy" in states:
        np.random.set_state(states["numpy"])
