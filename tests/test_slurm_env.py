"""Under `srun`, `flashrecovery run` reads its node rank, node count, head node and job id from
SLURM_* (agent/slurm.py); what the command line gives wins, and a disagreement is an error.
(tests/live/test_live_slurm.py runs the same under a real slurmctld and slurmd.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flashrecovery.agent import slurm
from flashrecovery.agent import torchrun_options as torchrun
from flashrecovery.agent.launcher import NODE_RANK_OMITTED
from flashrecovery.cli import build_parser
from flashrecovery.errors import ConfigError

SCRIPT = str(Path(__file__))
TASK = {  # what srun sets in task 1 of step 0 of job 4321, across 3 nodes
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
}


def expand(nodes: str) -> list[str]:
    assert nodes == "gpu[07-09]"
    return ["gpu07", "gpu08", "gpu09"]


def under_srun(*argv: str, environ: dict[str, str] = TASK) -> argparse.Namespace:
    full = ["run", "--nproc-per-node", "8", *argv, SCRIPT]
    args = build_parser(full).parse_args(full)
    step = slurm.from_environ(environ, expand)
    assert step is not None
    slurm.apply(args, step, node_rank_omitted=NODE_RANK_OMITTED)
    torchrun.resolve(args)
    return args


def test_the_documented_script_needs_no_flags_of_its_own() -> None:
    args = under_srun("--spare-nodes", "1")
    assert (args.node_rank, args.nnodes, args.spare_nodes) == (1, 2, 1)
    assert str(args.rdzv_endpoint) == "gpu07:19321"  # the first node; 15000 + 4321
    assert args.job_id == "slurm-4321.0"


def test_what_the_command_line_gives_wins() -> None:
    args = under_srun(
        "--nnodes", "2", "--spare-nodes", "1", "--node-rank", "auto",
        "--rdzv-endpoint", "head:29400", "--job-id", "mine",
    )  # fmt: skip
    assert (args.node_rank, args.nnodes, str(args.rdzv_endpoint), args.job_id) == (
        None, 2, "head:29400", "mine",
    )  # fmt: skip
    args = under_srun("--master-port", "29555")
    assert str(args.rdzv_endpoint) == "gpu07:29555" and args.nnodes == 3


def test_a_count_of_nodes_that_is_not_srun_s_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"srun started 3 agent.*ask for 5"):
        under_srun("--nnodes", "4", "--spare-nodes", "1")
    with pytest.raises(ConfigError, match="leaves no training node"):
        under_srun("--spare-nodes", "3")


def test_one_task_is_one_node_with_a_store_of_its_own() -> None:
    args = under_srun(environ={**TASK, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert (args.node_rank, args.nnodes, args.rdzv_endpoint) == (0, 1, None)


def test_outside_srun_nothing_is_read() -> None:
    batch_shell = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}
    assert slurm.from_environ(batch_shell, expand) is None
    assert slurm.from_environ({}, expand) is None


def test_incomplete_variables_say_which() -> None:
    broken = {k: v for k, v in TASK.items() if k != "SLURM_STEP_NUM_TASKS"}
    with pytest.raises(ConfigError, match="SLURM_STEP_NUM_TASKS"):
        slurm.from_environ(broken, expand)


def test_a_plain_node_list_needs_no_scontrol() -> None:
    assert slurm.scontrol_hostnames("a,b") == ["a", "b"]
