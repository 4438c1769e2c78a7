"""Does the engine's work per record stay flat as the world grows?

    python -m bench.engine_scale [--worlds 100 1000 10000 100000] [--steps 3] [--quick]

A scripted world (tests/simworld.py: no torch, no log) of each size starts, trains a few steps
(a heartbeat and a step record per rank per step) and loses one rank; the pure decide step is
timed on every record. Reported per world size: µs per training record, ms to start the job,
ms to decide the whole recovery (the failure, every member's regroup, the restore) and that per
rank. Per-record cost should not grow with the world; a recovery is O(ranks), each of which
regroups. Writes bench/results/engine_scale.json, a table and bench/results/engine_scale.png.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import matplotlib
from rich.console import Console

from bench.lib.results import RESULTS, machine, table, write_json
from flashrecovery.engine.decide import decide
from flashrecovery.engine.state import EngineState
from flashrecovery.records import Decision, Envelope

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # after use("Agg")

from flashrecovery.testing.simworld import SimulatedWorld


class Timed:
    """Feeds records to one engine state, timing only the decide calls."""

    def __init__(self, job_id: str) -> None:
        self.state = EngineState(job_id)
        self.position = 0
        self.seconds = 0.0

    def feed(self, records: list[Envelope]) -> list[Decision]:
        decisions: list[Decision] = []
        for record in records:
            started = time.perf_counter()
            decisions += decide(self.state, self.position, record)
            self.seconds += time.perf_counter() - started
            self.position += 1
        return decisions


def measure(world_size: int, steps: int) -> dict[str, Any]:
    world = SimulatedWorld("scale", world_size=world_size, spares=1)
    engine = Timed("scale")
    engine.feed(world.start())
    start_ms = engine.seconds * 1000
    training = list(world.train(steps))
    engine.seconds = 0.0
    engine.feed(training)
    per_record_us = engine.seconds / len(training) * 1e6

    engine.seconds = 0.0
    pending: list[Envelope] = [world.kill(world_size // 2)]
    while pending:  # the world answers each decision as the agent and hooks would
        decisions = engine.feed(pending)
        pending = [answer for d in decisions for answer in world.react(d)]
    return {
        "world_size": world_size,
        "training_records": len(training),
        "start_ms": start_ms,
        "us_per_training_record": per_record_us,
        "recovery_ms": engine.seconds * 1000,
        "recovery_us_per_rank": engine.seconds / world_size * 1e6,
        "job_state_after": str(engine.state.job.state),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=[100, 1000, 10_000, 100_000], help="ranks"
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per world")
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 ranks, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.steps = [100, 1000], 2
    console = Console()
    rows = []
    for size in args.worlds:
        console.print(f"{size:,} ranks …")
        rows.append(measure(size, args.steps))
    path = write_json("engine_scale", {"machine": machine(), "steps": args.steps, "rows": rows})
    console.print(
        table(
            "the decide step against world size",
            ["ranks", "start (ms)", "µs per record", "recovery (ms)", "recovery µs per rank"],
            [
                [
                    f"{r['world_size']:,}",
                    f"{r['start_ms']:.0f}",
                    f"{r['us_per_training_record']:.1f}",
                    f"{r['recovery_ms']:.1f}",
                    f"{r['recovery_us_per_rank']:.1f}",
                ]
                for r in rows
            ],
        )
    )
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sizes = [r["world_size"] for r in rows]
    ax.plot(sizes, [r["us_per_training_record"] for r in rows], "o-", label="µs per record")
    ax.plot(sizes, [r["recovery_us_per_rank"] for r in rows], "s-", label="recovery µs per rank")
    ax.set_xscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("µs")
    ax.set_title("decide cost against world size (flat is the goal)")
    ax.legend()
    fig.tight_layout()
    plot = RESULTS / "engine_scale.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
