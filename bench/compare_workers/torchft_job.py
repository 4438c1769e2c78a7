"""A torchft job on one machine: the lighthouse, one replica group per rank, and a supervisor
that respawns a replica which dies (what a cluster scheduler does for torchft).

    python bench/compare_workers/torchft_job.py --world 2 --model gpt --steps 1000 --out /abs

Exits 0 once every replica finished; on SIGTERM it ends its replicas and exits.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from torchft.coordination import LighthouseServer

WORKER = Path(__file__).resolve().with_name("torchft_worker.py")
POLL_S = 0.05
STOP_GRACE_S = 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse (torchft's default)"
    )
    parser.add_argument(
        "--join-timeout-ms", type=int, default=60_000, help="lighthouse (torchft's default)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="the Manager's and its group's (default)"
    )
    args = parser.parse_args()
    out = args.out.resolve()  # the replicas need absolute paths
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=100,  # torchft's default
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )

    def spawn(replica: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, str(WORKER), "--replica", str(replica)]
        command += ["--world", str(args.world), "--model", args.model, "--steps", str(args.steps)]
        command += ["--out", str(out), "--lighthouse", lighthouse.address()]
        command += ["--timeout-s", str(args.timeout_s)]
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    replicas = {r: spawn(r) for r in range(args.world)}
    finished: set[int] = set()
    while not stopping and len(finished) < args.world:
        time.sleep(POLL_S)
        for replica, process in replicas.items():
            code = process.poll()
            if code == 0:
                finished.add(replica)
            elif code is not None and replica not in finished:
                print(f"replica {replica} exited with {code}: respawned", flush=True)
                replicas[replica] = spawn(replica)
    for process in replicas.values():
        if process.poll() is None:
            process.terminate()
    for process in replicas.values():
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    lighthouse.shutdown()
    return 0 if len(finished) == args.world else 1


if __name__ == "__main__":
    sys.exit(main())
