"""Steady-state cost per step of the trainer hook against plain torch, same model, data and loop.

    python bench/overhead.py [--models gpt mlp] [--worlds 2 4] [--steps 60] [--repeats 3]
    python bench/overhead.py --quick      # CI: the MLP on 2 ranks, a few steps, nothing asserted

Sides (bench/overhead_rank.py runs every one of them through the same step loop):

- ``ddp``: plain torch DDP on gloo, its own processes and store: the baseline;
- ``stable-ddp``: the same DDP over the hook's stable process group (gloo underneath, buckets
  settled as ``register()`` settles them) with no session and no agent: what the group alone
  costs;
- ``hook-ddp``: the same DDP over the session's stable process group, under ``flashrecovery
  run``; ``commit()`` only votes;
- ``hook``: the hook's own reduce (no DDP): ``commit()`` averages the gradients, votes and steps;
- ``hsdp``: plain FSDP2 on a (ranks / 2) x 2 replicate x shard mesh: the HSDP baseline;
- ``hook-hsdp``: the same HSDP over the session's stable mesh, under ``flashrecovery run``.

A hook side pays everything the hook adds: the vote on the store, the StepCompleted record, the
heartbeat and decisions threads, and the agent (with its engine) on the same cores. Beside wall
time it counts CPU: each rank's per step, and the agent's over the ranks' steady steps, so the
hook's whole cost in CPU per step (every rank plus the agent, against the baseline's ranks) is
there too; unlike wall time on shared cores, a busy machine barely moves it. Runs are
interleaved (each repeat rotates the order, so a busy spell hits every side) and each repeat's
hook side is compared with the same repeat's baseline. The overhead shown is the median of
those paired overheads, with an interval that covers their median with at least 90 % whatever
the noise's shape (order statistics: up to 7 repeats it is their range, which 5 repeats make
94 % sure), and whether that decides the 5 % goal: "yes" (all of it at or below), "no"
(all above), "undecided" (the machine's noise is wider than the question) or "too few
repeats" (under 5: their range covers the median with under 90 %). Results:
bench/results/overhead.json (with the load average around every run), a table, and
bench/results/overhead.png; ``--render`` summarizes a JSON written before again. It measures;
it asserts nothing.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import RESULTS, job_spec, machine, table, write_json
from matplotlib import pyplot as plt
from overhead_rank import MODELS, plain_rank, read_times
from rich.console import Console
from rich.markup import escape

from flashrecovery.demo.job import LaunchedJob

RANK_SCRIPT = Path(__file__).resolve().with_name("overhead_rank.py")
PARTS = ("total", "compute", "commit", "optimizer", "cpu")  # overhead_rank.StepTimes
WARMUP = 5  # first steps pay one-time costs (allocations, gloo buffers)
GOAL_PCT = 5.0  # the step time the hook may add (issue: "a step path as fast as DDP")
CONFIDENCE = 0.9  # how surely the interval of the overhead's median must hold it
AGENT_SAMPLE_S = 0.1  # how often the agent's CPU time is read while a hook side runs


@dataclass(frozen=True)
class Side:
    parallel: str  # overhead_rank.py --parallel
    hook: bool  # under flashrecovery run, or plain torch
    baseline: str | None = None  # the side it is measured against
    stable: bool = False  # plain processes over the hook's stable group (no session, no agent)


SIDES = {
    "ddp": Side("ddp", hook=False),
    "stable-ddp": Side("ddp", hook=False, baseline="ddp", stable=True),
    "hook-ddp": Side("ddp", hook=True, baseline="ddp"),
    "hook": Side("hook", hook=True, baseline="ddp"),
    "hsdp": Side("hsdp", hook=False),
    "hook-hsdp": Side("hsdp", hook=True, baseline="hsdp"),
}


CpuSamples = list[tuple[float, float]]  # (unix time, the agent's CPU seconds so far)


def hook_run(
    side: Side, model: str, world: int, steps: int, out: Path, timeout: float
) -> CpuSamples:
    """The job under ``flashrecovery run``; its agent's CPU time, sampled while it runs."""
    spec = replace(
        job_spec(out.name, out.parent, nproc=world, spares=0, steps=steps),
        parallel=side.parallel,  # hsdp: the job gets --shards
        script=RANK_SCRIPT,
        script_args=(
            *("--model", model, "--parallel", side.parallel),
            *("--steps", str(steps), "--out", str(out / "times")),
        ),
    )
    samples: CpuSamples = []
    with LaunchedJob(spec) as job:
        agent = psutil.Process(job.pid)
        deadline = time.monotonic() + timeout
        code = None
        while code is None and time.monotonic() < deadline:
            try:
                cpu = agent.cpu_times()
            except psutil.NoSuchProcess:
                pass  # ended: the wait below says how
            else:
                samples.append((time.time(), cpu.user + cpu.system))
            code = job.wait(AGENT_SAMPLE_S)
        if code != 0:
            raise RuntimeError(f"{side} ended with {code}:\n{job.output_tail()}")
    return samples


def plain_run(
    side: Side, model: str, world: int, steps: int, out: Path, timeout: float
) -> CpuSamples:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.start_processes(
        plain_rank,
        args=(world, store.port, model, side.parallel, steps, str(out / "times"), side.stable),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {side.parallel} baseline did not finish in {timeout:.0f}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return []  # no agent


def run(
    name: str, model: str, world: int, steps: int, out: Path, timeout: float, repeat: int
) -> dict[str, Any]:
    """One run of one side: every rank's steady steps, the load around it."""
    side = SIDES[name]
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    agent_cpu = (hook_run if side.hook else plain_run)(side, model, world, steps, out, timeout)
    ranks = read_times(out / "times", world)
    steady = [{part: getattr(r, part)[WARMUP:] for part in PARTS} for r in ranks]
    parts = {part: _median_ms([t for r in steady for t in r[part]]) for part in PARTS[1:]}
    parts["agent_cpu"] = _agent_ms_per_step(agent_cpu, ranks[0].ended[WARMUP - 1 :])
    # CPU of the whole job per step: every rank's, and the agent's
    parts["job_cpu"] = world * parts["cpu"] + parts["agent_cpu"]
    return {
        "side": name,
        "repeat": repeat,
        "seconds": round(time.monotonic() - started, 2),
        "load_1m_before_after": [load_before, os.getloadavg()[0]],
        "params_sha256": ranks[0].params_sha256,
        "median_ms": _median_ms([t for r in steady for t in r["total"]]),
        "parts_ms": parts,
        "step_ms": [round(t * 1000, 3) for r in steady for t in r["total"]],
    }


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def _agent_ms_per_step(samples: CpuSamples, ended: list[float]) -> float:
    """The agent's CPU ms per step over the steady steps (``ended``: the step before the first
    of them, then each one's end), from the samples around that window; 0 without an agent."""
    if len(samples) < 2 or len(ended) < 2:
        return 0.0
    return (_cpu_at(samples, ended[-1]) - _cpu_at(samples, ended[0])) * 1000 / (len(ended) - 1)


def _cpu_at(samples: CpuSamples, when: float) -> float:
    """The agent's CPU time at ``when``, interpolated between the samples around it."""
    i = min(max(bisect.bisect_left(samples, (when,)), 1), len(samples) - 1)
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * min(max((when - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else c1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side over its runs, and each hook side against its baseline, repeat by repeat."""
    by_side: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_side.setdefault(r["side"], []).append(r)
    sides: dict[str, Any] = {}
    for name, side_runs in by_side.items():
        steps = [t for r in side_runs for t in r["step_ms"]]
        deciles = statistics.quantiles(steps, n=10)
        sides[name] = {
            "median_ms": statistics.median(steps),
            "p10_ms": deciles[0],
            "p90_ms": deciles[-1],
            "run_medians_ms": [r["median_ms"] for r in side_runs],
            "parts_ms": {
                part: statistics.median(r["parts_ms"][part] for r in side_runs)
                for part in side_runs[0]["parts_ms"]
            },
        }
        base_by_repeat = {r["repeat"]: r for r in by_side.get(SIDES[name].baseline or "", [])}
        pairs = [
            (r, base_by_repeat[r["repeat"]]) for r in side_runs if r["repeat"] in base_by_repeat
        ]
        if pairs:
            baseline = pairs[0][1]["side"]
            per_repeat = [100 * (a["median_ms"] / b["median_ms"] - 1) for a, b in pairs]
            low, high, coverage = median_interval(per_repeat)
            sides[name]["baseline"] = baseline
            sides[name]["overhead_pct"] = statistics.median(per_repeat)  # paired, repeat by repeat
            sides[name]["overhead_pct_per_repeat"] = per_repeat
            sides[name]["overhead_pct_interval"] = {
                "low": low,
                "high": high,
                "coverage": coverage,
            }
            sides[name]["within_goal"] = verdict(low, high, coverage)
            base_cpu = statistics.median(r["parts_ms"]["job_cpu"] for r in by_side[baseline])
            sides[name]["job_cpu_overhead_pct"] = 100 * (
                sides[name]["parts_ms"]["job_cpu"] / base_cpu - 1
            )
            sides[name]["bitwise_equal_to_baseline"] = all(
                a["params_sha256"] == b["params_sha256"] for a, b in pairs
            )
    return sides


def median_interval(
    values: list[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample (the repeats'
    paired overheads): the narrowest pair of order statistics, k-th smallest and k-th largest,
    that covers it with at least ``confidence`` (the sign test's binomial; at least the range).
    Returns (low, high, coverage): 5 repeats give their range with 94 %, 3 only 75 %."""
    ordered, n = sorted(values), len(values)

    def coverage(k: int) -> float:  # P(the k-th smallest <= median <= the k-th largest)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def verdict(low: float, high: float, coverage: float) -> str:
    """Whether a run decides the goal: every plausible median within it, none, or neither (and
    with fewer than 5 repeats it cannot say)."""
    if coverage < CONFIDENCE:
        return "too few repeats"
    if high <= GOAL_PCT:
        return "yes"
    if low > GOAL_PCT:
        return "no"
    return "undecided"


def plot(results: list[dict[str, Any]]) -> Path:
    """Per model and world, each side's median step (bar), p10-p90 (whisker), run medians
    (dots), and each hook side's overhead over its baseline."""
    fig, axes = plt.subplots(
        1, len(results), figsize=(max(6.5, 4.2 * len(results)), 4.5), squeeze=False
    )
    for ax, result in zip(axes[0], results, strict=True):
        names = list(result["sides"])
        for x, name in enumerate(names):
            s = result["sides"][name]
            ax.bar(x, s["median_ms"], color="tab:gray" if not SIDES[name].hook else "tab:blue")
            ax.errorbar(
                x,
                s["median_ms"],
                yerr=[[s["median_ms"] - s["p10_ms"]], [s["p90_ms"] - s["median_ms"]]],
                color="black",
                capsize=3,
            )
            ax.plot([x] * len(s["run_medians_ms"]), s["run_medians_ms"], "o", color="tab:orange")
            if "overhead_pct" in s:
                ax.annotate(
                    f"{s['overhead_pct']:+.1f}%",
                    (x, s["p90_ms"]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.set_title(f"{result['model']}, {result['world_size']} ranks", fontsize=9)
        ax.set_ylabel("ms per step")
    fig.suptitle(
        "step time: plain torch (gray) vs under the flashrecovery hook (blue)", fontsize=10
    )
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "overhead.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of each side (5 or more decide the goal)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument("--quick", action="store_true", help="CI: the MLP, 2 ranks, one run")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="summarize the runs of an earlier JSON again"
    )
    args = parser.parse_args()
    console = Console(width=170)  # the table is wide; CI logs are not a terminal
    if args.render is not None:
        data = json.loads(args.render.read_text())
        for result in data["results"]:
            result["sides"] = summarize(result["runs"])
        report(console, data)
        return
    if args.quick:
        args.models, args.worlds, args.steps, args.repeats = ["mlp"], [2], WARMUP + 7, 1
    if any(w % 2 for w in args.worlds) and {"hsdp", "hook-hsdp"} & set(args.sides):
        parser.error("HSDP runs a (ranks / 2) x 2 mesh: give even --worlds")
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-overhead-") as tmp:
        for model in args.models:
            for world in args.worlds:
                console.print(f"{model}, {world} ranks: {args.repeats} x {', '.join(args.sides)}")
                runs: list[dict[str, Any]] = []
                failed: list[dict[str, Any]] = []
                for repeat in range(args.repeats):  # rotate, so a busy spell hits every side
                    shift = repeat % len(args.sides)
                    for name in args.sides[shift:] + args.sides[:shift]:
                        out = Path(tmp) / f"{model}-{world}-{name}-{repeat}"
                        try:
                            runs.append(
                                run(name, model, world, args.steps, out, args.timeout, repeat)
                            )
                        except (RuntimeError, TimeoutError) as exc:  # say so, measure the rest
                            why = escape(str(exc))
                            console.print(f"[red]{name} run {repeat} failed:[/red] {why}")
                            failed.append({"side": name, "repeat": repeat, "error": str(exc)})
                runs.sort(key=lambda r: args.sides.index(r["side"]))  # stable: repeat order
                results.append(
                    {
                        "model": model,
                        "world_size": world,
                        "sides": summarize(runs),
                        "runs": runs,
                        "failed_runs": failed,
                    }
                )
    settings = {
        "steps": args.steps,
        "warmup_steps": WARMUP,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    report(console, {"machine": machine(), "settings": settings, "results": results})


def report(console: Console, data: dict[str, Any]) -> None:
    """Write the JSON, print the table, draw the plot."""
    path = write_json("overhead", data)
    results = data["results"]
    loads = [load for r in results for run in r["runs"] for load in run["load_1m_before_after"]]
    console.print(overhead_table(results, min(loads), max(loads)))
    console.print(f"written {path} and {plot(results)}")


def overhead_table(results: list[dict[str, Any]], load_min: float, load_max: float) -> Any:
    rows = []
    for r in results:
        for name, s in r["sides"].items():
            parts = s["parts_ms"]
            overhead = ""
            if "overhead_pct" in s:
                interval = s["overhead_pct_interval"]
                overhead = (
                    f"{s['overhead_pct']:+.1f}% "
                    f"({interval['low']:+.1f}…{interval['high']:+.1f} {interval['coverage']:.0%}) "
                    f"{s['within_goal']}"
                )
            rows.append(
                [
                    r["model"],
                    str(r["world_size"]),
                    name,
                    f"{s['median_ms']:.1f}",
                    f"{s['p10_ms']:.1f}-{s['p90_ms']:.1f}",
                    f"{parts['compute']:.1f} / {parts['commit']:.2f} / {parts['optimizer']:.1f}",
                    f"{parts['cpu']:.1f} / {parts['agent_cpu']:.1f}",
                    overhead,
                    f"{s['job_cpu_overhead_pct']:+.1f}%" if "job_cpu_overhead_pct" in s else "",
                ]
            )
    return table(
        f"ms per step, steady state, every rank's steps; 1-min load {load_min:.1f}-{load_max:.1f}"
        f" on {os.cpu_count()} cores",
        [
            "model",
            "ranks",
            "side",
            "median",
            "p10-p90",
            "fwd+bwd / commit / opt",
            "CPU rank / agent",
            f"vs baseline (interval): <= {GOAL_PCT:.0f}%?",
            "job CPU vs baseline",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
