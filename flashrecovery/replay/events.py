"""Show a job's records: a readable table by default, JSON lines on request.

`flashrecovery events --log URL [--job ID] [--rank R] [--type T] [--since POS] [--follow] [--json]`
reads both streams of the log (events and decisions) in position order.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashrecovery import terminal
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry, LogConnector
from flashrecovery.connectors.follow import StreamCursor
from flashrecovery.errors import LogError
from flashrecovery.options import add_job_option
from flashrecovery.records import TYPE_NAMES, Stream

SUMMARY_SKIP = {
    "schema_version",
    "record_id",
    "job_id",
    "generation",
    "source",
    "ts",
    "type",
    "rank",
    "chain",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL, e.g. sqlite://runs/JOB/log.db")
    add_job_option(parser, dest="job", help="job id (default: every job in the log)")
    parser.add_argument("--rank", type=int, help="only records about this rank")
    parser.add_argument(
        "--type",
        action="append",
        dest="types",
        type=record_type,
        metavar="TYPE",
        help="only this record type (repeatable), e.g. isolate_rank",
    )
    parser.add_argument("--since", type=int, default=0, help="first position to show")
    parser.add_argument(
        "--stream", choices=[s.value for s in Stream], help="one stream only (default both)"
    )
    parser.add_argument("--follow", action="store_true", help="keep printing new records")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")


def record_type(name: str) -> str:
    """A record type the log can hold; a typo is named with the types there are, never an
    empty table."""
    if name not in TYPE_NAMES:
        known = ", ".join(sorted(TYPE_NAMES))
        raise argparse.ArgumentTypeError(f"no record type {name!r}; the types are: {known}")
    return name


def matches(entry: Entry, args: argparse.Namespace) -> bool:
    record = entry.record
    if record is None:
        return args.rank is None and not args.types
    if args.types and record.type not in args.types:
        return False
    if args.rank is None or getattr(record, "rank", None) == args.rank:
        return True
    # A node's heartbeat carries its ranks' beats (agent/relay.py): it is about each of them.
    return any(getattr(beat, "rank", None) == args.rank for beat in getattr(record, "beats", []))


def as_json(job_id: str, stream: Stream, entry: Entry) -> dict[str, Any]:
    body: dict[str, Any] = (
        entry.record.model_dump(mode="json")
        if entry.record is not None
        else {"invalid": entry.raw.decode(errors="replace"), "error": entry.error}
    )
    return {"stream": stream.value, "position": entry.position, "job_id": job_id, **body}


def summary(entry: Entry) -> str:
    if entry.record is None:
        return f"[invalid] {entry.error}"
    fields = entry.record.model_dump(mode="json", exclude=SUMMARY_SKIP)
    return " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items() if v is not None)


def merged(cursors: list[StreamCursor], wait_s: float) -> list[tuple[Stream, Entry]]:
    """What is new on each stream, merged by timestamp (positions of two streams differ). With
    ``wait_s`` the first stream (the busy one) is waited on, with that bound, for news."""
    rows = [
        (cursor.stream, entry)
        for i, cursor in enumerate(cursors)
        for entry in (cursor.poll(wait_s) if i == 0 and wait_s > 0 else cursor.read())
    ]
    return sorted(
        rows,
        key=lambda row: (row[1].record.ts if row[1].record else 0.0, row[0] == Stream.DECISIONS),
    )


def print_rows(
    rows: Iterable[tuple[str, Stream, Entry]], args: argparse.Namespace, console: Console
) -> None:
    if args.json:
        for job_id, stream, entry in rows:
            sys.stdout.write(json.dumps(as_json(job_id, stream, entry)) + "\n")
        sys.stdout.flush()
        return
    table = Table(box=None, pad_edge=False)
    for column in ("time", "job", "stream", "pos", "gen", "source", "type", "rank"):
        table.add_column(column, no_wrap=True)
    table.add_column("details", overflow="fold", ratio=1)
    for job_id, stream, entry in rows:
        record = entry.record
        when = (
            dt.datetime.fromtimestamp(record.ts, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
            if record
            else "-"
        )
        rank = getattr(record, "rank", None)
        style = "bold" if stream == Stream.DECISIONS else None
        cells = (
            when,
            job_id,
            stream.value,
            str(entry.position),
            str(record.generation) if record else "-",
            record.source if record else "-",
            record.type if record else "invalid",
            "" if rank is None else str(rank),
            summary(entry),
        )
        table.add_row(*map(Text, cells), style=style)  # record text, never markup
    console.print(table)


def _batches(
    log: LogConnector, args: argparse.Namespace
) -> Iterator[list[tuple[str, Stream, Entry]]]:
    shown = [Stream(args.stream)] if args.stream else list(Stream)
    jobs = [args.job] if args.job else log.jobs()
    # Both streams are read, shown or not: a job's end (its JobFinished, on the events)
    # ends --follow once every job followed has ended.
    cursors = {job: [StreamCursor(log, s, job, args.since) for s in Stream] for job in jobs}
    ended: set[str] = set()
    wait_s = 0.0  # the first batch is what is there already
    while True:
        rows = [
            (job, stream, entry)
            for job, job_cursors in cursors.items()
            for stream, entry in merged(job_cursors, wait_s)
        ]
        ended |= {job for job, _, entry in rows if _is_end(entry)}
        yield [row for row in rows if row[1] in shown and matches(row[2], args)]
        if not args.follow or ended >= set(jobs):
            return
        wait_s = 0.5


def _is_end(entry: Entry) -> bool:
    return entry.record is not None and entry.record.type == "job_finished"


def run(args: argparse.Namespace) -> int:
    console = terminal.console()
    try:
        with open_log(args.log, read_only=True) as log:
            if args.job and args.job not in log.jobs():
                raise LogError(f"job {args.job!r} has no records in {args.log}")
            for batch in _batches(log, args):
                if batch or not args.follow:
                    print_rows(batch, args, console)
    except LogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
