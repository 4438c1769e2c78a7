"""The agent's process pool: ranks and hot spares, each in its own process group.

Each is forked from the node's fork server (agent/forkserver.py) when there is one, else
started as a new interpreter. A waiter thread per child blocks until it exits so an exit is
reported the moment it happens (no polling): where it can, as the child starts dying rather
than once the kernel has torn it down, tens of milliseconds later (agent/deathwatch.py).
Children get their own session so a terminal's Ctrl-C reaches only the agent, which then tears
every child down itself, grandchildren included (``killpg``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from flashrecovery.agent import deathwatch, script_main
from flashrecovery.agent.forkserver import ForkedProcess, ForkServer, Task
from flashrecovery.trainer_hooks.env import SECRET, SECRET_FD, Role

TERM_GRACE_S = 3.0  # SIGTERM, then SIGKILL what is still there
REAP_WAIT_S = 2.0  # how long a process being started waits for the dying ones to be gone
UNRUNNABLE = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE)


def meeting_env(endpoint: str) -> dict[str, str]:
    """How a process finds the store its generation meets on ("host:port")."""
    host, _, port = endpoint.rpartition(":")
    return {"MASTER_ADDR": host, "MASTER_PORT": port}


@dataclass
class Child:
    popen: subprocess.Popen[bytes] | ForkedProcess
    rank: int | None  # the rank it holds; None for a spare not (yet) assigned
    spare_id: int | None
    generation: int
    slot: int  # its LOCAL_RANK: its place (its device) on this node, kept when assigned
    reported: bool = False  # its exit was reported (it may still be dying)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def runnable(self) -> bool:
        """Alive and not stopped: a SIGSTOPped spare still looks fresh to the engine for up to
        a silence limit, but must not be handed a rank it cannot take."""
        try:
            status = psutil.Process(self.pid).status()
        except psutil.NoSuchProcess:
            return False
        return self.alive and status not in UNRUNNABLE


class Supervisor:
    def __init__(
        self,
        command: list[str],
        env: Mapping[str, str],
        on_exit: Callable[[Child, int], None],
        output_dir: Path | None = None,
        *,
        nproc_per_node: int,
        spare_ids: Callable[[], int],
        forks: ForkServer | None = None,
        finished: Callable[[int], bool] = lambda pid: False,
        watches: Path | None = None,
    ) -> None:
        """``finished(pid)``: whether the process finished training (its RankFinished is in
        the log); its exit is then no failure, whatever its status. ``watches``: where the
        death watches' files go while their processes start (the node's private directory);
        None: exits are seen at the reap only."""
        self._command = command
        self._forks = forks
        self._env = dict(env)
        self._on_exit = on_exit  # called from the child's waiter thread, unless tearing down
        self._output_dir = output_dir
        self._per_node = nproc_per_node  # a rank's LOCAL_RANK: its place on its node
        self._spare_ids = spare_ids  # unique job-wide (the job's store counts them)
        self._finished = finished
        self._lock = threading.Lock()
        self._children: list[Child] = []
        self._holders: dict[int, Child] = {}  # rank -> the process holding it on this node
        self._starting: set[int] = set()  # slots of processes being started
        self._tearing_down = False
        self._watches = watches if deathwatch.SUPPORTED else None

    # ------------------------------------------------------------------ starting

    def spawn_rank(
        self, rank: int, generation: int = 0, replacement: bool = False, meet: str | None = None
    ) -> Child:
        """``meet``: the store its generation meets on, when another than the agent's now."""
        env = {
            "RANK": str(rank),
            "FLASHRECOVERY_ROLE": Role.RANK,
            "FLASHRECOVERY_GENERATION": str(generation),
            "FLASHRECOVERY_REPLACEMENT": "1" if replacement else "0",
        }
        if meet is not None:
            env.update(meeting_env(meet))
        child = self._spawn(env, rank, None, generation)
        with self._lock:
            self._holders[rank] = child
        return child

    def meet_at(self, endpoint: str) -> None:
        """The processes started from now on meet on the store at ``endpoint``."""
        self._env.update(meeting_env(endpoint))

    def spawn_spare(self) -> Child:
        spare_id = self._spare_ids()
        env = {"FLASHRECOVERY_ROLE": Role.SPARE, "FLASHRECOVERY_SPARE_ID": str(spare_id)}
        return self._spawn(env, None, spare_id, 0)

    def _spawn(
        self, extra: dict[str, str], rank: int | None, spare_id: int | None, generation: int
    ) -> Child:
        output = None
        self._await_reaped()
        with self._lock:
            slot = self._free_slot(None if rank is None else rank % self._per_node)
            self._starting.add(slot)
        watch = self._death_watch()
        extra = {**extra, "LOCAL_RANK": str(slot)}
        if watch is not None:
            extra[deathwatch.ENV] = str(watch.path)
        if self._output_dir is not None:
            self._output_dir.mkdir(parents=True, exist_ok=True)
            name = f"rank{rank}" if spare_id is None else f"spare{spare_id}"
            output = self._output_dir / f"{name}-{time.time_ns()}.log"
        env = {**self._env, **extra}
        process: subprocess.Popen[bytes] | ForkedProcess | None = None
        try:
            if self._forks is not None:
                task = Task(
                    self._command, env, os.getcwd(), None if output is None else str(output)
                )
                with contextlib.suppress(OSError):  # the server is gone: a new interpreter then
                    process = self._forks.spawn(task)
            if process is None:
                process = _start(self._command, env, output)
            child = Child(process, rank=rank, spare_id=spare_id, generation=generation, slot=slot)
            with self._lock:
                self._children.append(child)
        finally:
            with self._lock:
                self._starting.discard(slot)
        waiter = threading.Thread(target=self._wait, args=(child,), name=f"wait-{child.pid}")
        waiter.daemon = True
        waiter.start()
        if watch is not None:
            threading.Thread(
                target=self._watch, args=(child, watch), name=f"watch-{child.pid}", daemon=True
            ).start()
        return child

    def _death_watch(self) -> deathwatch.Watch | None:
        """A new process's death watch; None (and none from now on, said once) where this
        system's libc cannot make one: its exits are then seen at the reap."""
        if self._watches is None:
            return None
        try:
            return deathwatch.Watch(self._watches)
        except (OSError, AttributeError) as exc:  # AttributeError: a libc without the call
            self._watches = None
            print(f"flashrecovery: exits are seen once reaped: {exc}", file=sys.stderr)
            return None

    def _await_reaped(self) -> None:
        """A process reported dead may hold its slot (its device) a few tens of milliseconds
        more while the kernel tears it down: a process started meanwhile (a replacement for
        that slot, a refilled spare taking the lowest free one) waits for it, bounded, rather
        than take another."""
        with self._lock:
            dying = [c for c in self._children if c.reported and c.alive]
        deadline = time.monotonic() + REAP_WAIT_S
        for child in dying:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(max(0.0, deadline - time.monotonic()))

    def _free_slot(self, preferred: int | None) -> int:
        """A place on this node no live process holds: a rank's own (its rank modulo the
        ranks per node) where it is free, else the lowest free one. A spare's is beyond the
        ranks' at the start, and a lost rank's once its process is gone: the device it had."""
        held = {c.slot for c in self._children if c.alive} | self._starting
        if preferred is not None and preferred not in held:
            return preferred
        return next(slot for slot in itertools.count() if slot not in held)

    def _wait(self, child: Child) -> None:
        self._exited(child, child.popen.wait())

    def _watch(self, child: Child, watch: deathwatch.Watch) -> None:
        """Report the child's exit as it starts dying (its reap reports it otherwise)."""
        try:
            died = watch.wait(lambda: not child.alive)
        finally:
            watch.close()
        code = deathwatch.exit_status(child.pid) if died else None
        if code is not None:
            self._exited(child, code)

    def _exited(self, child: Child, code: int) -> None:
        """Report an exit once (the death watch's or the reap's, whichever comes first)."""
        with self._lock:
            quiet, child.reported = self._tearing_down or child.reported, True
        if not quiet:
            self._on_exit(child, code)

    # ------------------------------------------------------------------ acting

    def assign(self, spare_id: int, rank: int, generation: int) -> Child | None:
        """The spare now holds ``rank``; None if no such spare was started."""
        with self._lock:
            child = next((c for c in self._children if c.spare_id == spare_id), None)
            if child is not None:
                child.rank, child.generation = rank, generation
                self._holders[rank] = child
            return child

    def kill(self, pid: int) -> bool:
        """SIGKILL a child (and its process group) if it is ours and still running."""
        with self._lock:
            child = next((c for c in self._children if c.pid == pid and c.alive), None)
        if child is None:
            return False
        _signal_group(child, signal.SIGKILL)
        return True

    # ------------------------------------------------------------------ observing

    def release(self, rank: int) -> None:
        """The rank is held on another node from now on."""
        with self._lock:
            self._holders.pop(rank, None)

    def all_finished(self) -> bool:
        """Every rank held here (none on a spare node) has exited with status 0, or exited at
        all once it finished training (a crash in the interpreter's teardown must not hold a
        job whose work is done)."""
        with self._lock:
            holders = list(self._holders.values())
        return all(not c.alive and not self._failed(c) for c in holders)

    def rank_down(self) -> bool:
        """Some rank's process here failed and nothing holds the rank yet."""
        with self._lock:
            holders = list(self._holders.values())
        return any(self._failed(c) for c in holders)

    def _failed(self, child: Child) -> bool:
        return child.popen.poll() not in (None, 0) and not self._finished(child.pid)

    def idle_spares(self) -> int:
        with self._lock:
            return sum(1 for c in self._children if c.rank is None and c.alive and not c.reported)

    # ------------------------------------------------------------------ ending

    def teardown(self) -> None:
        """End every child: SIGTERM, a bounded grace, then SIGKILL; exits go unreported."""
        with self._lock:
            self._tearing_down = True
            children = list(self._children)
        for child in children:
            if child.alive:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(max(0.0, deadline - time.monotonic()))
        for child in children:
            _signal_group(child, signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                child.popen.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"flashrecovery: process {child.pid} did not die", file=sys.stderr)


def _start(command: list[str], env: dict[str, str], output: Path | None) -> subprocess.Popen[bytes]:
    """A new interpreter for the child (``--start-method exec``, or no fork server). The job's
    secret goes through a pipe, never its environment: a new interpreter's is readable in
    /proc/<pid>/environ for its whole life (a forked child's shows its fork server's, which
    never holds it)."""
    env = dict(env)
    secret = env.pop(SECRET, None)
    handed: tuple[int, ...] = ()
    if secret is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, secret.encode())  # far below a pipe's capacity
        os.close(write_end)
        env[SECRET_FD], handed = str(read_end), (read_end,)
    out = None if output is None else open(output, "wb")  # noqa: SIM115
    try:
        return subprocess.Popen(
            script_main.wrapped(command),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            pass_fds=handed,
        )
    finally:
        if out is not None:
            out.close()  # the child holds its own descriptor
        for fd in handed:
            os.close(fd)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing left in the group
        os.killpg(child.pid, sig)  # its own session: the group id is its pid
