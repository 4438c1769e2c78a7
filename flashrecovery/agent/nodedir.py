"""The agent's private directory for its node's local sockets (agent/relay.py, agent/links.py)
and its processes' temporary files.

Only the user can enter it (mode 0700): that is what keeps other local users away from the
sockets. Its name carries the agent's pid, so a SIGKILLed agent's directory, which nothing
removed, is recognised and removed by the next agent that starts on the host.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "flashrecovery-node-"


class NodeDir:
    """``path`` is a fresh private directory; ``close()`` removes it. ``tmp`` in it is the
    ``TMPDIR`` of the node's ranks and spares: what they leave there (a SIGKILLed rank's
    multiprocessing directories, say) goes with the job."""

    def __init__(self) -> None:
        remove_stale(Path(tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))  # mode 0700
        self.tmp = self.path / "tmp"
        self.tmp.mkdir(mode=0o700)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_stale(parent: Path) -> list[Path]:
    """Remove the user's node directories under ``parent`` whose agent is no longer running;
    return them."""
    removed = []
    for path in parent.glob(f"{PREFIX}*"):
        pid = _owner_pid(path)
        if pid is not None and not _running(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _owner_pid(path: Path) -> int | None:
    """The agent pid in the directory's name, if it is one of this user's node directories."""
    pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
    try:
        mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
    except OSError:
        return None
    return int(pid) if mine and pid.isdigit() else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds the pid now: leave the directory be
    return True
