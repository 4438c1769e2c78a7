"""One rank of the overhead bench: the same training step with and without the hook.

Under ``flashrecovery run`` (the hook's sides) it is a script:

    flashrecovery run --nproc-per-node 2 bench/overhead/rank.py --model mlp --parallel ddp ...

and the bench (sides.py) calls ``plain_rank`` in processes of its own for the baselines (plain torch
DDP or HSDP over gloo, no hook). Both run ``train``: zero the gradients, forward, backward, then
(hook) ``session.commit()``, then the optimizer step; each step is timed from the end of the one
before, in three parts (forward and backward, the commit, the optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from bench.overhead.turns import Gate, Gates
from flashrecovery.demo.data import BATCH_SIZE, BLOCK_SIZE, batch_for, vocabulary
from flashrecovery.demo.job import replica_mesh
from flashrecovery.demo.model import (
    GPTConfig,
    TinyGPT,
    data_coordinate,
    lm_loss,
    pipeline_stages,
    tensor_parallel,
)
from flashrecovery.demo.pipeline import MICROBATCHES, Pipeline
from flashrecovery.trainer_hooks import Session, ddp, init, stable_group
from flashrecovery.trainer_hooks.final_state import parameters_sha256

MODELS = ("gpt", "mlp")
# Who reduces the gradients: the hook, torch DDP, FSDP2 (HSDP), FSDP2 beside tensor parallel,
# torch DDP over the replicas of each of two pipeline stages.
PARALLEL = ("hook", "ddp", "hsdp", "tp-hsdp", "pp")
SHARDED = ("hsdp", "tp-hsdp", "pp")  # on a mesh of the demo's layouts (flashrecovery/demo/job.py)
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 4, 32  # 4.2 M parameters
LEARNING_RATE = 1e-3
STORE_TIMEOUT = timedelta(seconds=60)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepTimes:
    """One rank's committed steps, in seconds: each step's wall time and its parts."""

    rank: int
    params_sha256: str = ""
    step: list[int] = field(default_factory=list)  # each committed step's number
    total: list[float] = field(default_factory=list)  # end of the previous step to end of this
    compute: list[float] = field(default_factory=list)  # zero_grad, batch, forward, backward
    commit: list[float] = field(default_factory=list)  # session.commit() (0 without the hook)
    optimizer: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the process's CPU time (all its threads)
    ended: list[float] = field(default_factory=list)  # unix time at its end (the agent's share)

    def write(self, out: Path) -> None:
        """Read only once every rank has exited, so no reader sees half a file."""
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.rank}.json").write_text(json.dumps(asdict(self)))


def read_times(out: Path, world: int) -> list[StepTimes]:
    return [StepTimes(**json.loads((out / f"rank{r}.json").read_text())) for r in range(world)]


def model_and_data(name: str) -> tuple[torch.nn.Module, Callable[[int, int, int], Batch]]:
    """The model (seeded: every rank builds the same) and its batch of (step, rank, world)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "gpt":
        return TinyGPT(GPTConfig(vocab_size=len(vocabulary()), block_size=BLOCK_SIZE)), batch_for
    layers: list[torch.nn.Module] = []
    for _ in range(MLP_LAYERS):
        layers += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), _mlp_batch


def _mlp_batch(step: int, rank: int, world: int) -> Batch:
    generator = torch.Generator().manual_seed((world * 100_000 + step) * 100 + rank)
    x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=generator)
    return x, torch.randn(MLP_BATCH, MLP_WIDTH, generator=generator)


def loss_of(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output, target) if name == "gpt" else F.mse_loss(output, target)


@dataclass
class Wrapped:
    """A model as a side trains it: what its step runs (a pipeline's schedule, or ``forward``)
    and whose batches this rank reads (its data-parallel coordinate, and their number)."""

    forward: torch.nn.Module
    data_rank: int
    data_world: int
    pipe: Pipeline | None = None


def wrap(
    name: str,
    model: torch.nn.Module,
    parallel: str,
    mesh: DeviceMesh | None,
    rank: int,
    world: int,
) -> Wrapped:
    """DDP, or FSDP2 on the mesh (each block, then the whole; tp-hsdp: the feed-forward layers
    split over "tp" first), or two pipeline stages in DDP over their replicas (pp), or the
    model as it is."""
    if parallel == "ddp":
        return Wrapped(DistributedDataParallel(model), rank, world)
    if parallel == "pp":
        assert mesh is not None
        pipe = Pipeline(*_stages(name, model), lambda y, t: loss_of(name, y, t), mesh)
        return Wrapped(pipe.module, pipe.replica, mesh.size(0), pipe)
    if parallel in SHARDED:
        assert mesh is not None
        if parallel == "tp-hsdp":
            mesh = (
                tensor_parallel(model, mesh) if isinstance(model, TinyGPT) else _mlp_tp(model, mesh)
            )
            rank, world = data_coordinate(mesh)
        blocks = model.blocks if isinstance(model, TinyGPT) else model.children()
        for block in blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return Wrapped(model, rank, world)


def _stages(name: str, model: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.Tensor]:
    """The model in two pipeline stages, and a microbatch of the first one's input."""
    if isinstance(model, TinyGPT):
        rows = BATCH_SIZE // MICROBATCHES
        return list(pipeline_stages(model)), torch.zeros(rows, BLOCK_SIZE, dtype=torch.long)
    layers = list(model.children())
    half = len(layers) // 2
    stages: list[torch.nn.Module] = [
        torch.nn.Sequential(*layers[:half]),
        torch.nn.Sequential(*layers[half:]),
    ]
    return stages, torch.zeros(MLP_BATCH // MICROBATCHES, MLP_WIDTH)


def _mlp_tp(model: torch.nn.Module, mesh: DeviceMesh) -> DeviceMesh:
    """The MLP's linear layers in pairs over "tp": the first by columns, the second by rows."""
    linears = [n for n, layer in model.named_children() if isinstance(layer, torch.nn.Linear)]
    plan: dict[str, ParallelStyle] = {}
    for first, second in zip(linears[::2], linears[1::2], strict=True):
        plan |= {first: ColwiseParallel(), second: RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    return mesh["dp_replicate", "dp_shard"]


def train(
    name: str,
    parallel: str,
    steps: int,
    rank: int,
    world: int,
    mesh: DeviceMesh | None,
    session: Session | None,
    stable: bool = False,
    gate: Gate | None = None,
) -> StepTimes:
    """Build, wrap and train; with a session every step commits through it (the hook's own
    reduce when ``parallel`` is "hook"), and the caller's optimizer steps when it commits.
    ``stable``: DDP on the hook's stable group without a session, its buckets settled as
    ``register()`` settles them. ``gate``: the rank waits for its job's turn at the gate steps
    (turns.py), the wait counted in no step."""
    model, batch = model_and_data(name)
    wrapped = wrap(name, model, parallel, mesh, rank, world)
    forward, pipe = wrapped.forward, wrapped.pipe
    optimizer = torch.optim.AdamW(forward.parameters(), lr=LEARNING_RATE)
    times = StepTimes(rank)
    step_range: Iterable[int] = range(steps)
    if session is not None:
        session.register(forward, optimizer, schedule=None if pipe is None else pipe.schedule)
        step_range = session.steps(steps)
    elif stable:
        ddp.settle_buckets(forward)
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in step_range:
        if gate is not None and gate.passes(step):
            last, last_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, wrapped.data_rank, wrapped.data_world)
        if pipe is None:
            loss = loss_of(name, forward(x), y)
            loss.backward()
            value = loss.item()
        else:
            value = pipe.step(x, y)
        computed = time.perf_counter()
        committed = session is None or session.commit(loss=value)
        voted = time.perf_counter()
        if committed and parallel != "hook":
            optimizer.step()
        now, cpu = time.perf_counter(), time.process_time()
        if committed:
            times.step.append(step)
            times.total.append(now - last)
            times.compute.append(computed - last)
            times.commit.append(voted - computed)
            times.optimizer.append(now - voted)
            times.cpu.append(cpu - last_cpu)
            times.ended.append(time.time())
        last, last_cpu = now, cpu
    # Sharded: gathered, a collective; pipelined: every stage's.
    times.params_sha256 = parameters_sha256(model) if pipe is None else pipe.digest()
    return times


def plain_rank(
    rank: int,
    world: int,
    port: int,
    name: str,
    parallel: str,
    steps: int,
    out: str,
    stable: bool,
    gates: Gates | None = None,
) -> None:
    """One rank of a baseline: plain torch on gloo, its own store (spawned: module level);
    ``stable``: over the hook's stable group instead (generation 0 for the whole run).

    In a session of its own, as the agent starts a hook's rank: with the kernel's autogroup
    scheduling each session gets its fair share of a busy machine, so ranks sharing the bench's
    session would get less CPU than the hook's and look slower than they are."""
    os.setsid()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    if stable:
        groups = stable_group.StableGroups("cpu")
        groups.attach(store, 0)
        stable_group.init_process_group(groups, store, rank, world)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = None
    if parallel in SHARDED:
        shape, names = replica_mesh(parallel, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    gate = None if gates is None else gates.open(rank)
    train(name, parallel, steps, rank, world, mesh, None, stable, gate).write(Path(out))
    dist.barrier()  # no rank leaves while another is still in a collective
    # Skip torch's teardown, as the hook's ranks do: it aborted a gpt baseline ("terminate
    # called without an active exception") after its times were written.
    os._exit(0)


def main(argv: list[str]) -> int:
    """A rank under the hook (started by ``flashrecovery run``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--parallel", choices=PARALLEL, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--gates",
        nargs=3,
        metavar=("DIR", "FIRST", "EVERY"),
        help="take turns with another job (turns.py): gates at FIRST, then every EVERY",
    )
    args = parser.parse_args(argv)
    gates = None
    if args.gates is not None:
        gates = Gates(args.gates[0], int(args.gates[1]), int(args.gates[2]))
    session = init()
    mesh = None
    if args.parallel in SHARDED:
        mesh = session.device_mesh(*replica_mesh(args.parallel, session.world_size))
    elif args.parallel == "ddp":
        session.process_group()
    with session:
        rank, world = session.rank, session.world_size
        gate = None if gates is None else gates.open(rank)
        times = train(
            args.model, args.parallel, args.steps, rank, world, mesh, session, False, gate
        )
    times.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
