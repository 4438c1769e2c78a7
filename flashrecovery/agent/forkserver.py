"""Rank and spare processes forked from one that has imported torch already.

A process started as ``python script.py`` spends seconds of CPU on imports before it runs a
line of the script: torch, and torch._dynamo, which torch's optimizer constructor imports on
first use. That was most of a job's start, all but a few ms of a fresh replacement's 3.3-3.8 s
from spawn to joining its group on 2 cores, and a refilled spare's start took the same CPU from
the ranks it shares cores with. So the agent starts this server once; it pays those imports
once, and each rank, spare and replacement of the node is forked from it and runs the script as
``__main__`` with the argv, environment and working directory it was given, ``sys.path[0]``
the script's directory: what ``python script.py`` would do, minus the imports.

Forking after torch's import is what DataLoader workers do. A child forked after CUDA was
initialized could not use it, so a server that finds CUDA initialized after its imports
refuses, and the agent starts its processes with a new interpreter each, as
``--start-method exec`` always does.

The server is single-threaded: it waits on its socket to the agent and on a pidfd per child,
answers each spawn request with the child's pid and reports each exit (the code as
``subprocess`` gives it: negative for a signal). It lives in the agent's process group and
ends when the agent closes the socket (or dies); its children have sessions of their own and
outlive it, as they would outlive the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import random
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import setproctitle

from flashrecovery.agent import script_main

# What a rank imports before its script does anything (the hook's session imports torch).
PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim.Optimizer.__init__ imports it on first use: 1.5 s here
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "flashrecovery.trainer_hooks.session",
)
READY_TIMEOUT_S = 300.0  # the server's imports on a busy node
SPAWN_TIMEOUT_S = 60.0  # a fork is milliseconds; a server this slow is given up on
# Not ``-m``: the agent's package imports this module, and runpy would run a second copy.
_MAIN = "import sys; from flashrecovery.agent.forkserver import main; sys.exit(main())"


@dataclasses.dataclass(frozen=True)
class Task:
    """One process to start: ``argv`` is ``[python, script, *args]`` or
    ``[python, -m, module, *args]``."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    output: str | None  # stdout and stderr go here, else the server's (the agent's)


# ---------------------------------------------------------------------- the server


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _lines(sock: socket.socket, pending: bytearray) -> list[dict[str, Any]] | None:
    """The whole lines that have arrived (None once the other side closed; a reset, when
    the agent was SIGKILLed, raises, and ``serve`` ends as quietly)."""
    data = sock.recv(1 << 16)
    if not data:
        return None
    pending.extend(data)
    *whole, rest = pending.split(b"\n")
    pending[:] = rest
    return [json.loads(line) for line in whole]


def serve(sock: socket.socket) -> Task | None:
    """Start a child per request until the agent closes the socket (returns None). In a child,
    returns its task, with every descriptor of the server closed."""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    pidfds: dict[int, int] = {}  # pid -> pidfd
    pending = bytearray()
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is sock:
                    requests = _lines(sock, pending)
                    if requests is None:
                        return None
                    for request in requests:
                        task = Task(**request["task"])
                        try:
                            pid = os.fork()
                        except OSError as exc:  # out of memory or processes: say so, go on
                            _send(sock, {"failed": request["id"], "error": str(exc)})
                            continue
                        if pid == 0:
                            for fd in pidfds.values():
                                os.close(fd)
                            return task
                        pidfds[pid] = os.pidfd_open(pid)
                        selector.register(pidfds[pid], selectors.EVENT_READ, pid)
                        _send(sock, {"spawned": request["id"], "pid": pid})
                else:
                    pid = key.data
                    selector.unregister(key.fileobj)
                    os.close(pidfds.pop(pid))
                    _, status = os.waitpid(pid, 0)
                    _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    except (BrokenPipeError, ConnectionResetError):
        return None  # the agent died: its children are on their own, as they would be
    finally:
        selector.close()
        sock.close()


def run_child(task: Task) -> int:
    """Become ``python script args…`` in this forked process: its own session, output,
    directory and environment, fresh random seeds (a new interpreter's would differ too)."""
    os.setsid()
    if task.output is not None:
        fd = os.open(task.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.chdir(task.cwd)
    os.environ.clear()
    os.environ.update(task.env)
    tempfile.tempdir = None  # the server's, cached: the child's TMPDIR is its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()
    import torch

    torch.seed()
    if "numpy.random" in sys.modules:  # imported by torch: its global state, too
        sys.modules["numpy.random"].seed()
    # `ps`, `pgrep -f train.py` and /proc/<pid>/cmdline show the command it stands for (the
    # title takes the place of the server's environment block in /proc/<pid>/environ too).
    setproctitle.setproctitle(shlex.join(task.argv))
    script_main.run(task.argv[1:])
    return 0


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the agent's to handle
    # Also claims the command line's memory while the environment is the one it started with,
    # so that each child can write its own title there.
    setproctitle.setproctitle(f"flashrecovery fork server (agent {os.getppid()})")
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        _send(sock, {"refused": "CUDA was initialized by the imports: a fork could not use it"})
        return 0
    gc.collect()
    gc.freeze()  # what every child shares stays shared: the collector never writes to it
    _send(sock, {"ready": os.getpid()})
    task = serve(sock)
    _end(0 if task is None else _exit_code(task))  # the server too: it imported them all
    return 0  # not reached: _end does not return


def _exit_code(task: Task) -> int:
    """The child's script run to its end, and the code ``python script.py`` would exit with
    (an uncaught exception is reported as the interpreter would: through sys.excepthook)."""
    try:
        return run_child(task)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1


def _end(code: int) -> None:
    """End the server, or a forked child, as multiprocessing ends its children: threads
    joined, exit functions run, streams flushed, then ``os._exit``. Finalizing an interpreter
    that imported triton has its nanobind print dozens of "leaked" lines (in a child, for
    objects only the server made)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# ---------------------------------------------------------------------- the agent's side


class ForkedProcess:
    """A child of the fork server, as the supervisor uses a ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class ForkServer:
    """The agent's handle on its fork server: ``spawn()`` a process, learn when it ends."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._sock, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _MAIN, str(theirs.fileno())],
            env=dict(env),
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._pending = bytearray()
        self._ids = 0
        self._spawned: dict[int, int | str] = {}  # request id -> pid, or why it failed
        self._abandoned: set[int] = set()  # requests given up on: the process is not wanted
        self._children: dict[int, ForkedProcess] = {}
        self._changed = threading.Condition()
        self._ready: bool | None = None  # None until the server says
        self.refusal = ""
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()

    def ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether the server has imported what it preloads and can fork (waits for it)."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready is not None, timeout)
            return bool(self._ready)

    def spawn(self, task: Task) -> ForkedProcess:
        with self._changed:
            if not self._ready:
                raise OSError("the fork server is gone")
            self._ids += 1
            request = self._ids
            _send(self._sock, {"id": request, "task": dataclasses.asdict(task)})
            answered = self._changed.wait_for(
                lambda: request in self._spawned or not self._ready, SPAWN_TIMEOUT_S
            )
            if not answered:  # should it come after all, it is killed (_take)
                self._abandoned.add(request)
                raise OSError(f"the fork server did not start the process in {SPAWN_TIMEOUT_S} s")
            outcome = self._spawned.pop(request, None)
            if isinstance(outcome, str):
                raise OSError(f"the fork server could not fork: {outcome}")
            if outcome is None:
                raise OSError("the fork server ended before it started the process")
            return self._children[outcome]

    def close(self) -> None:
        """End the server (its children go on); bounded."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(10)
        self._sock.close()

    def _read(self) -> None:
        try:
            while (messages := _lines(self._sock, self._pending)) is not None:
                for message in messages:
                    self._take(message)
        except OSError:
            pass  # closed by close()
        finally:
            self._lost()

    def _take(self, message: dict[str, Any]) -> None:
        with self._changed:
            if "ready" in message:
                self._ready = True
            elif "refused" in message:
                self._ready, self.refusal = False, str(message["refused"])
            elif "spawned" in message:
                pid = int(message["pid"])
                self._children[pid] = ForkedProcess(pid)
                request = int(message["spawned"])
                if request in self._abandoned:
                    _kill(pid)
                else:
                    self._spawned[request] = pid
            elif "failed" in message:
                self._spawned[int(message["failed"])] = str(message["error"])
            else:
                self._children.pop(int(message["exited"])).ended(int(message["code"]))
            self._changed.notify_all()

    def _lost(self) -> None:
        """The server ended: whatever it started can no longer be waited for, so it is ended
        here (SIGKILL to its process group) and reported so."""
        with self._changed:
            if self._ready is None:
                code = self._process.poll()
                self.refusal = f"the fork server exited ({code}) before it was ready"
            self._ready = False
            children, self._children = list(self._children.values()), {}
            self._changed.notify_all()
        for child in children:
            _kill(child.pid)
            child.ended(-signal.SIGKILL)


def _kill(pid: int) -> None:
    """SIGKILL a child and its process group (which it may not have made yet, just forked)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
