"""A script that makes torch's default group itself, under `flashrecovery run`, is told so.

An unported script calls ``dist.init_process_group("gloo")``: torch then looks for ``RANK`` (a
spare has none), binds ``MASTER_PORT`` (the agent's store holds it) and fails in a traceback,
once per replacement, until the crash-loop guard ends the job. In a process the agent started,
the call raises ``ScriptError`` with the fix instead, and the job ends at once.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from flashrecovery.errors import ScriptError

ROLE_ENV = "FLASHRECOVERY_ROLE"  # set by the agent on every process it starts
FIX = (
    "the script calls torch.distributed.init_process_group() itself: under flashrecovery run, "
    "call flashrecovery.init_process_group() instead (it makes the default group and returns "
    "the session; docs/hook.md)"
)
_installed = False


def install() -> None:
    """Guard torch's ``init_process_group`` in this process, if the agent started it; the
    hook's own call (its backend) goes through."""
    global _installed
    if ROLE_ENV not in os.environ or _installed:
        return
    _installed = True
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from flashrecovery.trainer_hooks.stable_group import BACKEND

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        backend = args[0] if args else kwargs.get("backend")
        if backend != BACKEND:
            raise ScriptError(FIX)
        return original(*args, **kwargs)

    dist.init_process_group = distributed_c10d.init_process_group = guarded
