"""How fast a replica's state moves: GB/s of a peer transfer against the state's size, from 1
and from 2 donors, beside raw gloo send/recv on the same link (the ceiling).

    python -m bench.transfer [--rounds 3] [--quick]

Three processes on loopback (a recipient and two donors, one torch thread each) share one gloo
group. The state is a model of 1024 x 1024 linear layers and its AdamW state after one step
(12.6 MB a layer: 20 layers are the 252 MB of a 21 M-parameter model). Each round runs every
method once, in turn (interleaved):
- raw gloo: one uint8 tensor of the state's size, one donor to the recipient;
- copying: the transfer as it was before trainer_hooks/transfer.py sent in place: every tensor
  concatenated into one buffer, sent, each tensor cloned out of it, the model loaded;
- in place, 1 donor and 2 donors (striped): trainer_hooks/transfer.py as a restore calls it, to
  a recipient holding a model and a fresh optimizer (whose state is made as it arrives), the
  model and optimizer loads included.
Time is the recipient's, from a barrier to the state loaded; the first round of each size also
checks the state arrived bitwise. Medians go to bench/results/transfer.json, a table and
bench/results/transfer.png. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.queues import Queue
from typing import Any

import torch
from matplotlib import pyplot as plt
from rich.console import Console

from bench.lib.results import RESULTS, machine, save_figure, table, write_json
from flashrecovery.agent.store import JobStore
from flashrecovery.trainer_hooks import groups, transfer

WIDTH = 1024
METHODS = ["raw gloo", "copying", "in place, 1 donor", "in place, 2 donors"]
RECIPIENT, DONORS = 0, [1, 2]
TIMEOUT = datetime.timedelta(seconds=120)
_RAW_TAG = 99  # above any tag transfer.py uses for a state of these sizes


def _trained(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and AdamW state on every call: one step from a fixed seed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _replicated(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _flat(state: Any) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8) for _, t in transfer.leaves(state)]


def _copying(group: groups.Group, rank: int, state: dict[str, Any], model: Any) -> None:
    """The old way: one concatenated buffer, then a clone of each tensor, then a load."""
    tensors = [t for _, t in transfer.leaves(state)]
    total = sum(t.nbytes for t in tensors)
    if rank in DONORS[:1]:
        group.send([torch.cat(_flat(state))], RECIPIENT, _RAW_TAG).wait()
    elif rank == RECIPIENT:
        payload = torch.empty(total, dtype=torch.uint8)
        group.recv([payload], DONORS[0], _RAW_TAG).wait()
        clones, offset = {}, 0
        for path, t in transfer.leaves(state):
            data = payload[offset : offset + t.nbytes]
            clones[path] = data.clone().view(t.dtype).reshape(t.shape)
            offset += t.nbytes
        model.load_state_dict({path[1]: v for path, v in clones.items() if path[0] == "model"})


def _in_place(group: groups.Group, rank: int, donors: list[int], state: Any, recipient: Any) -> Any:
    if rank in donors:
        transfer.send(group, RECIPIENT, state, {}, transfer.Stripe(donors.index(rank), len(donors)))
        return None
    if rank != RECIPIENT:
        return None
    model, optimizer = recipient
    received = transfer.recv(group, donors, _replicated(model, optimizer))
    model.load_state_dict(received.replicated["model"])
    optimizer.load_state_dict(received.replicated["optimizer"])
    return received.replicated


def _worker(
    rank: int,
    port: int,
    prefix: str,
    sizes: list[int],
    rounds: int,
    methods: list[str],
    out: Queue,
) -> None:
    torch.set_num_threads(1)
    client = groups.connect_store(f"127.0.0.1:{port}", prefix)
    group = groups.build(client, 0, rank, 3, lambda: False)
    barrier = torch.zeros(1)
    for layers in sizes:
        model, optimizer = _trained(layers)
        state = _replicated(model, optimizer)
        nbytes = sum(t.nbytes for t in _flat(state))
        raw = torch.empty(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for round_ in range(rounds):
            for method in methods:
                # The recipient: a model of the right shape and a fresh optimizer, as a spare.
                spare = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
                recipient = (spare, torch.optim.AdamW(spare.parameters()))
                group.allreduce([barrier]).wait()
                started = time.perf_counter()
                got = None
                if method == "raw gloo":
                    if rank == DONORS[0]:
                        group.send([raw], RECIPIENT, _RAW_TAG).wait()
                    elif rank == RECIPIENT:
                        group.recv([raw], DONORS[0], _RAW_TAG).wait()
                elif method == "copying":
                    _copying(group, rank, state, spare)
                else:
                    donors = DONORS[: 1 if method.endswith("1 donor") else 2]
                    got = _in_place(group, rank, donors, state, recipient)
                times[method].append(time.perf_counter() - started)
                if got is not None and round_ == 0:
                    for (path, a), (_, b) in zip(
                        transfer.leaves(got), transfer.leaves(state), strict=True
                    ):
                        if not torch.equal(a, b):
                            raise AssertionError(f"{method}: {path} arrived different")
        if rank == RECIPIENT:
            out.put({"layers": layers, "bytes": nbytes, "seconds": times})
    group.allreduce([barrier]).wait()
    groups.drop(group)


def measure(sizes: list[int], rounds: int, methods: list[str] = METHODS) -> list[dict[str, Any]]:
    """Each size's times (seconds, per method, per round), from the recipient."""
    store = JobStore.open(TIMEOUT)
    os.environ.update(store.environment())  # gloo on loopback, as a job's ranks
    spawn = mp.get_context("spawn")
    out: Queue = spawn.Queue()
    workers = [
        spawn.Process(
            target=_worker,
            args=(r, store.port, store.prefix, sizes, rounds, methods, out),
        )
        for r in (RECIPIENT, *DONORS)
    ]
    for w in workers:
        w.start()
    try:
        return [out.get(timeout=600) for _ in sizes]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
                w.join()


def gloo_ceiling_gb_per_s(layers: int, rounds: int) -> float:
    """Raw gloo send/recv of a ``layers``-layer state, one donor to the recipient: GB/s, the
    median of ``rounds``."""
    (result,) = measure([layers], rounds, ["raw gloo"])
    return float(result["bytes"] / statistics.median(result["seconds"]["raw gloo"]) / 1e9)


def _plot(results: list[dict[str, Any]]) -> Any:
    path = RESULTS / "transfer.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mb = [r["bytes"] / 1e6 for r in results]
    for method in METHODS:
        ax.plot(mb, [r["gb_per_s"][method] for r in results], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("state, MB")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"peer state transfer on loopback (load {os.getloadavg()[0]:.1f})")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size (median)")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[1, 5, 20], help="state sizes, in layers"
    )
    parser.add_argument("--quick", action="store_true", help="one small state, one round")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.layers = 1, [1]
    console = Console()
    load_before = os.getloadavg()
    results = measure(args.layers, args.rounds)
    for r in results:
        r["median_s"] = {m: statistics.median(v) for m, v in r["seconds"].items()}
        r["gb_per_s"] = {m: r["bytes"] / s / 1e9 for m, s in r["median_s"].items()}
    settings = {"rounds": args.rounds, "width": WIDTH, "bucket_bytes": transfer.BUCKET_BYTES}
    info = {**machine(), "loadavg_before": load_before}
    path = write_json("transfer", {"machine": info, "settings": settings, "results": results})
    console.print(
        table(
            f"GB/s (ms), median of {args.rounds}, loopback, load {os.getloadavg()[0]:.1f}",
            ["state MB", *METHODS],
            [
                [
                    f"{r['bytes'] / 1e6:.0f}",
                    *(f"{r['gb_per_s'][m]:.2f} ({r['median_s'][m] * 1e3:.0f})" for m in METHODS),
                ]
                for r in results
            ],
        )
    )
    console.print(f"written {path} and {_plot(results)}")


if __name__ == "__main__":
    main()
