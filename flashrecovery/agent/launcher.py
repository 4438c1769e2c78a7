"""Run a training script on N ranks plus hot spares, recovering from rank and node failures."""

from __future__ import annotations

import argparse
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

from flashrecovery.agent import slurm
from flashrecovery.agent import torchrun_options as torchrun
from flashrecovery.agent.config import AgentConfig, Endpoint, RunAs, SpareRefill, StartMethod
from flashrecovery.errors import ConfigError
from flashrecovery.observe.exporter import add_metrics_port
from flashrecovery.options import add_job_option
from flashrecovery.records import NonFinitePolicy, StragglerPolicy
from flashrecovery.trainer_hooks import probe
from flashrecovery.trainer_hooks.digest import DEFAULT_VERIFY_EVERY
from flashrecovery.trainer_hooks.env import GroupRebuild

NODE_RANK_OMITTED = -1  # no --node-rank given: decided by who can host the endpoint


def one_of(default: StrEnum) -> dict[str, Any]:
    """An option's choices and default: the values of ``default``'s enum, and it."""
    return {"choices": [member.value for member in type(default)], "default": default}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = torchrun.spelled(parser)
    add(
        "--nproc-per-node",
        type=torchrun.nproc,
        required=True,
        metavar="N",
        help="ranks on each node (or torchrun's auto, cpu, gpu)",
    )
    add("--spares", type=int, default=0, metavar="S", help="hot spare processes on each node")
    add(
        "--nnodes",
        type=torchrun.nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="training nodes, one agent each; torchrun's MIN:MAX trains on MIN and keeps up "
        "to MAX-MIN whole nodes of hot spares (the world never shrinks: spares take the place "
        "of a lost node); default 1, or under srun the tasks less --spare-nodes",
    )
    add(
        "--node-rank",
        type=_node_rank,
        default=NODE_RANK_OMITTED,
        metavar="K|auto",
        help="this agent's node (0 hosts the store and the engine); auto: the lowest free one, "
        "given at rendezvous (a node joining a running job adds its spares); omitted: 0 if "
        "this host can listen on --rdzv-endpoint and nobody does yet, else auto; under srun "
        "its task's SLURM_PROCID",
    )
    add(
        "--rdzv-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="where node 0's agent hosts the job's store (multi-node jobs; every agent needs "
        "FLASHRECOVERY_STORE_PREFIX, the job's secret, in its environment: docs/multinode.md); "
        "under srun: the step's first node, port 15000 + the job id's last 4 digits",
    )
    add(
        "--control-plane",
        action="store_true",
        help="the rendezvous store and the preferred engine run in `flashrecovery "
        "control-plane` at --rdzv-endpoint; the agents' engines stand by, and its loss "
        "costs one lease handover",
    )
    add(
        "--spare-nodes",
        type=int,
        default=0,
        metavar="M",
        help="whole nodes of hot spares (node ranks NNODES..NNODES+M-1, N spares each)",
    )
    add(
        "--node-wait",
        type=float,
        default=30.0,
        metavar="SEC",
        help="a lost node's ranks with no spare left wait this long for a node to join, then "
        "the job fails (default 30)",
    )
    add(
        "--log",
        default=None,
        metavar="URL",
        help="event log URL (default: sqlite://<cwd>/runs/<job-id>/log.db)",
    )
    add_job_option(
        parser,
        dest="job_id",
        help="default: generated (under srun: slurm-JOB.STEP)",
        also=torchrun.JOB_ID,
    )
    add(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="SEC",
        help="seconds between a rank's heartbeats; 3 missed ones fail the rank (default 1.0)",
    )
    add(
        "--stall-timeout",
        type=float,
        default=5.0,
        metavar="SEC",
        help="no step progress for max(10 x median step, SEC) while peers wait in the commit "
        "makes the rank holding them up suspect; a second such window fails it (default 5.0)",
    )
    add(
        "--straggler-policy",
        **one_of(StragglerPolicy.REPORT),
        help="what to do with a node whose link slows the job (its probes to its peers lost or "
        "late while theirs between them are not; needs 3 nodes or more to tell the node from "
        "the network) or a rank whose steps are steadily slower than its peers' (see "
        "--straggler-ratio): name it in the log (report, the default), or also replace its "
        "ranks with spares when they can take them all (replace)",
    )
    add(
        "--straggler-ratio",
        type=float,
        default=2.0,
        metavar="X",
        help="a rank whose compute time per step (its step less its waits on its peers) is, "
        "as a median over --straggler-steps steps, X times its peers' median or more is a "
        "straggler (default 2.0)",
    )
    add(
        "--straggler-steps",
        type=int,
        default=20,
        metavar="N",
        help="the steps a rank's slowdown is taken over: one slow step never names it, "
        "a rank merely noisy neither (default 20)",
    )
    add(
        "--nonfinite-policy",
        **one_of(NonFinitePolicy.FAIL),
        help="a step whose loss or gradients hold a NaN or an infinity on any rank is stepped by "
        "no rank and computed again once; non-finite again, the job fails naming the rank and "
        "step (fail, the default) or every rank skips its batch (skip); docs/hook.md",
    )
    add(
        "--verify-every",
        type=int,
        default=DEFAULT_VERIFY_EVERY,
        metavar="K",
        help="every K steps the replicas of each shard compare a digest of their model and "
        "optimizer state in the step's vote; a replica that differs from the majority is "
        f"replaced, restored from it (0: never; default {DEFAULT_VERIFY_EVERY}); docs/hook.md",
    )
    add(
        "--external-engine",
        action="store_true",
        help="run no engine in the agent: the job's decisions come from `flashrecovery engine "
        "--log URL --job ID` services (several may share the job through a lease)",
    )
    add(
        "--max-replacements",
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="the job fails when the same rank fails N times at the same committed step (a crash "
        "loop; a rank that never reaches its first step fails at step -1) (default 3)",
    )
    add(
        "--shards",
        type=int,
        default=1,
        metavar="S",
        help="model shards (HSDP: the mesh's shard dimension); rank r holds shard r %% S, "
        "the ranks of one shard are its replicas (default 1: pure data parallel)",
    )
    add(
        "--group-rebuild",
        **one_of(GroupRebuild.FRESH),
        help="how the process groups a script holds (DDP, FSDP2, DeviceMesh) change generation: "
        "a new backend per generation (fresh, the default: lazy gloo, and a new NCCL "
        "communicator bootstrapped by the whole group), or one backend reconfigured in place "
        "(reconfigure: torch's fault-tolerance API; on NCCL >= 2.28 the lost ranks are shrunk "
        "out and the replacements grown in, no bootstrap of the whole group)",
    )
    add(
        "--checkpoint-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="save asynchronous sharded checkpoints (torch.distributed.checkpoint) here; when no "
        "replica of a shard is left, every rank loads the latest complete one and the job "
        "carries on (needs --checkpoint-every)",
    )
    add(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="save a checkpoint after every K committed steps (with --checkpoint-dir)",
    )
    add(
        "--max-incidents",
        type=int,
        default=None,
        metavar="N",
        help="the job fails at its incident N+1 (default: no bound)",
    )
    add(
        "--spare-refill",
        **one_of(SpareRefill.IMMEDIATE),
        help="start a new spare as soon as one is taken (immediate, the default) or once the "
        "recovery that took it is over (after-recovery); a spare that dies or goes silent is "
        "replaced at once either way",
    )
    add(
        "--start-method",
        **one_of(StartMethod.FORKSERVER),
        help="forkserver (the default): every rank and spare is forked from one process per "
        "node that has imported torch already, which starts them in a fraction of a second; "
        "exec: a new interpreter for each, running the script as `python script.py` would "
        "(seconds of imports each)",
    )
    add(
        "--output-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each process's output to its own file here",
    )
    add_metrics_port(parser)
    add(
        "--final-state",
        type=Path,
        default=None,
        metavar="DIR",
        help="each rank's session.finish() writes the digest of its final parameters to "
        "DIR/rank<r>.json (for a bitwise comparison of runs: `flashrecovery chaos`)",
    )
    torchrun.add_arguments(add)
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "-m",
        "--module",
        dest="run_as",
        action="store_const",
        const=RunAs.MODULE,
        default=RunAs.SCRIPT,
        help="torchrun's: the script is a module, run as `python -m MODULE`",
    )
    runs.add_argument(
        "--no-python",
        "--no_python",
        dest="run_as",
        action="store_const",
        const=RunAs.PROGRAM,
        help="torchrun's: the script is a program of its own, run without python (needs "
        "--start-method exec)",
    )
    parser.add_argument("script", type=Path, help="the training script (or module, or program)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def default_node_rank(endpoint: Endpoint | None, control_plane: bool) -> int | None:
    """No ``--node-rank``: the agent that can host the store on the endpoint is node 0, every
    other one takes the lowest free rank, as torchrun's c10d rendezvous decides its host. A
    control plane hosts the store itself, so there node 0 must be named (the default 0)."""
    if endpoint is None or control_plane:
        return 0
    return 0 if endpoint.free_here() else None


def _node_rank(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a node rank or 'auto'")
    return int(text)


def _endpoint(text: str) -> Endpoint:
    try:
        return Endpoint.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fault_plan() -> probe.FaultPlan:
    """Test-only faults, from the agent's own environment (trainer_hooks/probe.py)."""
    try:
        return probe.FaultPlan.from_environ(os.environ)
    except ValueError as exc:
        raise ConfigError(f"{probe.ENV}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from flashrecovery.agent.job import Agent  # imports torch: only once the arguments are read

    try:
        step = slurm.from_environ(os.environ)
        if step is not None:
            slurm.apply(args, step, node_rank_omitted=NODE_RANK_OMITTED)
        for note in torchrun.resolve(args):
            print(f"flashrecovery run: {note}", file=sys.stderr)
        agent = Agent(
            AgentConfig(
                script=args.script,
                script_args=args.script_args,
                run_as=args.run_as,
                nproc=args.nproc_per_node,
                spares=args.spares,
                log_url=args.log,
                job_id=args.job_id,
                heartbeat_interval_s=args.heartbeat_interval,
                stall_floor_s=args.stall_timeout,
                straggler_policy=StragglerPolicy(args.straggler_policy),
                straggler_ratio=args.straggler_ratio,
                straggler_steps=args.straggler_steps,
                nonfinite_policy=NonFinitePolicy(args.nonfinite_policy),
                verify_every=args.verify_every,
                external_engine=args.external_engine,
                fault_plan=_fault_plan(),
                final_state_dir=args.final_state,
                output_dir=args.output_dir,
                max_replacements=args.max_replacements,
                max_incidents=args.max_incidents,
                shards=args.shards,
                checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every,
                group_rebuild=args.group_rebuild,
                spare_refill=args.spare_refill,
                start_method=args.start_method,
                metrics_port=args.metrics_port,
                nnodes=args.nnodes,
                node_rank=(
                    default_node_rank(args.rdzv_endpoint, args.control_plane)
                    if args.node_rank == NODE_RANK_OMITTED
                    else args.node_rank
                ),
                rdzv_endpoint=args.rdzv_endpoint,
                spare_nodes=args.spare_nodes,
                node_wait_s=args.node_wait,
                control_plane=args.control_plane,
                store_secret=os.environ.get("FLASHRECOVERY_STORE_PREFIX"),
            )
        )
    except ConfigError as exc:
        print(f"flashrecovery run: error: {exc}", file=sys.stderr)
        return 2
    if agent.config.starts_job:
        print(f"flashrecovery: job {agent.job_id}, log {agent.log_url}", file=sys.stderr)
    else:
        where = agent.config.rdzv_endpoint
        print(f"flashrecovery: joining the job at {where}, log {agent.log_url}", file=sys.stderr)
    sys.stderr.flush()
    return agent.run()
