"""flashrecovery for torchtitan: its own Trainer under `flashrecovery run`, each step the
session's (docs/hook.md, "torchtitan"). Where torchtitan is launched with

    torchrun --nproc-per-node 4 -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --parallelism.data_parallel_replicate_degree 2 --parallelism.tensor_parallel_degree 2

a job under flashrecovery is

    flashrecovery run --nproc-per-node 4 --shards 2 --spares 1 \\
        -m flashrecovery.integrations.torchtitan --module llama3 --config llama3_debugmodel \\
        --parallelism.data_parallel_replicate_degree 2 --parallelism.tensor_parallel_degree 2

with the same configuration and overrides, not a line of them changed. What it does where
torchtitan's Trainer does its own (trainer.py):

- **Process group and meshes.** ``flashrecovery.init_process_group()`` instead of torch's; a
  hot spare waits in it until it is given a rank. torchtitan's ParallelDims builds its meshes
  over it as it would over torch's. A replica is dp_shard x cp x tp ranks in a row: the job's
  ``--shards``.
- **The step.** Forward, backward, clipping and the loss's reductions, then the session's vote:
  the optimizer and the LR schedulers step only once the step is committed on every rank; an
  aborted step is computed again with the same batch.
- **A replacement's state.** The model, optimizer and LR schedulers come from the rank at the
  same (dp_shard, cp, tp) coordinate in another replica; it reads its own data past the
  batches committed (torchtitan's dataset state holds the rank's own tokens).

On CPU ranks (gloo) torchtitan needs three things it does not have there (cpu.py): a device,
attention with a backward (FlexAttention has none on CPU), and FSDP2 reductions gloo has.

Not covered, refused at start with the reason: pipeline parallel, gradient accumulation,
torchtitan's own checkpoints (flashrecovery's --checkpoint-dir stands for them) and its
validation between steps.
"""

from __future__ import annotations

from flashrecovery.integrations.torchtitan import cpu


def main(argv: list[str] | None = None) -> None:
    """torchtitan's ``train.py`` with the FlashRecoveryTrainer."""
    if not cpu.has_accelerator():
        cpu.use_cpu()  # before the imports below bind torchtitan's device
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from flashrecovery.integrations.torchtitan.trainer import FlashRecoveryTrainer

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = FlashRecoveryTrainer(config)
    try:
        with trainer.session:  # finished on every rank, or the failure told to the agent
            trainer.train()
    finally:
        trainer.close()
