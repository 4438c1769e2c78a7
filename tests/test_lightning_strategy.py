"""FlashRecoveryStrategy's checks at set-up (flashrecovery/integrations/lightning.py): what a
failed step could not be recomputed from is refused with the reason; the Trainer's devices
must be the agent's ranks per node. (tests/live/test_live_lightning.py runs it for real.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashrecovery.errors import ScriptError
from flashrecovery.integrations.lightning import (
    FlashRecoveryEnvironment,
    _refuse_what_cannot_be_recomputed,
)


def trainer(automatic: bool = True, accumulate: int = 1) -> object:
    module = SimpleNamespace(automatic_optimization=automatic)
    return SimpleNamespace(lightning_module=module, accumulate_grad_batches=accumulate)


def test_what_cannot_be_recomputed_is_refused_with_the_reason() -> None:
    _refuse_what_cannot_be_recomputed(trainer())  # type: ignore[arg-type]
    with pytest.raises(ScriptError, match="needs automatic optimization"):
        _refuse_what_cannot_be_recomputed(trainer(automatic=False))  # type: ignore[arg-type]
    with pytest.raises(ScriptError, match="accumulate_grad_batches must be 1"):
        _refuse_what_cannot_be_recomputed(trainer(accumulate=4))  # type: ignore[arg-type]


def test_the_trainer_s_devices_are_the_agent_s_ranks_per_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    environment = FlashRecoveryEnvironment()
    environment.validate_settings(num_devices=3, num_nodes=1)
    with pytest.raises(ValueError, match=r"devices=4\) but `flashrecovery run --nproc-per-node 3"):
        environment.validate_settings(num_devices=4, num_nodes=1)
    assert environment.global_rank() == 2 and environment.creates_processes_externally
