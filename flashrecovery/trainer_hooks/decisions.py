"""The decisions a rank follows: regroup and resume plans (from donors, or from a checkpoint
when no replica was left), per generation, and the end of the job.

A thread takes the job's decisions from the process's agent, which follows the decisions
stream once for its node (agent/links.py), and keeps the plans; the training thread waits on
them. When a plan moves the job past a generation, ``on_regroup`` runs at once in this thread
so a training thread blocked on a vote of the old generation is released.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

from flashrecovery.errors import FallbackRequired, JobFailed
from flashrecovery.records import (
    Decision,
    FailJob,
    FallbackToCheckpoint,
    IsolateRank,
    RegroupPlanned,
    ResumePlanned,
)
from flashrecovery.trainer_hooks.agent_link import AgentLink

FOLLOW_TIMEOUT_S = 0.5  # also how soon an orphaned process notices its agent is gone

T = TypeVar("T")


# What a process acts on: the only decisions an agent relays to its processes.
PROCESS_DECISIONS = (RegroupPlanned, ResumePlanned, FallbackToCheckpoint, FailJob, IsolateRank)


class DecisionFollower:
    def __init__(self, link: AgentLink, on_regroup: Callable[[int], None]) -> None:
        """``link``: to the agent that relays the decisions."""
        self._on_regroup = on_regroup
        self._changed = threading.Condition()
        self._regroup: RegroupPlanned | None = None  # the newest
        self._replaced: dict[int, set[int]] = {}  # generation -> the ranks its plan replaced
        self._resumes: dict[int, ResumePlanned | FallbackToCheckpoint] = {}
        self._fallback: FallbackToCheckpoint | None = None
        self._failed: FailJob | None = None
        self._isolated: set[int] = set()  # pids the engine fenced off
        self._stores: dict[int, str] = {}  # generation -> the store it moved to
        self._stop = threading.Event()
        self._link = link
        self._parent = os.getppid()
        self._thread = threading.Thread(
            target=self._run, name="flashrecovery-decisions", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(FOLLOW_TIMEOUT_S * 4)

    @property
    def latest_generation(self) -> int:
        with self._changed:
            return self._regroup.generation if self._regroup else 0

    def replaced_after(self, generation: int) -> set[int]:
        """The ranks that plans of generations after ``generation`` replaced."""
        with self._changed:
            return {r for g, ranks in self._replaced.items() if g > generation for r in ranks}

    def store_for(self, generation: int) -> tuple[int, str] | None:
        """The last move of the store up to ``generation``: the generation whose plan moved
        it and where to (None: no plan known here moved it)."""
        with self._changed:
            moved = [g for g in self._stores if g <= generation]
            return (max(moved), self._stores[max(moved)]) if moved else None

    def isolated(self, pid: int) -> bool:
        """Whether the engine declared the process failed (it must not rejoin)."""
        with self._changed:
            return pid in self._isolated

    def _run(self) -> None:
        while not self._stop.is_set():
            if os.getppid() != self._parent or self._link.closed:
                os._exit(70)  # the agent is gone: nobody can regroup or reap us
            for decision in self._link.poll_decisions(FOLLOW_TIMEOUT_S):
                self._apply(decision)

    def _apply(self, decision: Decision) -> None:
        with self._changed:
            if isinstance(decision, RegroupPlanned):
                self._replaced[decision.generation] = set(decision.replaced)
                if decision.store is not None:
                    self._stores[decision.generation] = decision.store
                if self._regroup is None or decision.generation > self._regroup.generation:
                    self._regroup = decision
            elif isinstance(decision, ResumePlanned):
                self._resumes[decision.generation] = decision
            elif isinstance(decision, FallbackToCheckpoint):
                if decision.step is None:
                    self._fallback = decision  # no checkpoint: the job ends
                else:
                    self._resumes[decision.generation] = decision
            elif isinstance(decision, FailJob):
                self._failed = decision
            elif isinstance(decision, IsolateRank) and decision.pid is not None:
                self._isolated.add(decision.pid)
            else:
                return
            self._changed.notify_all()
        if isinstance(decision, RegroupPlanned):
            self._on_regroup(decision.generation)

    def _wait(self, value: Callable[[], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if self._failed is not None:
                    raise JobFailed(f"the job failed: {self._failed.reason}")
                if self._fallback is not None:
                    raise FallbackRequired(
                        f"the job falls back to its checkpoint: {self._fallback.reason}"
                    )
                found = value()
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no recovery decision within {timeout:.0f}s")
                self._changed.wait(left)

    def regroup_coming(self, after: int, timeout: float) -> bool:
        """Whether a generation above ``after`` is planned within ``timeout``."""
        try:
            self.wait_regroup(after, timeout)
        except TimeoutError:
            return False
        return True

    def wait_regroup(self, after: int, timeout: float) -> RegroupPlanned:
        """The plan of the newest generation above ``after``."""
        return self._wait(
            lambda: self._regroup if self._regroup and self._regroup.generation > after else None,
            timeout,
        )

    def wait_resume(
        self, generation: int, timeout: float
    ) -> ResumePlanned | FallbackToCheckpoint | RegroupPlanned:
        """The resume plan of ``generation``, or a newer regroup that supersedes it."""

        def resume_or_newer() -> ResumePlanned | FallbackToCheckpoint | RegroupPlanned | None:
            if generation in self._resumes:
                return self._resumes[generation]
            if self._regroup and self._regroup.generation > generation:
                return self._regroup
            return None

        # mypy would widen the union to Decision when solving the type variable
        return cast(
            ResumePlanned | FallbackToCheckpoint | RegroupPlanned,
            self._wait(resume_or_newer, timeout),
        )
