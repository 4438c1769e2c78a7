"""flashrecovery: keep PyTorch training jobs running through rank failures.

``import flashrecovery`` offers the trainer hook as the docs call it
(``flashrecovery.init_process_group()``, ``flashrecovery.init()``, the errors): the names of
``flashrecovery.trainer_hooks``, which imports torch only on first use. In a process an agent
started, importing it also leaves the agent the exception that ends the process, if one does
(trainer_hooks/exit_note.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashrecovery import trainer_hooks as hooks
from flashrecovery.trainer_hooks import exit_note

if TYPE_CHECKING:  # what a type checker sees of the names __getattr__ hands out
    from flashrecovery.trainer_hooks import *  # noqa: F403

__all__ = list(hooks.__all__)


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(hooks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


exit_note.install()
