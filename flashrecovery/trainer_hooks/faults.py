"""Test-only fault injection: ``FLASHRECOVERY_FAULT=<point>@<step>`` makes this process fail
for real at one place of the commit protocol, so tests exercise the true failure paths.

Points: ``before_reduce`` and ``after_reduce`` SIGKILL the process there (after the gradients
are reduced but before the vote completes is the delicate case); ``finish`` SIGKILLs it in
``finish()`` once ``step`` is committed (the last step: lost after the job's work is done);
``raise`` raises instead of dying; ``hang`` SIGSTOPs the process so only the detectors can find
it; ``stall`` blocks the training thread forever before the step's commit while the process (and
its heartbeats) live on, so only the stall detector can find it.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

POINTS = ("before_reduce", "after_reduce", "finish", "raise", "hang", "stall")


class InjectedFault(RuntimeError):
    """The ``raise`` fault: an ordinary exception escaping the training loop."""


@dataclass(frozen=True)
class Fault:
    point: str
    step: int

    @classmethod
    def parse(cls, spec: str) -> Fault:
        point, sep, step = spec.partition("@")
        if not sep or point not in POINTS or not step.isdigit():
            raise ValueError(
                f"FLASHRECOVERY_FAULT={spec!r}: expected <point>@<step>, point one of "
                + ", ".join(POINTS)
            )
        return cls(point, int(step))

    def check(self, where: str, step: int) -> None:
        """Fail here if this is the fault's place; ``where`` is a point of the commit."""
        if step != self.step:
            return
        if self.point == where:
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "before_reduce" and self.point == "raise":
            raise InjectedFault(f"injected fault at step {step}")
        if where == "before_reduce" and self.point == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if where == "before_reduce" and self.point == "stall":
            threading.Event().wait()  # never set: stuck in user code until SIGKILLed
