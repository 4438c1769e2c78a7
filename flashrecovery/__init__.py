"""flashrecovery: keep PyTorch training jobs running through rank failures.

``import flashrecovery`` offers the trainer hook as the docs call it
(``flashrecovery.init_process_group()``, ``flashrecovery.init()``, the errors): the names of
``flashrecovery.trainer_hooks``, which imports torch only on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashrecovery.trainer_hooks import (
        FallbackRequired,
        JobFailed,
        LaunchError,
        ProtocolError,
        ReplacedError,
        Session,
        Stateful,
        init,
        init_process_group,
    )

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
    if name in __all__:
        return getattr(importlib.import_module("flashrecovery.trainer_hooks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
