"""Peer state transfer: donors send a replica's training state to a recipient over the new
generation's gloo group, point to point, tensors in place.

A state travels in two parts. The *replicated* part (model and optimizer state) is bitwise
equal on every healthy replica of a shard, so several donors can share it: laid end to end its
tensors' bytes are cut into as many equal stripes as there are donors, and donor ``i`` sends
stripe ``i``. The *own* part (RNG, extras, the step: small, possibly different per rank) and
the replicated part's structure travel as one pickle from the lead donor (stripe 0), with the
bit sums of every piece of every donor's stripe (digest.py): the recipient sums what it received
and names the donors whose pieces differ (``RestoreMismatch``), before anything is loaded.

No tensor is copied on the way where it can be avoided: a donor sends each tensor's own
storage; the recipient receives each straight into the storage of its own tensor at the same
place of its state (its parameters, and its optimizer state once it has one), else into a new
tensor of that shape, so loading the result copies nothing. Pieces under ``BUCKET_BYTES``
travel together in one message (one small copy each way) so that a model of many small tensors
does not pay a message per tensor. Every message of a transfer is posted at once and awaited at
the end, so the donors' sends overlap. A sharded model's DTensors (FSDP2) travel as their local
shard and placements; a replica of the same shard holds the same local shapes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from flashrecovery.errors import ProtocolError, RestoreMismatch
from flashrecovery.trainer_hooks import digest
from flashrecovery.trainer_hooks.dtensors import is_dtensor
from flashrecovery.trainer_hooks.groups import Group

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

BUCKET_BYTES = 1 << 20  # pieces smaller than this share a message
_HEADER, _STRUCTURE, _PAYLOAD = 0, 1, 2  # message tags; payload messages count up from 2

Path = tuple[Any, ...]
Piece = tuple[int, int, int]  # tensor index, first byte, end byte


@dataclass(frozen=True)
class Stripe:
    """Which part of a transfer one donor sends: ``index`` of ``count`` (0 is the lead)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"stripe {self.index} of {self.count} does not exist")


@dataclass(frozen=True)
class Received:
    """A received state: the replicated part, the lead donor's own part, bytes per donor."""

    replicated: Any
    own: Any
    bytes: dict[int, int]


@dataclass(frozen=True)
class _TensorRef:
    """A tensor of the replicated part: its place in the stream and its form."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class _DTensorRef:
    """A DTensor: its local shard in the stream, and how it lies on the mesh."""

    local: _TensorRef
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # The names of its mesh's dimensions: a parameter may lie on a part of the session's mesh
    # (tensor parallel on "tp", the rest of the model on ("dp_replicate", "dp_shard")).
    dims: tuple[str, ...] | None = None


def _children(state: Any) -> Iterator[tuple[Any, Any]]:
    """The (key, value) pairs a nested structure holds (none for a leaf)."""
    if isinstance(state, dict):
        yield from state.items()
    elif isinstance(state, list | tuple) and not isinstance(state, torch.Size):
        yield from enumerate(state)


def _rebuild(state: Any, values: list[Any]) -> Any:
    if isinstance(state, dict):
        return dict(zip(state, values, strict=True))
    return values if isinstance(state, list) else tuple(values)


def _pack(state: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure with each tensor replaced by a reference; the tensors go to ``tensors``."""
    if is_dtensor(state):
        local = _pack(state.to_local(), tensors)
        dims = state.device_mesh.mesh_dim_names
        return _DTensorRef(local, tuple(state.placements), tuple(state.shape), state.stride(), dims)
    if isinstance(state, torch.Tensor):
        tensors.append(state.detach())
        return _TensorRef(len(tensors) - 1, state.dtype, tuple(state.shape))
    if isinstance(state, dict | list | tuple):
        return _rebuild(state, [_pack(v, tensors) for _, v in _children(state)])
    return state


def leaves(state: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every tensor of a nested structure with its path of keys."""
    if isinstance(state, torch.Tensor):
        yield path, state
        return
    for key, value in _children(state):
        yield from leaves(value, (*path, key))


def _fits(tensor: Any, ref: _TensorRef) -> bool:
    """Whether ``tensor`` can receive ``ref``'s bytes in place."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.dtype == ref.dtype
        and tuple(tensor.shape) == ref.shape
        and tensor.is_contiguous()
    )


_MeshOf = Callable[[tuple[str, ...] | None], DeviceMesh]


def _mesh_of(own: Iterable[Any], mesh: DeviceMesh | None) -> _MeshOf:
    """Where a DTensor of the given mesh dimensions is rebuilt: on the very mesh the
    recipient's own DTensors of those dimensions lie on (a framework's sub-mesh, torchtitan's:
    the moment then meets its parameter on one mesh), else on that part of ``mesh``."""
    known = {t.device_mesh.mesh_dim_names: t.device_mesh for t in own if is_dtensor(t)}

    def of(dims: tuple[str, ...] | None) -> DeviceMesh:
        if dims in known:
            return known[dims]
        if mesh is None:
            raise ProtocolError("the donor sent DTensors, this rank has no device mesh")
        return mesh if dims is None or dims == mesh.mesh_dim_names else mesh[dims]

    return of


def _unpack(
    skeleton: Any,
    own: dict[Path, torch.Tensor],
    into: dict[int, torch.Tensor],
    mesh: _MeshOf,
    path: Path = (),
) -> Any:
    """The structure again, each reference replaced by the tensor its bytes will land in: the
    recipient's own tensor at that path if it fits, else a new one (collected in ``into``), a
    DTensor on ``mesh(its dimension names)``."""
    if isinstance(skeleton, _DTensorRef):
        mine = own.get(path)
        if (
            is_dtensor(mine)
            and mine.placements == skeleton.placements
            and _fits(mine.to_local(), skeleton.local)
        ):
            into[skeleton.local.index] = mine.to_local()
            return mine
        from torch.distributed.tensor import DTensor  # a sharded job's: imported by FSDP2

        local = _unpack(skeleton.local, {}, into, mesh, path)
        return DTensor.from_local(
            local,
            mesh(skeleton.dims),
            skeleton.placements,
            run_check=False,
            shape=torch.Size(skeleton.shape),
            stride=skeleton.stride,
        )
    if isinstance(skeleton, _TensorRef):
        mine = own.get(path)
        if mine is not None and _fits(mine, skeleton):
            tensor = mine.detach()
        else:
            tensor = torch.empty(skeleton.shape, dtype=skeleton.dtype)
        into[skeleton.index] = tensor
        return tensor
    if isinstance(skeleton, dict | list | tuple):
        return _rebuild(
            skeleton,
            [_unpack(v, own, into, mesh, (*path, k)) for k, v in _children(skeleton)],
        )
    return skeleton


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def stripe_pieces(sizes: Sequence[int], stripe: Stripe) -> list[Piece]:
    """The byte ranges of each tensor that make up ``stripe``: the tensors' bytes laid end to
    end are cut into ``stripe.count`` parts of equal size (to a byte)."""
    total = sum(sizes)
    lo, hi = total * stripe.index // stripe.count, total * (stripe.index + 1) // stripe.count
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        first, end = max(lo, offset), min(hi, offset + size)
        if first < end:
            pieces.append((index, first - offset, end - offset))
        offset += size
    return pieces


def messages(pieces: Sequence[Piece]) -> list[list[Piece]]:
    """How pieces travel: one of ``BUCKET_BYTES`` or more alone (in place), runs of smaller
    ones together until they reach ``BUCKET_BYTES``."""
    out: list[list[Piece]] = []
    run: list[Piece] = []
    run_bytes = 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if size >= BUCKET_BYTES:
            out.append([piece])
            continue
        run.append(piece)
        run_bytes += size
        if run_bytes >= BUCKET_BYTES:
            out.append(run)
            run, run_bytes = [], 0
    if run:
        out.append(run)
    return out


def _views(data: list[torch.Tensor], message: list[Piece]) -> list[torch.Tensor]:
    return [data[index][first:end] for index, first, end in message]


def send(
    group: Group,
    dst: int,
    replicated: Any,
    own: Any = None,
    stripe: Stripe = Stripe(),
    after_header: Callable[[], bool] = lambda: False,
) -> int:
    """Send ``stripe`` of ``replicated`` (and, from the lead, the structure, the tensors' bit
    sums and ``own``) to rank ``dst``; returns the bytes sent. ``after_header`` runs after the
    first message (where a test kills a donor mid-transfer); True: flip a bit of this donor's
    first payload message on the way, in a copy (the ``garble`` fault, probe.py)."""
    skeleton, tensors, data = packed(replicated)
    structure = b""
    if stripe.index == 0:
        structure = pickle.dumps((skeleton, own, stripe_sums(data, tensors, stripe.count)))
    header = torch.tensor([len(structure), sum(d.numel() for d in data)], dtype=torch.int64)
    group.send([header], dst, _HEADER).wait()
    garble = after_header()
    pending = []
    if structure:
        buffer = torch.frombuffer(bytearray(structure), dtype=torch.uint8)
        pending.append((group.send([buffer], dst, _STRUCTURE), buffer))
    sent = len(structure)
    plan = messages(stripe_pieces([d.numel() for d in data], stripe))
    for tag, message in enumerate(plan, start=_PAYLOAD):
        views = _views(data, message)
        buffer = views[0] if len(views) == 1 else torch.cat(views)
        if garble and buffer.numel():
            buffer, garble = buffer.clone(), False
            buffer[0] ^= 1
        pending.append((group.send([buffer], dst, tag), buffer))
        sent += buffer.numel()
    for work, _ in pending:
        work.wait()
    return sent


def recv(
    group: Group,
    donors: Sequence[int],
    like: Any = None,
    mesh: DeviceMesh | None = None,
) -> Received:
    """Receive a state striped across ``donors`` (the lead first). Each tensor lands in place
    in the tensor at the same path of ``like`` (the recipient's own replicated state) where
    dtype and shape match; a DTensor it does not hold (an optimizer moment a replacement has
    not made yet) is rebuilt where its own DTensors of the same mesh dimensions lie, else on
    that part of ``mesh``. ``RestoreMismatch`` if what
    arrived is not what the lead donor holds."""
    headers = [torch.empty(2, dtype=torch.int64) for _ in donors]
    for work in [group.recv([h], d, _HEADER) for h, d in zip(headers, donors, strict=True)]:
        work.wait()
    structure_len, total = (int(v) for v in headers[0])
    if any(int(h[1]) != total for h in headers):
        raise ProtocolError(f"donors {list(donors)} hold states of different sizes")
    structure = torch.empty(structure_len, dtype=torch.uint8)
    group.recv([structure], donors[0], _STRUCTURE).wait()
    # Sent by a replica of this job.
    skeleton, own, sums = pickle.loads(structure.numpy().tobytes())
    into: dict[int, torch.Tensor] = {}
    mine = dict(leaves(like))
    replicated = _unpack(skeleton, mine, into, _mesh_of(mine.values(), mesh))
    data = [_flat_bytes(into[i]) for i in range(len(into))]
    sizes = [d.numel() for d in data]
    if sum(sizes) != total:
        raise ProtocolError(f"the donors' state has {total} bytes, its structure {sum(sizes)}")
    received = {donor: 0 for donor in donors}
    received[donors[0]] += structure_len
    pending = []
    stripes = [stripe_pieces(sizes, Stripe(index, len(donors))) for index in range(len(donors))]
    for donor, pieces in zip(donors, stripes, strict=True):
        plan = messages(pieces)
        for tag, message in enumerate(plan, start=_PAYLOAD):
            views = _views(data, message)
            size = sum(v.numel() for v in views)
            buffer = views[0] if len(views) == 1 else torch.empty(size, dtype=torch.uint8)
            pending.append((group.recv([buffer], donor, tag), buffer, views))
            received[donor] += buffer.numel()
    for work, buffer, views in pending:
        work.wait()
        if len(views) > 1:
            _scatter(buffer, views)
    _check(data, [into[i] for i in range(len(into))], donors, stripes, sums)
    return Received(replicated, own, received)


def packed(state: Any) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """The structure, its tensors and their bytes, in the order a restore sends them."""
    tensors: list[torch.Tensor] = []
    skeleton = _pack(state, tensors)
    return skeleton, tensors, [_flat_bytes(t) for t in tensors]


def stripe_sums(
    data: list[torch.Tensor], tensors: list[torch.Tensor], count: int
) -> list[list[int]]:
    """The bit sums of every piece of each of ``count`` stripes: what the lead donor sends
    with the structure for the recipient to check what arrived against."""
    sizes = [d.numel() for d in data]
    return [
        _sums(data, tensors, stripe_pieces(sizes, Stripe(index, count))) for index in range(count)
    ]


def _sums(data: list[torch.Tensor], tensors: list[torch.Tensor], pieces: list[Piece]) -> list[int]:
    """The bit sums of a stripe's pieces (digest.bit_sum), each read as integers of its tensor's
    element width where its bytes are whole elements (every piece but those a stripe's edge
    cuts), else byte by byte: either way a flipped bit changes the sum."""
    views = []
    for index, first, end in pieces:
        raw = data[index][first:end]
        width = min(tensors[index].element_size(), 8)
        whole = raw.storage_offset() % width == 0 and raw.numel() % width == 0
        views.append(raw.view(digest.INT_OF_SIZE[width]) if whole else raw)
    return digest.bit_sums(views)


def _check(
    data: list[torch.Tensor],
    tensors: list[torch.Tensor],
    donors: Sequence[int],
    stripes: list[list[Piece]],
    sums: list[list[int]],
) -> None:
    """Whether what arrived adds up to the lead donor's sums, stripe by stripe: which donors
    sent pieces that differ, and of how many tensors."""
    culprits: list[int] = []
    tensors_wrong: set[int] = set()
    for donor, pieces, theirs in zip(donors, stripes, sums, strict=True):
        wrong = [
            piece
            for piece, mine, sent in zip(pieces, _sums(data, tensors, pieces), theirs, strict=True)
            if mine != sent
        ]
        if wrong:
            culprits.append(donor)
            tensors_wrong.update(index for index, _, _ in wrong)
    if culprits:
        raise RestoreMismatch(culprits, len(tensors_wrong), len(tensors))


def _scatter(buffer: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy a bucket's bytes out to the pieces it carried."""
    offset = 0
    for view in views:
        view.copy_(buffer[offset : offset + view.numel()])
        offset += view.numel()
