"""How the spare pool covers failures in flight: two ranks SIGKILLed at once, and the refill
policy under repeated kills.

    python -m bench.spares [--rounds 3] [--quick]

Scenarios, each one job of the demo's model on 4 ranks under `flashrecovery run`:
- double kill: two ranks SIGKILLed in the same instant, with 1 and with 2 spares (each round
  starts once the pool is full again);
- kill train: one rank SIGKILLed every few steps with 1 spare, `--spare-refill immediate` vs
  `after-recovery` (no waiting for the pool: the policy is what is measured).
RTO is the time from the SIGKILL to the last IncidentClosed it caused (every rank has committed
a new step). Medians go to bench/results/spares.json, a table and bench/results/spares.png. It
measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.launch import job_spec
from bench.lib.results import machine, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.demo.job import LaunchedJob
from flashrecovery.demo.watch import JobWatch
from flashrecovery.records import Stream

WORLD = 4
STEPS = 1_000_000  # never reached: each scenario ends its job once it has its rounds
GAP_STEPS = 4  # steps of normal training between a recovery and the next round
POOL_WAIT_S = 90.0  # a refilled spare starts python and torch on busy cores
POLL_S = 0.05


@dataclass(frozen=True)
class Scenario:
    name: str
    spares: int
    refill: str
    kills_per_round: int
    wait_for_pool: bool


SCENARIOS = [
    Scenario("double kill, 1 spare", 1, "immediate", 2, True),
    Scenario("double kill, 2 spares", 2, "immediate", 2, True),
    Scenario("kill train, refill immediate", 1, "immediate", 1, False),
    Scenario("kill train, refill after-recovery", 1, "after-recovery", 1, False),
]


def run(scenario: Scenario, rounds: int, seed: int, tmp: Path, timeout: float) -> list[float]:
    """RTO in seconds of each round (kill -> the last incident it opened is closed)."""
    name = scenario.name.replace(" ", "-").replace(",", "")
    spec = replace(
        job_spec(name, tmp, nproc=WORLD, spares=scenario.spares, steps=STEPS),
        agent_args=("--spare-refill", scenario.refill),
    )
    rng = random.Random(seed)
    rtos: list[float] = []
    deadline = time.monotonic() + timeout
    with open_log(spec.log_url) as log, LaunchedJob(spec) as job:
        watch = JobWatch(log, spec.job_id)
        while len(rtos) < rounds and time.monotonic() < deadline and job.poll() is None:
            opened = _next_round(job, watch, scenario, deadline)
            if opened is None:
                break
            ranks = rng.sample(range(WORLD), scenario.kills_per_round)
            pids = [watch.pid_of(r) for r in ranks]
            killed_at = [job.kill_descendant(pid) for pid in pids if pid is not None]
            if len(killed_at) != len(ranks) or None in killed_at:
                break
            target = opened + scenario.kills_per_round
            closed = _closures(log, spec.job_id)
            while len(closed) < target and time.monotonic() < deadline:
                watch.poll(POLL_S)  # the engine writes the closures as it sees the steps
                closed = _closures(log, spec.job_id)
            if len(closed) >= target:
                rtos.append(max(closed[opened:target]) - min(t for t in killed_at if t))
    return rtos


def _next_round(
    job: LaunchedJob, watch: JobWatch, scenario: Scenario, deadline: float
) -> int | None:
    """Wait until the job runs, GAP_STEPS steps past the last recovery (and the pool is full,
    if the scenario asks); the number of incidents so far, or None on timeout."""
    start = watch.committed()
    pool_deadline = time.monotonic() + POOL_WAIT_S
    while time.monotonic() < deadline and job.poll() is None:
        watch.poll(POLL_S)
        first = watch.incidents[0] == 0  # every scenario starts with a full pool
        wait_for_pool = scenario.wait_for_pool or first
        pool_full = watch.ready_spares >= scenario.spares or time.monotonic() > pool_deadline
        trained = watch.committed() >= max(start, 0) + GAP_STEPS
        if watch.running and trained and (pool_full or not wait_for_pool):
            return watch.incidents[0]
    return None


def _closures(log: Any, job_id: str) -> list[float]:
    return [
        e.record.ts
        for e in log.read(Stream.DECISIONS, job_id)
        if e.record is not None and e.record.type == "incident_closed"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (median)")
    parser.add_argument("--seed", type=int, default=0, help="which ranks are killed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario")
    parser.add_argument("--quick", action="store_true", help="1 round per scenario")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    console = Console()
    results = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-spares-") as tmp:
        for scenario in SCENARIOS:
            console.print(f"{scenario.name}: {args.rounds} rounds …")
            rtos = run(scenario, args.rounds, args.seed, Path(tmp), args.timeout)
            results.append(
                {
                    **asdict(scenario),
                    "rto_s": rtos,
                    "median_rto_s": statistics.median(rtos) if rtos else None,
                }
            )
    settings = {"world_size": WORLD, "rounds": args.rounds, "gap_steps": GAP_STEPS}
    path = write_json("spares", {"machine": machine(), "settings": settings, "results": results})

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    console.print(
        table(
            f"RTO, ms (SIGKILL → every rank committed a new step), {WORLD} ranks",
            ["scenario", "median", "each round"],
            [
                [r["name"], ms(r["median_rto_s"]), " ".join(ms(v) for v in r["rto_s"])]
                for r in results
            ],
        )
    )
    plot = stacked_bars(
        "spares",
        "median RTO by scenario",
        "ms",
        [r["name"].replace(", ", "\n") for r in results],
        {"RTO": [(r["median_rto_s"] or 0.0) * 1000 for r in results]},
    )
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
