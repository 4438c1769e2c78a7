"""A model's stages as a pipeline with replicas of each stage: ``torch.distributed.pipelining``
(a ``PipelineStage`` per rank, GPipe over 2 microbatches) on a ("dp_replicate", "pp") mesh, rank
r running stage r % stages in torch DDP over the replicas of its stage. Each stage's shapes are
given, and the schedule is handed to ``register`` (docs/hook.md, "Pipeline parallel"). The
demo's script and bench/overhead train through it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from flashrecovery.trainer_hooks.final_state import parameters_sha256

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MICROBATCHES = 2


class Pipeline:
    def __init__(
        self,
        stages: Sequence[torch.nn.Module],
        example: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        mesh: DeviceMesh,
    ) -> None:
        """``example``: a microbatch of the first stage's input (its shape and dtype)."""
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.group, self.index = mesh.get_group("pp"), mesh.get_local_rank("pp")
        self.replica = mesh.get_local_rank("dp_replicate")
        part = stages[self.index]
        for before in stages[: self.index]:
            example = before(example)  # with gradients on: the stage learns one flows back
        self.module = DistributedDataParallel(part, process_group=mesh.get_group("dp_replicate"))
        stage = PipelineStage(
            self.module,
            self.index,
            len(stages),
            torch.device("cpu"),
            input_args=example,
            output_args=part(example),
            group=self.group,
        )
        self.last_index = len(stages) - 1
        self.last = self.index == self.last_index
        self.schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step's forward and backward over every stage; the loss (the last stage's, sent
        to the others)."""
        losses: list[torch.Tensor] = []
        if self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step(x)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, group=self.group, group_src=self.last_index)
        return loss.item()

    def digest(self) -> str:
        """The whole model's digest: every stage's, in stage order (a collective)."""
        stages: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(stages, parameters_sha256(self.module.module), group=self.group)
        return hashlib.sha256("".join(str(s) for s in stages).encode()).hexdigest()
