"""bench/compare.py's flashrecovery side: the workload under the trainer hook, run by
`flashrecovery run` in every rank and hot spare.

    flashrecovery run --nproc-per-node 2 --spares 1 bench/compare_workers/flash_worker.py \
        --model gpt --steps 1000 --out /abs/dir

With ``--parallel ddp`` (the default) the model is wrapped in torch DDP over the session's
stable process group, as the torchrun side wraps it; ``hook``: the commit averages the
gradients itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel
from workload import MLP_WIDTH, MODELS, Progress, build

from flashrecovery.trainer_hooks import init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parallel", choices=("ddp", "hook"), default="ddp")
    parser.add_argument("--width", type=int, default=MLP_WIDTH, help="the MLP's")
    args = parser.parse_args()
    session = init()
    work = build(args.model, width=args.width)  # a hot spare builds it before it has a rank
    ddp = args.parallel == "ddp"
    if ddp:
        session.process_group()  # a hot spare waits in here until it has a rank
    forward = DistributedDataParallel(work.model) if ddp else work.model

    def warmup() -> None:  # a spare's first forward/backward, paid before it is needed
        work.loss(work.model, 0, 0, session.world_size).backward()

    session.register(forward, work.optimizer, warmup=warmup)
    progress = Progress(args.out)
    with session:
        for step in session.steps(args.steps):
            work.optimizer.zero_grad(set_to_none=True)
            loss = work.loss(forward, step, session.rank, session.world_size)
            loss.backward()
            if session.commit(loss=loss.item()):
                if ddp:
                    work.optimizer.step()
                progress.committed(session.rank, step)


if __name__ == "__main__":
    main()
