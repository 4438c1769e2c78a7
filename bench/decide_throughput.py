"""Records/s through the engine's decide step (pure, in memory) and through the engine loop on
the embedded log. Writes bench/results/decide_throughput.json and prints a table.

    python -m bench.decide_throughput [--ranks 64] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rich.console import Console
from rich.table import Table

from bench.lib.results import RESULTS
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry
from flashrecovery.engine.decide import decide
from flashrecovery.engine.loop import EngineLoop
from flashrecovery.engine.state import EngineState
from flashrecovery.logs import configure_logging
from flashrecovery.records import Envelope, Stream, dump_record
from flashrecovery.testing.simworld import SimulatedWorld


def workload(ranks: int, steps: int) -> list[Envelope]:
    world = SimulatedWorld("bench", world_size=ranks, spares=1)
    return [*world.start(), *world.train(steps)]


def pure_decide(records: list[Envelope]) -> float:
    state = EngineState("bench")
    start = time.perf_counter()
    for position, record in enumerate(records):
        decide(state, position, record)
    return len(records) / (time.perf_counter() - start)


def parse_and_decide(records: list[Envelope]) -> float:
    """As the loop sees records: bytes from the log, parsed, then decided."""
    raws = [dump_record(r) for r in records]
    state = EngineState("bench")
    start = time.perf_counter()
    for position, raw in enumerate(raws):
        entry = Entry.decode(position, raw, Stream.EVENTS)
        assert entry.record is not None
        decide(state, position, entry.record)
    return len(raws) / (time.perf_counter() - start)


def loop_on_embedded(records: list[Envelope]) -> float:
    """The engine loop catching up on records already in the embedded log."""
    with tempfile.TemporaryDirectory() as tmp:
        log = open_log(f"sqlite:///{tmp}/bench.db")
        for record in records:
            log.append(Stream.EVENTS, record)
        start = time.perf_counter()
        EngineLoop(log, "bench").catch_up()
        rate = len(records) / (time.perf_counter() - start)
        log.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    configure_logging()
    records = workload(args.ranks, args.steps)
    results = {
        "records": len(records),
        "ranks": args.ranks,
        "decide_records_per_s": pure_decide(records),
        "parse_and_decide_records_per_s": parse_and_decide(records),
        "engine_loop_on_embedded_records_per_s": loop_on_embedded(records),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decide_throughput.json").write_text(json.dumps(results, indent=2))
    table = Table(title=f"engine throughput ({len(records)} records, {args.ranks} ranks)")
    table.add_column("path")
    table.add_column("records/s", justify="right")
    for key, value in results.items():
        if key.endswith("_per_s"):
            table.add_row(key.removesuffix("_records_per_s"), f"{value:,.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
