"""A pipeline schedule's one-time setup, done when the model is registered.

At its first step a ``torch.distributed.pipelining`` schedule sets itself up with collectives
over its stages' group: a vote on how the stages learn their shapes (an all-reduce), then one
message between each pair of neighbouring stages to connect them. A replacement would do that
at its first step, long after the survivors did: collectives nobody else joins. So every
process sets its schedule up at registration (the members of generation 0 together over the
stable groups, a replacement alone while its group is still local), as DDP's buckets are
settled (ddp.py).

That needs each stage's shapes given (``PipelineStage``'s ``input_args`` and ``output_args``):
a stage that infers them exchanges them with its neighbours at the first step, which a
replacement would also do alone.

A schedule that batches a send with a receive (1F1B and the ones after it) needs NCCL to
coalesce the batch, or two neighbours that both send first wait for each other; the stable
groups send a batch's messages one by one (gloo queues them without waiting), so on GPUs only
GPipe, whose batches only send or only receive, is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashrecovery.errors import ScriptError

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


def settle_schedule(schedule: _PipelineSchedule) -> None:
    # Imported only by a pipelined job: the module costs a rank process time at start.
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        ScheduleGPipe,
    )
    from torch.distributed.pipelining.stage import PipelineStage

    if isinstance(schedule, PipelineScheduleSingle):
        stages = [schedule._stage]
    elif isinstance(schedule, PipelineScheduleMulti):
        stages = schedule._stages
    else:
        raise ScriptError(f"schedule=: a torch.distributed.pipelining schedule, not {schedule!r}")
    inferred = [
        stage.stage_index
        for stage in stages
        if not isinstance(stage, PipelineStage)
        or InferenceMode.needs_dynamic(stage._user_meta, schedule._has_backward)
    ]
    if inferred:
        raise ScriptError(
            f"pipeline stage(s) {inferred} infer their shapes at the first step, a message "
            "exchange a replacement would start alone: give each PipelineStage its "
            "input_args and output_args (made with gradients on); docs/hook.md, "
            '"Pipeline parallel"'
        )
    on_gpu = any(torch.device(stage.device).type == "cuda" for stage in stages)
    if on_gpu and not isinstance(schedule, ScheduleGPipe):
        raise ScriptError(
            f"{type(schedule).__name__} on GPUs batches sends with receives, which NCCL must "
            "coalesce and flashrecovery's process groups do not yet: use ScheduleGPipe "
            '(docs/hook.md, "Pipeline parallel")'
        )
    # The shapes are given, so nothing of the batch is read: no microbatch is needed.
    if isinstance(schedule, PipelineScheduleSingle):
        schedule._initialize_stage(None, None)
    else:
        schedule._initialize_stages((), None)
