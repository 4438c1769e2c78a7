"""torchtitan's Trainer with each step the session's (imported once torchtitan's device is
settled: see ``cpu.use_cpu``)."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from flashrecovery.errors import ConfigError, ScriptError
from flashrecovery.integrations.torchtitan import cpu
from flashrecovery.trainer_hooks import Session, init_process_group

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class FlashRecoveryTrainer(Trainer):
    """torchtitan's Trainer: its process group the session's, its steps voted and recovered."""

    session: Session

    def __init__(self, config: Trainer.Config) -> None:
        _refuse_what_cannot_recover(config)
        # A CUDA graph captures the communicators a regroup replaces.
        config.training.disable_cuda_graphs = True
        super().__init__(config)
        if self.gradient_accumulation_steps != 1:
            raise ScriptError(
                f"gradient accumulation ({self.gradient_accumulation_steps} batches a step): "
                "a step of several batches cannot be recomputed from the last one; set "
                "--training.global_batch_size to local_batch_size x the data-parallel ranks"
            )
        if not cpu.has_accelerator():
            cpu.dense_attention()
            cpu.sum_reductions(self.model_parts)

    def init_distributed(self) -> ParallelDims:
        """The session's process group and torchtitan's meshes over it (a hot spare waits here
        until it is given a rank). A replica, --shards ranks in a row, is torchtitan's
        dp_shard x cp x tp: the same coordinate in another replica holds the same state."""
        self.session = session = init_process_group()
        config = self.config
        dims = ParallelDims.from_config(config.parallelism, session.world_size)
        within = dims.dp_shard * dims.cp * dims.tp
        if within != session.shards:
            raise ConfigError(
                f"torchtitan's replica is dp_shard x cp x tp = {dims.dp_shard} x {dims.cp} x "
                f"{dims.tp} = {within} ranks, the job was started with --shards "
                f"{session.shards}: `flashrecovery run --shards {within}`"
            )
        session.use_device_mesh(dims.world_mesh)
        if config.debug.seed is None:
            # torchtitan's rank 0 would broadcast its generator's first state: a replacement
            # cannot join that broadcast, so every rank takes the value it would have sent.
            start = torch.Generator().get_state()[:8]
            config.debug.seed = int(start.view(torch.uint64).item())
        return dims

    def train(self) -> None:
        """torchtitan's loop, each step committed on every rank or none: an aborted step is
        computed again with the same batch once the job has recovered."""
        session, steps = self.session, self.config.training.steps
        model, optimizers, schedulers = self.model_parts[0], self.optimizers, self.lr_schedulers
        batches = _Batches(self._build_dataloader, steps)
        session.register(
            _AsItLies(model),
            _OptimizersAsTheyLie(optimizers),
            extras={"lr_schedulers": schedulers},
            loader=batches,
        )
        metrics = self.metrics_processor
        for _ in session.epochs(1):
            waited_from = time.perf_counter()
            for input_dict, labels in batches:
                metrics.data_loading_times.append(time.perf_counter() - waited_from)
                self.step = session.committed_step + 2  # torchtitan counts its steps from 1
                self.gc_handler.run(self.step)
                losses, grad_norm = self._compute(input_dict, labels)
                if session.commit(loss=losses[0]):
                    optimizers.step()
                    schedulers.step()
                    self.ntokens_seen = self.step * labels.numel()
                    metrics.ntokens_since_last_log += labels.numel()
                    if metrics.should_log(self.step):
                        metrics.log(
                            self.step,
                            *losses,
                            grad_norm,
                            extra_metrics={
                                "n_tokens_seen": self.ntokens_seen,
                                **schedulers.get_metrics(),
                            },
                        )
                waited_from = time.perf_counter()
        logger.info("Training completed")

    def _compute(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        """Forward, backward, clipping and the loss's reductions: every collective of the step
        is inside it, so a failure aborts the step on every rank alike."""
        self.optimizers.zero_grad()
        dims = self.parallel_dims
        local_tokens = (labels != IGNORE_INDEX).sum()
        global_tokens = (
            dist_utils.dist_sum_tensor(local_tokens.to(self.device), dims.get_mesh("batch"))
            if dims.dp_enabled
            else local_tokens.to(self.device)
        )
        inputs = {k: v.to(self.device) for k, v in input_dict.items()}
        loss = self.forward_backward_step(
            input_dict=inputs, labels=labels.to(self.device), global_valid_tokens=global_tokens
        ).detach()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=dims.get_optional_mesh("pp"),
            ep_enabled=dims.ep_enabled,
        )
        if dims.dp_cp_enabled:
            mesh = dims.get_optional_mesh("loss")
            losses = (
                dist_utils.dist_sum(loss, mesh),
                dist_utils.dist_max(loss * global_tokens / local_tokens, mesh),
            )
        else:
            losses = (float(loss.item()),) * 2
        return losses, float(grad_norm.item())

    def _build_dataloader(self) -> Iterable[Batch]:
        """This rank's loader from its start, as torchtitan builds it."""
        dims, training = self.parallel_dims, self.config.training
        batch = dims.get_mesh("batch") if dims.dp_enabled else None
        loader: Iterable[Batch] = self.config.dataloader.build(
            dp_world_size=batch.size() if batch is not None else 1,
            dp_rank=batch.get_local_rank() if batch is not None else 0,
            tokenizer=self.tokenizer,
            seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            snapshot_every_n_steps=None,
        )
        return loader


class _AsItLies(torch.nn.Module):
    """The model as flashrecovery moves and checkpoints it: its parameters and buffers as they
    lie on this rank (FSDP2's sharded: a step, cut short or not, ends with them resharded), by
    name. torchtitan's own state dict is its save format (a fused qkv split into q, k and v,
    gathered whole first: a collective of its tp and dp_shard peers, which a donor and its
    recipient cannot hold alone)."""

    model: torch.nn.Module

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its hooks stay out

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self.model.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters(recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        tensors = itertools.chain(self.model.named_parameters(), self.model.named_buffers())
        return {name: tensor.detach() for name, tensor in tensors}

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(state[name])  # onto itself where the restore landed in place


class _OptimizersAsTheyLie(torch.optim.Optimizer):
    """torchtitan's optimizers as flashrecovery moves, checks and checkpoints them: each one's
    own state dict, as it is. The container's state dict would first give an optimizer that
    never stepped its state with a step of zero gradients, which counts in AdamW's bias
    correction: a donor asked for its state before step 0 committed would then step
    differently from every rank that was not asked."""

    def __init__(self, container: Iterable[torch.optim.Optimizer]) -> None:
        # Not torch's __init__: the groups and the state are the optimizers' own, shared.
        self._optimizers = list(container)
        self.defaults: dict[str, Any] = {}
        self.param_groups = [group for o in self._optimizers for group in o.param_groups]
        self.state = collections.ChainMap(*(o.state for o in self._optimizers))  # type: ignore[assignment]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self._optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, own in zip(self._optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(own)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none)

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for optimizer in self._optimizers:
            optimizer.step()


class _Batches:
    """The job's batches, each iteration from the loader's start: torchtitan's dataset keeps
    this rank's own tokens in its state, so a replacement cannot take its donor's (another
    data-parallel rank's); it reads its own past the batches committed, as a plain loader."""

    def __init__(self, build: Callable[[], Iterable[Batch]], steps: int) -> None:
        self._build, self._steps = build, steps

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(iter(self._build()), self._steps)


def _refuse_what_cannot_recover(config: Trainer.Config) -> None:
    """What this integration does not cover, said before anything starts."""
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ScriptError(
            "torchtitan's pipeline parallel is not covered: its mesh puts pp before the "
            "replicas (a replica is not --shards ranks in a row) and its schedule sets itself "
            "up at its first step (see examples/train_pp.py for pipeline parallel)"
        )
    if config.checkpoint.enable:
        raise ScriptError(
            "torchtitan's checkpoints (--checkpoint.enable): a job under flashrecovery falls "
            "back to flashrecovery's own, `flashrecovery run --checkpoint-dir DIR "
            "--checkpoint-every N`"
        )
    if config.validator.enable:
        raise ScriptError(
            "torchtitan's validation (--validator.enable) runs collectives between the steps, "
            "where a lost rank cannot be recovered: run it apart from the training job"
        )
