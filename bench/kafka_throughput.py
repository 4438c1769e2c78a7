"""Throughput of the Kafka log through the connector, on a broker this script starts itself.

Run ``python -m bench.kafka_throughput [--records N] [--rounds R] [--bootstrap HOST:PORT]
[--quick]``. It times the broker's start, then runs the phases of ``log_throughput.py`` (writes
one by one, in batches and without waiting; from several processes; reads; a follower) on fresh
topics, in interleaved rounds (a job read alone gets topics of its own each round), and writes
``bench/results/kafka_throughput.json``, a PNG and a table. ``--setting producer.linger_ms=5``
(repeatable) passes a connector setting, to compare tunings. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import time
import uuid

from bench.lib.results import RESULTS
from bench.log_throughput import add_arguments, apply_quick, publish, run
from flashrecovery.connectors.kafka_broker import KAFKA_VERSION, KafkaBroker, ensure_jars

OUT = RESULTS / "kafka_throughput.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(out=OUT)
    parser.add_argument("--partitions", type=int, default=1, help="partitions per topic")
    parser.add_argument("--bootstrap", help="an already running broker (default: start one)")
    parser.add_argument("--setting", action="append", default=[], help="NAME=VALUE for the URL")
    args = parser.parse_args()
    apply_quick(args)
    broker = None if args.bootstrap else KafkaBroker()
    try:
        start_s = None
        if broker is not None:
            ensure_jars()  # a first-time fetch is not broker start time
            started = time.monotonic()
            args.bootstrap = broker.start()
            start_s = time.monotonic() - started
        bootstrap = args.bootstrap

        def fresh_topics() -> str:
            prefix = f"bench{uuid.uuid4().hex[:8]}."
            query = [f"topic_prefix={prefix}", f"partitions={args.partitions}", *args.setting]
            return f"kafka://{bootstrap}?{'&'.join(query)}"

        report = run(fresh_topics(), args.records, args.writers, args.rounds, fresh_topics)
    finally:
        if broker is not None:
            broker.stop()
    report["kafka"] = {"version": KAFKA_VERSION, "broker_start_s": start_s}
    publish(report, args.out)
    if start_s is not None:
        print(f"broker start (format + JVM until serving): {start_s:.1f} s")


if __name__ == "__main__":
    main()
