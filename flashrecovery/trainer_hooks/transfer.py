"""Peer state transfer: a donor replica sends its whole training state to a recipient over the
new generation's group, point to point.

The state is a nested structure (state dicts, RNG states, the step). Its tensors travel as one
flat byte buffer, the structure around them as a small pickle; so three messages per transfer
whatever the model's size: the two lengths, the structure, the bytes. A sharded model's
DTensors (FSDP2) travel as their local shard and placements, and become DTensors again on the
recipient's own mesh: a replica of the same shard holds the same local shapes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from flashrecovery.errors import ProtocolError
from flashrecovery.trainer_hooks.groups import Group

_HEADER, _SKELETON, _PAYLOAD = 0, 1, 2  # message tags


@dataclass(frozen=True)
class _TensorRef:
    """Where a tensor sits in the payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _DTensorRef:
    """A DTensor: its local shard in the payload, and how it lies on the mesh."""

    local: _TensorRef
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _pack(state: Any, chunks: list[torch.Tensor], offset: list[int]) -> Any:
    if isinstance(state, DTensor):
        local = _pack(state.to_local(), chunks, offset)
        return _DTensorRef(local, tuple(state.placements), tuple(state.shape), state.stride())
    if isinstance(state, torch.Tensor):
        data = state.detach().contiguous().reshape(-1).view(torch.uint8)
        ref = _TensorRef(state.dtype, tuple(state.shape), offset[0], data.numel())
        chunks.append(data)
        offset[0] += data.numel()
        return ref
    if isinstance(state, dict):
        return {k: _pack(v, chunks, offset) for k, v in state.items()}
    if isinstance(state, list | tuple):
        packed = [_pack(v, chunks, offset) for v in state]
        return packed if isinstance(state, list) else tuple(packed)
    return state


def _unpack(skeleton: Any, payload: torch.Tensor, mesh: DeviceMesh | None) -> Any:
    if isinstance(skeleton, _DTensorRef):
        if mesh is None:
            raise ProtocolError("the donor sent DTensors, this rank has no device mesh")
        local = _unpack(skeleton.local, payload, mesh)
        return DTensor.from_local(
            local,
            mesh,
            skeleton.placements,
            run_check=False,
            shape=torch.Size(skeleton.shape),
            stride=skeleton.stride,
        )
    if isinstance(skeleton, _TensorRef):
        data = payload[skeleton.offset : skeleton.offset + skeleton.nbytes]
        return data.clone().view(skeleton.dtype).reshape(skeleton.shape)
    if isinstance(skeleton, dict):
        return {k: _unpack(v, payload, mesh) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        items = [_unpack(v, payload, mesh) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def send(
    group: Group, dst: int, state: Any, after_header: Callable[[], object] = lambda: None
) -> int:
    """Send ``state`` to rank ``dst``; returns the bytes sent. ``after_header`` runs between
    the first message and the others (where a test kills a donor mid-transfer)."""
    chunks: list[torch.Tensor] = []
    skeleton = pickle.dumps(_pack(state, chunks, [0]))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    header = torch.tensor([len(skeleton), payload.numel()], dtype=torch.int64)
    group.send([header], dst, _HEADER).wait()
    after_header()
    group.send([torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)], dst, _SKELETON).wait()
    if payload.numel():
        group.send([payload], dst, _PAYLOAD).wait()
    return len(skeleton) + payload.numel()


def recv(group: Group, src: int, mesh: DeviceMesh | None = None) -> tuple[Any, int]:
    """Receive a state sent by ``src``; returns it with the bytes received. DTensors are
    rebuilt on ``mesh``."""
    header = torch.empty(2, dtype=torch.int64)
    group.recv([header], src, _HEADER).wait()
    skeleton_len, payload_len = (int(v) for v in header)
    skeleton = torch.empty(skeleton_len, dtype=torch.uint8)
    group.recv([skeleton], src, _SKELETON).wait()
    payload = torch.empty(payload_len, dtype=torch.uint8)
    if payload_len:
        group.recv([payload], src, _PAYLOAD).wait()
    structure = pickle.loads(skeleton.numpy().tobytes())  # sent by a replica of this job
    return _unpack(structure, payload, mesh), skeleton_len + payload_len
