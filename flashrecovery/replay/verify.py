"""Check a job's hash chains and its seal (connectors/chain.py writes them): a changed record no
longer matches what its writer's next record names, a lost one leaves a gap in its writer's
sequence numbers, and the seal names every writer's last record. And who wrote each record
(connectors/signing.py): in a log whose writers sign, an unsigned record is a break; with the
job's keys, so is a record not signed by the source it claims.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashrecovery.connectors.base import Entry
from flashrecovery.connectors.chain import Tip, digest
from flashrecovery.connectors.signing import Keyring
from flashrecovery.records import JobFinished, Stream


@dataclass(frozen=True)
class Break:
    """Where a writer's chain stops holding: ``position`` is the record that was changed (or
    after which records were lost)."""

    stream: Stream
    position: int
    writer: str
    reason: str

    def describe(self) -> str:
        return f"{self.stream.value} position {self.position} (writer {self.writer}): {self.reason}"


@dataclass
class ChainReport:
    breaks: list[Break] = field(default_factory=list)
    records: int = 0
    unchained: int = 0  # records without a link (older logs, foreign writers)
    signed: int = 0  # records that carry a signature (checked only with the job's keys)
    signatures_checked: bool = False  # the job's keys were at hand
    writers: int = 0
    sealed: bool = False  # a JobFinished record named the chain heads
    seal_position: int | None = None
    seal_hash: str | None = None  # compare with the one the agent printed at the end
    after_seal: int = 0  # events appended after the seal (not covered by it)

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def first(self) -> Break | None:
        return min(self.breaks, key=lambda b: (b.position, b.stream.value), default=None)

    def to_json(self) -> dict[str, Any]:
        first = self.first
        return {
            "ok": self.ok,
            "records": self.records,
            "writers": self.writers,
            "unchained": self.unchained,
            "signed": self.signed,
            "signatures_checked": self.signatures_checked,
            "sealed": self.sealed,
            "seal_position": self.seal_position,
            "seal_hash": self.seal_hash,
            "after_seal": self.after_seal,
            "breaks": len(self.breaks),
            "first_break": None
            if first is None
            else {
                "stream": first.stream.value,
                "position": first.position,
                "writer": first.writer,
                "reason": first.reason,
            },
        }


def handle_runs(entries: Iterable[Entry]) -> list[list[Entry]]:
    """The entries in runs of consecutive positions stored through one log handle (its writer
    token): one write or more each. A node's agent writes its ranks' records in batches
    (agent/links.py), a rank writing its own stores them one by one. Unchained entries are
    runs of one."""
    runs: list[list[Entry]] = []
    previous: tuple[int, str | None] = (-2, None)
    for entry in entries:
        link = entry.record.chain if entry.record is not None else None
        handle = link.writer.partition("/")[2] if link is not None else None
        if handle is not None and previous == (entry.position - 1, handle):
            runs[-1].append(entry)
        else:
            runs.append([entry])
        previous = (entry.position, handle)
    return runs


def _check_stream(stream: Stream, entries: list[Entry], report: ChainReport) -> None:
    seen: dict[str, Tip] = {}
    for entry in entries:
        report.records += 1
        link = entry.record.chain if entry.record is not None else None
        if link is None:
            report.unchained += 1
            continue
        tip = seen.get(link.writer)
        problem: tuple[int, str] | None = None
        if tip is None and (link.seq != 0 or link.prev):
            problem = (entry.position, f"first record seen is seq {link.seq}: records lost before")
        elif tip is not None and link.seq != tip.seq + 1:
            problem = (
                tip.position,
                f"seq {tip.seq} is followed by seq {link.seq} at position "
                f"{entry.position}: records lost or repeated between",
            )
        elif tip is not None and link.prev != tip.hash:
            problem = (
                tip.position,
                f"its hash is not what the writer's next record (position "
                f"{entry.position}) names: one of them was changed",
            )
        if problem is not None:
            report.breaks.append(Break(stream, problem[0], link.writer, problem[1]))
        seen[link.writer] = Tip(link.seq, digest(entry.raw), entry.position)
    report.writers += len(seen)


def _check_seal(streams: Mapping[Stream, list[Entry]], report: ChainReport) -> None:
    seal = next(
        (
            e
            for e in reversed(streams[Stream.EVENTS])
            if isinstance(e.record, JobFinished) and e.record.chain_heads
        ),
        None,
    )
    if seal is None or not isinstance(seal.record, JobFinished):
        return
    report.sealed, report.seal_position, report.seal_hash = True, seal.position, digest(seal.raw)
    report.after_seal = sum(1 for e in streams[Stream.EVENTS] if e.position > seal.position)
    for head in seal.record.chain_heads:
        stream = Stream(head.stream)
        records = {
            e.record.chain.seq: e
            for e in streams.get(stream, [])
            if e.record is not None
            and e.record.chain is not None
            and e.record.chain.writer == head.writer
        }
        sealed = records.get(head.seq)
        if sealed is None:
            last = max(records, default=None)
            where = records[last].position if last is not None else seal.position
            report.breaks.append(
                Break(
                    stream,
                    where,
                    head.writer,
                    f"the seal names seq {head.seq}, the log ends at seq {last}: records lost",
                )
            )
        elif digest(sealed.raw) != head.hash:
            report.breaks.append(
                Break(
                    stream, sealed.position, head.writer, "its hash is not the one the seal names"
                )
            )


def _check_signatures(
    streams: Mapping[Stream, list[Entry]], keys: Keyring | None, report: ChainReport
) -> None:
    """Without keys only a log whose writers sign at all can show an unsigned record (an
    older log signs nothing); with them every record must be its claimed source's."""
    entries = [(stream, e) for stream, es in streams.items() for e in es if e.record is not None]
    report.signed = sum(1 for _, e in entries if e.record and e.record.chain and e.record.chain.mac)
    report.signatures_checked = keys is not None
    for stream, entry in entries:
        assert entry.record is not None
        link = entry.record.chain
        writer = link.writer if link is not None else entry.record.source
        if keys is not None:
            forgery = keys.forgery(entry.raw, entry.record)
        elif report.signed and (link is None or not link.mac):
            forgery = f"unsigned {entry.record.type} in a log whose writers sign"
        else:
            forgery = None
        if forgery is not None:
            report.breaks.append(Break(stream, entry.position, writer, f"not believed: {forgery}"))


def verify(streams: Mapping[Stream, list[Entry]], keys: Keyring | None = None) -> ChainReport:
    """Check every writer's chain on both streams, then the seal if the job has one, then who
    wrote each record (with ``keys``, every signature)."""
    report = ChainReport()
    for stream, entries in streams.items():
        _check_stream(stream, entries, report)
    _check_seal(streams, report)
    _check_signatures(streams, keys, report)
    return report
