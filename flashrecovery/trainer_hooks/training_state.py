"""What a rank holds of the training: the model, the optimizer, the user's other stateful
objects, the data position, the random state of the step in progress, and the step it has
committed. A donor sends it, a recipient and a checkpoint load take it on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from flashrecovery.trainer_hooks import rng
from flashrecovery.trainer_hooks.position import DataPosition


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class TrainingState:
    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extras: dict[str, Stateful] = {}
        self.position = DataPosition()
        self.committed_step = -1
        self.nonfinite_step: int | None = None  # a step whose last attempt was non-finite
        self._rng_at_step: dict[str, Any] = {}
        self._restored_rng: dict[str, Any] | None = None  # the donor's, from the next step on

    def register(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: Mapping[str, Stateful] | None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.extras = {**(extras or {}), "flashrecovery.data": self.position}

    @property
    def registered(self) -> bool:
        return self.model is not None

    def begin_step(self) -> None:
        """A restored rank takes its donor's random state here, once it has fetched the step's
        batch itself, as the donor had; then the step's random state is captured, so that an
        aborted attempt is recomputed with the same randomness."""
        if self._restored_rng is not None:
            rng.restore(self._restored_rng)
            self._restored_rng = None
        self._rng_at_step = rng.capture()

    def abort_step(self) -> None:
        """The step is recomputed: its gradients dropped, its randomness as it began."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        rng.restore(self._rng_at_step)

    def whole(self) -> dict[str, Any]:
        """The whole training state (what a checkpoint holds)."""
        return {**self.replicated(), **self.own()}

    def replicated(self) -> dict[str, Any]:
        """The state every replica of a shard holds bitwise alike (several donors share it)."""
        assert self.model is not None and self.optimizer is not None
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def own(self) -> dict[str, Any]:
        """The rest of a donor's state, sent by the lead donor alone."""
        return {
            "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
            "rng": rng.capture(),
            "committed_step": self.committed_step,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Take on a state. Tensors that landed in place make the loads copy-free."""
        assert self.model is not None and self.optimizer is not None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extras.items():
            obj.load_state_dict(state["extras"][name])
        self._restored_rng = state["rng"]
        self.committed_step = int(state["committed_step"])
