"""bench/compare.py's torchft side: one replica group (of one process) under torchft's
Manager. Survivors carry on without a lost replica; a respawned one asks the lighthouse into
the quorum and heals from a peer's state before it commits.

    python bench/compare_workers/torchft_worker.py --replica 0 --world 2 --model gpt \
        --steps 1000 --out /abs/dir --lighthouse http://127.0.0.1:PORT

Run by torchft_job.py, which starts the lighthouse and respawns replicas that die. The
gradients are averaged by the Manager's own allreduce, on one flat buffer: torchft 0.2.0's DDP
wrapper fails an assertion in its comm hook (torchft/ddp.py) when a peer dies, which takes
the survivors down with it.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo
from workload import MODELS, Progress, build


def average(manager: Manager, grads: list[torch.Tensor]) -> None:
    """Average the gradients over the quorum's replicas; after a peer's failure the Manager
    records the error and should_commit() says no."""
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(averaged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--world", type=int, required=True, help="replica groups in the job")
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="absolute")
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="torchft's default")
    args = parser.parse_args()
    timeout = timedelta(seconds=args.timeout_s)
    work = build(args.model)

    def state_dict() -> dict[str, Any]:
        return {"model": work.model.state_dict(), "optimizer": work.optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        work.model.load_state_dict(state["model"])
        work.optimizer.load_state_dict(state["optimizer"])

    # The replica group's own store: a group of one process hosts it itself.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"compare-{args.replica}",
    )
    params = list(work.model.parameters())
    progress = Progress(args.out)
    while manager.current_step() < args.steps:
        manager.start_quorum()
        work.optimizer.zero_grad(set_to_none=True)
        # The quorum runs beside the forward: a healing replica learns its step from it.
        work.loss(work.model, manager.current_step(), args.replica, args.world).backward()
        average(manager, [p.grad for p in params if p.grad is not None])
        if manager.should_commit():  # which counts the step
            work.optimizer.step()
            progress.committed(args.replica, manager.current_step() - 1)
    manager.shutdown()


if __name__ == "__main__":
    main()
