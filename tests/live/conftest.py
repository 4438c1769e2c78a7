"""Fixtures of the live tests (the job runner is in livejob.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from livejob import OPENED, run_job


@pytest.fixture(autouse=True)
def close_opened_logs() -> Iterator[None]:
    """Close what run_job opened once each test is over (a session fixture's stays open: its
    log is read no more, and sqlite's holds no socket)."""
    before = len(OPENED)
    yield
    while len(OPENED) > before:
        OPENED.pop().close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """Final parameters of a fault-free run with the same seed (run_job's defaults), once for
    every module that compares with it."""
    job = run_job(tmp_path_factory.mktemp("reference"))
    assert job.exit_code == 0
    params: torch.Tensor = job.final(0)["params"]
    return params
