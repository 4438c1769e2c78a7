"""torchtitan on CPU ranks (gloo), where it assumes an accelerator. Three things stand in the
way, each replaced here only when no accelerator is present:

- **The device.** torchtitan picks "cuda" when it finds no accelerator and binds its device
  module when its modules are imported: ``use_cpu()`` gives it "cpu" and a device module whose
  memory statistics are empty, before those imports.
- **Attention's backward.** FlexAttention has no backward on CPU (torch raises
  NotImplementedError): ``dense_attention()`` computes the same masked attention (the block
  mask made dense) with ``scaled_dot_product_attention``, which has one. Its masks are made
  without torch.compile.
- **FSDP2's reductions.** torchtitan divides the gradients itself and asks FSDP2 for a divide
  factor of 1, which FSDP2 turns into a PREMUL_SUM that gloo does not have:
  ``sum_reductions()`` asks for plain sums, the same result.
"""

from __future__ import annotations

import types
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    create_block_mask,
    create_mask,
)


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def use_cpu() -> None:
    """Make torchtitan's device "cpu": call before anything imports ``torchtitan.trainer``."""
    import torchtitan.tools.utils as titan_utils

    memory = psutil.virtual_memory().total
    titan_utils.device_type = "cpu"
    titan_utils.device_module = types.SimpleNamespace(
        set_device=lambda device: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=lambda device=None: None,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=memory),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
    )


def _dense_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any,
    block_mask: BlockMask | None,
    scale: float | None,
    enable_gqa: bool,
    return_aux: AuxRequest,
    kernel_options: dict[str, Any],
) -> tuple[torch.Tensor, AuxOutput]:
    if score_mod is not None or return_aux.lse or return_aux.max_scores:
        raise NotImplementedError(
            "on CPU flashrecovery computes torchtitan's attention densely: a score_mod or an "
            "auxiliary output (lse) of FlexAttention is not covered there"
        )
    mask = None
    if block_mask is not None:
        batch, length = q.shape[0], q.shape[2]
        mask = create_mask(block_mask.mask_mod, batch, 1, length, k.shape[2], q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, AuxOutput()


def dense_attention() -> None:
    """FlexAttention computed densely (call after torchtitan's set-up, which may compile it),
    its block masks made without compiling (a compile costs each rank seconds on its first
    step, a replacement too, for masks a dense attention makes small use of)."""
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask


def sum_reductions(modules: list[torch.nn.Module]) -> None:
    """FSDP2 reduces gradients by plain sums (torchtitan's divide factor is 1)."""
    from torch.distributed.fsdp import FSDPModule

    for part in modules:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
