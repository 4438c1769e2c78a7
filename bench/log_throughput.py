"""Throughput of the event log: appends (one writer, several writer processes), reads, follows.

Run ``python bench/log_throughput.py [--records N] [--url URL]``. The default is a fresh embedded
log in a temporary directory; any log URL works, since every phase uses its own job id. Writes
``bench/results/log_throughput.json`` and prints a table. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sqlite3
import statistics
import tempfile
import threading
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flashrecovery.connectors import Entry, LogConnector, open_log
from flashrecovery.records import Heartbeat, Stream

RESULTS = Path(__file__).resolve().parent / "results" / "log_throughput.json"
READ_BATCH = 1000
BATCH = 500  # records per append_many in the batched phase
LABELS = {
    "single_writer_append": "append, 1 writer",
    "single_writer_batched": f"append_many ({BATCH} a batch), 1 writer",
    "writer_processes_append": "append, N processes",
    "read": f"read, pages of {READ_BATCH}",
    "follow_while_appending": "follow while appending",
}
WAIT_S = 120.0


def heartbeat(job_id: str, step: int, rank: int = 0) -> Heartbeat:
    return Heartbeat(job_id=job_id, generation=0, source=f"rank:{rank}", rank=rank, step=step,
                     pid=os.getpid(), host="bench")  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rates(count: int, elapsed: float, name: str, samples: list[float]) -> dict[str, float]:
    """A phase's result: records/s and the median and p99 of its per-record samples (ms)."""
    return {
        "records": count,
        "seconds": elapsed,
        "records_per_s": count / elapsed,
        f"{name}_p50_ms": statistics.median(samples) * 1e3,
        f"{name}_p99_ms": percentile(samples, 0.99) * 1e3,
    }


def bench_single_writer(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    latencies = []
    started = time.perf_counter()
    for step in range(count):
        before = time.perf_counter()
        log.append(Stream.EVENTS, heartbeat(job_id, step))
        latencies.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    return rates(count, elapsed, "append", latencies)


def bench_single_writer_batched(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """One writer that does not wait per record: batches of BATCH, one commit (or one wait for
    the acknowledgements) each; the sample is a batch's latency."""
    latencies = []
    started = time.perf_counter()
    for first in range(0, count, BATCH):
        batch = [heartbeat(job_id, step) for step in range(first, min(first + BATCH, count))]
        before = time.perf_counter()
        log.append_many(Stream.EVENTS, batch)
        latencies.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    return rates(count, elapsed, "batch", latencies)


def _writer_process(
    url: str, job_id: str, writer: int, count: int, go: MpEvent, times: Queue[tuple[float, float]]
) -> None:
    """One writer process: open, wait for the start signal, append, report its time window."""
    with open_log(url) as log:
        if not go.wait(WAIT_S):
            raise TimeoutError("never told to start")
        started = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on Linux
        for step in range(count):
            log.append(Stream.EVENTS, heartbeat(job_id, step, rank=writer))
        times.put((started, time.monotonic()))


def bench_writer_processes(url: str, job_id: str, writers: int, count: int) -> dict[str, Any]:
    """``writers`` processes append ``count`` records between them, all started at once."""
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    times: Queue[tuple[float, float]] = ctx.Queue()
    per_writer = count // writers
    processes = [
        ctx.Process(target=_writer_process, args=(url, job_id, w, per_writer, go, times))
        for w in range(writers)
    ]
    for process in processes:
        process.start()
    try:
        go.set()
        windows = [times.get(timeout=WAIT_S) for _ in processes]
    finally:
        for process in processes:
            process.join(WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
    elapsed = max(end for _, end in windows) - min(start for start, _ in windows)
    total = per_writer * writers
    return {
        "writers": writers,
        "records": total,
        "seconds": elapsed,
        "records_per_s": total / elapsed,
    }


def bench_read(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """Read a job back in pages of READ_BATCH, decoding and validating every record."""
    started = time.perf_counter()
    position, seen = 0, 0
    while True:
        page = log.read(Stream.EVENTS, job_id, from_position=position, limit=READ_BATCH)
        if not page:
            break
        seen += len(page)
        position = page[-1].position + 1
    elapsed = time.perf_counter() - started
    if seen != count:
        raise RuntimeError(f"read {seen} records of {job_id}, expected {count}")
    return {"records": seen, "seconds": elapsed, "records_per_s": seen / elapsed}


def bench_follow(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """A follower thread tails the job while this thread appends; how fast and how late it sees."""
    seen: list[tuple[Entry, float]] = []
    following = threading.Event()

    def follower() -> None:
        position = 0
        deadline = time.monotonic() + WAIT_S
        following.set()
        while len(seen) < count and time.monotonic() < deadline:
            for entry in log.follow(Stream.EVENTS, job_id, position, timeout=1.0):
                seen.append((entry, time.time()))
                position = entry.position + 1

    thread = threading.Thread(target=follower, daemon=True)
    thread.start()
    following.wait(WAIT_S)
    started = time.perf_counter()
    for step in range(count):
        log.append(Stream.EVENTS, heartbeat(job_id, step))
    thread.join(WAIT_S)
    elapsed = time.perf_counter() - started
    if len(seen) != count:
        raise RuntimeError(f"follower saw {len(seen)} records of {job_id}, expected {count}")
    lags = [seen_at - entry.record.ts for entry, seen_at in seen if entry.record is not None]
    return rates(count, elapsed, "lag", lags)


def run(url: str, records: int, writers: int) -> dict[str, Any]:
    tag = f"bench-{os.getpid()}-{int(time.time())}"
    with open_log(url) as log:
        results = {
            "single_writer_append": bench_single_writer(log, f"{tag}-single", records),
            "single_writer_batched": bench_single_writer_batched(
                log, f"{tag}-batched", records * 5
            ),
            "writer_processes_append": bench_writer_processes(
                url, f"{tag}-multi", writers, records
            ),
            "read": bench_read(log, f"{tag}-single", records),
            "follow_while_appending": bench_follow(log, f"{tag}-follow", records),
        }
    return {
        "url": url,
        "records": records,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
        },
        "results": results,
    }


def render(report: dict[str, Any]) -> Table:
    table = Table(title=f"log throughput — {report['url']}")
    table.add_column("phase")
    table.add_column("records", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("records/s", justify="right")
    table.add_column("detail")
    for phase, result in report["results"].items():
        detail = ", ".join(
            f"{key.removesuffix('_ms')} {value:.2f} ms"
            for key, value in result.items()
            if key.endswith("_ms")
        )
        if "writers" in result:
            detail = f"{result['writers']} processes"
        table.add_row(
            LABELS[phase],
            str(result["records"]),
            f"{result['seconds']:.2f}",
            f"{result['records_per_s']:,.0f}",
            detail,
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4000, help="records per phase")
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--url", help="log URL (default: a fresh sqlite file in a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fr-bench-") as tmp:
        report = run(args.url or f"sqlite://{tmp}/run.db", args.records, args.writers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    Console().print(render(report))
    Console().print(f"written to {args.out}")


if __name__ == "__main__":
    main()
