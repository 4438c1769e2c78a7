"""What the hash chain costs per record: stamping a link on append (serialize + SHA-256 + lock),
the bytes it adds, a durable append on the embedded log with and without it, and verifying.
Writes bench/results/chain_cost.json and .png, prints a table.

    python -m bench.chain_cost [--ranks 8] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

from rich.console import Console

from bench.lib.results import machine, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.connectors.base import Entry
from flashrecovery.connectors.chain import ChainWriter
from flashrecovery.records import Envelope, Stream, dump_record
from flashrecovery.replay.verify import verify
from flashrecovery.testing.simworld import SimulatedWorld


def workload(ranks: int, steps: int) -> list[Envelope]:
    world = SimulatedWorld("bench", world_size=ranks, spares=1)
    return [*world.start(), *world.train(steps)]


def per_record_us(records: list[Envelope], append: Callable[[Envelope], object]) -> float:
    start = time.perf_counter()
    for record in records:
        append(record)
    return (time.perf_counter() - start) / len(records) * 1e6


def in_memory(records: list[Envelope]) -> dict[str, float]:
    """Serializing a record as every append does, without and with its chain link."""
    stored: list[bytes] = []
    chains = ChainWriter()

    def keep(stream: Stream, job_id: str, raw: bytes) -> int:
        stored.append(raw)
        return len(stored)

    plain = per_record_us(records, lambda r: keep(Stream.EVENTS, r.job_id, dump_record(r)))
    plain_bytes = statistics.fmean(len(raw) for raw in stored)
    stored.clear()
    chained = per_record_us(records, lambda r: chains.append(Stream.EVENTS, r, keep))
    chained_bytes = statistics.fmean(len(raw) for raw in stored)
    entries = [Entry.decode(i, raw, Stream.EVENTS) for i, raw in enumerate(stored)]
    start = time.perf_counter()
    assert verify({Stream.EVENTS: entries}).ok
    verify_us = (time.perf_counter() - start) / len(entries) * 1e6
    return {
        "dump_us": plain,
        "dump_and_link_us": chained,
        "link_us": chained - plain,
        "bytes_plain": plain_bytes,
        "bytes_chained": chained_bytes,
        "bytes_added": chained_bytes - plain_bytes,
        "verify_us": verify_us,
    }


def on_embedded_log(records: list[Envelope], rounds: int = 3) -> dict[str, float]:
    """A durable append (fsync per commit) without and with the link, same records, rounds
    alternating so that the disk's mood weighs on both alike; the best round of each."""
    plain, chained = [], []
    with tempfile.TemporaryDirectory() as tmp:
        log = open_log(f"sqlite:///{tmp}/bench.db")
        try:
            for i in range(rounds):
                job = [r.model_copy(update={"job_id": f"job{i}"}) for r in records]
                raws = [dump_record(r) for r in job]
                start = time.perf_counter()
                for raw in raws:
                    log.append_raw(Stream.EVENTS, f"raw{i}", raw)
                plain.append((time.perf_counter() - start) / len(raws) * 1e6)
                chained.append(per_record_us(job, lambda r: log.append(Stream.EVENTS, r)))
        finally:
            log.close()
    return {"append_plain_us": min(plain), "append_chained_us": min(chained)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--durable", type=int, default=500, help="records appended to sqlite")
    args = parser.parse_args()
    records = workload(args.ranks, args.steps)
    memory = in_memory(records)
    durable = on_embedded_log(records[: args.durable])
    result = {
        "records": len(records),
        "durable_records": min(len(records), args.durable),
        **memory,
        **durable,
        "machine": machine(),
    }
    path = write_json("chain_cost", result)
    console = Console()
    console.print(
        table(
            "hash chain cost per record",
            ["what", "without chain", "with chain", "added"],
            [
                [
                    "serialize (µs)",
                    f"{memory['dump_us']:.1f}",
                    f"{memory['dump_and_link_us']:.1f}",
                    f"{memory['link_us']:.1f}",
                ],
                [
                    "bytes",
                    f"{memory['bytes_plain']:.0f}",
                    f"{memory['bytes_chained']:.0f}",
                    f"{memory['bytes_added']:.0f}",
                ],
                [
                    "sqlite append (µs)",
                    f"{durable['append_plain_us']:.0f}",
                    f"{durable['append_chained_us']:.0f}",
                    f"{durable['append_chained_us'] - durable['append_plain_us']:.0f}",
                ],
                ["verify (µs)", "-", f"{memory['verify_us']:.1f}", "-"],
            ],
        )
    )
    plot = stacked_bars(
        "chain_cost",
        "serialize per record: plain vs linked",
        "µs per record",
        ["plain", "chained"],
        {
            "serialize": [memory["dump_us"], memory["dump_us"]],
            "link (hash, lock)": [0.0, max(memory["link_us"], 0.0)],
        },
    )
    console.print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
