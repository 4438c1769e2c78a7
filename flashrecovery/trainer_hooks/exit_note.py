"""The exception that ended a rank or spare, left for its agent in one line.

The agent sees an exit code; the user needs the error (``KeyError: 'RANK'``), and the
process's output may be a terminal or a file the agent does not read. So every process the
agent starts (the fork server's child, or the hook's import under ``--start-method exec``)
chains a ``sys.excepthook`` that writes the exception's last line into the agent's private
directory; the agent takes it when the process exits and puts it in ``RankExited.error``
(and ``fatal`` for a ``ScriptError``: the job fails at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from types import TracebackType

from flashrecovery.errors import ScriptError

ENV = "FLASHRECOVERY_EXIT_NOTES"  # the agent's node directory
MAX_CHARS = 300
_installed = False


def install() -> None:
    """In a process the agent started (``ENV`` set): note an uncaught exception, then let the
    hook before it print the traceback as ever."""
    global _installed
    directory = os.environ.get(ENV)
    if not directory or _installed:
        return
    _installed = True
    previous = sys.excepthook

    def note(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        line = traceback.format_exception_only(kind, value)[-1].strip()[:MAX_CHARS]
        left = ExitNote(line, fatal=isinstance(value, ScriptError))
        with contextlib.suppress(OSError):  # the agent's directory is gone: it is ending too
            _path(Path(directory), os.getpid()).write_text(json.dumps(dataclasses.asdict(left)))
        previous(kind, value, tb)

    sys.excepthook = note


@dataclasses.dataclass(frozen=True)
class ExitNote:
    error: str  # the exception's last line: ``KeyError: 'RANK'``
    fatal: bool  # a ScriptError: no replacement would do better


def take(directory: Path, pid: int) -> ExitNote | None:
    """The note process ``pid`` left, once (None if it left none, or half of one)."""
    path = _path(directory, pid)
    try:
        text = path.read_text()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    try:
        return ExitNote(**json.loads(text))
    except (ValueError, TypeError):
        return None


def advice(error: str, spare: bool) -> str | None:
    """What to change, where an error says a script reads what a process cannot have yet."""
    if spare and error == "KeyError: 'RANK'":
        return (
            "the script reads RANK before flashrecovery.init_process_group(), and a hot spare "
            "has no rank until it takes one: read it after (or use dist.get_rank())"
        )
    return None


def _path(directory: Path, pid: int) -> Path:
    return directory / f"exit-{pid}"
