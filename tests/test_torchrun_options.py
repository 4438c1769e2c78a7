"""`flashrecovery run` reads a torchrun command line as torchrun would (agent/torchrun_options.py):
the spellings, torchrun's names for flashrecovery's options, and what it cannot honour said."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from flashrecovery.agent import torchrun_options as torchrun
from flashrecovery.agent.config import AgentConfig, RunAs
from flashrecovery.cli import build_parser
from flashrecovery.errors import ConfigError

SCRIPT = str(Path(__file__))


def parsed(*argv: str) -> tuple[argparse.Namespace, list[str]]:
    full = ["run", *argv, SCRIPT, "--lr", "0.1"]
    args = build_parser(full).parse_args(full)
    return args, torchrun.resolve(args)


def test_a_torchrun_command_line_means_what_it_means_to_torchrun() -> None:
    args, notes = parsed(
        "--nproc_per_node", "2", "--nnodes", "2:3", "--node_rank", "0", "--max_restarts", "5",
        "--rdzv_id", "run-7", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29400",
        "--rdzv_conf", "join_timeout=600", "--run_path",
    )  # fmt: skip
    assert (args.nproc_per_node, args.nnodes, args.spare_nodes) == (2, 2, 1)
    assert (args.node_rank, args.max_replacements, args.job_id) == (0, 5, "run-7")
    assert str(args.rdzv_endpoint) == "127.0.0.1:29400"
    assert args.script_args == ["--lr", "0.1"]
    assert notes == [
        "--rdzv-conf join_timeout=600 is not used: the agents' rendezvous has bounds of its "
        "own (--node-wait)"
    ]


def test_master_addr_and_port_are_the_endpoint_of_several_nodes_and_unused_on_one() -> None:
    args, notes = parsed("--nproc-per-node", "1", "--nnodes", "2", "--master_addr", "10.1.2.3",
                         "--master_port", "29555")  # fmt: skip
    assert str(args.rdzv_endpoint) == "10.1.2.3:29555" and notes == []
    args, notes = parsed("--standalone", "--nproc-per-node", "auto", "--master-port", "29555")
    assert args.rdzv_endpoint is None and args.nproc_per_node == (os.cpu_count() or 1)
    assert len(notes) == 1 and "not used on one node" in notes[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: the agents meet on node 0's own store"),
        (["--standalone", "--nnodes", "2"], "--standalone is one node"),
        (["--nnodes", "1:3", "--spare-nodes", "1"], "keeps 2 spare node(s), --spare-nodes says 1"),
        (
            ["--master-port", "1", "--nnodes", "2", "--rdzv-endpoint", "h:2"],
            "name one thing",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parsed("--nproc-per-node", "1", *argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "3:2"], "MAX is less than MIN"),
        (["--nnodes", "0"], "expected N or MIN:MAX"),
        (["--nproc-per-node", "many"], "expected a number of ranks, auto, cpu or gpu"),
        pytest.param(
            ["--nproc-per-node", "gpu"],
            "this host has no GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU"),
        ),
    ],
)
def test_bad_counts_are_refused_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    full = ["run", *(["--nproc-per-node", "1"] if argv[0] != "--nproc-per-node" else []), *argv]
    with pytest.raises(SystemExit):
        build_parser([*full, SCRIPT]).parse_args([*full, SCRIPT])
    assert message in capsys.readouterr().err


def test_a_module_or_a_program_instead_of_a_script(tmp_path: Path) -> None:
    args, _ = parsed("--nproc-per-node", "1", "-m")  # parsed() puts the script after the flags
    assert args.run_as is RunAs.MODULE
    args, _ = parsed("--nproc-per-node", "1", "--no_python")
    assert args.run_as is RunAs.PROGRAM
    module = AgentConfig(script=Path("flashrecovery.demo.train"), run_as=RunAs.MODULE, job_id="j",
                         log_url=f"sqlite:///{tmp_path / 'log.db'}")  # fmt: skip
    assert module.resolved().command[1:3] == ["-m", "flashrecovery.demo.train"]
    with pytest.raises(ConfigError, match="no module 'nosuchpackage'"):
        AgentConfig(script=Path("nosuchpackage.train"), run_as=RunAs.MODULE).resolved()


def test_a_program_must_be_executable_and_started_by_exec(tmp_path: Path) -> None:
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError, match="not executable"):
        AgentConfig(script=program, run_as=RunAs.PROGRAM, start_method="exec").resolved()
    program.chmod(0o755)
    with pytest.raises(ConfigError, match="add --start-method exec"):
        AgentConfig(script=program, run_as=RunAs.PROGRAM).resolved()
    config = AgentConfig(script=program, run_as=RunAs.PROGRAM, start_method="exec", job_id="j",
                         log_url=f"sqlite:///{tmp_path / 'log.db'}")  # fmt: skip
    assert config.resolved().command == [str(program)]
