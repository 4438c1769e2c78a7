"""torchrun's command line, as `flashrecovery run` reads it: a torchrun command runs unchanged.

Every dashed option also takes torchrun's underscores (``--nproc_per_node``); torchrun's
names for what flashrecovery calls otherwise are spellings of the same option
(``--max-restarts``: the crash-loop guard, ``--rdzv-id``: the job id); ``--nproc-per-node``
takes ``auto``/``cpu``/``gpu``; ``--nnodes MIN:MAX`` trains on MIN nodes and keeps the rest
as whole nodes of hot spares (a job's world never shrinks here: a spare takes a lost node's
place); ``--master-addr``/``--master-port`` name the rendezvous endpoint as
``--rdzv-endpoint`` does; ``--standalone``, ``--rdzv-backend c10d|static`` and
``--rdzv-conf`` are accepted where they mean what flashrecovery does anyway, and ``--run-path``
is what it always does (the script runs through ``runpy.run_path`` in the rank's interpreter).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from flashrecovery.agent.config import Endpoint
from flashrecovery.errors import ConfigError

JOB_ID = ("--rdzv-id", "--rdzv_id")
BACKENDS = ("c10d", "static")  # the agents meet on node 0's TCPStore: c10d's rendezvous, or
# static's (a fixed endpoint); etcd's is another system altogether

Add = Callable[..., argparse.Action]


def spelled(parser: argparse.ArgumentParser) -> Add:
    """``parser.add_argument`` that also accepts each dashed option name with underscores."""

    def add(*names: str, **kwargs: Any) -> argparse.Action:
        underscored = ["--" + n[2:].replace("-", "_") for n in names if "-" in n[2:]]
        return parser.add_argument(*names, *underscored, **kwargs)

    return add


def add_arguments(add: Add) -> None:
    """torchrun's options that `flashrecovery run` has no option of its own for."""
    add("--standalone", action="store_true", help="torchrun's: one node (the default)")
    add("--master-addr", default=None, metavar="HOST", help="torchrun's: the rendezvous host")
    add("--master-port", type=int, default=None, metavar="PORT", help="torchrun's: its port")
    add(
        "--rdzv-backend",
        default=None,
        metavar="NAME",
        help="torchrun's: c10d or static (the agents meet on node 0's store either way)",
    )
    add("--rdzv-conf", default=None, metavar="K=V,…", help="torchrun's: not used")
    add(
        "--run-path",
        action="store_true",
        help="torchrun's: the script runs by runpy.run_path in the rank's interpreter (always)",
    )


def nproc(text: str) -> int:
    """A count of ranks, or torchrun's ``auto`` (the GPUs, else the CPUs), ``gpu``, ``cpu``."""
    if text.lstrip("-").isdigit():
        return int(text)  # the agent's config says what a count must be
    if text in ("auto", "gpu", "cpu"):
        count = _gpus() if text != "cpu" else 0
        if text == "gpu" and count == 0:
            raise argparse.ArgumentTypeError("gpu: this host has no GPU")
        return count or os.cpu_count() or 1
    raise argparse.ArgumentTypeError(f"{text!r}: expected a number of ranks, auto, cpu or gpu")


def nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` nodes."""
    low, _, high = text.partition(":")
    if not low.isdigit() or not (high or low).isdigit() or int(low) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN:MAX nodes (N >= 1)")
    bounds = (int(low), int(high or low))
    if bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: MAX is less than MIN")
    return bounds


def resolve(args: argparse.Namespace) -> list[str]:
    """Fold torchrun's options into flashrecovery's (in place); ConfigError says why not. What
    is returned is said to the user: what of torchrun's is not used here."""
    low, high = args.nnodes = args.nnodes or (1, 1)
    if high > low:
        if args.spare_nodes not in (0, high - low):
            raise ConfigError(
                f"--nnodes {low}:{high} keeps {high - low} spare node(s), --spare-nodes says "
                f"{args.spare_nodes}"
            )
        args.spare_nodes = high - low
    args.nnodes = low
    if args.rdzv_backend not in (None, *BACKENDS):
        raise ConfigError(
            f"--rdzv-backend {args.rdzv_backend}: the agents meet on node 0's own store; use "
            f"{' or '.join(BACKENDS)} (or leave it out)"
        )
    several = args.nnodes > 1 or args.spare_nodes > 0
    named = args.master_addr is not None or args.master_port is not None
    if named and args.rdzv_endpoint is not None:
        raise ConfigError("--master-addr/--master-port and --rdzv-endpoint name one thing")
    if named and several:  # one node's agent hosts its store on a free port of its own
        host = args.master_addr or "127.0.0.1"
        args.rdzv_endpoint = Endpoint.parse(f"{host}:{args.master_port or DEFAULT_PORT}")
    if args.standalone and (several or args.rdzv_endpoint is not None):
        raise ConfigError(
            "--standalone is one node on a store of its own: not with --nnodes > 1 or a "
            "rendezvous endpoint"
        )
    notes = []
    if args.rdzv_conf:
        notes.append(
            f"--rdzv-conf {args.rdzv_conf} is not used: the agents' rendezvous has bounds of "
            "its own (--node-wait)"
        )
    if named and not several:
        notes.append(
            "--master-addr/--master-port are not used on one node: the agent's store takes a "
            "free port, and the ranks see it as MASTER_ADDR/MASTER_PORT"
        )
    return notes


DEFAULT_PORT = 29500  # torchrun's --master-port


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
