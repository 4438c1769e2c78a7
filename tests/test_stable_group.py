"""The stable process group on its own: local until it joins a generation, and a peer's death
in a DDP backward turns into a recorded error, never an exception, with the rest of the step's
collectives returning at once (real processes, a real SIGKILL)."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, BarrierOptions

from flashrecovery.errors import LaunchError, LostAfterTraining
from flashrecovery.trainer_hooks import ddp, stable_group
from flashrecovery.trainer_hooks.env import GROUP_REBUILD, SECRET, SECRET_FD, LaunchEnv
from flashrecovery.trainer_hooks.position import DataPosition

TIMEOUT = datetime.timedelta(seconds=30)


def on_cpu_and_cuda(why_cuda_needs_two: str) -> pytest.MarkDecorator:
    """Run on gloo, and on NCCL where 2 CUDA devices exist (skipped with the reason else)."""
    needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=why_cuda_needs_two)
    return pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_two)])


def test_a_group_in_no_generation_is_local() -> None:
    group = stable_group.StableGroup("world", rank=1, size=3, device="cpu")
    mine = torch.tensor([1.0, 2.0])
    slots = [torch.zeros(2) for _ in range(3)]
    work = group.allgather([slots], [mine], AllgatherOptions())
    assert work.wait()
    assert all(torch.equal(slot, mine) for slot in slots)  # what DDP's shape check expects
    flat = torch.zeros(6)
    group._allgather_base(flat, mine, AllgatherOptions()).wait()
    assert torch.equal(flat, mine.repeat(3))
    summed = torch.tensor([5.0])
    future = group.allreduce([summed], AllreduceOptions()).get_future()
    assert future.value() == [summed] and summed.item() == 5.0  # left as it is
    assert group.barrier(opts=BarrierOptions()).wait()  # torch passes its options by keyword
    assert group.error is None


def _ddp_rank(rank: int, port: int, out: str, device: str, after_training: bool = False) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    stable = stable_group.StableGroups(device)
    stable.attach(store, 0)
    stable_group.init_process_group(stable, store, rank, 2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).to(device))
    batch = torch.ones(2, 4, device=device)
    model(batch).sum().backward()  # a step with both ranks
    dist.barrier()  # as a user's script would (torch passes its options by keyword)
    store.set(f"stepped/{rank}", "1")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["stepped/1"])
    while stable.error() is None:  # the peer's death surfaces in a step's all-reduce
        model(batch).sum().backward()
    if after_training:  # the script's loop is over: no commit follows to abort anything
        stable.training_over()
        said = []
        for collective in (
            lambda: dist.all_reduce(torch.ones(1, device=device)),
            lambda: model(batch).sum().backward(),
        ):
            try:
                collective()
                said.append("returned")
            except (LostAfterTraining, RuntimeError) as exc:
                said.append(type(exc).__name__)
        said.append(str(stable.lost_after_training() is not None))
        Path(out).write_text(" ".join(said))
        os._exit(0)
    # The rest of the step's collectives return at once.
    after = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    assert after is not None and after.is_completed() and after.wait()
    dist.barrier()  # returns at once too
    Path(out).write_text(stable.error() or "")
    os._exit(0)


@on_cpu_and_cuda("the NCCL path (communicators aborted on a failure) needs 2 CUDA devices")
def test_a_dead_peer_in_ddp_backward_is_recorded_not_raised(tmp_path: Path, device: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "error.txt"
    context = mp.start_processes(
        _ddp_rank, args=(store.port, str(out), device), nprocs=2, join=False, start_method="spawn"
    )
    survivor, victim = context.processes
    survivor.join(60)
    victim.join(5)
    assert (survivor.exitcode, victim.exitcode) == (0, -signal.SIGKILL)
    assert out.read_text()  # the backend's own words for the lost peer


def test_a_dead_peer_after_the_training_loop_raises(tmp_path: Path) -> None:
    """Once the loop is over, the same lost peer raises from the script's next collective and
    from DDP's backward, instead of leaving their outputs untouched."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "said.txt"
    context = mp.start_processes(
        _ddp_rank, args=(store.port, str(out), "cpu", True), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    survivor, victim = context.processes
    survivor.join(60)
    victim.join(5)
    assert survivor.exitcode == 0
    assert out.read_text() == "LostAfterTraining LostAfterTraining True"


def _reconfigured_rank(rank: int, port: int, out: str, replacement: bool, device: str) -> None:
    """Rank 1 dies after a step of generation 0; its replacement (a new process) joins
    generation 1 through the survivor's reconfigured backend, and DDP, wrapped once, sums the
    two ranks' gradients again."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    stable = stable_group.StableGroups(device, rebuild="reconfigure")
    stable_group.init_process_group(
        stable, dist.PrefixStore(f"torch{int(replacement)}", store), rank, 2
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1, bias=False).to(device))
    ones = torch.ones(2, 4, device=device)
    if not replacement:
        stable.attach(store, 0)
        model(ones).sum().backward()  # a step of both ranks
        assert stable.error() is None
        store.set(f"stepped/{rank}", "1")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        store.wait(["stepped/1"])
        while stable.error() is None:  # the peer's death surfaces in a step's all-reduce
            model(ones).sum().backward()
        stable.detach()
    model.zero_grad()
    stable.attach(store, 1)  # the survivor and the replacement alike
    model(ones * (rank + 1)).sum().backward()
    assert stable.error() is None, stable.error()
    Path(out, f"grad-{rank}").write_text(str(model.module.weight.grad.tolist()))
    os._exit(0)


@on_cpu_and_cuda("NCCL's reconfigure (shrink and grow) needs 2 CUDA devices")
def test_a_reconfigured_group_takes_a_replacement_under_a_wrapped_model(
    tmp_path: Path, device: str
) -> None:
    """``--group-rebuild reconfigure`` (torch's fault-tolerance API; on NCCL a shrink and a
    grow), run on gloo, which offers the same API."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    members = mp.start_processes(
        _reconfigured_rank,
        args=(store.port, str(tmp_path), False, device),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    survivor, victim = members.processes
    victim.join(60)
    assert victim.exitcode == -signal.SIGKILL
    replacement = mp.get_context("spawn").Process(
        target=_reconfigured_rank, args=(1, store.port, str(tmp_path), True, device)
    )
    replacement.start()
    survivor.join(60)
    replacement.join(60)
    assert (survivor.exitcode, replacement.exitcode) == (0, 0)
    # Rank r's batch is two rows of r + 1: its gradient 2 (r + 1) per weight; DDP averages the
    # two ranks' (2 and 4) to 3 on both. Without the replacement's share it would stay 2 or 4.
    grads = {(tmp_path / f"grad-{rank}").read_text() for rank in (0, 1)}
    assert grads == {str([[3.0, 3.0, 3.0, 3.0]])}


def _handle_then_die(port: int) -> None:
    """Rank 1 of group "world": gives its reconfigure handle for generation 0 as a member
    does, then is lost before it reconfigures."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    backend = stable_group.Reconfigurable(store, "world", 1, 2, "cpu")
    dist.PrefixStore("gen/0/pg/world/handles/", store).set(
        "1", backend.backend.get_reconfigure_handle()
    )
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_member_lost_after_giving_its_handle_holds_the_reconfigure_only_until_a_newer_plan(
    tmp_path: Path,
) -> None:
    """Without the release the survivor would wait out the backend's reconfigure timeout
    (60 s), its generation's resume with it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lost = mp.get_context("spawn").Process(target=_handle_then_die, args=(store.port,))
    lost.start()
    lost.join(60)
    assert lost.exitcode == -signal.SIGKILL
    planned = threading.Event()
    group = stable_group.StableGroup("world", 0, 2, "cpu", planned.is_set, reconfigure=True)
    threading.Timer(1.0, planned.set).start()  # the engine plans the next generation
    started = time.monotonic()
    group.attach(store, 0)
    elapsed = time.monotonic() - started
    assert group.error is not None and "newer generation was planned" in group.error
    assert 1.0 <= elapsed < stable_group.COLLECTIVE_TIMEOUT.total_seconds() / 4


def _stuck_peer_rank(rank: int, port: int, out: str, where: str) -> None:
    """Rank 1 stays in its own code (alive, connections open) while rank 0 is in a collective
    of the step; the test then plans a newer generation."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    planner = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    stable = stable_group.StableGroups("cpu", lambda: planner.check(["planned"]))
    stable.attach(store, 0)
    stable_group.init_process_group(stable, store, rank, 2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    batch = torch.ones(2, 4)
    model(batch).sum().backward()  # a step with both ranks
    if rank == 1:
        store.set("stuck", "1")
        store.wait(["done"], datetime.timedelta(seconds=120))
        os._exit(0)
    store.wait(["stuck"])
    store.set("blocked", "1")
    started = time.monotonic()
    if where == "backward":  # DDP's reducer waits on the bucket's future, inside torch
        model(batch).sum().backward()
    else:  # a collective waited for in Python, as FSDP2 waits for its all-gather
        dist.all_reduce(torch.ones(1))
    elapsed = time.monotonic() - started
    Path(out).write_text(f"{elapsed}\n{stable.error()}")
    store.set("done", "1")
    os._exit(0)


@pytest.mark.parametrize("where", ["backward", "all_reduce"])
def test_a_stuck_peer_holds_a_collective_only_until_a_newer_generation_is_planned(
    tmp_path: Path, where: str
) -> None:
    """Without the release the survivor would wait out gloo's 60 s collective timeout, and the
    engine would fail it with the stuck peer (its heartbeats name the old generation)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "released.txt"
    context = mp.start_processes(
        _stuck_peer_rank,
        args=(store.port, str(out), where),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    store.wait(["blocked"], datetime.timedelta(seconds=60))
    store.set("planned", "1")
    for process in context.processes:
        process.join(60)
    assert [p.exitcode for p in context.processes] == [0, 0]
    elapsed, error = out.read_text().split("\n")
    assert "newer generation was planned" in error
    assert float(elapsed) < stable_group.COLLECTIVE_TIMEOUT.total_seconds() / 4


def test_settled_ddp_reduces_the_last_layer_first() -> None:
    """A replacement's DDP (its group still local) settles its buckets at registration in the
    order a backward makes gradients ready, so the first bucket's all-reduce can start while the
    backward still runs: the first layer in the first bucket would hold every bucket back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    group = stable_group.StableGroup("world", rank=0, size=2, device="cpu")
    wrapped = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=0.02
    )
    ddp.settle_buckets(wrapped)
    assert wrapped._has_rebuilt_buckets
    assert all(p.grad is None for p in model.parameters())  # the settling leaves no gradient
    names = {p: n for n, p in model.named_parameters()}
    launched: list[list[str]] = []

    def record(_: object, bucket):  # unannotated: DDP refuses all but its own class
        launched.append([names[p] for p in bucket.parameters()])
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    wrapped.register_comm_hook(None, record)
    wrapped(torch.randn(2, 64)).sum().backward()
    assert launched == [
        ["3.bias", "3.weight", "2.bias", "2.weight"],
        ["1.bias", "1.weight", "0.bias", "0.weight"],
    ]


def test_data_position_round_trips() -> None:
    position = DataPosition(epoch=2, batch=7)
    other = DataPosition()
    other.load_state_dict(position.state_dict())
    assert other == position
    other.next_epoch()
    assert (other.epoch, other.batch) == (3, 0)


LAUNCH = {
    "FLASHRECOVERY_ROLE": "rank",
    "FLASHRECOVERY_JOB_ID": "j",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
    "FLASHRECOVERY_STORE_PREFIX": "secret",
    "WORLD_SIZE": "2",
    "FLASHRECOVERY_HEARTBEAT_INTERVAL": "1",
    "RANK": "0",
    "FLASHRECOVERY_AGENT_SOCKET": "/tmp/s",
    "FLASHRECOVERY_AGENT_LINK": "/tmp/l",
}


def test_the_group_rebuild_comes_from_the_launch_and_a_bad_one_is_refused() -> None:
    launch = LAUNCH
    assert LaunchEnv.from_environ(launch).group_rebuild == "fresh"
    chosen = LaunchEnv.from_environ({**launch, GROUP_REBUILD: "reconfigure"})
    assert chosen.group_rebuild == "reconfigure"
    with pytest.raises(LaunchError, match="FLASHRECOVERY_GROUP_REBUILD='rebuild'"):
        LaunchEnv.from_environ({**launch, GROUP_REBUILD: "rebuild"})


def test_the_secret_is_read_from_the_pipe_the_agent_hands_a_new_interpreter() -> None:
    launch = {k: v for k, v in LAUNCH.items() if k != SECRET}
    read_end, write_end = os.pipe()
    os.write(write_end, b"piped-secret")
    os.close(write_end)
    env = LaunchEnv.from_environ({**launch, SECRET_FD: str(read_end)})
    assert env.store_prefix == "piped-secret" and "piped-secret" not in repr(env)
    with pytest.raises(OSError):  # read once, then closed
        os.fstat(read_end)
    with pytest.raises(LaunchError, match="FLASHRECOVERY_STORE_PREFIX is not set"):
        LaunchEnv.from_environ(launch)


def test_a_failed_collectives_stand_in_outputs_are_unseen_by_dispatch_modes() -> None:
    """After a failure a gather's outputs are filled locally: operations that stand in for the
    collective, which selective activation checkpointing (a dispatch mode recording the
    forward's operations to meet the backward's with) must not see, or the backward fails."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[object] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    output, tensor = torch.empty(6), torch.arange(3.0)
    with Recorder() as recorder:
        stable_group._local_outputs("_allgather_base", [output, tensor], 2)
    assert recorder.ops == []
    assert torch.equal(output, tensor.repeat(2))
