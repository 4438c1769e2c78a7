"""Create the log's Kafka topics (events and decisions) ahead of the first run.

Connectors create them on first use too; this is for clusters where topics are provisioned by
an operator, or to set partitions and replication once.
"""

from __future__ import annotations

import argparse
import sys

from flashrecovery.connectors.kafka import KafkaSettings, ensure_topics, redact
from flashrecovery.errors import LogError
from flashrecovery.records import Stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("create",))
    parser.add_argument("--log", required=True, help="kafka://host:port[?topic_prefix=…&…]")


def run(args: argparse.Namespace) -> int:
    try:
        settings = KafkaSettings.parse(args.log)
        created = ensure_topics(settings)
    except LogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for stream_topic in (settings.topic(s) for s in Stream):
        state = "created" if stream_topic in created else "exists"
        print(f"{stream_topic}\t{state}")
    print(f"topics ready on {redact(args.log)}", file=sys.stderr)
    return 0
