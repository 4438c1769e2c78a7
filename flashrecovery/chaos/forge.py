"""The chaos kind ``forge``: a process that can append to a running job's log, through the
project's own ``open_log``, but holds none of the job's keys, writes one well-formed record of
every type (events and decisions) about a live rank: that it failed, exited, went silent,
finished, that the job ended, that it must be isolated. None may be acted on: the engine answers
each forged event with a RecordRejected, the agents carry out no forged decision
(docs/protocol.md "Who may write").

`python -m flashrecovery.chaos.forge --log URL --job ID --rank R --pid P --step S --generation G
--out FILE` appends them, then waits (bounded) for the engine's rejection of each event, and
leaves what it wrote and how long the rejections took in FILE (JSON) for the verdict.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from flashrecovery.connectors import open_log
from flashrecovery.connectors.follow import StreamCursor
from flashrecovery.records import Decision, EngineLease, Envelope, RecordRejected, Stream
from flashrecovery.testing.samples import RECORD_TYPES, SAMPLE_FIELDS, type_name

REJECTED_WITHIN_S = 30.0  # the engine reads the events within a poll; this bounds the wait
DETECTORS = {"heartbeat_missed", "stall_suspected", "spare_missed", "node_missed"}
AGENTS = {"rank_exited", "spare_activated", "replacement_spawned", "job_started", "job_finished"}


def _source(name: str, cls: type[Envelope], rank: int) -> str:
    """The source a record of this type would come from in the job."""
    if issubclass(cls, Decision):
        return "engine"
    if cls is EngineLease:
        return "engine:forger"
    if name in DETECTORS:
        return "detector"
    if "rank" in cls.model_fields and name not in AGENTS:
        return f"rank:{rank}"
    return "agent:0"


def forgeries(job_id: str, generation: int, rank: int, pid: int, step: int) -> list[Envelope]:
    """One record of each type, aimed at ``rank`` (its process ``pid``, at ``step``)."""
    aimed = {"rank": rank, "pid": pid, "step": step, "node": 0, "caused_by": 0}
    out = []
    for cls in RECORD_TYPES:
        name = type_name(cls)
        fields: dict[str, Any] = {**SAMPLE_FIELDS[name]}
        fields.update({k: v for k, v in aimed.items() if k in cls.model_fields})
        out.append(
            cls(
                job_id=job_id,
                generation=generation,
                source=_source(name, cls, rank),
                ts=time.time(),
                **fields,
            )
        )
    return out


def forge(url: str, job_id: str, records: list[Envelope]) -> dict[str, Any]:
    """Append ``records`` through a handle with no keys; wait for the engine's rejections."""
    with open_log(url) as log:
        appended = time.time()
        events: dict[str, int] = {}
        decisions: dict[str, int] = {}
        for record in records:
            placed = decisions if isinstance(record, Decision) else events
            stream = Stream.DECISIONS if isinstance(record, Decision) else Stream.EVENTS
            placed[record.type] = log.append(stream, record)
        waiting = set(events.values())
        cursor = StreamCursor(log, Stream.DECISIONS, job_id)
        deadline = time.monotonic() + REJECTED_WITHIN_S
        while waiting and time.monotonic() < deadline:
            for entry in cursor.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                if isinstance(entry.record, RecordRejected):
                    waiting.discard(entry.record.caused_by)
        return {
            "events": events,
            "decisions": decisions,
            "appended_ts": appended,
            "rejected_after_s": None if waiting else time.time() - appended,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashrecovery.chaos.forge")
    parser.add_argument("--log", required=True)
    parser.add_argument("--job", required=True)
    for name in ("--rank", "--pid", "--step", "--generation"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = forgeries(args.job, args.generation, args.rank, args.pid, args.step)
    args.out.write_text(json.dumps(forge(args.log, args.job, records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
