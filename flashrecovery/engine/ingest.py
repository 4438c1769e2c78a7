"""Log entries into the decide step: the one place where the log's view (an entry that may not
even be a record) meets the pure engine."""

from __future__ import annotations

from flashrecovery.connectors.base import Entry
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision


def ingest(state: EngineState, entry: Entry) -> list[Decision]:
    """Apply one log entry; a malformed one is counted and explained, never raised."""
    if entry.record is None:
        state.reject(f"malformed: {entry.error}")
        state.position = max(state.position, entry.position)
        return []
    return decide(state, entry.position, entry.record)
