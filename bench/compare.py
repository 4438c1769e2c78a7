"""Five ways to survive a SIGKILL, side by side: the same model, the same kills, one command.

    python -m bench.compare [--models gpt mlp] [--worlds 2 4] [--kills 5] [--rounds 5] [--quick]

Systems (each a real job of real processes on this machine):
- flashrecovery, hot spare: `flashrecovery run --spares 1`; a ready spare takes the rank over;
- flashrecovery, fresh spawn: `--spares 0`; the agent starts a new process for the rank;
- torchrun + checkpoint: `torchrun --max-restarts`, plain DDP, rank 0 checkpoints every
  ``--checkpoint-every`` steps; every worker restarts and reloads the last checkpoint;
- torchft (defaults), torchft (tuned): torchft's Manager, one replica group per rank and a
  lighthouse; the killed replica is respawned at once and heals from a peer; once with
  torchft's default timeouts, once with timeouts tuned for one machine (TORCHFT_SETTINGS, also
  in the JSON); needs ``pip install -e '.[compare]'`` (skipped with a one-line reason otherwise).
Their workers are in bench/compare_workers/: the same models (the demo's GPT and a 4 x 1024²
MLP), batches and step, and the same witness, a line per committed step (workload.py).

Each (model, world size) is measured in ``--rounds`` rounds; a round runs one job of every
system in turn (the order rotates), each job taking its share of ``--kills`` SIGKILLs of a
seeded random rank at a seeded random step, so the machine's noise hits every system alike.
From the committed-step lines, per kill: RTO (SIGKILL → every rank committed a step in the
process that holds it afterwards), how long the ranks not killed went without committing, the
committed steps lost (recomputed), and steady ms/step away from kills (and, for the hot spare,
away from its refill: the next spare starting on the same cores after a recovery; its steps
then are reported apart as ``refill_ms_per_step``). Results: median, min and
max per system, ratios to flashrecovery's hot spare, bench/results/compare.json, a table and
bench/results/compare.png. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.launch import job_spec
from bench.lib.results import machine, ms, stacked_bars, table, write_json
from flashrecovery.connectors import open_log
from flashrecovery.demo.job import JobSpec, LaunchedJob
from flashrecovery.demo.watch import JobWatch
from flashrecovery.records import SpareReady, Stream

WORKERS = Path(__file__).resolve().parent / "compare_workers"
PROGRESS = "progress.jsonl"  # compare_workers/workload.py writes it
STEPS = 1_000_000  # never reached: the bench ends each job once it has its kills
WARMUP_STEPS = 5  # a process's first steps pay one-time costs: not steady
GAP_STEPS = 4  # every rank commits at least this many steps between a recovery and a kill
RANDOM_STEPS = 6  # ... plus a seeded random 0..RANDOM_STEPS-1 more: the kill's step
SPARE_WAIT_S = 90.0  # a refilled spare starts python and torch on busy cores
RECOVERY_TIMEOUT_S = 180.0
POLL_S = 0.05
BASELINE = "flashrecovery hot spare"


@dataclasses.dataclass(frozen=True)
class CommandSpec(JobSpec):
    """A job that is not `flashrecovery run`: LaunchedJob owns its process tree all the same."""

    argv: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return list(self.argv)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One job of one system: what it trains and where its files go."""

    model: str
    world: int
    run_dir: Path
    checkpoint_every: int

    def worker_args(self) -> tuple[str, ...]:
        return ("--model", self.model, "--steps", str(STEPS), "--out", str(self.run_dir))


def _flashrecovery(spares: int) -> Callable[[Trial], JobSpec]:
    def spec(trial: Trial) -> JobSpec:
        base = job_spec(trial.run_dir.name, trial.run_dir.parent, trial.world, spares, STEPS)
        script = WORKERS / "flash_worker.py"
        return dataclasses.replace(base, script=script, script_args=trial.worker_args())

    return spec


def _command(trial: Trial, argv: list[str]) -> JobSpec:
    name = trial.run_dir.name
    return CommandSpec(name, "", trial.run_dir, trial.world, 0, STEPS, argv=tuple(argv))


def _torchrun(trial: Trial) -> JobSpec:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", str(trial.world), "--max-restarts", "1000"]
    worker = [str(WORKERS / "torchrun_worker.py"), *trial.worker_args()]
    return _command(trial, [*launcher, *worker, "--checkpoint-every", str(trial.checkpoint_every)])


# torchft's settings, per row: its defaults, and timeouts tuned for one machine (a lost
# replica's heartbeat expires in 0.5 s, a quorum waits 1 s for stragglers; the Manager's and
# its group's operations time out after 10 s).
TORCHFT_SETTINGS = {
    "torchft (defaults)": {
        "heartbeat_timeout_ms": 5000,
        "join_timeout_ms": 60_000,
        "timeout_s": 60.0,
    },
    "torchft (tuned)": {"heartbeat_timeout_ms": 500, "join_timeout_ms": 1000, "timeout_s": 10.0},
}


def _torchft(settings: dict[str, float]) -> Callable[[Trial], JobSpec]:
    def spec(trial: Trial) -> JobSpec:
        job = [sys.executable, str(WORKERS / "torchft_job.py"), "--world", str(trial.world)]
        for key, value in settings.items():
            job += [f"--{key.replace('_', '-')}", str(value)]
        return _command(trial, [*job, *trial.worker_args()])

    return spec


SYSTEMS: dict[str, Callable[[Trial], JobSpec]] = {
    BASELINE: _flashrecovery(1),
    "flashrecovery fresh spawn": _flashrecovery(0),
    "torchrun + checkpoint": _torchrun,
    **{name: _torchft(settings) for name, settings in TORCHFT_SETTINGS.items()},
}


def skip_reason(system: str) -> str | None:
    if system in TORCHFT_SETTINGS and importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install -e '.[compare]')"
    return None


# ------------------------------------------------------------------ the committed-step lines


@dataclasses.dataclass(frozen=True)
class Commit:
    t: float
    rank: int
    pid: int
    step: int


class ProgressTail:
    """The committed-step lines of one job, read as they are appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits: list[Commit] = []
        self._offset = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next poll
        self._offset += len(complete)
        self.commits += [Commit(**json.loads(line)) for line in complete.splitlines()]

    def since(self, t: float) -> dict[int, list[Commit]]:
        """Each rank's commits after ``t``."""
        out: dict[int, list[Commit]] = {}
        for commit in self.commits:
            if commit.t > t:
                out.setdefault(commit.rank, []).append(commit)
        return out

    def pid_of(self, rank: int) -> int | None:
        return next((c.pid for c in reversed(self.commits) if c.rank == rank), None)


# ------------------------------------------------------------------ one job, its kills


@dataclasses.dataclass
class Kill:
    rank: int
    pid: int
    t: float
    recovered: bool = False


def _wait(
    condition: Callable[[], bool], tail: ProgressTail, job: LaunchedJob, limit: float
) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and job.poll() is None:
        tail.poll()
        if condition():
            return True
        time.sleep(POLL_S)
    return False


def _spare_ready(watch: JobWatch) -> bool:
    watch.poll(0)
    return watch.ready_spares >= 1


def _spares_ready_at(watch: JobWatch) -> list[float]:
    """When each spare reported ready (its record's time), from the job's log."""
    entries = watch.log.read(Stream.EVENTS, watch.job_id)
    return sorted(e.record.ts for e in entries if isinstance(e.record, SpareReady))


def _trained(
    tail: ProgressTail, job: LaunchedJob, world: int, since: float, steps: int, limit: float
) -> bool:
    """Wait until every rank has committed ``steps`` steps after ``since``."""

    def done() -> bool:
        per_rank = tail.since(since)
        return all(len(per_rank.get(rank, [])) >= steps for rank in range(world))

    return _wait(done, tail, job, limit)


def run_job(
    system: str, trial: Trial, kills: int, rng: random.Random, timeout: float
) -> dict[str, Any]:
    """Launch one job of ``system``, SIGKILL ``kills`` ranks one after another (each once every
    rank trained on), and return its kills and committed-step lines."""
    spec = SYSTEMS[system](trial)
    tail = ProgressTail(trial.run_dir / PROGRESS)
    done: list[Kill] = []
    load_before = os.getloadavg()
    error = None
    with ExitStack() as stack:
        job = stack.enter_context(LaunchedJob(spec))
        watch = (
            JobWatch(stack.enter_context(open_log(spec.log_url)), spec.job_id)
            if spec.spares
            else None
        )
        since, limit = time.time(), timeout
        for i in range(kills):
            rank, extra = rng.randrange(trial.world), rng.randrange(RANDOM_STEPS)
            gap = GAP_STEPS + extra + (WARMUP_STEPS if i == 0 else 0)
            if not _trained(tail, job, trial.world, since, gap, limit):
                error = f"no training before kill {i + 1}:\n{job.output_tail()}"
                break
            if watch is not None:  # the hot-spare path, not a race with the spare's start-up
                _wait(lambda: _spare_ready(watch), tail, job, SPARE_WAIT_S)
            pid = tail.pid_of(rank)
            killed_at = None if pid is None else job.kill_descendant(pid)
            if pid is None or killed_at is None:
                error = f"rank {rank}'s process was gone before kill {i + 1}"
                break
            kill = Kill(rank, pid, killed_at)
            done.append(kill)

            def recovered(kill: Kill = kill) -> bool:
                per_rank = tail.since(kill.t)
                return all(
                    any(c.pid != kill.pid for c in per_rank.get(r, [])) for r in range(trial.world)
                )

            kill.recovered = _wait(recovered, tail, job, RECOVERY_TIMEOUT_S)
            if not kill.recovered:
                error = f"not recovered from kill {i + 1} in {RECOVERY_TIMEOUT_S:.0f}s"
                break
            since = time.time()
        else:  # the last recovery's holders settle: their own steps close its window
            _trained(tail, job, trial.world, since, GAP_STEPS, limit)
            if watch is not None and done:  # and the last refill (see job_metrics)
                _wait(lambda: _spare_ready(watch), tail, job, SPARE_WAIT_S)
        tail.poll()
        spares_ready = [] if watch is None else _spares_ready_at(watch)
    return {
        "spares_ready_t": spares_ready,
        "system": system,
        "kills": [dataclasses.asdict(k) for k in done],
        "commits": tail.commits,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "error": error,
    }


# ------------------------------------------------------------------ what the lines say


def kill_metrics(commits: list[Commit], kill: Kill, until: float) -> dict[str, Any] | None:
    """RTO, the others' stall and the steps lost of one kill, from the lines between it and
    ``until`` (the next kill, or the job's end). Each rank's holder is the process that wrote
    its last line in that window; its first commit there is the rank's recovery. A rank not
    killed stalls for its longest gap between commits from its last before the kill to its
    first once every rank has recovered (a step in flight at the kill does not hide it)."""
    before = [c for c in commits if c.t < kill.t]
    window = [c for c in commits if kill.t < c.t < until]
    ranks = {c.rank for c in before}
    first: dict[int, Commit] = {}
    for rank in ranks:
        mine = [c for c in window if c.rank == rank]
        if not mine:
            return None
        first[rank] = next(c for c in mine if c.pid == mine[-1].pid)
    recovered = max(c.t for c in first.values())

    def stall(rank: int) -> float:
        last_before = max(c.t for c in before if c.rank == rank)
        after = [c.t for c in window if c.rank == rank and c.t >= recovered]
        span = [c.t for c in window if c.rank == rank and c.t < recovered]
        times = [last_before, *span, *after[:1]]
        return max(b - a for a, b in pairwise(times))

    last_step = max(c.step for c in before)
    return {
        "rank": kill.rank,
        "kill_t": kill.t,
        "rto_s": recovered - kill.t,
        "stall_s": max((stall(r) for r in ranks if r != kill.rank), default=0.0),
        "steps_lost": max(0, last_step + 1 - min(c.step for c in first.values())),
        "recovered_t": recovered,
    }


def steady_step_times(commits: list[Commit], quiet: Callable[[float, float], bool]) -> list[float]:
    """Commit-to-commit times of each process past its first WARMUP_STEPS, in quiet spells."""
    by_pid: dict[int, list[Commit]] = {}
    for commit in commits:
        by_pid.setdefault(commit.pid, []).append(commit)
    return [
        b.t - a.t
        for mine in by_pid.values()
        for a, b in zip(mine[WARMUP_STEPS:], mine[WARMUP_STEPS + 1 :], strict=False)
        if quiet(a.t, b.t)
    ]


def job_metrics(job: dict[str, Any]) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """Each kill's metrics, the steady step times, and the step times while a new spare
    started after a recovery (the hot spare's refill: python and torch starting on the same
    cores; not steady, and reported apart)."""
    commits: list[Commit] = job["commits"]
    kills = [Kill(**k) for k in job["kills"] if k["recovered"]]
    ends = [k.t for k in kills[1:]] + [math.inf]
    rows = [m for k, end in zip(kills, ends, strict=True) if (m := kill_metrics(commits, k, end))]
    recoveries = [(k.t, m["recovered_t"]) for k, m in zip(kills, rows, strict=False)]
    ready = job.get("spares_ready_t", [])
    refills = [
        (recovered, t)
        for killed, recovered in recoveries
        if (t := next((r for r in ready if r > killed), None)) is not None and t > recovered
    ]
    disturbed = recoveries + refills

    def quiet(start: float, end: float) -> bool:
        return all(end < a or start > b for a, b in disturbed)

    def refilling(start: float, end: float) -> bool:
        return any(a <= start and end <= b for a, b in refills)

    return rows, steady_step_times(commits, quiet), steady_step_times(commits, refilling)


def summarise(system: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    times: list[float] = []
    refill_times: list[float] = []
    for job in jobs:
        job_rows, job_times, job_refill_times = job_metrics(job)
        rows += job_rows
        times += job_times
        refill_times += job_refill_times

    def spread(key: str) -> dict[str, float] | None:
        values = [r[key] for r in rows]
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "system": system,
        "kills_measured": len(rows),
        "rto_s": spread("rto_s"),
        "stall_s": spread("stall_s"),
        "steps_lost": spread("steps_lost"),
        "steady_ms_per_step": statistics.median(times) * 1000 if times else None,
        "refill_ms_per_step": statistics.median(refill_times) * 1000 if refill_times else None,
        "kills": rows,
        "errors": [j["error"] for j in jobs if j["error"]],
        "loadavg": [j["loadavg_before"] for j in jobs],
    }


def with_ratios(summaries: list[dict[str, Any]]) -> None:
    base = next((s for s in summaries if s["system"] == BASELINE and s["rto_s"]), None)
    for s in summaries:
        s["rto_vs_hot_spare"] = (
            s["rto_s"]["median"] / base["rto_s"]["median"] if base and s["rto_s"] else None
        )
        steady, base_steady = s["steady_ms_per_step"], base and base["steady_ms_per_step"]
        s["step_vs_hot_spare"] = steady / base_steady if steady and base_steady else None


# ------------------------------------------------------------------ the command


def measure_config(
    model: str, world: int, systems: list[str], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}:{model}:{world}")
    per_round = math.ceil(args.kills / args.rounds)
    jobs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for round_ in range(args.rounds):
        shift = round_ % len(systems)
        for system in systems[shift:] + systems[:shift]:  # rotate: a busy spell hits each
            kills = min(per_round, args.kills - per_round * round_)
            if kills <= 0:
                continue
            name = f"{system.replace(' ', '-').replace('+', 'and')}-{model}-{world}-{round_}"
            trial = Trial(model, world, tmp / name, args.checkpoint_every)
            jobs[system].append(run_job(system, trial, kills, rng, args.timeout))
    summaries = [summarise(s, jobs[s]) for s in systems]
    with_ratios(summaries)
    return {"model": model, "world_size": world, "systems": summaries}


def _spread_ms(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "-"
    return f"{ms(spread['median'])} [{ms(spread['min'])}..{ms(spread['max'])}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _less_step(summary: dict[str, Any]) -> str:
    """The median RTO less one steady step, ms: what a recovery costs beyond recomputing the
    step the failure took."""
    rto, step = summary["rto_s"], summary["steady_ms_per_step"]
    return "-" if rto is None or step is None else f"{rto['median'] * 1000 - step:.0f}"


def render(configs: list[dict[str, Any]], skipped: dict[str, str], console: Console) -> Path:
    rows = []
    for config in configs:
        for s in config["systems"]:
            lost = s["steps_lost"]
            rows.append(
                [
                    f"{config['model']}, {config['world_size']} ranks",
                    s["system"],
                    str(s["kills_measured"]),
                    _spread_ms(s["rto_s"]),
                    _less_step(s),
                    _ratio(s["rto_vs_hot_spare"]),
                    _spread_ms(s["stall_s"]),
                    "-" if lost is None else f"{lost['median']:.0f} [{lost['max']:.0f}]",
                    "-" if s["steady_ms_per_step"] is None else f"{s['steady_ms_per_step']:.1f}",
                    _ratio(s["step_vs_hot_spare"]),
                    "-" if s["refill_ms_per_step"] is None else f"{s['refill_ms_per_step']:.1f}",
                ]
            )
    columns = ["config", "system", "kills", "RTO ms med [min..max]", "RTO - 1 step"]
    columns += ["RTO vs hot spare"]
    columns += ["others' stall ms", "steps lost med [max]", "ms/step", "vs hot spare"]
    columns += ["ms/step, next spare starting"]
    console.print(table("SIGKILL → every rank committed a new step", columns, rows))
    for system, reason in skipped.items():
        console.print(f"{system}: skipped, {reason}", markup=False)
    for system, settings in TORCHFT_SETTINGS.items():
        console.print(f"{system}: {', '.join(f'{k} {v:g}' for k, v in settings.items())}")
    labels, medians = [], []
    for config in configs:
        for s in config["systems"]:
            labels.append(f"{config['model']} {config['world_size']}r\n{s['system']}")
            medians.append((s["rto_s"] or {"median": 0.0})["median"] * 1000)
    return stacked_bars("compare", "median RTO after a SIGKILL", "ms", labels, {"RTO": medians})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("gpt", "mlp"), default=["gpt", "mlp"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per job")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--kills", type=int, default=5, help="per system and configuration")
    parser.add_argument("--rounds", type=int, default=5, help="jobs per system, interleaved")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="torchrun's K steps")
    parser.add_argument("--seed", type=int, default=0, help="which ranks, at which steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per wait at most")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="hot spare vs torchrun (+ torchft), gpt, 2 ranks, 1 kill",
    )
    args = parser.parse_args()
    if args.quick:
        args.models, args.worlds, args.kills, args.rounds = ["gpt"], [2], 1, 1
        args.systems = [BASELINE, "torchrun + checkpoint", "torchft (tuned)"]
    if args.kills < 1 or args.rounds < 1 or args.rounds > args.kills:
        parser.error("--kills and --rounds: at least 1, and no more rounds than kills")
    skipped = {s: r for s in args.systems if (r := skip_reason(s))}
    systems = [s for s in args.systems if s not in skipped]
    console = Console(width=200)  # the table is wide; a pipe would fold it at 80
    settings = {
        **vars(args),
        "gap_steps": GAP_STEPS,
        "random_steps": RANDOM_STEPS,
        "warmup_steps": WARMUP_STEPS,
        "torchft_settings": TORCHFT_SETTINGS,
        "loadavg_at_start": os.getloadavg(),
    }
    configs: list[dict[str, Any]] = []
    started = time.time()

    def write() -> Path:  # after every configuration: a run cut short keeps what it measured
        settings["wall_s"] = round(time.time() - started, 1)
        data = {"machine": machine(), "settings": settings, "skipped": skipped}
        return write_json("compare", {**data, "configs": configs})

    path = write()
    with tempfile.TemporaryDirectory(prefix="flashrecovery-compare-") as tmp:
        try:
            for world in args.worlds:
                for model in args.models:
                    console.print(f"{model}, {world} ranks: {', '.join(systems)} …")
                    configs.append(measure_config(model, world, systems, args, Path(tmp)))
                    path = write()
        except KeyboardInterrupt:  # the jobs were stopped on the way out
            settings["interrupted"] = True
            path = write()
    plot = render(configs, skipped, console)
    console.print(f"written {path} and {plot}")


if __name__ == "__main__":
    main()
