"""Write the log of a scripted failure (no torch): 4 ranks, 1 spare, rank 2 SIGKILLed after
step 2, recovered, finished. Then inspect it with `flashrecovery events` / `replay`.

    python examples/scripted_scenario.py runs/scripted/log.db
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flashrecovery.connectors import open_log
from flashrecovery.testing.simworld import scripted_failure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "db", nargs="?", default="runs/scripted/log.db", help="sqlite file to write"
    )
    parser.add_argument("--job-id", default="scripted")
    args = parser.parse_args()
    url = f"sqlite://{Path(args.db).resolve()}"
    with open_log(url) as log:
        if args.job_id in log.jobs():
            parser.error(f"{args.db} already holds job {args.job_id!r}; choose another --job-id")
        decisions = scripted_failure(log, args.job_id)
    print(f"wrote job {args.job_id!r} to {url}: {len(decisions)} decisions")
    for decision in decisions:
        print(f"  {decision.type} (caused by events position {decision.caused_by})")
    print(f"\n  flashrecovery events --log {url} --job {args.job_id}")
    print(f"  flashrecovery replay --log {url} --job {args.job_id}")
    print("  flashrecovery diagram")


if __name__ == "__main__":
    main()
