"""The fork server (agent/forkserver.py) and the supervisor's two ways to start a process: each
child runs its script as `python script.py` would, and its exit reaches the agent with the code
`subprocess` would give."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flashrecovery.agent.forkserver import ForkServer, Task
from flashrecovery.agent.supervisor import Child, Supervisor

pytestmark = pytest.mark.timeout(120)

REPORT = """\
import json, os, sys
from pathlib import Path
Path(sys.argv[1]).write_text(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
    "env": os.environ.get("ONLY_THIS_CHILD"), "sid": os.getsid(0), "pid": os.getpid(),
    "torch_loaded": "torch" in sys.modules,
    "cmdline": open("/proc/self/cmdline").read().replace(chr(0), " ").strip(),
    "seeds": [__import__("torch").initial_seed(), __import__("random").random()],
}))
print("to stdout"); print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[2]))
"""
RAISE = "raise RuntimeError('the script failed')\n"
SLEEP = "import time\ntime.sleep(60)\n"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer(dict(os.environ))
    assert forks.ready(), forks.refusal
    yield forks
    forks.close()


def ended(pid: int, timeout: float = 10.0) -> bool:
    """Whether the process is gone (or a zombie no one reaped yet) within ``timeout``."""
    try:
        process = psutil.Process(pid)
        deadline = time.monotonic() + timeout
        while process.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass
    return True


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_child_runs_its_script_as_python_would(server: ForkServer, tmp_path: Path) -> None:
    report, output = tmp_path / "report.json", tmp_path / "out.log"
    argv = [sys.executable, str(script(tmp_path, "report.py", REPORT)), str(report), "3"]
    env = {**os.environ, "ONLY_THIS_CHILD": "yes"}
    child = server.spawn(Task(argv, env, str(tmp_path), str(output)))
    assert child.wait(60) == 3
    seen = json.loads(report.read_text())
    assert seen["argv"] == argv[1:] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path / "scripts")
    assert seen["env"] == "yes" and "ONLY_THIS_CHILD" not in os.environ
    assert seen["sid"] == seen["pid"] == child.pid  # a session of its own
    assert seen["torch_loaded"]  # imported before the fork, not by the script
    assert seen["cmdline"] == shlex.join(argv)  # what `ps` shows

    # Seeded afresh, as new interpreters would be: forked alike, they would draw alike.
    again = tmp_path / "again.json"
    other = server.spawn(
        Task([argv[0], argv[1], str(again), "0"], env, str(tmp_path), str(tmp_path / "again.log"))
    )
    assert other.wait(60) == 0
    seeds = json.loads(again.read_text())["seeds"]
    assert all(a != b for a, b in zip(seeds, seen["seeds"], strict=True))
    # (then, at exit, whatever the interpreter says: triton's leak report of what was frozen)
    assert output.read_text().splitlines()[:2] == ["to stdout", "to stderr"]


def test_exits_are_reported_as_subprocess_reports_them(server: ForkServer, tmp_path: Path) -> None:
    failing = server.spawn(
        Task([sys.executable, str(script(tmp_path, "raise.py", RAISE))], dict(os.environ),
             str(tmp_path), str(tmp_path / "raise.log"))
    )  # fmt: skip
    assert failing.wait(60) == 1
    assert "RuntimeError: the script failed" in (tmp_path / "raise.log").read_text()
    sleeper = server.spawn(
        Task([sys.executable, str(script(tmp_path, "sleep.py", SLEEP))], dict(os.environ),
             str(tmp_path), None)
    )  # fmt: skip
    assert sleeper.poll() is None
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(60) == -signal.SIGKILL


def test_children_outlive_a_closed_server_and_die_with_a_lost_one(tmp_path: Path) -> None:
    sleep = [sys.executable, str(script(tmp_path, "sleep.py", SLEEP))]
    closed = ForkServer(dict(os.environ))
    assert closed.ready()
    survivor = closed.spawn(Task(sleep, dict(os.environ), str(tmp_path), None))
    closed.close()  # the agent's end: its children are torn down by the supervisor, not here
    assert psutil.pid_exists(survivor.pid)
    os.kill(survivor.pid, signal.SIGKILL)

    lost = ForkServer(dict(os.environ))
    assert lost.ready()
    orphan = lost.spawn(Task(sleep, dict(os.environ), str(tmp_path), None))
    lost._process.kill()  # the server dies on its own: nothing could wait for its children
    assert orphan.wait(60) == -signal.SIGKILL
    assert ended(orphan.pid)
    with pytest.raises(OSError, match="gone"):
        lost.spawn(Task(sleep, dict(os.environ), str(tmp_path), None))
    lost.close()


@pytest.mark.parametrize("method", ["forkserver", "exec"])
def test_the_supervisor_reports_a_rank_exit_either_way(
    method: str, tmp_path: Path, server: ForkServer
) -> None:
    report = tmp_path / "report.json"
    exits: list[tuple[int | None, int]] = []
    done = threading.Event()

    def on_exit(child: Child, code: int) -> None:
        exits.append((child.rank, code))
        done.set()

    forks = server if method == "forkserver" else None
    supervisor = Supervisor(
        [sys.executable, str(script(tmp_path, "report.py", REPORT)), str(report), "0"],
        dict(os.environ),
        on_exit,
        tmp_path / "output",
        nproc_per_node=2,
        spare_ids=lambda: 0,
        forks=forks,
        watches=tmp_path,
    )
    try:
        child = supervisor.spawn_rank(1)
        assert done.wait(60)
        child.popen.wait(30)  # reported as it ended, maybe before it was reaped
        assert exits == [(1, 0)] and supervisor.all_finished()
        assert json.loads(report.read_text())["pid"] == child.pid
        [output] = (tmp_path / "output").iterdir()
        assert output.name.startswith("rank1-") and "to stderr" in output.read_text()
    finally:
        supervisor.teardown()


HEAP = "import sys, time\nheap = b'x' * (400 << 20)\nprint('ready', flush=True)\ntime.sleep(60)\n"


@pytest.mark.parametrize("method", ["forkserver", "exec"])
def test_a_sigkilled_rank_is_reported_as_it_dies_not_once_reaped(
    method: str, tmp_path: Path, server: ForkServer
) -> None:
    """The kernel unmaps a dying process's memory before its parent can reap it (tens of
    milliseconds for a few hundred megabytes): the death watch reports the exit before that,
    with the signal, once."""
    exits: list[tuple[int, bool]] = []
    done = threading.Event()

    def on_exit(child: Child, code: int) -> None:
        exits.append((code, child.alive))
        done.set()

    supervisor = Supervisor(
        [sys.executable, str(script(tmp_path, "heap.py", HEAP))],
        dict(os.environ),
        on_exit,
        tmp_path / "output",
        nproc_per_node=1,
        spare_ids=lambda: 0,
        forks=server if method == "forkserver" else None,
        watches=tmp_path,
    )
    try:
        child = supervisor.spawn_rank(0)
        output = tmp_path / "output"
        deadline = time.monotonic() + 60
        while "ready" not in "".join(p.read_text() for p in output.iterdir()):
            assert time.monotonic() < deadline and child.alive
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert done.wait(30)
        child.popen.wait(30)
        assert exits == [(-signal.SIGKILL, True)]  # reported while still dying, once
    finally:
        supervisor.teardown()


def test_a_child_ends_as_its_script_does_and_prints_only_what_it_prints(
    server: ForkServer, tmp_path: Path
) -> None:
    """Exit functions run and output is flushed; nothing the server imported reports at the
    child's exit (triton's nanobind printed dozens of "leaked" lines at each rank's end)."""
    text = (
        "import atexit, sys, threading, time\n"
        "import torch._dynamo  # what a rank's DDP imports, with triton under it\n"
        "atexit.register(lambda: print('exit function ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread ended'))).start()\n"
        "print('done', end='')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    path = script(tmp_path, "ends.py", text)
    for code in (0, 3):
        output = tmp_path / f"ends{code}.log"
        task = Task([sys.executable, str(path), str(code)], dict(os.environ), str(tmp_path),
                    str(output))  # fmt: skip
        assert server.spawn(task).wait(60) == code
        assert output.read_text() == "donethread ended\nexit function ran\n"


def test_a_system_without_a_death_watch_still_reports_exits_at_the_reap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(directory: Path) -> None:
        raise OSError(38, "no robust mutexes here")

    monkeypatch.setattr("flashrecovery.agent.deathwatch.Watch", refused)
    exits: list[int] = []
    done = threading.Event()

    def on_exit(child: Child, code: int) -> None:
        exits.append(code)
        done.set()

    supervisor = Supervisor(
        [sys.executable, str(script(tmp_path, "exit4.py", "raise SystemExit(4)\n"))],
        dict(os.environ),
        on_exit,
        nproc_per_node=1,
        spare_ids=lambda: 0,
        watches=tmp_path,
    )
    try:
        supervisor.spawn_rank(0)
        assert done.wait(60) and exits == [4]
        assert "exits are seen once reaped: [Errno 38] no robust mutexes here" in (
            capsys.readouterr().err
        )
    finally:
        supervisor.teardown()
