"""A Slurm job step, as `flashrecovery run` reads it: under `srun`, the agent's node rank, the
number of nodes, the head node and the job id come from ``SLURM_*``, so a batch script needs no
hand-written flags (docs/multinode.md, "Slurm").

One agent per Slurm task (``srun --ntasks-per-node=1``: task K is node K). The head node, where
node 0's agent hosts the job's store, is the first host of the step's node list (task 0 runs
there). Its port is derived from the job id as Lightning's Slurm environment derives it, so two
jobs sharing a head node do not meet on one port. What the user gives on the command line wins.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from flashrecovery.errors import ConfigError

Hostnames = Callable[[str], list[str]]  # a Slurm node list -> its host names, in order


@dataclass(frozen=True)
class SlurmStep:
    """The ``SLURM_*`` of one task of an srun step."""

    job_id: str
    step_id: str
    task: int  # SLURM_PROCID: this agent's node rank
    tasks: int  # SLURM_STEP_NUM_TASKS: the agents of the job, spare nodes included
    head: str  # the first host of the step's nodes

    @property
    def port(self) -> int:
        """15000 plus the job id's last four digits (Lightning's choice): 15000-24999."""
        return 15000 + int(self.job_id[-4:])

    @property
    def flashrecovery_job_id(self) -> str:
        return f"slurm-{self.job_id}.{self.step_id}"  # Slurm's own name of the step


def from_environ(
    environ: Mapping[str, str], hostnames: Hostnames | None = None
) -> SlurmStep | None:
    """The step this process is a task of, or None outside `srun` (a batch script's own shell
    is no task: it has no step)."""
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return None
    try:
        job_id, step_id = environ["SLURM_JOB_ID"], environ["SLURM_STEP_ID"]
        task, tasks = int(environ["SLURM_PROCID"]), int(environ["SLURM_STEP_NUM_TASKS"])
        nodes = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"an srun task with incomplete SLURM_* variables: {exc}") from None
    if not job_id.isdigit():
        raise ConfigError(f"SLURM_JOB_ID={job_id!r}: expected a number")
    head = (hostnames or scontrol_hostnames)(nodes)[0]
    return SlurmStep(job_id, step_id, task, tasks, head)


def scontrol_hostnames(nodes: str) -> list[str]:
    """Slurm's own expansion of a node list (``node[01-04,07]``); a plain list needs none."""
    if "[" not in nodes:
        return nodes.split(",")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodes],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(
            f"cannot expand the Slurm node list {nodes!r} with scontrol ({exc}); give "
            "--rdzv-endpoint HOST:PORT"
        ) from None
    return out.split()


def apply(args: argparse.Namespace, step: SlurmStep, *, node_rank_omitted: int) -> None:
    """Fill what the command line left out from the step (in place); ConfigError where the
    two disagree."""
    if args.job_id is None:
        args.job_id = step.flashrecovery_job_id
    if args.nnodes is None:
        if step.tasks <= args.spare_nodes:
            raise ConfigError(
                f"srun started {step.tasks} agent(s), and --spare-nodes {args.spare_nodes} "
                "leaves no training node"
            )
        args.nnodes = (step.tasks - args.spare_nodes,) * 2
    if args.node_rank == node_rank_omitted:
        args.node_rank = step.task
        low, high = args.nnodes
        if low + max(args.spare_nodes, high - low) != step.tasks:
            raise ConfigError(
                f"srun started {step.tasks} agent(s) (one per task), but --nnodes and "
                f"--spare-nodes ask for {low + max(args.spare_nodes, high - low)}"
            )
    several = step.tasks > 1
    if several and args.rdzv_endpoint is None:
        args.master_addr = args.master_addr or step.head
        args.master_port = args.master_port or step.port
