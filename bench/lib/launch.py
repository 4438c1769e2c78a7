"""Launching the jobs the benches measure: the demo's training job on a throw-away log."""

from __future__ import annotations

from pathlib import Path

from flashrecovery.demo.job import JobSpec


def job_spec(name: str, tmp: Path, nproc: int, spares: int, steps: int) -> JobSpec:
    """The demo's training job on its own embedded log under ``tmp``."""
    return JobSpec(
        job_id=name,
        log_url=f"sqlite://{tmp / name / 'log.db'}",
        run_dir=tmp / name,
        nproc=nproc,
        spares=spares,
        steps=steps,
    )
