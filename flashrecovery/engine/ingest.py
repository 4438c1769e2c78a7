"""Log entries into the decide step: the one place where the log's view (an entry that may not
even be a record, or one not signed by the source it claims) meets the pure engine."""

from __future__ import annotations

from flashrecovery.connectors.base import Entry
from flashrecovery.engine.context import Context
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, RecordRejected


def ingest(state: EngineState, entry: Entry, forgery: str | None = None) -> list[Decision]:
    """Apply one log entry; a malformed one is counted and explained, never raised. One whose
    signature the loop found wrong (``forgery`` says why: connectors/signing.py) is counted
    and answered with a RecordRejected decision, so a replay that cannot check signatures
    (it lacks the secret) learns from the log which events the engine did not believe."""
    if entry.record is None:
        state.reject(f"malformed: {entry.error}")
        state.position = max(state.position, entry.position)
        return []
    if forgery is not None:
        state.reject(f"forged: {forgery}")
        state.position = max(state.position, entry.position)
        ctx = Context(state, entry.position, entry.record)
        ctx.emit(
            RecordRejected,
            rejected_type=entry.record.type[:64],
            claimed_source=entry.record.source[:256],
            reason=forgery,
        )
        return ctx.decisions
    return decide(state, entry.position, entry.record)
