"""Run a job under a seeded random schedule of faults and check that it recovered from each.

`flashrecovery chaos [--faults N] [--seed S] [--spares S] [--log URL] [--json] [script args]`
runs the demo model (or the given script) once fault-free for reference, then again under the
schedule: SIGKILL, SIGSTOP, a raised exception, a stalled rank, kills inside a recovery (the
donor, the replacement, a second member while regrouping or while the group forms), and with
``--external-engine`` the deciding engine SIGKILLed mid-incident, on a broker it started
itself (``--kafka``) a broker restart mid-incident. It prints per fault the detection time, RTO,
committed steps lost and whether it was recovered, then the checks: completion, final parameters
bitwise equal to the reference, replay with no divergence, survivors' PIDs, no process left. The
exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from flashrecovery import terminal
from flashrecovery.agent import netns
from flashrecovery.agent.launcher import one_of
from flashrecovery.agent.testbed import Testbed
from flashrecovery.chaos import schedule
from flashrecovery.chaos.network import LASTS_S, SETTLE_STEPS, NetworkFaults
from flashrecovery.chaos.schedule import (
    FORGED,
    IDLE_SPARE_SIGNAL,
    MID_INCIDENT,
    NETWORK,
    OUTSIDE_SIGNAL,
    STRAGGLING,
    VERIFIED,
    PlannedFault,
)
from flashrecovery.chaos.verdict import Sent, judge
from flashrecovery.connectors import LogError, open_log
from flashrecovery.connectors.kafka_broker import KafkaBroker
from flashrecovery.demo.cli import execute
from flashrecovery.demo.job import JobSpec, LaunchedJob
from flashrecovery.demo.watch import JobWatch, Kill, KillOutcome
from flashrecovery.records import StragglerPolicy, Stream
from flashrecovery.trainer_hooks import final_state

FIRST_STEP = 4  # the first fault's step: the spares have had time to warm up
LEFT_GRACE_S = 10.0  # an orphan ends itself within a second of its agent; give it this long
ENGINE_LEASE_TTL_S = 1.0
FORGER_WAIT_S = 40.0  # a forger waits up to 30 s for the rejections (chaos/forge.py)
MIN_STEP_S = 0.1  # a demo step's wall time at least, so the faults meet steps in flight
# A step on netns nodes with the log on a 3-broker cluster takes about this long: paced to it,
# a run's steps (its faults' seconds over the pace) are no more than the faults need; a
# faster pace only makes more steps (and a longer fault-free reference), not faster ones.
NETNS_STEP_S = 0.25
ENGINE = [sys.executable, "-m", "flashrecovery.cli", "engine"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", type=int, default=6, help="faults to inject (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule (default 0)")
    parser.add_argument("--nproc", type=int, default=3, help="ranks (default 3)")
    parser.add_argument(
        "--spares",
        type=int,
        default=None,
        help="hot spares (default 2; with --nodes, on each node: default 1)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="steps the job trains (default: room for every fault); with a script, the steps "
        "it trains (required)",
    )
    parser.add_argument("--gap", type=int, default=8, help="steps between two faults (default 8)")
    parser.add_argument(
        "--kinds",
        help="comma-separated fault kinds to draw from (default: all this job can take): "
        + ", ".join(schedule.KINDS),
    )
    parser.add_argument("--log", help="log URL (default: sqlite log in the run dir)")
    parser.add_argument(
        "--kafka",
        action="store_true",
        help="start a Kafka broker of its own for the log (Java and Maven needed); the "
        "schedule may then restart it mid-incident",
    )
    parser.add_argument(
        "--external-engine",
        action="store_true",
        help="decide from two `flashrecovery engine` services sharing a lease; the schedule "
        "may then SIGKILL the deciding one mid-incident",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="loopback nodes sharing --nproc ranks, an agent each, plus a spare node; the "
        "schedule may then lose a node (node_kill, node0_kill)",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="with --nodes: each node in a network namespace of its own, the log on a 3-broker "
        "Kafka cluster of such hosts (root; agent/testbed.py); the schedule may then cut a "
        "node off, drop one direction of its traffic, flap or degrade its link, or kill the "
        "events' leader broker",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SEC")
    parser.add_argument("--stall-timeout", type=float, default=5.0, metavar="SEC")
    parser.add_argument(
        "--straggler-policy",
        **one_of(StragglerPolicy.REPORT),
        help="the job's --straggler-policy: a degraded node is named (report, the default), or "
        "named and replaced (replace); either way the degraded kind checks it was named",
    )
    parser.add_argument(
        "--min-step-s",
        type=float,
        help=f"pad each demo step to this wall time (default {MIN_STEP_S}, with --netns "
        f"{NETNS_STEP_S}: the pace a step keeps there anyway)",
    )
    parser.add_argument("--run-dir", type=Path, help="default: runs/chaos-<time>")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument(
        "--json", action="store_true", help="the verdict as JSON on stdout (progress on stderr)"
    )
    parser.add_argument("script", nargs="?", type=Path, help="a training script (default: demo)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


@dataclass
class Plan:
    """The faults of one chaos run and what is done about them from outside."""

    faults: list[PlannedFault]
    sent: dict[int, Sent] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        if args.spares is None:
            args.spares = 2 if args.nodes == 1 else 1
        if args.faults < 0 or args.nproc < 2 or args.spares < 0 or args.gap < 3:
            raise ValueError("--faults >= 0, --nproc >= 2, --spares >= 0 and --gap >= 3")
        if args.min_step_s is None:
            args.min_step_s = NETNS_STEP_S if args.netns else MIN_STEP_S
        if args.min_step_s <= 0:
            raise ValueError(f"--min-step-s {args.min_step_s}: must be > 0 (it paces the faults)")
        if args.nodes < 1 or args.nproc % args.nodes:
            raise ValueError(f"--nodes {args.nodes}: --nproc {args.nproc} must split evenly")
        if args.netns and (args.nodes < 2 or args.kafka or args.log):
            raise ValueError("--netns needs --nodes 2 or more and makes its own Kafka log")
        possible = schedule.available_kinds(
            args.nproc, args.external_engine, args.kafka, args.spares, args.nodes, args.netns
        )
        kinds = args.kinds.split(",") if args.kinds else possible
        for kind in kinds:
            if kind not in possible:
                raise ValueError(
                    f"fault kind {kind!r} is not possible in this job; possible: "
                    + ", ".join(possible)
                )
        faults = schedule.draw(
            args.faults, args.seed, args.nproc, kinds, FIRST_STEP, args.gap, args.nodes
        )
        plan = cls(faults)
        for fault, after in zip(faults, [*faults[1:], None], strict=True):
            # Sent two steps before the next fault at the latest, ready spare or not: a kill
            # that waited longer would take the next fault's process with it.
            last = None if after is None else max(after.step - 2, fault.step - 1)
            if fault.kind in schedule.NODE_KILLS:
                kill = Kill(None, fault.step, node=fault.node, spare_wait_until=last)
                plan.sent[fault.index] = Sent(kill=kill)
            elif fault.kind in OUTSIDE_SIGNAL or fault.kind in MID_INCIDENT:
                sig = OUTSIDE_SIGNAL.get(fault.kind, OUTSIDE_SIGNAL["sigkill"])
                kill = Kill(fault.rank, fault.step, sig, spare_wait_until=last)
                plan.sent[fault.index] = Sent(kill=kill)
        return plan

    @property
    def kills(self) -> list[Kill]:
        return [s.kill for s in self.sent.values() if s.kill is not None]

    def fault_plan(self) -> list[str]:
        return [entry for fault in self.faults for entry in fault.plan]

    def last_step(self) -> int:
        return max((f.step for f in self.faults), default=0)

    def over(self, fault: PlannedFault, watch: JobWatch) -> bool:
        """A network fault healed and the job past it; a kill sent and the job past it too
        (or missed); the others pace themselves."""
        sent = self.sent.get(fault.index)
        kill = None if sent is None else sent.kill
        if kill is not None and kill.outcome is KillOutcome.MISSED:
            return True
        if fault.kind in NETWORK:
            return sent is not None and sent.settled
        if kill is None:
            return True
        if kill.outcome is KillOutcome.PENDING or kill.committed is None:
            return False
        return watch.running and watch.committed() >= kill.committed + SETTLE_STEPS

    def turn(self, index: int, watch: JobWatch) -> bool:
        """Whether every fault before ``index`` is over: faults come one at a time, so that
        each meets a job that got over the one before (a link held for seconds, or a node
        just lost, must not have the next fault pile onto its recovery)."""
        return all(self.over(f, watch) for f in self.faults if f.index < index)

    def release(self, kills: list[Kill], watch: JobWatch) -> None:
        """Hand the killer its next kill once its turn has come (kills stay in order)."""
        for fault in self.faults:
            sent = self.sent.get(fault.index)
            if sent is None or sent.kill is None or sent.kill in kills:
                continue
            if self.turn(fault.index, watch):
                kills.append(sent.kill)
            return


class Engines:
    """The `flashrecovery engine` services of a job: two share it once it has started (the
    agent refuses a job id that has records already); one killed is replaced."""

    def __init__(self, job: JobSpec) -> None:
        self._job = job
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start_with(self, watch: JobWatch) -> None:
        if not self.processes and watch.state.config is not None:
            for _ in range(2):
                self.start_one()

    def start_one(self) -> None:
        name = f"engine-{len(self.processes)}"
        with (self._job.run_dir / f"{name}.out").open("wb") as out:
            options = ["--log", self._job.log_url, "--job", self._job.job_id, "--engine-id", name]
            self.processes[name] = subprocess.Popen(
                [*ENGINE, *options, "--lease-ttl", str(ENGINE_LEASE_TTL_S)],
                env={**os.environ, **self._job.environment()},  # the job's secret
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def kill(self, name: str) -> bool:
        process = self.processes.get(name)
        if process is None or process.poll() is not None:
            return False
        process.kill()
        process.wait()
        self.start_one()  # a standby again for the next time
        return True

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


FORGER = [sys.executable, "-m", "flashrecovery.chaos.forge"]


@dataclass
class OutsideFaults:
    """Carries out what the killer does not: the engine kills and broker restarts, each once
    the rank kill before it has opened an incident that is not closed yet, the signals to
    an idle spare, each once the job runs at its step with a spare ready, and the forgers, each
    once the job runs at its step."""

    plan: Plan
    engines: Engines | None
    broker: KafkaBroker | None
    forgers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __call__(self, job: LaunchedJob, watch: JobWatch) -> str | None:
        if self.engines is not None:
            self.engines.start_with(watch)
        return self._idle_spare(job, watch) or self._mid_incident(watch) or self._forge(job, watch)

    def _forge(self, job: LaunchedJob, watch: JobWatch) -> str | None:
        """A process of its own with the log's URL and no key (chaos/forge.py)."""
        for fault in self.plan.faults:
            sent = self.plan.sent.setdefault(fault.index, Sent())
            if fault.kind not in FORGED or sent.forged is not None:
                continue
            pid = watch.pid_of(fault.rank)
            if watch.committed() < fault.step - 1 or not watch.running or pid is None:
                return None
            sent.forged = job.spec.run_dir / f"forged-{fault.index}.json"
            aim = ["--rank", str(fault.rank), "--pid", str(pid), "--step", str(fault.step)]
            aim += ["--generation", str(watch.state.generation), "--out", str(sent.forged)]
            where = ["--log", job.spec.log_url, "--job", job.spec.job_id]
            self.forgers.append(subprocess.Popen([*FORGER, *where, *aim], stdin=subprocess.DEVNULL))
            return f"[red]forged[/] a record of every type about rank {fault.rank} (pid {pid})"
        return None

    def wait_forgers(self) -> None:
        """Each forger ends once the engine has rejected what it wrote (or after its bound)."""
        for forger in self.forgers:
            try:
                forger.wait(FORGER_WAIT_S)
            except subprocess.TimeoutExpired:
                forger.kill()
                forger.wait()

    def _idle_spare(self, job: LaunchedJob, watch: JobWatch) -> str | None:
        for fault in self.plan.faults:
            sent = self.plan.sent.setdefault(fault.index, Sent())
            if fault.kind not in IDLE_SPARE_SIGNAL or sent.spare is not None:
                continue
            ready = watch.state.ready_spares()
            if watch.committed() < fault.step - 1 or not watch.running or not ready:
                return None  # in order: a later one waits for this one
            # The newest: the planner hands a rank to the oldest, which could be under way.
            spare, sig = ready[-1], IDLE_SPARE_SIGNAL[fault.kind]
            ts = job.kill_descendant(spare.pid, sig)
            if ts is None:
                return None  # gone meanwhile: try another next round
            sent.spare = (spare.spare_id, spare.pid, ts)
            return f"[red]{sig.name}[/] idle spare {spare.spare_id} (pid {spare.pid})"
        return None

    def _mid_incident(self, watch: JobWatch) -> str | None:
        opened, closed = watch.incidents
        for fault in self.plan.faults:
            sent = self.plan.sent.get(fault.index)
            if fault.kind not in MID_INCIDENT or sent is None or sent.mid_incident_ts:
                continue
            if sent.kill is None or sent.kill.outcome is not KillOutcome.KILLED or opened == closed:
                continue
            sent.mid_incident_ts = time.time()
            if fault.kind == "engine_kill" and self.engines is not None:
                holder = watch.leases.holder(time.time())
                if holder is not None and self.engines.kill(holder):
                    sent.engine_killed = holder
                    return f"[red]SIGKILL[/] engine {holder} mid-incident"
                sent.notes.append("no engine held the lease")
            elif fault.kind == "broker_restart" and self.broker is not None:
                self.broker.stop(keep_data=True)
                self.broker.start()
                return "[red]restarted[/] the Kafka broker mid-incident"
        return None


def _job_pids(log_url: str, job_id: str) -> set[int]:
    with open_log(log_url) as log:
        return {
            pid
            for entry in log.read(Stream.EVENTS, job_id)
            if entry.record is not None and (pid := getattr(entry.record, "pid", None))
        }


def processes_left(log_url: str, job_id: str, since: float) -> list[int]:
    """Processes of the job (every pid its log names) still running ``LEFT_GRACE_S`` after
    its agent ended. Only processes started after the job began count (a pid may be reused)."""
    pids = _job_pids(log_url, job_id)
    alive: list[psutil.Process] = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.create_time() >= since - 1 and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    _, still = psutil.wait_procs(alive, timeout=LEFT_GRACE_S)
    return sorted(p.pid for p in still)


def _specs(
    args: argparse.Namespace, plan: Plan, run_dir: Path, log_url: str
) -> tuple[JobSpec, JobSpec]:
    """The chaos job and its fault-free reference: same world, seed and steps."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Network faults hold a link for seconds each, one after another: the run lasts that long too.
    held_s = sum(LASTS_S[f.kind] for f in plan.faults if f.kind in LASTS_S)
    steps = args.steps or plan.last_step() + args.gap + math.ceil(held_s / args.min_step_s)
    script = args.script.resolve() if args.script else None
    common: dict[str, Any] = {
        "log_url": log_url,
        "nproc": args.nproc,
        "steps": steps,
        "seed": args.seed,
        "script": script,
        "script_args": tuple(args.script_args),
        "secret": secrets.token_hex(16),  # one launcher: the verdict reads both through it
    }
    options = ["--heartbeat-interval", str(args.heartbeat_interval)]
    options += ["--stall-timeout", str(args.stall_timeout)]
    options += ["--straggler-policy", str(args.straggler_policy)]
    if any(f.kind in VERIFIED for f in plan.faults):
        # Compared at every step: a flipped bit is found in the step it lands in, before any
        # rank steps with it, so the job can still end bitwise equal to its reference.
        options += ["--verify-every", "1"]
    if any(f.kind in STRAGGLING for f in plan.faults):
        # Scored over 5 steps: a slowed rank is named within the fault's SLOW_STEPS.
        options += ["--straggler-steps", "5"]
    chaos_options = [*options, "--final-state", str(run_dir / "final")]
    chaos_options += ["--output-dir", str(run_dir / "output")]
    if args.external_engine:
        chaos_options.append("--external-engine")
    nodes = {"nodes": args.nodes}
    job = JobSpec(
        job_id=f"chaos-{stamp}-seed{args.seed}",
        run_dir=run_dir,
        spares=args.spares,
        spare_nodes=1 if args.nodes > 1 else 0,
        **nodes,
        min_step_s=args.min_step_s,
        agent_args=tuple(chaos_options),
        fault_plan=",".join(plan.fault_plan()),
        **common,
    )
    reference = JobSpec(
        job_id=f"{job.job_id}-reference",
        run_dir=run_dir / "reference",
        spares=0,
        **nodes,
        agent_args=(*options, "--final-state", str(run_dir / "reference" / "final")),
        **common,
    )
    return job, reference


def run(args: argparse.Namespace) -> int:
    try:
        plan = Plan.from_args(args)
        if args.script is not None and args.steps is None:
            raise ValueError("with a script, say how many steps it trains: --steps N")
        if args.steps is not None and args.steps <= plan.last_step():
            raise ValueError(
                f"--steps {args.steps}: the last fault lands at step {plan.last_step()}"
            )
        if args.kafka and args.log:
            raise ValueError("--kafka starts a broker for the log: give no --log with it")
    except ValueError as exc:
        print(f"flashrecovery chaos: error: {exc}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or Path("runs") / f"chaos-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    console = terminal.console(stderr=args.json)
    broker = KafkaBroker() if args.kafka else None
    testbed: Testbed | None = None
    try:
        if broker is not None:
            console.print("starting a Kafka broker…")
            broker.start()
        if args.netns:
            console.print("making the nodes' networks and a 3-broker Kafka cluster…")
            testbed = Testbed(args.nodes + 1)  # and the spare node
        if testbed is not None:
            log_url = testbed.log_url(f"chaos-{stamp}.")
        elif broker is not None:
            log_url = f"kafka://{broker.bootstrap}?timeout_s=30"
        else:
            log_url = args.log or f"sqlite://{run_dir / 'log.db'}"
        job, reference = _specs(args, plan, run_dir, log_url)
        verdict = _run_both(args, plan, job, reference, broker, console, testbed)
    except LogError as exc:
        print(f"flashrecovery chaos: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if broker is not None:
            broker.stop()
        if testbed is not None:
            testbed.close()
        verdict_netns = netns.leftovers() if args.netns else []
    if args.netns:
        verdict["checks"]["no_namespace_left"] = not verdict_netns
        verdict["ok"] = verdict["ok"] and not verdict_netns
    if args.json:
        print(json.dumps(verdict, indent=2, sort_keys=True))
    else:
        print_verdict(verdict, console)
    return 0 if verdict["ok"] else 1


def _run_both(
    args: argparse.Namespace,
    plan: Plan,
    job: JobSpec,
    reference: JobSpec,
    broker: KafkaBroker | None,
    console: Console,
    testbed: Testbed | None = None,
) -> dict[str, Any]:
    shape = f"{job.nproc} ranks + {job.spares} hot spare(s)"
    if job.nodes > 1:
        where = "nodes with networks of their own" if testbed else "loopback nodes"
        shape = f"{job.nproc} ranks on {job.nodes} {where} + a spare node"
    console.print(
        f"[bold]flashrecovery chaos[/]: {shape}, {job.steps} steps, {len(plan.faults)} "
        f"fault(s), seed {args.seed}\nrun dir {job.run_dir}"
    )
    for fault in plan.faults:
        console.print(f"  fault {fault.index}: {fault.kind}, {fault.describe()}")
    network = testbed.network if testbed is not None else None
    execute(reference, [], console, "reference (fault-free)", args.timeout, network=network)
    engines = Engines(job) if args.external_engine else None
    left: list[int] = []
    started = time.time()

    def at_end(launched: LaunchedJob, watch: JobWatch) -> None:
        launched.wait_lost(LEFT_GRACE_S)  # a node cut off ends once it sees it was given up
        left.extend(processes_left(job.log_url, job.job_id, started))

    outside = OutsideFaults(plan, engines, broker)
    faults_of_network = (
        NetworkFaults(plan.faults, plan.sent, testbed, plan.turn) if testbed else None
    )
    released: list[Kill] = []  # the killer's, each in its turn

    def on_round(launched: LaunchedJob, watch: JobWatch) -> str | None:
        plan.release(released, watch)
        said = outside(launched, watch)
        if said is None and faults_of_network is not None:
            said = faults_of_network(launched, watch)
        return said

    try:
        returncode = execute(
            job,
            released,
            console,
            "chaos",
            args.timeout,
            on_round=on_round,
            at_end=at_end,
            network=network,
        )
    finally:
        outside.wait_forgers()
        if engines is not None:
            engines.stop()
    with open_log(job.log_url) as log:
        return judge(
            job.believed(log),
            job.job_id,
            job.nproc,
            job.steps,
            plan.faults,
            plan.sent,
            returncode,
            final_state.read(job.run_dir / "final", job.nproc),
            final_state.read(reference.run_dir / "final", reference.nproc),
            left,
        )


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]NO[/]"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_verdict(verdict: dict[str, Any], console: Console) -> None:
    table = Table(title=f"chaos: {verdict['job_id']}", title_justify="left")
    for column in ("#", "kind", "where", "detection ms", "RTO ms", "steps lost", "recovered"):
        table.add_column(column, justify="right" if "ms" in column or column == "#" else "left")
    table.add_column("notes")
    for row in verdict["faults"]:
        table.add_row(
            str(row["index"]),
            row["kind"],
            row["where"],
            _ms(row["detection_ms"])
            if row["detection_steps"] is None
            else f"{row['detection_steps']} steps",
            _ms(row["rto_ms"]),
            str(row["committed_steps_lost"]),
            _yes(row["recovered"]) if row["sent"] else "[yellow]not sent[/]",
            "; ".join(row["notes"]),
        )
    console.print(table)
    for row in verdict["unplanned_incidents"]:
        console.print(
            f"unplanned incident {row['incident_id']}: rank {row['failed_rank']}, "
            f"{row['reason']} ({row['state']})",
            markup=False,
        )
    checks = Table(show_header=False, title="checks", title_justify="left")
    checks.add_column()
    checks.add_column()
    faults = len(verdict["faults"])
    checks.add_row("faults sent", f"{verdict['sent']}/{faults}")
    checks.add_row("faults recovered", f"{verdict['recovered']}/{verdict['sent']}")
    for name, ok in verdict["checks"].items():
        checks.add_row(name.replace("_", " "), _yes(ok))
    console.print(checks)
    records = verdict["records"]
    console.print(
        f"{records['records']} records; stored twice: {records['duplicate_record_ids']}; "
        f"step records missing: {records['step_records_missing']} "
        f"(a lost node took {records['step_records_lost_with_nodes']} with it, "
        f"{records['step_records_reached_by_restore']} reached by a restore), "
        f"twice: {records['step_records_duplicated']}"
    )
    if verdict["processes_left"]:
        console.print(f"processes left: {verdict['processes_left']}")
    result = "[green]OK[/]" if verdict["ok"] else "[red]FAILED[/]"
    console.print(f"chaos verdict: {result}")
