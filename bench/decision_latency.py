"""Detection-to-decision latency per log backend: from a RankExited record appended by the agent
to the IsolateRank decision readable by a follower (engine loop running in its own thread).

    python bench/decision_latency.py [--trials 20] [--kafka 127.0.0.1:9092]

Without --kafka it starts the project's own broker (flashrecovery broker) for the run.
Writes bench/results/decision_latency.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import LogConnector
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.logs import configure_logging
from flashrecovery.records import Decision, Envelope, Stream

# The scripted world (no torch) lives with the tests: tests/simworld.py.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from simworld import SimulatedWorld

RESULTS = Path(__file__).parent / "results"


def follow_until(
    log: LogConnector, job: str, position: int, last_type: str
) -> tuple[list[Decision], int]:
    """Decisions from ``position`` up to and including one of ``last_type``."""
    got: list[Decision] = []
    while not got or got[-1].type != last_type:
        entries = log.follow(Stream.DECISIONS, job, position, timeout=10.0)
        if not entries:
            raise RuntimeError(f"no {last_type} decision within 10 s")
        position = entries[-1].position + 1
        got += [e.record for e in entries if isinstance(e.record, Decision)]
    return got, position


def measure(log: LogConnector, trials: int, label: str) -> list[float]:
    """Milliseconds from each kill record's append until the isolate, replace and regroup
    decisions are readable by a follower (what a rank or the agent waits for)."""
    job = f"latency-{uuid.uuid4().hex[:8]}"
    world = SimulatedWorld(
        job, world_size=4, spares=trials, heartbeat_interval_s=600.0, clock=time.time()
    )
    engine = EngineLoop(log, job, poll_s=0.5).start()
    position = 0
    latencies = []

    def append(records: list[Envelope]) -> None:
        for record in records:
            log.append(Stream.EVENTS, record)

    try:
        append([*world.start(), *world.train(1)])
        for trial in track(range(trials), description=f"{label}: kill -> decision"):
            start = time.perf_counter()
            append([world.kill(trial % world.world_size)])
            regroup, position = follow_until(log, job, position, "regroup_planned")
            latencies.append((time.perf_counter() - start) * 1000)
            append([r for d in regroup for r in world.react(d)])
            resume, position = follow_until(log, job, position, "resume_planned")
            append([r for d in resume for r in world.react(d)])
            append(list(world.train(1)))
    finally:
        engine.stop()
    return latencies


def summarise(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kafka", help="bootstrap of a running broker (default: start one)")
    args = parser.parse_args()
    configure_logging()
    results: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        bootstrap = args.kafka
        if bootstrap is None:
            from flashrecovery.connectors.kafka_broker import KafkaBroker

            broker = KafkaBroker()
            broker.start()
            stack.callback(broker.stop)
            bootstrap = broker.bootstrap
        urls = {
            "embedded": f"sqlite:///{tmp}/latency.db",
            "kafka": f"kafka://{bootstrap}?topic_prefix=latency{uuid.uuid4().hex[:6]}.",
        }
        for label, url in urls.items():
            log = stack.enter_context(open_log(url))
            results[label] = summarise(measure(log, args.trials, label))
    results["kafka_added_median_ms"] = {
        "value": results["kafka"]["median_ms"] - results["embedded"]["median_ms"]
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decision_latency.json").write_text(json.dumps(results, indent=2))
    table = Table(title=f"kill record → isolate decision readable ({args.trials} trials)")
    for column in ("log", "median ms", "p90 ms", "min ms", "max ms"):
        table.add_column(column, justify="right")
    for label in urls:
        r = results[label]
        table.add_row(label, *(f"{r[k]:.1f}" for k in ("median_ms", "p90_ms", "min_ms", "max_ms")))
    Console().print(table)
    Console().print(f"Kafka adds {results['kafka_added_median_ms']['value']:.1f} ms (median)")


if __name__ == "__main__":
    main()
