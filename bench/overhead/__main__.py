"""Steady-state cost per step of the trainer hook against plain torch, same model, data and loop.

    python bench/overhead.py [--models gpt mlp] [--worlds 2 4] [--steps 60] [--repeats 3]
    python bench/overhead.py --phases 40 [--phase-steps 24] [--sides hook-ddp hook-hsdp] ...
    python bench/overhead.py --quick [--phases 2]  # CI: the MLP on 2 ranks, nothing asserted

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
bench/results/overhead.png; ``--render`` summarizes a JSON written before again, and given
several pools each cell's pairs over all of them (bench/results/overhead_pooled.json). It
measures; it asserts nothing.

``--phases N`` measures differently, because on a shared machine separate runs half a minute
apart meet different machines: each hook side and its baseline run at once and take turns
(bench/turns.py), N phases of ``--phase-steps`` steps each, the first of each pair of phases
rotating; the first steps of a phase (after its wait) are left out. Each pair of neighbouring
phases is a paired overhead, so one run gives N pairs a second or two apart. The job that waits
is not stopped: its threads and its agent go on, and what the waiting hook job takes of the
cores beyond what the waiting baseline takes is added to every paired overhead (the most it
could have slowed the baseline), so the verdict errs against the hook. "Job CPU" is then every
process of the job (ranks, agent, fork server) per step of its phases.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
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
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException
from turns import Gates, Turns

from flashrecovery.demo.job import LaunchedJob

RANK_SCRIPT = Path(__file__).resolve().with_name("overhead_rank.py")
PARTS = ("total", "compute", "commit", "optimizer", "cpu")  # overhead_rank.StepTimes
WARMUP = 5  # first steps pay one-time costs (allocations, gloo buffers)
GOAL_PCT = 5.0  # the step time the hook may add (issue: "a step path as fast as DDP")
CONFIDENCE = 0.9  # how surely the interval of the overhead's median must hold it
AGENT_SAMPLE_S = 0.1  # how often the agent's CPU time is read while a hook side runs
PHASE_SKIP = 2  # taking turns: the first steps of a phase, after a wait, are left out


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


def hook_job(
    side: Side, model: str, world: int, steps: int, out: Path, gates: Gates | None = None
) -> LaunchedJob:
    """The job under ``flashrecovery run`` (started on entering it)."""
    spec = replace(
        job_spec(out.name, out.parent, nproc=world, spares=0, steps=steps),
        parallel=side.parallel,  # hsdp: the job gets --shards
        script=RANK_SCRIPT,
        script_args=(
            *("--model", model, "--parallel", side.parallel),
            *("--steps", str(steps), "--out", str(out / "times")),
            *(gates.args() if gates is not None else ()),
        ),
    )
    return LaunchedJob(spec)


class PlainJob:
    """A baseline's ranks: plain torch in processes of their own, on a store of the bench's."""

    def __init__(
        self, side: Side, model: str, world: int, steps: int, out: Path, gates: Gates | None = None
    ) -> None:
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        args = (world, self._store.port, model, side.parallel, steps, str(out / "times"))
        self._context = mp.start_processes(
            plain_rank,
            args=(*args, side.stable, gates),
            nprocs=world,
            join=False,
            start_method="spawn",
        )

    def __enter__(self) -> PlainJob:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._context.processes]

    def wait(self, timeout: float) -> int | None:
        """0 once every rank ended well, a rank's failure's code, None while they run."""
        try:
            return 0 if self._context.join(timeout=timeout) else None
        except ProcessExitedException as exc:
            return exc.exit_code or 1
        except ProcessException:  # a rank raised
            return 1


def hook_run(
    side: Side, model: str, world: int, steps: int, out: Path, timeout: float
) -> CpuSamples:
    """The job under ``flashrecovery run``; its agent's CPU time, sampled while it runs."""
    samples: CpuSamples = []
    with hook_job(side, model, world, steps, out) as job:
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
    deadline = time.monotonic() + timeout
    with PlainJob(side, model, world, steps, out) as job:
        while (code := job.wait(1.0)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {side.parallel} baseline did not finish in {timeout:.0f}s")
    if code != 0:
        raise RuntimeError(f"the {side.parallel} baseline ended with {code}")
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


def take_turns(
    name: str, model: str, world: int, phases: int, every: int, tmp: Path, timeout: float
) -> dict[str, Any]:
    """A hook side and its baseline running at once, taking turns (bench/turns.py): ``phases``
    phases of ``every`` steps each, the first of each pair rotating. Per phase: when it ran,
    the CPU its job took (every process), and the CPU the waiting job took meanwhile."""
    names = (SIDES[name].baseline or "", name)
    pair = tmp / f"{model}-{world}-{name}-turns"
    steps = WARMUP + phases * every + 1  # the last gate lets both through to one step more
    turns: dict[str, Turns] = {}
    record: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        jobs: dict[str, LaunchedJob | PlainJob] = {}
        for side_name in names:
            side, out = SIDES[side_name], pair / side_name
            turns[side_name] = Turns(out / "gates", world)
            stack.callback(turns[side_name].close)
            gates = Gates(str(out / "gates"), WARMUP, every)
            job: LaunchedJob | PlainJob = (hook_job if side.hook else PlainJob)(
                side, model, world, steps, out, gates
            )
            stack.enter_context(job)
            jobs[side_name] = job

        def alive(side_name: str) -> Callable[[], bool]:
            return lambda: jobs[side_name].wait(0) is None

        for side_name in names:
            turns[side_name].wait_at(WARMUP, timeout, alive(side_name))
        processes = {n: _processes(jobs[n]) for n in names}  # all of them exist by now
        for phase in range(phases):
            for side_name in names if phase % 2 == 0 else names[::-1]:
                waiting = names[1 - names.index(side_name)]
                before, started = {n: _cpu_s(processes[n]) for n in names}, time.time()
                turns[side_name].let_through()
                turns[side_name].wait_at(WARMUP + (phase + 1) * every, timeout, alive(side_name))
                after, ended = {n: _cpu_s(processes[n]) for n in names}, time.time()
                record.append(
                    {
                        "side": side_name,
                        "phase": phase,
                        "started": started,
                        "seconds": ended - started,
                        "job_cpu_s": sum(after[side_name]) - sum(before[side_name]),
                        "agent_cpu_s": after[side_name][1] - before[side_name][1],
                        "waiting_cpu_s": sum(after[waiting]) - sum(before[waiting]),
                        "load_1m": os.getloadavg()[0],
                    }
                )
        deadline = time.monotonic() + timeout
        for side_name in names:
            turns[side_name].let_through()
        for side_name in names:
            while (code := jobs[side_name].wait(1.0)) is None and time.monotonic() < deadline:
                pass
            if code != 0:
                raise RuntimeError(f"{side_name} taking turns ended with {code}")
    times = {n: read_times(pair / n / "times", world) for n in names}
    return {
        "model": model,
        "world_size": world,
        "turns": {"phases": phases, "steps_per_phase": every, "skipped_per_phase": PHASE_SKIP},
        "phases": record,
        "ranks": {n: [asdict(r) for r in times[n]] for n in names},
    }


def _processes(job: LaunchedJob | PlainJob) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """A job's ranks, and its other processes (a hook job's agent and fork server)."""
    if isinstance(job, PlainJob):
        return [psutil.Process(pid) for pid in job.pids], []
    agent = psutil.Process(job.pid)
    tree = [agent, *agent.children(recursive=True)]
    ranks = [p for p in tree if p.pid != job.pid and RANK_SCRIPT.name in " ".join(p.cmdline())]
    return ranks, [p for p in tree if p not in ranks]


def _cpu_s(processes: tuple[list[psutil.Process], list[psutil.Process]]) -> tuple[float, float]:
    """CPU seconds so far: the ranks', the rest's."""

    def total(group: list[psutil.Process]) -> float:
        seconds = 0.0
        for process in group:
            with contextlib.suppress(psutil.NoSuchProcess):
                cpu = process.cpu_times()
                seconds += cpu.user + cpu.system
        return seconds

    return total(processes[0]), total(processes[1])


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


def summarize_turns(result: dict[str, Any]) -> dict[str, Any]:
    """Both sides of a ``take_turns`` run, and the hook side against its baseline phase by
    phase (each pair of neighbouring phases is a paired overhead). The waiting job's CPU is
    charged against the hook: what the waiting hook job takes beyond what the waiting baseline
    takes, as a share of the machine's cores, is added to every paired overhead (the most it
    could have slowed the baseline's phases), so the verdict errs against the hook."""
    every, skip = result["turns"]["steps_per_phase"], result["turns"]["skipped_per_phase"]
    base_name, hook_name = list(result["ranks"])
    sides: dict[str, Any] = {}
    phase_ms: dict[str, dict[int, float]] = {}
    for name, ranks in result["ranks"].items():
        phases = [p for p in result["phases"] if p["side"] == name]
        by_phase: dict[int, list[dict[str, float]]] = {}
        for r in ranks:
            for i, step in enumerate(r["step"]):
                phase, offset = divmod(step - WARMUP, every)
                if step >= WARMUP and offset >= skip and phase < result["turns"]["phases"]:
                    by_phase.setdefault(phase, []).append({p: r[p][i] for p in PARTS})
        phase_ms[name] = {k: _median_ms([s["total"] for s in v]) for k, v in by_phase.items()}
        steps = [s for v in by_phase.values() for s in v]
        totals = [1000 * s["total"] for s in steps]
        deciles = statistics.quantiles(totals, n=10)
        parts = {part: _median_ms([s[part] for s in steps]) for part in PARTS[1:]}
        parts["job_cpu"] = statistics.median(1000 * p["job_cpu_s"] / every for p in phases)
        parts["agent_cpu"] = statistics.median(1000 * p["agent_cpu_s"] / every for p in phases)
        sides[name] = {
            "median_ms": statistics.median(totals),
            "p10_ms": deciles[0],
            "p90_ms": deciles[-1],
            "run_medians_ms": list(phase_ms[name].values()),
            "parts_ms": parts,
            "waiting_cpu_ms_per_s": statistics.median(
                1000 * p["waiting_cpu_s"] / p["seconds"]
                for p in result["phases"]
                if p["side"] != name
            ),
        }
    pairs = sorted(set(phase_ms[hook_name]) & set(phase_ms[base_name]))
    cores = os.cpu_count() or 1
    excess = sides[hook_name]["waiting_cpu_ms_per_s"] - sides[base_name]["waiting_cpu_ms_per_s"]
    charge = max(excess / (10 * cores), 0.0)  # ms/s over the cores' 1000 ms/s each, in percent
    per_pair = [100 * (phase_ms[hook_name][k] / phase_ms[base_name][k] - 1) + charge for k in pairs]
    low, high, coverage = median_interval(per_pair)
    hook, base = sides[hook_name], sides[base_name]
    hook.update(
        {
            "baseline": base_name,
            "overhead_pct": statistics.median(per_pair),
            "overhead_pct_per_repeat": per_pair,
            "overhead_pct_interval": {"low": low, "high": high, "coverage": coverage},
            "waiting_bias_pct": charge,
            "within_goal": verdict(low, high, coverage),
            "job_cpu_overhead_pct": 100
            * (hook["parts_ms"]["job_cpu"] / base["parts_ms"]["job_cpu"] - 1),
            "bitwise_equal_to_baseline": result["ranks"][hook_name][0]["params_sha256"]
            == result["ranks"][base_name][0]["params_sha256"],
        }
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
    parser.add_argument(
        "--phases",
        type=int,
        default=0,
        help="take turns instead (bench/turns.py): each hook side and its baseline run at once, "
        "PHASES phases each of --phase-steps steps",
    )
    parser.add_argument("--phase-steps", type=int, default=30, help="steps per phase")
    parser.add_argument("--quick", action="store_true", help="CI: the MLP, 2 ranks, one run")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="summarize the runs of an earlier JSON again; given several, pool each cell's "
        "pairs over all of them",
    )
    args = parser.parse_args()
    console = Console(width=170)  # the table is wide; CI logs are not a terminal
    if args.render:
        earlier = [resummarize(json.loads(path.read_text())) for path in args.render]
        if len(earlier) == 1:
            report(console, earlier[0])
        else:
            report_pooled(console, args.render, pool(earlier))
        return
    if args.quick:
        args.models, args.worlds, args.steps, args.repeats = ["mlp"], [2], WARMUP + 7, 1
        args.phase_steps = PHASE_SKIP + 3
    if any(w % 2 for w in args.worlds) and {"hsdp", "hook-hsdp"} & set(args.sides):
        parser.error("HSDP runs a (ranks / 2) x 2 mesh: give even --worlds")
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="flashrecovery-overhead-") as tmp:
        for model in args.models:
            for world in args.worlds:
                if args.phases:
                    for name in args.sides:
                        if SIDES[name].baseline is None:
                            continue
                        console.print(
                            f"{model}, {world} ranks: {name} and {SIDES[name].baseline} taking "
                            f"{args.phases} turns of {args.phase_steps} steps"
                        )
                        result = take_turns(
                            name,
                            model,
                            world,
                            args.phases,
                            args.phase_steps,
                            Path(tmp),
                            args.timeout,
                        )
                        result["sides"] = summarize_turns(result)
                        results.append(result)
                    continue
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
        "phases": args.phases,
        "phase_steps": args.phase_steps,
        "steps": args.steps,
        "warmup_steps": WARMUP,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    report(console, {"machine": machine(), "settings": settings, "results": results})


def resummarize(data: dict[str, Any]) -> dict[str, Any]:
    """An earlier JSON's results, summarized again by this version of the bench."""
    for result in data["results"]:
        if "phases" in result:
            result["sides"] = summarize_turns(result)
        else:
            result["sides"] = summarize(result["runs"])
    return data


def pool(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell's paired overheads over several runs (of the same code: the caller's word) as
    one sample, so that runs too short to decide a cell alone can decide it together. Every
    pair of every run counts, each with its own run's waiting charge; the pairs are independent
    but meet different machines from run to run, so the interval is that of the median of the
    runs' mixture. Cells keep the order they first appear in."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for data in runs:
        for result in data["results"]:
            for name, side in result["sides"].items():
                if "overhead_pct_per_repeat" not in side:
                    continue  # a baseline
                key = (result["model"], result["world_size"], name)
                cell = cells.setdefault(
                    key,
                    {"model": key[0], "world_size": key[1], "side": name, "runs": 0, "pairs": []},
                )
                cell["runs"] += 1
                cell["pairs"] += side["overhead_pct_per_repeat"]
    for cell in cells.values():
        low, high, coverage = median_interval(cell["pairs"])
        cell["overhead_pct"] = statistics.median(cell["pairs"])
        cell["overhead_pct_interval"] = {"low": low, "high": high, "coverage": coverage}
        cell["within_goal"] = verdict(low, high, coverage)
    return list(cells.values())


def report_pooled(console: Console, paths: list[Path], cells: list[dict[str, Any]]) -> None:
    """Write the pooled JSON and print its table."""
    path = write_json("overhead_pooled", {"pooled": [str(p) for p in paths], "cells": cells})
    rows = [
        [
            c["model"],
            str(c["world_size"]),
            c["side"],
            str(c["runs"]),
            str(len(c["pairs"])),
            overhead_text(c),
        ]
        for c in cells
    ]
    columns = [
        "model",
        "ranks",
        "side",
        "runs",
        "pairs",
        f"vs baseline (interval): <= {GOAL_PCT:.0f}%?",
    ]
    console.print(table(f"pooled over {len(paths)} runs", columns, rows))
    console.print(f"written {path}")


def report(console: Console, data: dict[str, Any]) -> None:
    """Write the JSON, print the table, draw the plot."""
    path = write_json("overhead", data)
    results = data["results"]
    loads = [
        load for r in results for run in r.get("runs", ()) for load in run["load_1m_before_after"]
    ]
    loads += [phase["load_1m"] for r in results for phase in r.get("phases", ())]
    console.print(overhead_table(results, min(loads), max(loads)))
    for r in results:
        if "phases" in r:
            base, hook = (r["sides"][n] for n in r["ranks"])
            console.print(
                f"{r['model']}, {r['world_size']} ranks, taking turns: while waiting, the hook's "
                f"job took {hook['waiting_cpu_ms_per_s']:.1f} ms of CPU a second, the "
                f"baseline's {base['waiting_cpu_ms_per_s']:.1f}; each paired overhead includes "
                f"{hook['waiting_bias_pct']:+.2f} % for the difference"
            )
    console.print(f"written {path} and {plot(results)}")


def overhead_text(s: dict[str, Any]) -> str:
    """A hook side's (or a pooled cell's) overhead, its interval and the verdict, in a cell."""
    interval = s["overhead_pct_interval"]
    return (
        f"{s['overhead_pct']:+.1f}% "
        f"({interval['low']:+.1f}…{interval['high']:+.1f} {interval['coverage']:.0%}) "
        f"{s['within_goal']}"
    )


def overhead_table(results: list[dict[str, Any]], load_min: float, load_max: float) -> Any:
    rows = []
    for r in results:
        for name, s in r["sides"].items():
            parts = s["parts_ms"]
            overhead = overhead_text(s) if "overhead_pct" in s else ""
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
