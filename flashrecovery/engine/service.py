"""Run the engine for a job as a service, apart from the agent.

`flashrecovery engine --log URL --job ID`: rebuilds the job's state from the log, writes the
decisions still due, then follows the events until the job ends.
"""

from __future__ import annotations

import argparse
import signal
import sys

from flashrecovery.connectors import LogError, open_log
from flashrecovery.engine.loop import EngineLoop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="log URL")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--poll", type=float, default=0.05, help="longest wait per follow (s)")


def run(args: argparse.Namespace) -> int:
    try:
        log = open_log(args.log)
    except LogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loop = EngineLoop(log, args.job, poll_s=args.poll)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop(timeout=0))
    try:
        loop.run()
    except KeyboardInterrupt:
        return 130
    finally:
        log.close()
    print(f"job {args.job}: {loop.state.job.state}")
    return 0
