"""Fixtures of the live tests (the job runner is in livejob.py)."""

from __future__ import annotations

import pytest
import torch
from livejob import run_job


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """Final parameters of a fault-free run with the same seed (run_job's defaults), once for
    every module that compares with it."""
    job = run_job(tmp_path_factory.mktemp("reference"))
    assert job.exit_code == 0
    params: torch.Tensor = job.final(0)["params"]
    return params
