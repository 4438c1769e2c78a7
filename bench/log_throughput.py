"""Throughput of the event log: writes one by one, in batches and handed over without waiting,
from one writer and from several processes; reads of a whole job and a follower's view.

Run ``python -m bench.log_throughput [--records N] [--rounds R] [--url URL] [--quick]``. The
default is a fresh embedded log in a temporary directory; any log URL works, since every phase
uses its own job id. The phases run in rounds, interleaved, so the machine's noise hits all
alike; each phase's figure is the median of its rounds (min and max beside it), and the load
average is recorded around every phase. Writes ``bench/results/log_throughput.json`` and a PNG
beside it, and prints a table. It measures, it asserts nothing.
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
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import matplotlib
from rich.console import Console
from rich.table import Table

from bench.lib.results import RESULTS
from bench.lib.stats import percentile
from flashrecovery.connectors import Entry, LogConnector, open_log
from flashrecovery.records import Heartbeat, Stream

matplotlib.use("Agg")  # files only, never a window
from matplotlib import pyplot as plt  # after use("Agg"): the backend must be chosen first

OUT = RESULTS / "log_throughput.json"
BATCH = 500  # records per append_many in the batched phase
BULK = 5  # the batched and async phases write BULK x --records (they are fast)
LABELS = {
    "append": "append, one by one (waits for each)",
    "append_many": f"append_many, {BATCH} a batch",
    "append_async": "append_async, one flush at the end",
    "processes": "append, N processes",
    "read": "read a job behind the others' (catch-up)",
    "read_alone": "read a job alone in its topic",
    "follow": "follow while appending",
}
WAIT_S = 120.0


def heartbeat(job_id: str, step: int, rank: int = 0) -> Heartbeat:
    return Heartbeat(job_id=job_id, generation=0, source=f"rank:{rank}", rank=rank, step=step,
                     pid=os.getpid(), host="bench")  # fmt: skip


class Timer:
    """Wall time and this process's CPU time (every thread: a client's I/O thread counts) of a
    phase. CPU per record is what load hides least: 1e6 / it is the rate one idle core gives."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def result(self, count: int) -> dict[str, float]:
        return {
            "records": count,
            "seconds": self.wall,
            "records_per_s": count / self.wall,
            "cpu_us_per_record": self.cpu / count * 1e6,
        }


def rates(count: int, timer: Timer, name: str, samples: list[float]) -> dict[str, float]:
    """A phase's result: records/s, CPU per record, and the median and p99 of its per-record
    samples (ms)."""
    return {
        **timer.result(count),
        f"{name}_p50_ms": statistics.median(samples) * 1e3,
        f"{name}_p99_ms": percentile(samples, 0.99) * 1e3,
    }


def bench_append(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    latencies = []
    with Timer() as timer:
        for step in range(count):
            before = time.perf_counter()
            log.append(Stream.EVENTS, heartbeat(job_id, step))
            latencies.append(time.perf_counter() - before)
    return rates(count, timer, "append", latencies)


def bench_append_many(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """One writer that waits once per batch of BATCH (one commit, or one wait for the
    acknowledgements); the sample is a batch's latency."""
    latencies = []
    with Timer() as timer:
        for first in range(0, count, BATCH):
            batch = [heartbeat(job_id, step) for step in range(first, min(first + BATCH, count))]
            before = time.perf_counter()
            log.append_many(Stream.EVENTS, batch)
            latencies.append(time.perf_counter() - before)
    return rates(count, timer, "batch", latencies)


def bench_append_async(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """One writer that never waits per record, then flushes once: the time until every record is
    stored (durable) is the phase's time; the sample is one hand-over."""
    latencies = []
    with Timer() as timer:
        for step in range(count):
            before = time.perf_counter()
            log.append_async(Stream.EVENTS, heartbeat(job_id, step))
            latencies.append(time.perf_counter() - before)
        log.flush(timeout=WAIT_S)
    return rates(count, timer, "hand_over", latencies)


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


def bench_processes(url: str, job_id: str, writers: int, count: int) -> dict[str, Any]:
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
    """Read a whole job back in one call, decoding and validating every record: what the engine
    does when it catches up."""
    with Timer() as timer:
        seen = len(log.read(Stream.EVENTS, job_id))
    if seen != count:
        raise RuntimeError(f"read {seen} records of {job_id}, expected {count}")
    return timer.result(seen)


def bench_read_alone(url: str, job_id: str, count: int) -> dict[str, Any]:
    """Write a job on a log of its own (untimed), then read it back like ``bench_read``. On
    Kafka ``read`` scans, and decodes, every record of the job's partition from its start (the
    other phases' jobs, earlier rounds'): this is the read alone, where nothing else is in the
    way; the embedded log indexes by job, so there the two are the same."""
    with open_log(url) as log:
        log.read(Stream.EVENTS, f"{job_id}-none")  # connected, as a reader that catches up is
        for first in range(0, count, BATCH):
            last = min(first + BATCH, count)
            log.append_many(Stream.EVENTS, [heartbeat(job_id, s) for s in range(first, last)])
        return bench_read(log, job_id, count)


def bench_follow(log: LogConnector, job_id: str, count: int) -> dict[str, Any]:
    """A follower thread tails the job while this thread appends one by one; how fast and how
    late it sees."""
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
    with Timer() as timer:  # the CPU is the writer's and the follower's
        for step in range(count):
            log.append(Stream.EVENTS, heartbeat(job_id, step))
        thread.join(WAIT_S)
    if len(seen) != count:
        raise RuntimeError(f"follower saw {len(seen)} records of {job_id}, expected {count}")
    lags = [seen_at - entry.record.ts for entry, seen_at in seen if entry.record is not None]
    return rates(count, timer, "lag", lags)


def _loaded(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A phase's result with the 1-minute load average before and after it."""
    before = os.getloadavg()[0]
    result = measure()
    return {**result, "load_1m": [before, os.getloadavg()[0]]}


def run_round(
    url: str, log: LogConnector, tag: str, records: int, writers: int, alone_url: str
) -> dict[str, Any]:
    bulk = records * BULK
    return {
        "append": _loaded(lambda: bench_append(log, f"{tag}-append", records)),
        "append_many": _loaded(lambda: bench_append_many(log, f"{tag}-many", bulk)),
        "append_async": _loaded(lambda: bench_append_async(log, f"{tag}-async", bulk)),
        "processes": _loaded(lambda: bench_processes(url, f"{tag}-procs", writers, records)),
        "read": _loaded(lambda: bench_read(log, f"{tag}-async", bulk)),
        "read_alone": _loaded(lambda: bench_read_alone(alone_url, f"{tag}-alone", bulk)),
        "follow": _loaded(lambda: bench_follow(log, f"{tag}-follow", records)),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: the median records/s over the rounds, its min and max, the median of the
    latency samples' figures, and the load seen around it."""
    out: dict[str, Any] = {}
    for phase in rounds[0]:
        runs = [r[phase] for r in rounds]
        per_s = [run["records_per_s"] for run in runs]
        out[phase] = {
            "records": runs[0]["records"],
            "records_per_s": statistics.median(per_s),
            "min_per_s": min(per_s),
            "max_per_s": max(per_s),
            "load_1m": [
                min(min(run["load_1m"]) for run in runs),
                max(max(run["load_1m"]) for run in runs),
            ],
            **{
                key: statistics.median(run[key] for run in runs)
                for key in runs[0]
                if key.endswith("_ms")
            },
            **(
                {"cpu_us_per_record": statistics.median(run["cpu_us_per_record"] for run in runs)}
                if "cpu_us_per_record" in runs[0]
                else {}
            ),
            **({"writers": runs[0]["writers"]} if "writers" in runs[0] else {}),
        }
    return out


def run(
    url: str,
    records: int,
    writers: int,
    rounds: int,
    alone_url: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Every phase in ``rounds`` interleaved rounds; ``alone_url`` gives the log a job is read
    alone on, one per round (default: ``url``, where jobs do not share what a read scans)."""
    tag = f"bench-{os.getpid()}-{int(time.time())}"
    fresh = alone_url or (lambda: url)
    with open_log(url) as log:
        results = [
            run_round(url, log, f"{tag}-{i}", records, writers, fresh()) for i in range(rounds)
        ]
    return {
        "url": url,
        "records": records,
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1_5_15m": os.getloadavg(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
        },
        "results": summarize(results),
        "rounds_raw": results,
    }


def render(report: dict[str, Any]) -> Table:
    table = Table(title=f"log throughput — {report['url']} ({report['rounds']} rounds, median)")
    columns = ("phase", "records", "records/s", "min-max /s", "CPU µs/rec", "load 1m", "detail")
    for column in columns:
        table.add_column(column, justify="left" if column in ("phase", "detail") else "right")
    for phase, result in report["results"].items():
        detail = ", ".join(
            f"{key.removesuffix('_ms')} {value:.2f} ms"
            for key, value in result.items()
            if key.endswith("_ms")
        )
        if "writers" in result:
            detail = f"{result['writers']} processes"
        low, high = result["load_1m"]
        table.add_row(
            LABELS[phase],
            str(result["records"]),
            f"{result['records_per_s']:,.0f}",
            f"{result['min_per_s']:,.0f}-{result['max_per_s']:,.0f}",
            f"{result['cpu_us_per_record']:.0f}" if "cpu_us_per_record" in result else "",
            f"{low:.1f}-{high:.1f}",
            detail,
        )
    return table


def plot(report: dict[str, Any], path: Path) -> Path:
    """Records/s per phase (log scale), the bar at the median, the whisker from min to max."""
    phases = list(report["results"])
    medians = [report["results"][p]["records_per_s"] for p in phases]
    spread = [
        [m - report["results"][p]["min_per_s"] for p, m in zip(phases, medians, strict=True)],
        [report["results"][p]["max_per_s"] - m for p, m in zip(phases, medians, strict=True)],
    ]
    load = report["machine"]["loadavg_1_5_15m"][0]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh([LABELS[p] for p in phases], medians, xerr=spread, color="tab:blue")
    for y, value in enumerate(medians):
        ax.annotate(f"{value:,.0f}", (value, y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("records/s (median of rounds; whiskers min-max)")
    ax.set_title(f"{report['url'].split('?')[0]} — load {load:.1f} on {os.cpu_count()} cores")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def publish(report: dict[str, Any], out: Path) -> None:
    """JSON, PNG and the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = plot(report, out)
    console = Console()
    console.print(render(report))
    console.print(f"written to {out} and {png}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=4000, help="records per one-by-one phase")
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all phases")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (CI)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the JSON")


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.records, args.writers, args.rounds = 200, 2, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--url", help="log URL (default: a fresh sqlite file in a temp dir)")
    args = parser.parse_args()
    apply_quick(args)
    with tempfile.TemporaryDirectory(prefix="fr-bench-") as tmp:
        report = run(args.url or f"sqlite://{tmp}/run.db", args.records, args.writers, args.rounds)
    publish(report, args.out)


if __name__ == "__main__":
    main()
