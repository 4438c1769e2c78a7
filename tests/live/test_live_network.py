"""The job on nodes with networks of their own (network namespaces, the log on a 3-broker Kafka
cluster of such hosts), as `flashrecovery chaos --nodes 3 --netns` runs it: node 0 (the meeting
store's and the deciding engine's host) cut off both ways while its processes run, one
direction of another node's traffic dropped, a link dropping 5 % of its packets, the broker
leading the job's events cut off. Every check of the chaos
verdict holds: the job completes bitwise equal to a fault-free run, each cut node is given up
and replaced, the degraded node is named as the cause in the log and, with --straggler-policy
replace, replaced (the default, report, is judged by bench.nemesis --quick in CI and by
tests/test_chaos.py), replay finds no divergence and no split brain (one engine decided,
one generation committed each step), no record was lost or stored twice, no process and no
namespace is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashrecovery.agent import netns

REPO = Path(__file__).resolve().parents[2]
WHY = netns.unavailable()
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}"),
    pytest.mark.timeout(900),
]


def chaos(tmp_path: Path, kinds: str, faults: int, seed: int, *more: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "flashrecovery.cli", "chaos", "--nodes", "3", "--netns",
        "--kinds", kinds, "--faults", str(faults), "--seed", str(seed),
        "--run-dir", str(tmp_path / "run"), "--json", "--timeout", "400", *more,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the ranks import this checkout
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=840, cwd=tmp_path, env=env
    )
    assert done.stdout.strip(), f"no verdict; stderr:\n{done.stderr[-3000:]}"
    verdict: dict[str, Any] = json.loads(done.stdout)
    context = json.dumps(verdict, indent=1)[:8000]
    assert done.returncode == 0, context
    assert verdict["ok"] and all(verdict["checks"].values()), context
    for check in ("unleased_deciders", "double_commits", "believed_from_lost_nodes"):
        assert verdict["replay"][check] == [], context
    assert all(r["sent"] and r["recovered"] for r in verdict["faults"]), context
    return verdict


def test_node_0_and_the_events_leader_cut_off_one_way_loss_a_degraded_node_replaced(
    tmp_path: Path,
) -> None:
    kinds = "oneway,degraded,node0_partition,broker_partition"
    # seed 26: node 2 degraded at step 4, node 0 cut off at 12, the events' leader at 20, and
    # node 1's outgoing traffic dropped at 28 (the last: it leaves the job one node of its own)
    # paced as chaos paces netns runs by default (the steps such a job takes anyway)
    verdict = chaos(tmp_path, kinds, 4, 26, "--straggler-policy", "replace")
    rows = {r["kind"]: r for r in verdict["faults"]}
    assert set(rows) == set(kinds.split(","))
    for kind in ("oneway", "node0_partition"):
        assert len(rows[kind]["incidents"]) == 1, rows[kind]
    assert rows["broker_partition"]["incidents"] == []  # the log's fault costs no incident
    degraded = rows["degraded"]
    assert len(degraded["incidents"]) == 1, degraded  # named, then replaced by the policy
    assert "named and replaced" in degraded["notes"][0], degraded
