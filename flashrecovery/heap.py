"""Keep Python's full garbage collections short in a process that has torch loaded.

A full collection walks every object the process holds; with torch (and what DDP and FSDP
import) that is millions, so each one takes a tenth of a second or more, and it comes whenever
the count of allocations trips it: inside a training step, or in a replacement while it receives
its state, where it would stand in the recovery's critical path.

``settle()`` runs one collection, then moves every object that is left into the permanent
generation (``gc.freeze``), which later collections skip: they then walk only what was made
since, a few milliseconds. Call it once the long-lived objects exist (the model, the optimizer,
the imports), off the path that must be fast; calling it again later freezes what came since.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect once, then freeze what remains (garbage is collected first, never frozen)."""
    gc.collect()
    gc.freeze()
