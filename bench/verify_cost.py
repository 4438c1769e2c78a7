"""What the integrity checks cost a rank (docs/hook.md, "Replicas vouch for each other", "Non-
finite steps", "How state moves"): the state digest against the model's size (one pass over
the model and AdamW's two moments), its share of a step for each `--verify-every K`, the NaN
look over the gradients, and a restore's check (the lead donor's and the recipient's sums),
on one thread. Writes bench/results/verify_cost.json and .png, prints a table.

    python -m bench.verify_cost [--params 1 4 16] [--every 1 5 20 100] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from matplotlib import pyplot as plt
from rich.console import Console

from bench.lib.results import RESULTS, machine, save_figure, table, write_json
from flashrecovery.trainer_hooks import digest, nonfinite, transfer

WIDTH = 1024  # of the square layers the models are made of


def model_of(million_params: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square linear layers reaching about ``million_params`` M parameters, AdamW stepped once
    (so its moments exist), gradients left in place."""
    layers = max(1, round(million_params * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    return model, optimizer


def best_ms(work: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed runs after one warm-up, in ms."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(million_params: float, repeats: int) -> dict[str, float]:
    model, optimizer = model_of(million_params)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    _, tensors, data = transfer.packed(state)  # what a restore sends, in its order
    return {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "digest_ms": best_ms(lambda: digest.state_digest(model, optimizer), repeats),
        "nan_look_ms": best_ms(lambda: nonfinite.found(1.0, grads), repeats),
        "restore_sums_ms": best_ms(lambda: transfer.stripe_sums(data, tensors, 1), repeats),
    }


def cells(row: dict[str, float], every: list[int]) -> list[str]:
    """A size's row of the table: the digest, its share of a step for each K, the others."""
    digest_ms = row["digest_ms"]
    per_step = [f"{digest_ms / k:.3f}" for k in every]
    return [f"{row['params_m']:.1f} M", f"{digest_ms:.2f}", *per_step,
            f"{row['nan_look_ms']:.2f}", f"{row['restore_sums_ms']:.2f}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1, 4, 16, 64],
                        help="model sizes, millions of parameters")  # fmt: skip
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 20, 100],
                        help="--verify-every values to spread the digest over")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="CI: 1 M parameters, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.params, args.repeats = [1], 3
    torch.set_num_threads(1)
    rows = [measure(size, args.repeats) for size in args.params]
    path = write_json("verify_cost", {"sizes": rows, "every": args.every, "machine": machine()})
    console = Console()
    columns = ["parameters", "digest", *(f"digest / step, K={k}" for k in args.every)]
    columns += ["NaN look / step", "restore check (each side)"]
    console.print(
        table(
            "integrity checks, ms on one thread (the model's parameters plus AdamW's moments)",
            columns,
            [cells(row, args.every) for row in rows],
        )
    )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [row["params_m"] for row in rows]
    for k in args.every:
        ax.plot(sizes, [row["digest_ms"] / k for row in rows], marker="o", label=f"digest, K={k}")
    ax.plot(sizes, [row["nan_look_ms"] for row in rows], marker="s", label="NaN look (a turn)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("ms per step")
    ax.set_title("what the integrity checks add to a step, by model size")
    ax.legend(fontsize=8)
    plot = save_figure(fig, RESULTS / "verify_cost.png")
    console.print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
