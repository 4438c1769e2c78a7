"""bench/rto.py --state-mb's pure parts: the MLP's width for a state size, and the steady step
read from a job's step records."""

from __future__ import annotations

import pytest

from bench.compare_workers.workload import MLP_LAYERS, build, mlp_width
from bench.rto import WARMUP_STEPS, steady_step_s
from flashrecovery.connectors import open_log
from flashrecovery.records import StepCompleted, Stream

JOB = "rto-state"


@pytest.mark.parametrize("state_mb", [10, 100, 500, 1200])
def test_the_mlp_s_parameters_and_adamw_moments_come_within_a_percent_of_the_size(
    state_mb: float,
) -> None:
    width = mlp_width(state_mb)
    floats = MLP_LAYERS * (width * width + width)
    assert abs(3 * 4 * floats / 1e6 - state_mb) / state_mb < 0.01


def test_the_widened_mlp_trains_on_inputs_of_its_width() -> None:
    work = build("mlp", width=mlp_width(1))
    work.loss(work.model, 0, 0, 2).backward()
    (first, *_) = work.model.parameters()
    assert first.shape == (mlp_width(1), mlp_width(1)) and first.grad is not None


def _step(rank: int, step: int, ts: float) -> StepCompleted:
    return StepCompleted(
        job_id=JOB, generation=0, source=f"rank:{rank}", rank=rank, step=step, duration_s=0.1, ts=ts
    )


def test_the_steady_step_leaves_out_the_first_steps_and_all_after_the_first_kill() -> None:
    with open_log("memory://") as log:
        for rank in (0, 1):
            # two slow first steps, then one a second; the kill at t=20, slower steps after it
            # (with the first steps counted the median would be 3 s, with the later ones 5 s)
            times = [0.0, 5.0, 10.0, 11.0, 12.0, 22.0, 27.0, 32.0]
            for step, ts in enumerate(times):
                log.append(Stream.EVENTS, _step(rank, step, ts + rank * 0.01))
        assert WARMUP_STEPS == 2
        assert steady_step_s(log, JOB, until=20.0) == pytest.approx(1.0)
        assert steady_step_s(log, JOB, until=4.0) is None  # nothing steady before the kill
