"""A digest of what a rank holds of the model and optimizer state (docs/hook.md, "Replicas
vouch for each other"): replicas of a shard hold it bitwise alike, so their digests are equal;
a bit flipped in any tensor makes them differ.

Computed where the state lives (a DTensor's local shard, on its device): each tensor's bits are
summed as integers of its element size (a flipped bit changes that sum by a power of two, never
by nothing), one pass over the state, about 2 ms for 4 M parameters with AdamW's two moments on
one CPU thread here; only the sums, a few bytes a tensor, leave the device, and their SHA-256 is
the digest.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator

import torch

from flashrecovery.trainer_hooks.dtensors import local

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DIGEST_CHARS = 16  # of the SHA-256's hex: what a vote and a record carry
# `flashrecovery run --verify-every`: one pass over the state every this many steps keeps its
# share of a step small (docs/benchmarks.md); a corruption is found this many steps late at most.
DEFAULT_VERIFY_EVERY = 20


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The state's tensors in an order every replica shares: the model's, then the optimizer's
    per parameter as its groups list them, each state's entries by name."""
    yield from model.state_dict().values()
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name in sorted(state):
                if isinstance(state[name], torch.Tensor):
                    yield state[name]


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's elements read as integers of their size, wrapping at that size:
    a flipped bit k changes it by 2**k, never a multiple of 2**size; and a sum as wide as its
    elements runs as fast as a float sum (widened to int64 it is 30x slower here). A 0-d
    tensor of that integer type."""
    tensor = local(tensor).detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype is torch.bool or tensor.is_floating_point():
        tensor = tensor.view(INT_OF_SIZE[tensor.element_size()])
    return tensor.sum(dtype=tensor.dtype)


def bit_sums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's ``bit_sum``, in order. The sums are stacked per integer type and device and
    only the stacks leave the device: per tensor, one sum and nothing else (4.5 -> 2.7 ms for the
    bench GPT's 305 state tensors against a sum widened and copied out one by one)."""
    stacks: dict[tuple[torch.dtype, torch.device], list[tuple[int, torch.Tensor]]] = {}
    count = 0
    for count, tensor in enumerate(tensors, start=1):
        total = bit_sum(tensor)
        stacks.setdefault((total.dtype, total.device), []).append((count - 1, total))
    sums = [0] * count
    for entries in stacks.values():
        values = torch.stack([total for _, total in entries]).cpu().tolist()
        for (index, _), value in zip(entries, values, strict=True):
            sums[index] = value
    return sums


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The SHA-256 of the state's bit sums (``DIGEST_CHARS`` of its hex): what a vote carries."""
    sums = bit_sums(_tensors(model, optimizer))
    return hashlib.sha256(struct.pack(f"<{len(sums)}q", *sums)).hexdigest()[:DIGEST_CHARS]


def flip_bit(model: torch.nn.Module, bit: int = 22) -> None:
    """The ``bitflip`` fault (probe.py): one bit of the first element of the first parameter
    that has elements, in this process's memory (a silent corruption of its state)."""
    for param in model.parameters():
        tensor = local(param).detach()
        if tensor.numel() and tensor.is_floating_point():
            as_int = tensor.view(INT_OF_SIZE[tensor.element_size()])
            with torch.no_grad():
                as_int[(0,) * as_int.dim()] ^= 1 << min(bit, 8 * tensor.element_size() - 2)
            return
