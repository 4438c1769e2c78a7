"""A pipeline schedule's one-time setup at registration (trainer_hooks/pipeline.py), as a
replacement makes it: its group still local, so the setup's collectives (the shape vote, the
neighbours' first message) return at once and its first step starts none. In a process of its
own: torch keeps one default group per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashrecovery.errors import ScriptError
from flashrecovery.trainer_hooks import pipeline

AS_A_REPLACEMENT = """
import torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from flashrecovery.errors import ScriptError
from flashrecovery.trainer_hooks import pipeline, stable_group

stable = stable_group.StableGroups("cpu")
stable_group.init_process_group(stable, dist.HashStore(), rank=1, world_size=2)
part = torch.nn.Linear(4, 1)
example = torch.zeros(2, 4, requires_grad=True)
mse = torch.nn.functional.mse_loss
try:
    pipeline.settle_schedule(ScheduleGPipe(PipelineStage(part, 1, 2, "cpu"), 2, loss_fn=mse))
except ScriptError as exc:
    print("refused:", exc)
for kind in (ScheduleGPipe, Schedule1F1B):
    stage = PipelineStage(part, 1, 2, "cpu", input_args=example, output_args=part(example))
    schedule = kind(stage, 2, loss_fn=mse)
    pipeline.settle_schedule(schedule)
    done = schedule._p2p_initialized, schedule._stage_forward_initialized
    print(kind.__name__, "set up" if all(done) else "not set up")
"""


def test_a_schedule_is_set_up_at_registration_and_one_that_infers_its_shapes_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-c", AS_A_REPLACEMENT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    refused, gpipe, one_f_one_b = done.stdout.strip().splitlines()
    assert refused.startswith("refused: pipeline stage(s) [1] infer their shapes")
    assert "input_args and output_args" in refused
    assert (gpipe, one_f_one_b) == ("ScheduleGPipe set up", "Schedule1F1B set up")


def test_what_is_no_pipeline_schedule_is_refused() -> None:
    with pytest.raises(ScriptError, match=r"a torch\.distributed\.pipelining schedule"):
        pipeline.settle_schedule(object())  # type: ignore[arg-type]
