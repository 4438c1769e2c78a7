"""What must hold over a whole log however the network failed: exactly one engine decides at a
time, exactly one generation commits each step, and nothing a node writes once it is given up
moves the job.

A network cut can leave an old engine or an old generation's ranks running while the rest of the
job moves on (docs/multinode.md, "The network"). Fencing must keep them from acting, and the log
shows whether it did: every decision was written by an engine that held the lease (the engine
whose log handle wrote it, named by the writer of its hash-chain link; a job with no lease at all
has its one engine), no step was committed by two generations, unless a fallback to a
checkpoint rolled the job back past it in between, and every record written through a lost
node's log handle after it was given up was fenced or rejected by the engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from flashrecovery.connectors.base import Entry
from flashrecovery.engine.lease import LeaseBook
from flashrecovery.engine.state import EngineState
from flashrecovery.records import EngineLease, FallbackToCheckpoint, NodeJoined, StepCompleted


def _handle(entry: Entry) -> str | None:
    """The log handle (its writer token) that stored an entry, if it is chained: a chain that
    went on under a new writer id after a failed append (``<token>.<restarts>``, per stream)
    is still its handle's."""
    link = entry.record.chain if entry.record is not None else None
    return link.writer.partition("/")[2].partition(".")[0] if link is not None else None


def deciders_without_lease(events: Iterable[Entry], decisions: Iterable[Entry]) -> list[str]:
    """Engines that wrote decisions without ever being granted the lease (empty: fine). An
    engine is known by the log handle it writes through: its leases' and its decisions'."""
    book, granted, handles = LeaseBook(), set(), {}
    for entry in events:
        if book.fold(entry.record) and isinstance(entry.record, EngineLease):
            granted.add(entry.record.engine_id)
        if isinstance(entry.record, EngineLease):
            handle = _handle(entry)
            if handle is not None:
                handles[handle] = entry.record.engine_id
    if not handles:
        return []  # one engine with no lease decided for the whole job (a single node's)
    writers = {_handle(entry) for entry in decisions if entry.record is not None}
    return sorted(
        handles.get(writer, f"an engine that took no lease (log handle {writer})")
        for writer in writers
        if writer is not None and handles.get(writer) not in granted
    )


def steps_committed_twice(events: Iterable[Entry], decisions: Iterable[Entry]) -> list[str]:
    """Steps that two generations committed (empty: fine); a step after a fallback's
    checkpoint may be committed again in a generation after that fallback."""
    fallbacks = [
        (entry.record.generation, entry.record.step)
        for entry in decisions
        if isinstance(entry.record, FallbackToCheckpoint) and entry.record.step is not None
    ]
    committed: dict[int, set[int]] = {}
    for entry in events:
        if isinstance(entry.record, StepCompleted):
            committed.setdefault(entry.record.step, set()).add(entry.record.generation)
    problems = []
    for step, generations in sorted(committed.items()):
        ordered = sorted(generations)
        for earlier, later in itertools.pairwise(ordered):
            rolled_back = any(
                earlier < generation <= later and checkpoint < step
                for generation, checkpoint in fallbacks
            )
            if not rolled_back:
                problems.append(f"step {step} committed in generations {earlier} and {later}")
    return problems


class LostNodeWrites:
    """Fed each event around its replay (``before``, then ``after`` the engine ingested it):
    collects what a node's log handle wrote after the node was given up and the engine believed
    (neither fenced nor rejected). Leases are the lease book's to refuse (engine/lease.py)."""

    def __init__(self) -> None:
        self._node_of: dict[str, int] = {}  # log handle -> the node whose agent writes with it
        self._suspect: tuple[int, int] | None = None  # (node, fenced + rejected) before ingest
        self.believed: list[str] = []

    def before(self, entry: Entry, state: EngineState) -> None:
        writer = _handle(entry)
        if isinstance(entry.record, NodeJoined) and writer is not None:
            self._node_of.setdefault(writer, entry.record.node)
        node = self._node_of.get(writer) if writer is not None else None
        ignored = isinstance(entry.record, EngineLease) or entry.record is None
        lost = node is not None and state.node_lost(node) and not ignored
        self._suspect = (node, _dropped(state)) if lost and node is not None else None

    def after(self, entry: Entry, state: EngineState) -> None:
        if self._suspect is None:
            return
        node, dropped = self._suspect
        if _dropped(state) == dropped and entry.record is not None:
            self.believed.append(
                f"{entry.record.type} at events position {entry.position}, from node {node} "
                "after it was given up"
            )


def _dropped(state: EngineState) -> int:
    return state.fenced + state.rejected.total()
