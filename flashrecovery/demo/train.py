"""The demo's training script, run by `flashrecovery run` in every rank and hot spare.

A plain loop over the trainer hook: build the model, register it, train over the steps the
session yields (after a recovery it resumes after the committed step), and leave the final
parameters' digest, the losses and the step times in ``<run-dir>/rank<k>.json``. With
``--parallel ddp`` the model is wrapped in torch DDP over the session's stable process group
(``hsdp``: sharded with FSDP2 over a replicas x shards mesh; ``fsdp``: over all ranks, no
replica, checkpoints on; ``tp-hsdp`` and ``3d``: each block's feed-forward layers split over the
mesh's "tp" dimension, FSDP2 over the others; ``tp``: split over all ranks, no replica,
checkpoints on; ``pp``: two pipeline stages, each in DDP over its replicas), which reduces the
gradients, and the script steps its optimizer on a committed step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from flashrecovery.demo.data import BATCH_SIZE, BLOCK_SIZE, batch_for, vocabulary
from flashrecovery.demo.job import PARALLEL, REPLICA_MESH, replica_mesh
from flashrecovery.demo.model import (
    GPTConfig,
    TinyGPT,
    data_coordinate,
    lm_loss,
    pipeline_stages,
    tensor_parallel,
)
from flashrecovery.demo.pipeline import MICROBATCHES, Pipeline
from flashrecovery.demo.results import RankResult
from flashrecovery.trainer_hooks import init
from flashrecovery.trainer_hooks.final_state import parameters_sha256

LEARNING_RATE = 1e-3
WARMUP_STEPS = 10  # linear learning-rate warm-up


def _warmup_factor(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP_STEPS)


def build(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer, LambdaLR]:
    """The same model, optimizer and schedule in every process of every run with this seed.

    The schedule is state outside model and optimizer: registered as an extra, it shows that a
    replacement receives user state too (a wrong learning rate would break bitwise equality)."""
    torch.set_num_threads(1)  # one thread: CPU kernels reduce in a fixed order, bitwise repeatable
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab_size=len(vocabulary()), block_size=BLOCK_SIZE))
    return model, *optimizer_for(model)


def optimizer_for(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW and its warm-up schedule over the model's parameters (FSDP2's, once sharded)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    return optimizer, LambdaLR(optimizer, _warmup_factor)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pad each step to this wall time (before the commit) so a human can watch",
    )
    parser.add_argument("--parallel", choices=PARALLEL, default="hook")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    session = init()
    ours = args.parallel != "hook"  # torch's DDP / FSDP reduce the gradients
    mesh = None
    if args.parallel in REPLICA_MESH:  # a hot spare waits in here until it has a rank
        mesh = session.device_mesh(*replica_mesh(args.parallel, session.world_size))
    elif args.parallel == "fsdp":
        mesh = session.device_mesh((session.world_size,), ("shard",))
    elif args.parallel == "tp":
        mesh = session.device_mesh((1, 1, session.world_size), ("dp_replicate", "dp_shard", "tp"))
    elif ours:
        session.process_group()
    model, optimizer, schedule = build(args.seed)
    forward: torch.nn.Module = model
    # Whose batches this rank reads, where its tp or pp peers read the same (else its rank's:
    # read in the loop, as a hot spare in the hook's own loop has no rank before it).
    data: tuple[int, int] | None = None
    pipe = None
    if mesh is not None and "pp" in (mesh.mesh_dim_names or ()):
        example = torch.zeros(BATCH_SIZE // MICROBATCHES, BLOCK_SIZE, dtype=torch.long)
        pipe = Pipeline(pipeline_stages(model), example, lm_loss, mesh)
        forward, data = pipe.module, (pipe.replica, mesh.size(0))
        optimizer, schedule = optimizer_for(forward)
    elif mesh is not None:
        # Here, not at the top: FSDP2's import costs a rank half a second of CPU at start,
        # which a replacement spawned fresh for the other modes would pay for nothing.
        from torch.distributed.fsdp import fully_shard

        data_mesh = mesh
        if "tp" in (mesh.mesh_dim_names or ()):
            data_mesh = tensor_parallel(model, mesh)
            data = data_coordinate(data_mesh)
        if data_mesh.size() > 1:  # tensor parallel alone: nothing to shard over
            for block in model.blocks:
                fully_shard(block, mesh=data_mesh)
            fully_shard(model, mesh=data_mesh)
        optimizer, schedule = optimizer_for(model)
    elif ours:
        forward = DistributedDataParallel(model)

    def warmup() -> None:  # a spare's first forward/backward, paid before it is needed
        x, y = batch_for(0, 0, session.world_size)
        model.loss(x, y).backward()  # every step starts by clearing the gradients

    session.register(
        forward,
        optimizer,
        extras={"lr_schedule": schedule},
        warmup=warmup,
        schedule=None if pipe is None else pipe.schedule,
    )
    losses: dict[int, float] = {}
    step_times: list[float] = []  # commit to commit: the hook's own work between steps counts
    last = time.perf_counter()
    with session:  # an exception is reported at once; a spare never assigned stays inside
        for step in session.steps(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            x, y = batch_for(step, *(data or (session.rank, session.world_size)))
            if pipe is None:
                loss = lm_loss(forward(x), y)
                loss.backward()
                value = loss.item()
            else:
                value = pipe.step(x, y)
            time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - started)))
            committed = session.commit(loss=value)
            now = time.perf_counter()
            if committed:
                if ours:
                    optimizer.step()
                schedule.step()
                losses[step] = value
                step_times.append(now - last)
            last = now
        # Sharded: gathered over the groups, still up; pipelined: every stage's, in order.
        digest = parameters_sha256(model) if pipe is None else pipe.digest()
    RankResult(
        rank=session.rank,
        pid=os.getpid(),
        generation=session.generation,
        steps=args.steps,
        params_sha256=digest,
        losses=losses,
        step_times_s=step_times,
    ).write(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
