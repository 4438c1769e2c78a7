"""Showcase: train a tiny GPT on ranks + a hot spare, SIGKILL a rank mid-run, recover losslessly.

`flashrecovery demo [--nproc 4] [--spares 1] [--steps 40] [--kill RANK@STEP …] [--seed 0]
[--log URL] [--run-dir DIR] [--verify] [--json]` launches the job under `flashrecovery run`
(with ``--nodes N [--kill-node K@STEP]``: N loopback nodes of one agent each plus a spare node,
and a whole node SIGKILLed),
follows its log live, kills the chosen rank's process from outside when it reaches the step, and
then tells what the recovery cost and proves: detection time, RTO and its phases, steps lost and
recomputed, survivors' PIDs, loss-curve continuity, the replay verdict and, with ``--verify``,
bitwise equality with a fault-free reference run of the same seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from flashrecovery import terminal
from flashrecovery.connectors import open_log
from flashrecovery.demo.job import (
    NO_REPLICA,
    NO_REPLICA_CHECKPOINT_EVERY,
    PARALLEL,
    REPLICA_MESH,
    JobSpec,
    LaunchedJob,
    replica_ranks,
    whole_replicas,
)
from flashrecovery.demo.summary import summarize
from flashrecovery.demo.watch import JobWatch, Kill, Killer, follow
from flashrecovery.errors import LogError
from flashrecovery.trainer_hooks.env import GroupRebuild

if TYPE_CHECKING:
    from flashrecovery.agent.netns import Network
    from flashrecovery.agent.testbed import Testbed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks (default 4; with --nodes N: N, one a node)"
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=None,
        help="hot spares (default 1; with --nodes: per node, default 0)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="loopback nodes, an agent each, sharing --nproc ranks, plus a spare node of "
        "--nproc/--nodes hot spares (default 1: one agent, no spare node)",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="with --nodes: each node in a network namespace of its own with an address of its "
        "own, the log on a 3-broker Kafka cluster of such hosts (needs root; agent/netns.py)",
    )
    parser.add_argument(
        "--kill-node",
        action="append",
        default=[],
        metavar="NODE@STEP",
        help="SIGKILL a whole node (its agent's process group) while it works on STEP",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="RANK@STEP",
        help="SIGKILL RANK while it works on STEP (repeatable; default: one random, seeded)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model seed and the random kill's")
    parser.add_argument("--log", help="log URL (default: sqlite log in the run dir)")
    parser.add_argument("--run-dir", type=Path, help="default: runs/demo-<time>")
    parser.add_argument(
        "--verify", action="store_true", help="also run fault-free and compare bitwise"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout (progress goes to stderr)",
    )
    parser.add_argument(
        "--min-step-s",
        type=float,
        default=0.1,
        help="pad each step to this wall time so the run can be watched (default 0.1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="give up on a run after this many seconds"
    )
    parser.add_argument(
        "--parallel",
        choices=PARALLEL,
        default="hook",
        help="who reduces the gradients: the hook (default), torch DDP on the stable group, "
        "FSDP2 HSDP on a (nproc/2, 2) mesh, FSDP2 beside tensor parallel on a (dp_replicate, "
        "dp_shard, tp) mesh: tp-hsdp (nproc/2, 1, 2), 3d (nproc/4, 2, 2), two pipeline stages "
        "with DDP over their replicas (pp: nproc/2 x 2), or with no replica, a checkpoint every "
        f"{NO_REPLICA_CHECKPOINT_EVERY} steps to fall back to: FSDP2 over all ranks (fsdp) or "
        "tensor parallel over all ranks (tp)",
    )
    parser.add_argument(
        "--group-rebuild",
        choices=[m.value for m in GroupRebuild],
        default="fresh",
        help="with ddp, hsdp or fsdp: how their process groups change generation "
        "(flashrecovery run --group-rebuild)",
    )


def kill_plan(args: argparse.Namespace) -> list[Kill]:
    """The kills asked for, or one random kill drawn from the seed (so a rerun repeats it)."""
    if args.nproc < 1 or args.spares < 0 or args.steps < 2:
        raise ValueError("--nproc must be >= 1, --spares >= 0 and --steps >= 2")
    if args.parallel in REPLICA_MESH:
        within = replica_ranks(args.parallel)
        if not whole_replicas(args.parallel, args.nproc):
            replica = REPLICA_MESH[args.parallel].items()
            mesh = " x ".join(f"{size} {name}" for name, size in replica)
            raise ValueError(
                f"--parallel {args.parallel} holds each replica on {mesh} = {within} ranks, with "
                f"at least 2 replicas: --nproc must be a multiple of {within}, at least "
                f"{2 * within}"
            )
    if args.nodes < 1 or args.nproc % args.nodes:
        raise ValueError(f"--nodes {args.nodes}: --nproc {args.nproc} must split evenly")
    # no replica: a lost rank falls back to a checkpoint, so a kill comes after the first one
    first = NO_REPLICA_CHECKPOINT_EVERY if args.parallel in NO_REPLICA else 1
    if not args.kill and not args.kill_node:
        rng = random.Random(args.seed)
        step = rng.randint(max(first, args.steps // 4), max(first, 3 * args.steps // 4))
        return [Kill(rng.randrange(args.nproc), step)]
    plan = [Kill.parse(spec) for spec in args.kill]
    for kill in plan:
        if not (kill.rank is not None and 0 <= kill.rank < args.nproc and kill.step < args.steps):
            raise ValueError(
                f"--kill {kill.rank}@{kill.step}: rank must be < {args.nproc} "
                f"and step < {args.steps}"
            )
        if kill.step < first:
            raise ValueError(
                f"--kill {kill.rank}@{kill.step}: --parallel {args.parallel} has no replica and "
                f"falls back to its first checkpoint after step {first - 1}: kill at step "
                f"{first} or later"
            )
    nodes = [Kill.parse_node(spec) for spec in args.kill_node]
    for kill in nodes:
        if not (kill.node is not None and 0 <= kill.node < args.nodes and kill.step < args.steps):
            raise ValueError(
                f"--kill-node {kill.node}@{kill.step}: node must be 0..{args.nodes - 1} and "
                f"step < {args.steps}"
            )
    return [*plan, *nodes]


def render(spec: JobSpec, watch: JobWatch, killer: Killer, title: str) -> RenderableType:
    committed = watch.committed() + 1
    opened, closed = watch.incidents
    grid = Table.grid(padding=(0, 2))
    grid.add_row("[bold]" + title, ProgressBar(total=spec.steps, completed=committed, width=40))
    grid.add_row("steps committed", f"{committed}/{spec.steps}")
    grid.add_row("generation", f"{watch.state.generation}  (job {watch.state.job.state})")
    grid.add_row("incidents", f"{opened} opened, {closed} closed")
    grid.add_row("hot spares ready", str(watch.ready_spares))
    for kill in killer.plan:
        grid.add_row("kill", kill.describe())
    grid.add_row("last record", Text(watch.last_record))  # record text, never markup
    return grid


def execute(
    spec: JobSpec,
    kills: list[Kill],
    console: Console,
    title: str,
    timeout: float,
    on_round: Callable[[LaunchedJob, JobWatch], str | None] = lambda job, watch: None,
    at_end: Callable[[LaunchedJob, JobWatch], None] = lambda job, watch: None,
    network: Network | None = None,
) -> int | None:
    """Run one job to its end (or the timeout), killing as planned; returns the agent's code.
    ``on_round`` acts once per round of the watch (what it says is printed); ``at_end`` runs
    once the agent has ended, before whatever it left behind is ended. ``network``: each node
    in a host of it (--netns)."""
    with open_log(spec.log_url) as log, LaunchedJob(spec, network) as job:
        watch = JobWatch(spec.believed(log), spec.job_id)
        killer = Killer(job, kills)
        with Live(
            render(spec, watch, killer, title), console=console, refresh_per_second=8
        ) as live:

            def show(fired: Kill | None) -> None:
                if fired is not None:
                    live.console.print(f"[red]{fired.sig.name}[/] {fired.describe()}")
                said = on_round(job, watch)
                if said:
                    live.console.print(said)
                live.update(render(spec, watch, killer, title))

            returncode = follow(job, watch, killer, timeout, show)
        console.line()  # Live leaves its last frame without one when output is not a terminal
        if returncode != 0:
            console.print(f"[red]{title}: the agent ended with {returncode}[/]; its output:")
            console.print(job.output_tail(), markup=False, highlight=False)
        at_end(job, watch)
        return returncode


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.spares is None:
        args.spares = 1 if args.nodes == 1 else 0
    if args.nproc is None:
        args.nproc = 4 if args.nodes == 1 else args.nodes
    try:
        kills = kill_plan(args)
    except ValueError as exc:
        print(f"flashrecovery demo: error: {exc}", file=sys.stderr)
        return 2
    if args.netns and (args.nodes < 2 or args.log):
        print("flashrecovery demo: error: --netns needs --nodes 2 or more, and makes its own "
              "Kafka log (no --log)", file=sys.stderr)  # fmt: skip
        return 2
    run_dir = (args.run_dir or Path("runs") / f"demo-{stamp}").resolve()
    with contextlib.ExitStack() as stack:
        testbed = None
        if args.netns:  # the agent package imports torch: only here
            from flashrecovery.agent.testbed import Testbed

            testbed = stack.enter_context(Testbed(args.nodes + 1))
        log_url = (
            testbed.log_url(f"demo-{stamp}.")
            if testbed is not None
            else args.log or f"sqlite://{run_dir / 'log.db'}"
        )
        return _run(args, stamp, run_dir, log_url, kills, testbed)


def _run(
    args: argparse.Namespace,
    stamp: str,
    run_dir: Path,
    log_url: str,
    kills: list[Kill],
    testbed: Testbed | None,
) -> int:
    checkpoint_every = NO_REPLICA_CHECKPOINT_EVERY if args.parallel in NO_REPLICA else 0
    spec = JobSpec(
        job_id=f"demo-{stamp}-seed{args.seed}",
        log_url=log_url,
        run_dir=run_dir,
        nproc=args.nproc,
        spares=args.spares,
        steps=args.steps,
        seed=args.seed,
        min_step_s=args.min_step_s,
        parallel=args.parallel,
        nodes=args.nodes,
        spare_nodes=0 if args.nodes == 1 else 1,
        checkpoint_every=checkpoint_every,
        agent_args=("--group-rebuild", args.group_rebuild),
    )
    reference = (
        JobSpec(
            job_id=f"{spec.job_id}-reference",
            log_url=log_url,
            run_dir=run_dir / "reference",
            nproc=args.nproc,
            spares=0,
            steps=args.steps,
            seed=args.seed,
            parallel=args.parallel,
            nodes=args.nodes,
            checkpoint_every=checkpoint_every,
            secret=spec.secret,  # one launcher: its summary reads both through it
        )
        if args.verify
        else None
    )
    # With --json: progress on stderr, the JSON on stdout; unfolded when not a terminal.
    console = terminal.console(stderr=args.json)
    plan = ", ".join(f"{k.target} at step {k.step}" for k in kills)
    shape = f"{spec.nproc} ranks + {spec.spares} hot spare(s)"
    if spec.nodes > 1:
        shape = (
            f"{spec.nodes} nodes x {spec.nproc // spec.nodes} ranks + {spec.spares} hot "
            f"spare(s) each, and a spare node of {spec.nproc // spec.nodes}"
        )
    console.print(
        f"[bold]flashrecovery demo[/]: {shape}, {spec.steps} steps, seed {spec.seed}; "
        f"SIGKILL {plan}\nrun dir {run_dir}"
    )
    network = testbed.network if testbed is not None else None
    try:
        returncode = execute(spec, kills, console, "training", args.timeout, network=network)
        if reference is not None:
            execute(reference, [], console, "reference (fault-free)", args.timeout, network=network)
        with open_log(log_url) as log:
            summary = summarize(spec.believed(log), spec, kills, returncode, reference)
    except LogError as exc:
        print(f"flashrecovery demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print_summary(summary, console)
    return 0 if summary["ok"] else 1


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]NO[/]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def incident_table(row: dict[str, Any]) -> Table:
    """One incident, one line per phase: narrow enough for any terminal."""
    table = Table(
        title=Text(f"{row['incident_id']}: {row['failed']}, {row['reason']}"),
        title_justify="left",
        show_header=False,
    )
    table.add_column()
    table.add_column(justify="right")
    table.add_row("replaced by", str(row["replacement"]))
    table.add_row("detection (SIGKILL → engine knows)", _ms(row["detection_s"]))
    for phase, seconds in row["phases_s"].items():
        table.add_row(f"  phase: {phase.replace('_', ' ')}", _ms(seconds))
    table.add_row("RTO (exit record → every rank committed a new step)", _ms(row["rto_s"]))
    table.add_row("RTO from the SIGKILL", _ms(row["rto_from_kill_s"]))
    fallback = (
        " (from the checkpoint: no replica left)" if row["checkpoint_step"] is not None else ""
    )
    table.add_row("resumed after step", f"{row['resume_step']}{fallback}")
    table.add_row("committed steps lost", str(row["committed_steps_lost"]))
    table.add_row("steps recomputed", str(row["steps_recomputed"]))
    return table


def print_summary(summary: dict[str, Any], console: Console) -> None:
    verdict = "[green]OK[/]" if summary["ok"] else "[red]FAILED[/]"
    console.rule(f"summary {verdict}")
    console.print(
        f"job {summary['job_id']}: {summary['steps']} steps on {summary['world_size']} ranks, "
        f"completed {_yes(summary['completed'])}"
    )
    for kill in summary["kills"]:
        target = (
            f"rank {kill['rank']} (pid"
            if kill["node"] is None
            else f"node {kill['node']} (agent pid"
        )
        console.print(
            f"SIGKILL {target} {kill['pid']}) planned at step {kill['step']}, "
            f"sent after it committed step {kill['committed']}: {kill['outcome']}"
        )
    for row in summary["incidents"]:
        console.print(incident_table(row))
    console.print(
        f"committed steps lost: {summary['committed_steps_lost']}, "
        f"steps recomputed: {summary['steps_recomputed']}"
    )
    pids = ", ".join(f"rank {r}: {p['joined']} → {p['final']}" for r, p in summary["pids"].items())
    console.print(f"survivors' PIDs unchanged: {_yes(summary['survivor_pids_unchanged'])} ({pids})")
    for change in summary["unplanned_pid_changes"]:
        console.print(f"  [red]unplanned restart[/] {change}")
    curve = summary["loss_curve"]
    losses = curve["mean_loss"]
    span = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "no steps"
    console.print(
        f"loss curve continuous (no gap, no duplicate step): {_yes(curve['continuous'])}  "
        f"{curve['sparkline']}  {span}"
    )
    if not curve["continuous"]:
        console.print(f"  gaps {curve['gaps']}, duplicates {curve['duplicates']}")
    replay = summary["replay"]
    console.print(
        f"replay reproduces every decision: {_yes(replay['ok'])} "
        f"({replay['decisions_checked']} decisions from {replay['events']} events)"
    )
    check = summary["verify"]
    if check is not None:
        console.print(
            f"bitwise equal to the fault-free run {check['reference_job_id']}: "
            f"{_yes(check['bitwise_equal'])} (ranks equal {_yes(check['ranks_equal'])}, "
            f"equal to reference {_yes(check['equal_to_reference'])}, "
            f"every loss equal {_yes(check['losses_equal'])})"
        )
    console.print(f"timeline: {summary['timeline']}", markup=False, soft_wrap=True)
    console.print(f"inspect: {summary['commands']['events']}", markup=False, soft_wrap=True)
    console.print(f"replay:  {summary['commands']['replay']}", markup=False, soft_wrap=True)
