"""How long a rank waited on its peers in a step, so that the time it computed can be told apart
(``StepCompleted.compute_s``, scored against its peers' by the engine: engine/stragglers.py).

In a synchronous job every rank's step takes as long as the slowest one's: the others wait in
their collectives (DDP's bucket all-reduces, FSDP2's gathers, the hook's own sum) until the
slowest contributes. The time during which at least one of the rank's collectives was
outstanding is what it did not spend on its own work; the rest of its step is. Where
collectives overlap its computation (DDP's buckets during backward) that rest is an
underestimate on the ranks that wait, so the slowest rank stands out, if anything, more.

The clock is the union of the collectives' [launch, done] intervals: a count of outstanding
ones, and the time the count was above zero. Each step starts a new epoch: a collective of an
earlier step that never reported done is forgotten rather than counted for ever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WaitClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._outstanding = 0
        self._since = 0.0  # when the count last rose above zero
        self._waited = 0.0  # this epoch's closed spans

    def launched(self) -> Callable[[], None]:
        """A collective starts; call what is returned once it is done (once; later calls and
        calls from an earlier epoch do nothing)."""
        with self._lock:
            epoch = self._epoch
            if not self._outstanding:
                self._since = time.perf_counter()
            self._outstanding += 1
        done = False

        def finished() -> None:
            nonlocal done
            with self._lock:
                if done or epoch != self._epoch:
                    return
                done = True
                self._outstanding -= 1
                if not self._outstanding:
                    self._waited += time.perf_counter() - self._since

        return finished

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A blocking collective (the hook's own sum) as one outstanding span."""
        finished = self.launched()
        try:
            yield
        finally:
            finished()

    def take(self) -> float:
        """Seconds waited since the last take, spans still open counted up to now; a new
        epoch begins."""
        with self._lock:
            now = time.perf_counter()
            waited = self._waited + (now - self._since if self._outstanding else 0.0)
            self._epoch += 1
            self._outstanding, self._waited = 0, 0.0
            return waited
