"""torchrun's other forms of the script argument, under `flashrecovery run`: ``-m MODULE``
(forked from the fork server as `python -m` would run it) and ``--no-python PROGRAM`` (an
executable of its own, started by exec). A rank SIGKILLed in each is replaced by a spare that
runs the same form, and the job ends bitwise equal to the fault-free run of the script."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from livejob import SCRIPT, run_job

from flashrecovery.agent.config import RunAs

pytestmark = pytest.mark.timeout(240)


def assert_recovered_bitwise(job_dir: Path, reference: torch.Tensor, **kwargs: Any) -> None:
    job = run_job(job_dir, spares=1, kill_at={1: 8}, **kwargs)
    assert job.exit_code == 0, job.records(type="job_finished")
    assert [r.rank for r in job.records(type="spare_activated")] == [1]
    for rank in range(3):
        assert torch.equal(job.final(rank)["params"], reference), f"rank {rank} diverged"


def test_a_module_runs_as_python_m_runs_it(tmp_path: Path, reference: torch.Tensor) -> None:
    # The tests' script as a module of the repository (the working directory, as `python -m`).
    assert_recovered_bitwise(
        tmp_path, reference, script=Path("tests.scripts.train_mlp"), run_as=RunAs.MODULE
    )


def test_a_program_of_its_own_runs_without_python(tmp_path: Path, reference: torch.Tensor) -> None:
    program = tmp_path / "train.sh"
    program.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SCRIPT}" "$@"\n')
    program.chmod(0o755)
    assert_recovered_bitwise(
        tmp_path, reference, script=program, run_as=RunAs.PROGRAM, start_method="exec"
    )
