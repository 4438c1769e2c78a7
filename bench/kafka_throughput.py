"""Throughput of the Kafka log through the connector, on a broker this script starts itself.

Run ``python bench/kafka_throughput.py [--records N] [--bootstrap HOST:PORT]``. It times the
broker's start, then runs the same phases as ``log_throughput.py`` (append from one writer and
from several processes, read, follow) on fresh topics, writes
``bench/results/kafka_throughput.json`` and prints a table. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

from log_throughput import render, run  # the shared phases (bench/ is on sys.path as a script)
from rich.console import Console

from flashrecovery.connectors.kafka_broker import KAFKA_VERSION, KafkaBroker, ensure_jars

RESULTS = Path(__file__).resolve().parent / "results" / "kafka_throughput.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4000, help="records per phase")
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--partitions", type=int, default=1, help="partitions per topic")
    parser.add_argument("--bootstrap", help="an already running broker (default: start one)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    broker = None if args.bootstrap else KafkaBroker()
    try:
        start_s = None
        if broker is not None:
            ensure_jars()  # a first-time fetch is not broker start time
            started = time.monotonic()
            args.bootstrap = broker.start()
            start_s = time.monotonic() - started
        prefix = f"bench{uuid.uuid4().hex[:8]}."
        url = f"kafka://{args.bootstrap}?topic_prefix={prefix}&partitions={args.partitions}"
        report = run(url, args.records, args.writers)
    finally:
        if broker is not None:
            broker.stop()
    report["kafka"] = {"version": KAFKA_VERSION, "broker_start_s": start_s}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console = Console()
    console.print(render(report))
    if start_s is not None:
        console.print(f"broker start (format + JVM until serving): {start_s:.1f} s")
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
