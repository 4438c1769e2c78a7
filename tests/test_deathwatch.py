"""The death watch (agent/deathwatch.py): a process that holds its robust mutex is seen dying as
the kernel starts tearing it down, with its exit status, in real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from flashrecovery.agent import deathwatch

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not deathwatch.SUPPORTED, reason="no known futex syscall on this CPU"),
]

HOLD = "from flashrecovery.agent import deathwatch; deathwatch.hold(); print('held', flush=True)\n"


def started(watch: deathwatch.Watch, body: str) -> subprocess.Popen[str]:
    """A process that holds ``watch``'s mutex, then runs ``body``."""
    env = {**os.environ, deathwatch.ENV: str(watch.path)}
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD + body], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def waited(
    watch: deathwatch.Watch, ended: Callable[[], bool]
) -> tuple[threading.Event, list[bool]]:
    """``watch.wait`` on a thread: set once it returned, with what it returned."""
    returned: list[bool] = []
    done = threading.Event()

    def run() -> None:
        returned.append(watch.wait(ended))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, returned


def test_a_sigkilled_holder_is_seen_dying_with_its_signal(tmp_path: Path) -> None:
    watch = deathwatch.Watch(tmp_path)
    process = started(watch, "import time; time.sleep(60)\n")
    done, returned = waited(watch, lambda: False)
    assert not done.wait(0.2)  # alive: the watch waits
    assert not watch.path.exists()  # held: its file is gone already
    process.send_signal(signal.SIGKILL)
    assert done.wait(10) and returned == [True]
    assert deathwatch.exit_status(process.pid) == -signal.SIGKILL  # not reaped yet: still there
    assert process.wait(10) == -signal.SIGKILL
    watch.close()


def test_an_exit_of_its_own_is_seen_with_its_code(tmp_path: Path) -> None:
    watch = deathwatch.Watch(tmp_path)
    process = started(watch, "import sys; sys.stdin.readline(); sys.exit(3)\n")
    done, returned = waited(watch, lambda: False)
    process.communicate("go\n", timeout=10)
    assert done.wait(10) and returned == [True]
    assert process.returncode == 3
    watch.close()


def test_a_process_that_never_held_it_ends_the_wait_once_it_has_ended(tmp_path: Path) -> None:
    watch = deathwatch.Watch(tmp_path)
    process = subprocess.Popen([sys.executable, "-c", "pass"])  # no ENV: it holds nothing
    done, returned = waited(watch, lambda: process.poll() is not None)
    assert done.wait(10) and returned == [False]
    watch.close()
    assert not watch.path.exists()


def test_the_mutex_is_not_handed_down_to_the_holders_own_children(tmp_path: Path) -> None:
    """A rank's DataLoader workers are forked from it: one that ends is no death of the rank."""
    watch = deathwatch.Watch(tmp_path)
    process = started(
        watch,
        "import os, sys\n"
        "child = os.fork()\n"
        "if child == 0: os._exit(0)\n"
        "os.waitpid(child, 0); print('forked', flush=True); sys.stdin.readline()\n",
    )
    done, returned = waited(watch, lambda: False)
    assert process.stdout is not None and process.stdout.readline() == "forked\n"
    assert deathwatch.ENV not in os.environ
    assert not done.wait(0.3)  # its child ended, the holder did not
    process.communicate("go\n", timeout=10)
    assert done.wait(10) and returned == [True]
    watch.close()
