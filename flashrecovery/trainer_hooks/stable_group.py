"""Process groups that outlive a generation: the user's DDP, FSDP2 or DeviceMesh holds one
``StableGroup`` for the whole job, and the session rebuilds the gloo (CPU) or NCCL (CUDA)
group underneath it for each new generation, so a model is wrapped once and never re-wrapped.

A peer's failure can surface in any collective of a step (DDP's bucket all-reduce, FSDP's
all-gather or reduce-scatter), inside user code that must not see an exception. So the first
failure is recorded, every later collective of the generation returns at once with its outputs
untouched, and ``commit()`` finds the error and aborts the step, which is then recomputed.
Once the training loop is over no commit follows: a failure then raises ``LostAfterTraining``
(``StableGroups.training_over()``), never outputs left untouched that a save would write.

Until the process has joined a generation (a replacement builds and wraps its model before it
receives its state) the group is *local*: an all-gather fills every slot with this rank's
tensor (what DDP's shape check expects of identical replicas), every other collective leaves
its tensors as they are. Whatever that computes is overwritten by the state transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch._C._distributed_c10d import ReconfigureOptions
from torch.utils._python_dispatch import _disable_current_modes

from flashrecovery.errors import LostAfterTraining, Superseded
from flashrecovery.trainer_hooks import groups, inflight
from flashrecovery.trainer_hooks.env import GroupRebuild
from flashrecovery.trainer_hooks.groups import COLLECTIVE_TIMEOUT
from flashrecovery.trainer_hooks.waits import WaitClock

BACKEND = "flashrecovery"
GLOO, NCCL = dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroup.BackendType.NCCL

# The collectives torch's ProcessGroup offers, by how a local (or failed) call fills its outputs.
_GATHER_LISTS = ("allgather", "allgather_coalesced")  # (outputs: [[T]], inputs: [T], opts)
_GATHER_FLAT = ("_allgather_base", "all_gather_single")  # (output, input, opts)
_GATHER_FLAT_COALESCED = ("allgather_into_tensor_coalesced",)  # (outputs: [T], inputs: [T], opts)
_LEAVE_AS_IS = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "barrier",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
)


def _gather_flat(output: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    output.view(-1).copy_(tensor.reshape(-1).repeat(size))


def _outputs(args: Sequence[Any]) -> list[Any]:
    """What a collective's future holds: its first argument's tensors."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor):
        return [first]
    return list(first) if isinstance(first, list) else []


def _local_outputs(op: str, args: Sequence[Any], size: int) -> list[Any]:
    """Fill the outputs of ``op`` as if every peer held this rank's tensors, unseen by the
    dispatch modes the caller runs under: these operations stand in for a collective, not for
    the model's computation (selective activation checkpointing records the forward's
    operations and meets the backward's recomputation with them: one it did not record
    fails the backward)."""
    with _disable_current_modes():
        if op in _GATHER_LISTS:
            for outputs, tensor in zip(args[0], args[1], strict=True):
                for output in outputs:
                    output.copy_(tensor)
        elif op in _GATHER_FLAT:
            _gather_flat(args[0], args[1], size)
        elif op in _GATHER_FLAT_COALESCED:
            for output, tensor in zip(args[0], args[1], strict=True):
                _gather_flat(output, tensor, size)
    return _outputs(args)


class _DoneWork(dist.Work):
    """A collective that completed locally (or was skipped after a failure)."""

    def __init__(self, result: list[Any]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._result)
        return future


class _GuardedWork(dist.Work):
    """A collective in flight whose failure is recorded on the group instead of raised, and
    which a newer generation's plan ends (a peer stuck in its own code holds it up otherwise:
    trainer_hooks/inflight.py).

    It lets go of torch's work once finished: a gloo work keeps its generation's connections
    open, and peers blocked in that generation are released only when they close."""

    def __init__(
        self,
        work: dist.Work,
        group: object,
        result: list[Any],
        fail: Callable[[str], None],
        superseded: Callable[[], bool],
        finished: Callable[[], None],
    ) -> None:
        """``fail``: records a failure (and raises once training is over); ``finished``: told
        once the collective is done (waits.py)."""
        super().__init__()
        self._work: dist.Work | None = work
        self._group, self._superseded = group, superseded
        self._result, self._fail, self._finished = result, fail, finished

    def wait(self, timeout: object = None) -> bool:
        work, self._work = self._work, None
        if work is not None:
            try:
                inflight.wait(work, self._group, self._superseded)
            except (RuntimeError, Superseded) as exc:  # torch's errors, DistError included
                self._fail(str(exc))
            finally:
                self._finished()
        return True

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        result, fail, finished = self._result, self._fail, self._finished

        def settle(future: torch.futures.Future[Any]) -> Any:
            finished()
            try:
                return future.value()
            except (RuntimeError, Superseded) as exc:
                fail(str(exc))
                return result

        if self._work is None:
            return _DoneWork(result).get_future()
        return inflight.future(self._work, self._group, self._superseded).then(settle)


class Reconfigurable:
    """A stable group's one backend for the whole job, reconfigured in place for each
    generation through torch's fault-tolerance API (``enable_reconfigure``; torch >= 2.15).
    On NCCL (``ProcessGroupNCCL2``, NCCL >= 2.28) a reconfigure revokes the communicator,
    shrinks the lost ranks out and grows the replacements in from the survivors' communicator,
    instead of bootstrapping the whole group again as a new communicator would. Gloo offers
    the same API (each reconfigure builds a new full mesh: slower than ``LazyGloo``, which is
    why gloo uses it only when asked, and how this path is tested without a GPU)."""

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, device: str) -> None:
        prefixed = dist.PrefixStore(f"pg/{name}/", store)
        self.device, self.rank, self.size = device, rank, size
        self.backend: C10dBackend
        if device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            options.enable_reconfigure = True
            self.backend = dist.ProcessGroupNCCL2(prefixed, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(
                prefixed, rank, size, timeout=COLLECTIVE_TIMEOUT, enable_reconfigure=True
            )
        if not self.backend.supports_reconfigure:
            raise RuntimeError(f"{type(self.backend).__name__} cannot be reconfigured here")

    def reconfigure(self, handles: dist.Store, uuid: int, superseded: Callable[[], bool]) -> None:
        """Every member's call for the generation (each with its handle, exchanged under
        ``handles`` by waits a newer generation cuts short); raises if one fails. A member lost
        after it gave its handle leaves the others waiting in the backend's reconfigure for as
        long as its timeout: that wait runs in a thread of its own, given up on as soon as
        ``superseded()`` holds (the backend is then dropped with the thread, which ends at the
        timeout)."""
        rendezvous = groups.Rendezvous(handles, superseded, "a group's reconfigure")
        rendezvous.set(str(self.rank), self.backend.get_reconfigure_handle())
        everyone = [rendezvous.get(str(peer)).decode() for peer in range(self.size)]
        options = ReconfigureOptions()
        options.uuid, options.handles, options.timeout = uuid, everyone, COLLECTIVE_TIMEOUT
        failed: list[Exception] = []  # raised here: a peer's loss (RuntimeError) or a bug
        done = threading.Event()

        def run() -> None:
            try:
                self.backend.reconfigure(options).wait()
            except Exception as exc:  # re-raised in the caller's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="reconfigure", daemon=True).start()
        while not done.wait(groups.RENDEZVOUS_SLICE.total_seconds()):
            if superseded():
                raise RuntimeError("a newer generation was planned while the group reconfigured")
        if failed:
            raise failed[0]


class _Generation:
    """One generation's backend of a stable group, under ``gen/{g}/pg/{name}/``: a torch
    ProcessGroup (every collective of its API) over a lazily connecting gloo group (its pairs
    connect on the first collective that uses them, so building it waits for nobody; a first
    connect may wait as long as a collective), plus NCCL
    for CUDA tensors. Whatever keeps the generation alive holds this object, so the gloo group
    is let go of cleanly only once nothing does (groups.LazyGloo). With a ``Reconfigurable``
    backend (already reconfigured for this generation) that one serves its device instead of
    a new one."""

    def __init__(
        self,
        store: dist.Store,
        generation: int,
        name: str,
        rank: int,
        size: int,
        device: str,
        reconfigured: Reconfigurable | None = None,
    ) -> None:
        prefixed = dist.PrefixStore(f"gen/{generation}/pg/{name}/", store)
        self.group = dist.ProcessGroup(prefixed, rank, size)
        if reconfigured is not None and reconfigured.device == "cpu":
            self.group._register_backend(torch.device("cpu"), GLOO, reconfigured.backend)
        else:
            self._gloo = groups.LazyGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
            self.group._register_backend(torch.device("cpu"), GLOO, self._gloo.backend)
        self.group._set_default_backend(GLOO)
        if device == "cuda":
            nccl: C10dBackend
            if reconfigured is not None:
                nccl = reconfigured.backend
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = COLLECTIVE_TIMEOUT
                nccl = dist.ProcessGroupNCCL(
                    dist.PrefixStore("nccl/", prefixed), rank, size, options
                )
            self.group._register_backend(torch.device("cuda"), NCCL, nccl)
            self.group._set_default_backend(NCCL)


class StableGroup(dist.ProcessGroup):
    """One process group of the user's (the world, or a DeviceMesh dimension), stable for the
    whole job; its members are fixed, its backend belongs to one generation at a time."""

    def __init__(
        self,
        name: str,
        rank: int,
        size: int,
        device: str,
        superseded: Callable[[], bool] = lambda: False,
        reconfigure: bool = False,
        clock: WaitClock | None = None,
    ) -> None:
        """``superseded()``: whether a generation newer than the attached one is planned.
        ``reconfigure``: keep one ``Reconfigurable`` backend, reconfigured per generation
        (else a new backend per generation). ``clock``: times its collectives (waits.py)."""
        super().__init__(rank, size)
        self._name, self._desc, self._device = name, name, device
        self._superseded = superseded
        self._clock = clock or WaitClock()
        self.training_over = False  # a failure raises from now on (the module's docstring)
        self._lock = threading.Lock()
        self._inner: _Generation | None = None
        self._reconfigures = reconfigure
        self._reconfigurable: Reconfigurable | None = None
        # The first failure's message: never the exception, whose traceback would keep a
        # gloo work, and with it the generation's connections, alive.
        self._error: str | None = None

    # ------------------------------------------------------------------ generations

    def attach(self, store: dist.Store, generation: int) -> None:
        """Build this group's backend for ``generation`` (every member must call it)."""
        self.detach()
        try:
            reconfigured = self._reconfigure(store, generation)
        except RuntimeError as exc:  # a member lost meanwhile: this generation's steps abort
            self._reconfigurable = None  # the next generation starts from a new backend
            self.fail(str(exc))
            return
        inner = _Generation(
            store, generation, self._name, self.rank(), self.size(), self._device, reconfigured
        )
        with self._lock:
            self._inner, self._error = inner, None

    def _reconfigure(self, store: dist.Store, generation: int) -> Reconfigurable | None:
        if not self._reconfigures:
            return None
        if self._reconfigurable is None:
            self._reconfigurable = Reconfigurable(
                store, self._name, self.rank(), self.size(), self._device
            )
        handles = dist.PrefixStore(f"gen/{generation}/pg/{self._name}/handles/", store)
        # The same on every member, never the same for two groups or generations.
        digest = hashlib.sha256(f"{self._name}/{generation}".encode()).digest()
        self._reconfigurable.reconfigure(
            handles, int.from_bytes(digest[:7], "big"), self._superseded
        )
        return self._reconfigurable

    def detach(self) -> None:
        """Let go of the backend: its connections close once nothing holds it (gloo's
        ``shutdown()`` leaves them open), which releases peers still blocked in it. The group is
        local until the next ``attach``."""
        with self._lock:
            self._inner, self._error = None, None

    def fail(self, error: str) -> None:
        """Record the first failure of the generation; later collectives return at once."""
        with self._lock:
            if self._error is None:
                self._error = error
                inner = self._inner
            else:
                inner = None
        if inner is not None and self._device == "cuda" and not self._reconfigures:
            # NCCL would wait for its timeout: abort the communicators (callable from any
            # thread; a reconfigured one is revoked by its next reconfigure instead). Gloo
            # needs nothing: a dead peer's closed sockets fail its operations.
            with contextlib.suppress(RuntimeError):
                inner.group.abort()

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    # ------------------------------------------------------------------ collectives

    def _run(self, op: str, args: Sequence[Any], options: dict[str, Any]) -> dist.Work:
        """``options``: what torch passes by keyword (``dist.barrier()`` gives ``opts=``)."""
        with self._lock:
            inner, error = (None, self._error) if self._error is not None else (self._inner, None)
        if error is not None and self.training_over:
            raise LostAfterTraining(error)
        if inner is None:
            return _DoneWork(_local_outputs(op, args, self.size()))
        finished = self._clock.launched()
        try:
            work = getattr(inner.group, op)(*args, **options)
        except RuntimeError as exc:
            finished()
            self._failed(str(exc))
            return _DoneWork(_local_outputs(op, args, self.size()))
        return _GuardedWork(work, inner, _outputs(args), self._failed, self._superseded, finished)

    def _failed(self, error: str) -> None:
        """A collective of the script's failed: recorded; raised once training is over."""
        self.fail(error)
        if self.training_over:
            raise LostAfterTraining(error)

    def _get_backend(self, device: torch.device) -> StableGroup:  # type: ignore[override]
        """torch asks a group for its backend on a device (``batch_isend_irecv``: whether the
        backend coalesces a batch of sends and receives). The backend underneath changes with
        each generation, so the group answers for itself, as torch's Python process groups do."""
        return self

    supports_coalescing = False  # a batch's sends and receives go one by one (pipeline.py)

    # ------------------------------------------------------------------ naming (DeviceMesh)

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc


def _collective(op: str) -> Callable[..., dist.Work]:
    def call(self: StableGroup, *args: Any, **options: Any) -> dist.Work:
        return self._run(op, args, options)

    call.__name__ = op
    return call


for _op in (*_GATHER_LISTS, *_GATHER_FLAT, *_GATHER_FLAT_COALESCED, *_LEAVE_AS_IS):
    setattr(StableGroup, _op, _collective(_op))


class StableGroups:
    """Every stable group of this process, in creation order (the order every rank builds
    them in), and the generation they are attached to."""

    def __init__(
        self,
        device: str,
        superseded: Callable[[], bool] = lambda: False,
        rebuild: GroupRebuild = GroupRebuild.FRESH,
        clock: WaitClock | None = None,
    ) -> None:
        """``rebuild``: FRESH, a new backend per generation, or RECONFIGURE, one
        ``Reconfigurable`` backend per group for the whole job. ``clock``: how long the
        groups' collectives were outstanding (waits.py)."""
        self.device = device  # "cuda" (NCCL underneath) or "cpu" (gloo)
        self.clock = clock or WaitClock()
        self._training_over = False
        self._superseded = superseded
        self._reconfigure = rebuild == GroupRebuild.RECONFIGURE
        self._groups: list[StableGroup] = []
        self._formed: tuple[dist.Store, int] | None = None

    @property
    def in_use(self) -> bool:
        return bool(self._groups)

    def create(self, options: Any, _backend_options: object = None) -> StableGroup:
        """torch's backend creator (``dist.Backend.register_backend(..., extended_api=True)``):
        a new group joins the current generation at once if this process is in one."""
        group = StableGroup(
            str(options.group_id),
            options.group_rank,
            options.group_size,
            self.device,
            self._superseded,
            self._reconfigure,
            self.clock,
        )
        group.training_over = self._training_over
        self._groups.append(group)
        if self._formed is not None:
            try:
                group.attach(*self._formed)
            except RuntimeError as exc:  # a member failed meanwhile: the step will abort
                group.fail(str(exc))
        return group

    def training_over(self) -> None:
        """The script's training loop ended: a collective that fails from now on raises."""
        self._training_over = True
        for group in self._groups:
            group.training_over = True

    def lost_after_training(self) -> str | None:
        """The failure of a collective after the training loop, if one failed."""
        return self.error() if self._training_over else None

    def attach(self, store: dist.Store, generation: int) -> None:
        self._formed = (store, generation)
        for group in self._groups:
            group.attach(store, generation)

    def detach(self) -> None:
        self._formed = None
        for group in self._groups:
            group.detach()

    def error(self) -> str | None:
        for group in self._groups:
            if group.error is not None:
                return group.error
        return None


def init_process_group(stable: StableGroups, store: dist.Store, rank: int, world_size: int) -> None:
    """Make torch's default group one of ``stable``'s: ``BACKEND`` becomes a torch distributed
    backend whose groups are ``stable``'s (once per process: torch keeps one default group),
    rendezvousing under ``torch/`` of ``store``."""
    dist.Backend.register_backend(
        BACKEND, stable.create, extended_api=True, devices=["cpu", "cuda"]
    )
    dist.init_process_group(
        BACKEND, store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size
    )
