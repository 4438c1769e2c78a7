"""What the hash chain and the writers' signatures cost per record: stamping a link on append
(serialize + SHA-256 + lock), signing it (one HMAC-SHA256 under its source's key), the bytes
each adds, a durable append on the embedded log plain, linked and signed, and checking the
chains and the signatures. Writes bench/results/chain_cost.json and .png, prints a table.

    python -m bench.chain_cost [--ranks 8] [--steps 300] [--quick]
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
from flashrecovery.connectors.signing import Keyring
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


KEYS = Keyring("bench-secret-0123456789abcdef")


def in_memory(records: list[Envelope]) -> dict[str, float]:
    """Serializing a record as every append does: plain, with its chain link, and signed."""
    stored: list[bytes] = []
    chains, signing = ChainWriter(), ChainWriter()
    signing.keys = KEYS

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
    stored.clear()
    signed = per_record_us(records, lambda r: signing.append(Stream.EVENTS, r, keep))
    signed_bytes = statistics.fmean(len(raw) for raw in stored)
    entries = [Entry.decode(i, raw, Stream.EVENTS) for i, raw in enumerate(stored)]
    start = time.perf_counter()
    assert all(e.record and KEYS.forgery(e.raw, e.record) is None for e in entries)
    check_us = (time.perf_counter() - start) / len(entries) * 1e6
    return {
        "dump_us": plain,
        "dump_and_link_us": chained,
        "link_us": chained - plain,
        "dump_link_and_sign_us": signed,
        "sign_us": signed - chained,
        "bytes_plain": plain_bytes,
        "bytes_chained": chained_bytes,
        "bytes_added": chained_bytes - plain_bytes,
        "bytes_signed": signed_bytes,
        "bytes_added_by_signature": signed_bytes - chained_bytes,
        "verify_us": verify_us,
        "check_signature_us": check_us,
    }


def on_embedded_log(records: list[Envelope], rounds: int = 3) -> dict[str, float]:
    """A durable append (fsync per commit) plain, linked and signed, same records, rounds
    alternating so that the disk's mood weighs on all alike; the best round of each."""
    plain, chained, signed = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        log, signing = open_log(f"sqlite:///{tmp}/bench.db"), open_log(f"sqlite:///{tmp}/bench.db")
        signing.sign_with(KEYS)
        try:
            for i in range(rounds):
                job = [r.model_copy(update={"job_id": f"job{i}"}) for r in records]
                raws = [dump_record(r) for r in job]
                start = time.perf_counter()
                for raw in raws:
                    log.append_raw(Stream.EVENTS, f"raw{i}", raw)
                plain.append((time.perf_counter() - start) / len(raws) * 1e6)
                chained.append(per_record_us(job, lambda r: log.append(Stream.EVENTS, r)))
                again = [r.model_copy(update={"job_id": f"signed{i}"}) for r in records]
                signed.append(per_record_us(again, lambda r: signing.append(Stream.EVENTS, r)))
        finally:
            log.close()
            signing.close()
    return {
        "append_plain_us": min(plain),
        "append_chained_us": min(chained),
        "append_signed_us": min(signed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--durable", type=int, default=500, help="records appended to sqlite")
    parser.add_argument("--quick", action="store_true", help="CI: 4 ranks, 20 steps, 100 durable")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps, args.durable = 4, 20, 100
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
    append = [durable[f"append_{k}_us"] for k in ("plain", "chained", "signed")]
    console.print(
        table(
            "hash chain and signature cost per record",
            ["what", "plain", "linked", "linked + signed", "signing adds"],
            [
                [
                    "serialize (µs)",
                    f"{memory['dump_us']:.1f}",
                    f"{memory['dump_and_link_us']:.1f}",
                    f"{memory['dump_link_and_sign_us']:.1f}",
                    f"{memory['sign_us']:.1f}",
                ],
                [
                    "bytes",
                    f"{memory['bytes_plain']:.0f}",
                    f"{memory['bytes_chained']:.0f}",
                    f"{memory['bytes_signed']:.0f}",
                    f"{memory['bytes_added_by_signature']:.0f}",
                ],
                [
                    "sqlite append (µs)",
                    *(f"{us:.0f}" for us in append),
                    f"{append[2] - append[1]:.0f}",
                ],
                [
                    "check (µs)",
                    "-",
                    f"{memory['verify_us']:.1f} (chain)",
                    f"+ {memory['check_signature_us']:.1f} (signature)",
                    f"{memory['check_signature_us']:.1f}",
                ],
            ],
        )
    )
    plot = stacked_bars(
        "chain_cost",
        "serialize per record: plain, linked, signed",
        "µs per record",
        ["plain", "linked", "signed"],
        {
            "serialize": [memory["dump_us"]] * 3,
            "link (hash, lock)": [0.0, *[max(memory["link_us"], 0.0)] * 2],
            "sign (HMAC)": [0.0, 0.0, max(memory["sign_us"], 0.0)],
        },
    )
    console.print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
