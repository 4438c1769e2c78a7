"""Steady-state cost per step of the trainer hook against plain torch DDP, same model and data.

    python bench/overhead.py [--worlds 2 4] [--steps 60] [--quick]

Two hook sides, each the demo's training script under `flashrecovery run` (no spare, no fault):
"hook", whose commit averages the gradients itself, and "hook-ddp", the model wrapped in torch
DDP over the session's stable process group (DDP's buckets overlap the backward), whose commit
only votes. Both vote through the store, append a StepCompleted record and run a heartbeat
thread beside the loop. The baseline is the same model wrapped in
DistributedDataParallel on gloo, started with torch.multiprocessing on a TCPStore of its own.
Both time each step commit to commit and drop the first ``WARMUP`` steps. Results go to
bench/results/overhead.json, a table and bench/results/overhead.png. It measures, it asserts
nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import job_spec, machine, stacked_bars, table, write_json
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel

from flashrecovery.demo.data import batch_for
from flashrecovery.demo.job import LaunchedJob
from flashrecovery.demo.model import lm_loss
from flashrecovery.demo.results import RankResult, read_results
from flashrecovery.demo.train import build
from flashrecovery.trainer_hooks.final_state import parameters_sha256

WARMUP = 5  # first steps pay one-time costs (allocations, gloo buffers)
STORE_TIMEOUT = timedelta(seconds=60)


def step_times(results: dict[int, RankResult]) -> list[float]:
    """Steady-state step times of every rank."""
    return [t for r in results.values() for t in r.step_times_s[WARMUP:]]


def hook_run(world: int, steps: int, out: Path, timeout: float, parallel: str) -> list[float]:
    spec = replace(
        job_spec(out.name, out.parent, nproc=world, spares=0, steps=steps), parallel=parallel
    )
    with LaunchedJob(spec) as job:
        code = job.wait(timeout)
        if code != 0:
            raise RuntimeError(f"hook run ended with {code}:\n{job.output_tail()}")
    return step_times(read_results(spec.run_dir, world))


def ddp_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    """One rank of the baseline (spawned: module level, picklable arguments)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, optimizer, schedule = build(seed=0)
    ddp = DistributedDataParallel(model)
    losses: dict[int, float] = {}
    times: list[float] = []
    last = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch_for(step, rank, world)
        loss = lm_loss(ddp(x), y)
        loss.backward()
        losses[step] = loss.item()
        optimizer.step()
        schedule.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    dist.destroy_process_group()
    result = RankResult(rank, os.getpid(), 0, steps, parameters_sha256(model), losses, times)
    result.write(Path(out))


def ddp_run(world: int, steps: int, out: Path, timeout: float, parallel: str) -> list[float]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )
    context = mp.start_processes(
        ddp_worker,
        args=(world, store.port, steps, str(out)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the DDP baseline did not finish within {timeout:.0f}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return step_times(read_results(out, world))


# side -> how it runs and its demo --parallel value
SIDES: dict[str, tuple[Callable[[int, int, Path, float, str], list[float]], str]] = {
    "ddp": (ddp_run, "ddp"),
    "hook": (hook_run, "hook"),
    "hook-ddp": (hook_run, "ddp"),
}


def stats(times: list[float]) -> dict[str, Any]:
    return {
        "median_ms": statistics.median(times) * 1000,
        "p90_ms": statistics.quantiles(times, n=10)[-1] * 1000,
        "samples": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per world")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run at most")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 25 steps, one run each")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.steps, args.repeats = [2], 25, 1
    torch.set_num_threads(1)
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-overhead-") as tmp:
        for world in args.worlds:
            console.print(f"{world} ranks: {', '.join(SIDES)}, {args.repeats} runs of each …")
            times: dict[str, list[float]] = {side: [] for side in SIDES}
            for repeat in range(args.repeats):  # rotate, so a busy spell hits every side
                names, shift = list(SIDES), repeat % len(SIDES)
                for side in names[shift:] + names[:shift]:
                    runner, parallel = SIDES[side]
                    out = Path(tmp) / f"{side}-{world}-{repeat}"
                    times[side] += runner(world, args.steps, out, args.timeout, parallel)
            row: dict[str, Any] = {"world_size": world}
            for side in SIDES:
                row[side] = stats(times[side])
                overhead = row[side]["median_ms"] - row["ddp"]["median_ms"]
                row[f"{side}_overhead_ms"] = overhead
                row[f"{side}_overhead_pct"] = 100 * overhead / row["ddp"]["median_ms"]
            rows.append(row)
    settings = {"steps": args.steps, "warmup_steps": WARMUP, "repeats": args.repeats}
    path = write_json("overhead", {"machine": machine(), "settings": settings, "worlds": rows})
    console.print(
        table(
            "step time, ms (steady state, every rank's steps)",
            ["ranks", "side", "median", "p90", "overhead vs DDP"],
            [
                [
                    str(r["world_size"]),
                    side,
                    f"{r[side]['median_ms']:.1f}",
                    f"{r[side]['p90_ms']:.1f}",
                    f"{r[f'{side}_overhead_ms']:+.1f} ({r[f'{side}_overhead_pct']:+.0f}%)",
                ]
                for r in rows
                for side in SIDES
            ],
        )
    )
    plot = stacked_bars(
        "overhead",
        "median step time: plain DDP vs the flashrecovery hook",
        "ms",
        [f"{r['world_size']} ranks\n{side}" for r in rows for side in SIDES],
        {"median step": [r[side]["median_ms"] for r in rows for side in SIDES]},
    )
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
