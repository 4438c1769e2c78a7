"""The torchtitan integration's pure parts (flashrecovery/integrations/torchtitan): what it
refuses before a job starts, its optimizers' state read as it lies, and the dense attention
that stands in for FlexAttention on CPU (equal to FlexAttention's own forward, which CPU has).
Its live job: tests/live."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from flashrecovery.errors import ScriptError
from flashrecovery.integrations.torchtitan import cpu

cpu.use_cpu()  # before torchtitan's trainer is imported, as the integration's main does
from torchtitan.components.optimizer import OptimizersContainer, default_adamw  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from flashrecovery.integrations.torchtitan.trainer import (  # noqa: E402
    _OptimizersAsTheyLie,
    _refuse_what_cannot_recover,
)

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"],
            "pipeline parallel is not covered",
        ),
        (["--checkpoint.enable"], "flashrecovery run --checkpoint-dir"),
        (["--validator.enable"], "collectives between the steps"),
    ],
    ids=["pipeline", "checkpoint", "validation"],
)
def test_what_cannot_be_recovered_is_refused_with_the_reason(flags: list[str], said: str) -> None:
    config = ConfigManager().parse_args([*DEBUG, *flags])
    with pytest.raises(ScriptError, match=said):
        _refuse_what_cannot_recover(config)


def test_the_debug_configuration_as_it_is_is_accepted() -> None:
    _refuse_what_cannot_recover(ConfigManager().parse_args(DEBUG))


def test_dense_attention_equals_flex_attention_under_a_document_mask() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=generator) for _ in range(3))
    documents = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor):
        return (documents[b, i] == documents[b, j]) & (j <= i)

    mask = create_block_mask(same_document_causal, 2, None, 16, 16, device="cpu")
    expected = flex_attention(q, k, v, block_mask=mask)
    dense, _ = cpu._dense_flex_attention(
        q,
        k,
        v,
        score_mod=None,
        block_mask=mask,
        scale=None,
        enable_gqa=False,
        return_aux=AuxRequest(),
        kernel_options={},
    )
    torch.testing.assert_close(dense, expected)
    with pytest.raises(NotImplementedError, match="score_mod"):
        cpu._dense_flex_attention(
            q,
            k,
            v,
            score_mod=lambda score, *_: score,
            block_mask=mask,
            scale=None,
            enable_gqa=False,
            return_aux=AuxRequest(),
            kernel_options={},
        )


def _stepped(model: torch.nn.Module, optimizers: OptimizersContainer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    optimizers.step()
    optimizers.zero_grad()


def test_reading_the_optimizers_state_before_the_first_step_changes_nothing() -> None:
    """A donor is asked for its state before step 0 committed when a rank fails in step 0:
    torchtitan's own state dict would first give AdamW a step of zero gradients (its step
    count 1 from then on, so every later update of the donor and its recipient differs)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizers = OptimizersContainer(default_adamw(), model_parts=[model])
    view = _OptimizersAsTheyLie(optimizers)
    assert view.state_dict()["optimizers"][0]["state"] == {}
    assert not view.state and not optimizers.optimizers[0].state
    _stepped(model, optimizers)
    steps = [state["step"].item() for state in optimizers.optimizers[0].state.values()]
    assert steps == [1.0, 1.0]  # the weight's and the bias's: the first step is the first


def test_the_optimizers_state_moves_whole() -> None:
    torch.manual_seed(0)
    donor_model, recipient_model = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    donor = OptimizersContainer(default_adamw(), model_parts=[donor_model])
    recipient = OptimizersContainer(default_adamw(), model_parts=[recipient_model])
    _stepped(donor_model, donor)
    _OptimizersAsTheyLie(recipient).load_state_dict(_OptimizersAsTheyLie(donor).state_dict())
    held = _OptimizersAsTheyLie(recipient).state
    for param, theirs in zip(recipient_model.parameters(), donor_model.parameters(), strict=True):
        assert torch.equal(held[param]["exp_avg"], donor.optimizers[0].state[theirs]["exp_avg"])
        assert held[param]["step"].item() == 1.0
