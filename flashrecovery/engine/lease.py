"""Who may decide for a job: a lease recorded in the job's own log.

Engines append `EngineLease` records to the events stream; the log's order arbitrates. A lease
is accepted when no other engine holds an unexpired one at its timestamp; the holder renews it
well before it expires. Standby engines follow the same log, keep their state warm, and take over
once the holder's lease runs out, or at once when the holder's node is given up (its agent seen
gone, AgentExited, or silent too long, NodeMissed) — then they write the decisions still due,
which carry the same deterministic ids, so none is written twice. An engine on a node given up
is never granted the lease again, whatever it appends once its link heals, and a node given up
cannot give up another (its view of its peers is that of a node cut off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashrecovery.records import AgentExited, EngineLease, Envelope, NodeMissed


@dataclass
class LeaseBook:
    """The lease currently granted, folded from the log's EngineLease records in order."""

    current: EngineLease | None = None
    lost_nodes: set[int] = field(default_factory=set)  # nodes given up on, as the engine does

    def fold(self, record: Envelope | None) -> bool:
        """Fold one record of the events stream (only leases and the findings that give a
        node up move the book); True when it granted a lease."""
        if isinstance(record, EngineLease):
            return self.observe(record)
        seen_gone = isinstance(record, AgentExited) and record.observer not in self.lost_nodes
        if seen_gone or isinstance(record, NodeMissed):
            assert isinstance(record, AgentExited | NodeMissed)
            self.lost(record.node)
        return False

    def observe(self, lease: EngineLease) -> bool:
        """Fold one lease record; True when it was granted (a renewal or a takeover)."""
        if lease.node is not None and lease.node in self.lost_nodes:
            return False
        held = self.current
        if held is None or held.engine_id == lease.engine_id or held.expires_ts <= lease.ts:
            self.current = lease
            return True
        return False

    def lost(self, node: int) -> None:
        """A node is given up: a lease held on it ends with it (every engine folds the same
        record at the same place of the log, so all of them agree)."""
        self.lost_nodes.add(node)
        if self.current is not None and self.current.node == node:
            self.current = None

    def holder(self, now: float) -> str | None:
        if self.current is None or self.current.expires_ts <= now:
            return None
        return self.current.engine_id
