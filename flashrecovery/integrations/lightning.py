"""flashrecovery for Lightning: a DDP strategy whose every optimizer step is the session's
(docs/hook.md, "Lightning").

    trainer = L.Trainer(strategy=FlashRecoveryStrategy(), accelerator="cpu", devices=N, ...)

under `flashrecovery run --nproc-per-node N`. What it does where Lightning's DDP strategy does
its own:

- **Process group.** ``flashrecovery.init_process_group()`` instead of torch's: the group outlives
  a generation, and a hot spare waits in it until it is given a rank (the rank Lightning sees
  is the session's, read when asked).
- **The step.** The optimizer step runs Lightning's closure (``training_step`` and backward)
  through ``session.run_step``: it is committed on every rank or none; on an abort the closure
  runs again on the same batch with the same randomness, then the optimizer steps.
- **A replacement's state.** The model and optimizer come from a donor like any rank's; with
  them a donor sends Lightning's loop progress, LR schedulers and callbacks' states (taken
  mid-step, where Lightning's own restart re-runs the batch in flight), which Lightning then
  restores through its own checkpoint path. The replacement reads past the batches of the
  epoch its donor had committed. Until its first step, Lightning's own barriers, broadcasts and
  reductions (set-up, resume) and the SIGTERM broadcast before its first batch stay local:
  its peers are in the step, not in Lightning's set-up.

``FlashRecoveryHSDPStrategy`` is the same for FSDP2 over the session's replicate x shard mesh.
Not covered (refused at set-up with the reason): manual optimization, more than one optimizer,
gradient accumulation (a step of several batches cannot be recomputed from the last one).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from flashrecovery.errors import ScriptError
from flashrecovery.trainer_hooks import Session, init_process_group


class FlashRecoveryEnvironment(ClusterEnvironment):
    """The ranks as `flashrecovery run` starts them (torchrun's variables), the rank read from
    the session once it has one: a hot spare learns its rank only when it takes one."""

    def __init__(self) -> None:
        self.session: Session | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return "FLASHRECOVERY_AGENT_SOCKET" in os.environ

    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def set_world_size(self, size: int) -> None:
        pass  # the job's, from `flashrecovery run`

    def global_rank(self) -> int:
        if self.session is not None:
            try:
                return self.session.rank
            except ScriptError:
                pass  # a spare with no rank yet
        return int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        pass  # the session's

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", "0"))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_devices))
        if num_devices != local:
            raise ValueError(
                f"Trainer(devices={num_devices}) but `flashrecovery run --nproc-per-node "
                f"{local}`: give the Trainer the same number of devices per node"
            )


class FlashRecoveryStrategy(DDPStrategy):
    """Lightning's DDP strategy with flashrecovery's process group, step vote and recovery."""

    strategy_name = "flashrecovery"

    def __init__(self, **ddp_kwargs: Any) -> None:
        self._environment = FlashRecoveryEnvironment()
        super().__init__(cluster_environment=self._environment, **ddp_kwargs)
        self._session: Session | None = None
        self._loops = _LoopState()
        self._catching_up = False  # a replacement between its rank and its first step
        self._finished = False
        self._read_past = 0  # batches of the restored epoch the replacement's loader skips

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError("the flashrecovery session starts with the trainer's fit()")
        return self._session

    @property
    def root_device(self) -> torch.device:
        """A hot spare's LOCAL_RANK is its own slot past the node's ranks: on a GPU its own
        device, which the Trainer's ``devices`` do not list."""
        devices = self.parallel_devices
        assert devices
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        kind = devices[0].type
        return devices[0] if kind == "cpu" else torch.device(kind, self.local_rank)

    # ---------------------------------------------------------------- set-up

    def setup_distributed(self) -> None:
        """The session's process group in place of torch's (a hot spare waits here)."""
        self._session = init_process_group()
        self._environment.session = self._session
        # A replacement (a generation after the first) joins peers that are in a step: from
        # here to its first step, Lightning's own collectives stay local.
        self._catching_up = self._session.generation > 0
        self.set_world_ranks()
        self._process_group_backend = "flashrecovery"

    def set_world_ranks(self) -> None:
        if self._session is not None:
            rank = self.global_rank
            rank_zero_only.rank = fabric_rank_zero_only.rank = rank  # type: ignore[attr-defined]

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the session restores it, with the model

    def setup(self, trainer: Trainer) -> None:
        _refuse_what_cannot_be_recomputed(trainer)
        super().setup(trainer)  # the model wrapped in DDP, its optimizer made
        if len(self.optimizers) != 1:
            raise ScriptError("FlashRecoveryStrategy: one optimizer only")
        [optimizer] = self.optimizers
        session = self.session
        self._loops.trainer = trainer
        assert self.model is not None
        session.register(self.model, optimizer, extras={"lightning": self._loops})
        session.join()  # a replacement receives its donor's state here
        _local_while_catching_up(trainer, lambda: self._catching_up)
        restored = self._loops.restored
        if restored is not None:
            # Lightning restores its loops, schedulers and callbacks from this, as from a
            # checkpoint file (restore_training_state() runs after this set-up).
            connector = trainer._checkpoint_connector
            connector._loaded_checkpoint = restored
            connector.restore_callbacks()
            self._read_past = -1  # known once the loops are restored: process_dataloader

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._loops.trainer
        if self._read_past == -1 and trainer is not None and trainer.training:
            self._read_past = 0
            done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
            if done:
                return _ReadPast(dataloader, done)
        return dataloader

    # ---------------------------------------------------------------- the step

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def voted() -> Any:
            self._catching_up = False  # from here on its peers are where it is
            return self.session.run_step(closure, _loss)

        return super().optimizer_step(optimizer, voted, model, **kwargs)

    # Lightning's own collectives outside a step (set-up, resume): while a replacement catches
    # up, its peers are in the step, so they stay local.

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not (self._catching_up or self._finished):  # (after finish: the group is closed)
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._catching_up else super().broadcast(obj, src)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._catching_up:
            return tensor
        return super().reduce(tensor, group, reduce_op)

    # ---------------------------------------------------------------- the end

    def on_train_end(self) -> None:
        """Every rank done (a rank lost after the last step is replaced meanwhile)."""
        self.session.finish()
        self._finished = True

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._session is not None:
            self._session.__exit__(type(exception), exception, exception.__traceback__)


class FlashRecoveryHSDPStrategy(FlashRecoveryStrategy):
    """FSDP2 under Lightning, recoverable from a replica: the session's mesh of
    ``world / S`` replicas by ``S`` shards (``flashrecovery run --shards S``) is
    ``strategy.device_mesh``, over which the LightningModule's ``configure_model`` calls
    ``fully_shard(..., mesh=self.trainer.strategy.device_mesh)``; the model is not wrapped in
    DDP. A lost rank is restored from the rank holding its shard in another replica."""

    strategy_name = "flashrecovery_hsdp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mesh: DeviceMesh | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("the device mesh is made with the trainer's fit()")
        return self._mesh

    def setup_distributed(self) -> None:
        super().setup_distributed()
        session = self.session
        shards = session.shards
        replicas = session.world_size // shards
        if replicas < 2:
            raise ScriptError(
                "FlashRecoveryHSDPStrategy needs a replica of every shard (`flashrecovery run "
                f"--shards S` with S < the world's {session.world_size} ranks): with none, a "
                "lost rank has no donor"
            )
        self._mesh = session.device_mesh((replicas, shards), ("replicate", "shard"))

    def configure_ddp(self) -> None:
        pass  # FSDP2 shards the model in the LightningModule's configure_model


class _LoopState:
    """What of Lightning a donor sends beside the model and optimizer: the fit loop's progress
    (taken mid-step: Lightning's restart re-runs the batch in flight), the LR schedulers and
    the callbacks' states. A recipient keeps it for Lightning to restore."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        assert trainer is not None
        fit_loop = trainer.fit_loop.state_dict()
        # The loader's own state as Lightning would save it counts the batch it prefetched;
        # the replacement reads past the committed batches instead (process_dataloader).
        fit_loop.get("state_dict", {}).pop("combined_loader", None)
        return {
            "loops": {"fit_loop": fit_loop},
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "callbacks": call._call_callbacks_state_dict(trainer),
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": lightning.__version__,  # as in a checkpoint file
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state


class _ReadPast:
    """The train loader, its first iteration started past ``count`` batches (a replacement's,
    mid-epoch); everything else is the loader's own."""

    def __init__(self, loader: Any, count: int) -> None:
        self._loader, self._count = loader, count

    def __iter__(self) -> Iterator[Any]:
        # Skipped at the first next(), as a loader reads: Lightning sets the sampler's epoch
        # after it has called iter().
        count, self._count = self._count, 0
        return itertools.islice(iter(self._loader), count, None)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _local_while_catching_up(trainer: Trainer, catching_up: Callable[[], bool]) -> None:
    """Lightning's training loop broadcasts a SIGTERM flag before every batch, with torch's own
    call rather than the strategy's: its peers made that broadcast before the step they are
    recomputing, so a replacement's first batch skips it (the others keep it)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    broadcast = epoch_loop._broadcast_sigterm_tensor

    def unless_catching_up() -> None:
        if not catching_up():
            broadcast()

    epoch_loop._broadcast_sigterm_tensor = unless_catching_up  # type: ignore[method-assign]


def _loss(result: Any) -> float | None:
    return float(result) if isinstance(result, torch.Tensor) and result.numel() == 1 else None


def _refuse_what_cannot_be_recomputed(trainer: Trainer) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise ScriptError(
            "FlashRecoveryStrategy needs automatic optimization: a failed step is recomputed "
            "by running Lightning's closure again, which manual optimization has not"
        )
    if trainer.accumulate_grad_batches != 1:
        raise ScriptError(
            "FlashRecoveryStrategy: accumulate_grad_batches must be 1 (a step of several "
            "batches cannot be recomputed from its last one)"
        )
