"""The trainer hook: what a PyTorch training loop calls to survive rank failures (docs/hook.md).

session = init()
session.register(model, optimizer)
for step in session.steps(total):
    loss_fn(model(batch(step, session.rank))).backward()
    session.commit()
session.finish()

The session (and torch with it) is imported on first use: the agent imports this package's
launch environment and fault probe, and an agent that imported torch would take seconds more of
CPU to start, on every node and in every fresh replacement's launch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flashrecovery.errors import (
    FallbackRequired,
    JobFailed,
    LaunchError,
    ProtocolError,
    ReplacedError,
)

if TYPE_CHECKING:
    from flashrecovery.trainer_hooks.session import Session, Stateful, init, init_process_group

_FROM_SESSION = ("Session", "Stateful", "init", "init_process_group")

__all__ = [
    "FallbackRequired",
    "JobFailed",
    "LaunchError",
    "ProtocolError",
    "ReplacedError",
    "Session",
    "Stateful",
    "init",
    "init_process_group",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_SESSION:
        return getattr(importlib.import_module("flashrecovery.trainer_hooks.session"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
