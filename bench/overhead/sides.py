"""The sides of the comparison and how each is run: under `flashrecovery run` (the hook) or as
plain torch processes, one after the other or taking turns (turns.py)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from bench.lib.launch import job_spec
from bench.lib.sampling import CpuSamples, cpu_seconds, ms_per_step
from bench.lib.stats import median_ms
from bench.overhead.rank import plain_rank, read_times
from bench.overhead.turns import Gates, Turns
from flashrecovery.demo.job import LaunchedJob

RANK_SCRIPT = Path(__file__).resolve().with_name("rank.py")
PARTS = ("total", "compute", "commit", "optimizer", "cpu")  # rank.StepTimes
WARMUP = 5  # first steps pay one-time costs (allocations, gloo buffers)
AGENT_SAMPLE_S = 0.1  # how often the agent's CPU time is read while a hook side runs
PHASE_SKIP = 2  # taking turns: the first steps of a phase, after a wait, are left out


@dataclass(frozen=True)
class Side:
    parallel: str  # overhead_rank.py --parallel
    hook: bool  # under flashrecovery run, or plain torch
    baseline: str | None = None  # the side it is measured against
    stable: bool = False  # plain processes over the hook's stable group (no session, no agent)
    verify_every: int | None = None  # the hook's --verify-every (None: the default, 20)


SIDES = {
    "ddp": Side("ddp", hook=False),
    "stable-ddp": Side("ddp", hook=False, baseline="ddp", stable=True),
    "hook-ddp": Side("ddp", hook=True, baseline="ddp"),
    # the replicas' state comparison as a knob: off, and at every step
    "hook-ddp-k0": Side("ddp", hook=True, baseline="ddp", verify_every=0),
    "hook-ddp-k1": Side("ddp", hook=True, baseline="ddp", verify_every=1),
    "hook": Side("hook", hook=True, baseline="ddp"),
    "hsdp": Side("hsdp", hook=False),
    "hook-hsdp": Side("hsdp", hook=True, baseline="hsdp"),
    "tp-hsdp": Side("tp-hsdp", hook=False),
    "hook-tp-hsdp": Side("tp-hsdp", hook=True, baseline="tp-hsdp"),
    "pp": Side("pp", hook=False),
    "hook-pp": Side("pp", hook=True, baseline="pp"),
}


def hook_job(
    side: Side, model: str, world: int, steps: int, out: Path, gates: Gates | None = None
) -> LaunchedJob:
    """The job under ``flashrecovery run`` (started on entering it)."""
    spec = replace(
        job_spec(out.name, out.parent, nproc=world, spares=0, steps=steps),
        parallel=side.parallel,  # hsdp, tp-hsdp, pp: the job gets --shards
        agent_args=() if side.verify_every is None else ("--verify-every", str(side.verify_every)),
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
    parts = {part: median_ms([t for r in steady for t in r[part]]) for part in PARTS[1:]}
    parts["agent_cpu"] = ms_per_step(agent_cpu, ranks[0].ended[WARMUP - 1 :])
    # CPU of the whole job per step: every rank's, and the agent's
    parts["job_cpu"] = world * parts["cpu"] + parts["agent_cpu"]
    return {
        "side": name,
        "repeat": repeat,
        "seconds": round(time.monotonic() - started, 2),
        "load_1m_before_after": [load_before, os.getloadavg()[0]],
        "params_sha256": ranks[0].params_sha256,
        "median_ms": median_ms([t for r in steady for t in r["total"]]),
        "parts_ms": parts,
        "step_ms": [round(t * 1000, 3) for r in steady for t in r["total"]],
    }


def take_turns(
    name: str, model: str, world: int, phases: int, every: int, tmp: Path, timeout: float
) -> dict[str, Any]:
    """A hook side and its baseline running at once, taking turns (turns.py): ``phases``
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
    return cpu_seconds(processes[0]), cpu_seconds(processes[1])
