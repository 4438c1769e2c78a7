"""Pipeline parallel with data-parallel replicas of each stage: the model's layers split into
stages (``torch.distributed.pipelining``: a ``PipelineStage`` per rank, the GPipe or 1F1B
schedule over microbatches), each stage wrapped in torch DDP over the mesh's "dp" dimension, on
CPU ranks with gloo. An ordinary script plus the hook's lines (docs/hook.md, "Pipeline
parallel").

The mesh is ("dp", "pp"), row-major: rank r runs stage r % stages, and ``--shards`` is the
number of stages. A lost rank is restored from the same stage in another replica; the step's
vote covers every stage, so a step commits on every stage or on none. With no replica left of
a stage the job falls back to the latest complete checkpoint.

    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 examples/train_pp.py
    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 examples/train_pp.py --schedule 1f1b
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import flashrecovery

BATCH = 6
MICROBATCHES = 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def layers() -> list[torch.nn.Module]:
    """The whole model's layers, made alike on every rank (same seed); each keeps its stage's."""
    torch.manual_seed(0)
    return [
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 8),
        torch.nn.Linear(8, 1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="each rank's final parameters")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute, s")
    parser.add_argument("--replicas", type=int, default=2, help="dp")
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = flashrecovery.init_process_group()
    stages = session.world_size // args.replicas
    mesh = session.device_mesh((args.replicas, stages), ("dp", "pp"))
    index = mesh.get_local_rank("pp")
    every = layers()
    per_stage = len(every) // stages
    first, end = index * per_stage, (index + 1) * per_stage
    part = torch.nn.Sequential(*every[first:end])
    # The stage's shapes given, not inferred: inference is a message exchange at the first
    # step, which a replacement would start alone while its peers are past it. Made with
    # gradients on: an example that requires none tells the stage no gradient flows there.
    example = torch.nn.Sequential(*every[:first])(torch.zeros(BATCH // MICROBATCHES, 8))
    shapes = {"input_args": example, "output_args": part(example)}
    model = DistributedDataParallel(part, process_group=mesh.get_group("dp"))
    stage = PipelineStage(
        model, index, stages, torch.device("cpu"), group=mesh.get_group("pp"), **shapes
    )
    schedule = SCHEDULES[args.schedule](stage, MICROBATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Every stage of one replica reads the same batches: the first its inputs, the last its
    # targets.
    x = torch.randn(240, 8, generator=torch.Generator().manual_seed(1234))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(
        data, num_replicas=args.replicas, rank=mesh.get_local_rank("dp"), shuffle=True, seed=0
    )
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    session.register(model, optimizer, schedule=schedule)

    for epoch in session.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in session.batches(loader):
            optimizer.zero_grad()
            losses: list[torch.Tensor] = []
            if index == 0:
                schedule.step(inputs)
            elif index == stages - 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            time.sleep(args.step_time)
            loss = torch.stack(losses).mean().item() if losses else None
            if session.commit(loss=loss):
                optimizer.step()

    if args.out is not None:
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save({"params": params, "pid": os.getpid()}, args.out / f"rank{dist.get_rank()}.pt")
    session.finish()


if __name__ == "__main__":
    main()
