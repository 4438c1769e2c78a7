"""Replay a job's log through the machines and check every recorded decision.

`flashrecovery replay --log URL --job ID [--until POSITION] [--json] [--plot PNG]
[--what-if NAME=VALUE …] [--verify-chain]`: the command around the replayer (replay/replayer.py)
and its rendering (replay/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flashrecovery.connectors import open_log
from flashrecovery.connectors.chain import read_streams
from flashrecovery.connectors.signing import SECRET, Keyring
from flashrecovery.errors import ConfigError, LogError
from flashrecovery.options import add_job_option
from flashrecovery.records import Stream
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.report import print_chain, print_replay, print_what_if
from flashrecovery.replay.verify import verify as verify_chains
from flashrecovery.replay.whatif import compare, parse_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL, e.g. sqlite://runs/JOB/log.db")
    add_job_option(parser, dest="job", required=True, help="job id")
    parser.add_argument("--until", type=int, default=None, help="stop after this events position")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--plot",
        type=plot_path,
        metavar="PNG",
        help="draw the job's timeline (a lane per rank, host, spare and the engine) to this file",
    )
    parser.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="decide again with this setting changed (repeatable): heartbeat_interval, "
        "missed_heartbeats, startup_grace, stall_factor, stall_floor, spares, max_replacements, "
        "max_incidents; shows where detections and decisions differ and the RTO they imply",
    )
    parser.add_argument(
        "--verify-chain",
        action="store_true",
        help="also check every writer's hash chain, the final record's seal and who wrote each "
        "record (every signature, with the job's secret in FLASHRECOVERY_STORE_PREFIX); "
        "report the first break (position, writer)",
    )


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")


def plot_path(value: str) -> Path:
    """Where the timeline goes: a picture format matplotlib writes, in a directory that
    exists (nothing is made: a mistyped directory is said, not created)."""
    path = Path(value)
    kind = path.suffix.lstrip(".").lower()
    if kind not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{value}: the timeline is a picture; end the name in .{', .'.join(PLOT_FORMATS)}"
        )
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: no directory {path.parent}")
    return path


def run(args: argparse.Namespace) -> int:
    try:
        settings = parse_settings(args.what_if)
        with open_log(args.log, read_only=True) as log:
            if args.job not in log.jobs():
                raise LogError(f"job {args.job!r} has no records in {args.log}")
            secret = os.environ.get(SECRET)
            keys = Keyring(secret) if secret else None  # the job's: signatures are checked
            report = replay_job(log, args.job, args.until, keys)
            chain = verify_chains(read_streams(log, args.job), keys) if args.verify_chain else None
            what_if = (
                compare(args.job, log.read(Stream.EVENTS, args.job), settings)
                if args.what_if
                else None
            )
            if args.plot is not None:
                from flashrecovery.replay.plot import plot_job  # matplotlib: only when asked

                plot_job(log, args.job, args.plot, report)
    except (LogError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        document = report.to_json()
        if chain is not None:
            document["chain"] = chain.to_json()
        if what_if is not None:
            document["what_if"] = what_if.to_json()
        print(json.dumps(document, indent=2))
    else:
        print_replay(report)
        if chain is not None:
            print_chain(chain)
        if what_if is not None:
            print_what_if(what_if)
    if args.plot is not None:
        print(f"timeline: {args.plot}")
    return 0 if report.ok and (chain is None or chain.ok) else 1
