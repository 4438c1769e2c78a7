"""Agents probing their links (agent/link_probe.py) with real datagrams: on loopback every
probe comes back on time; across hosts with networks of their own, a host whose link drops
packets at random shows late probes on its links and only on its links."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from flashrecovery.agent import netns
from flashrecovery.agent.link_probe import LinkProbe, ring_peers
from flashrecovery.records import LinkSample

WHY = netns.unavailable()

# One agent's probe in a host: answers at its address, probes the peers given on stdin for
# the seconds given, then prints its samples of the whole time as JSON.
PROBE = """
import json, sys, time
from flashrecovery.agent.link_probe import LinkProbe
probe = LinkProbe(sys.argv[1])
print(probe.endpoint, flush=True)
peers = json.loads(sys.stdin.readline())
probe.probe({int(node): endpoint for node, endpoint in peers.items()})
time.sleep(float(sys.argv[2]))  # the probes' own rhythm: what is measured is this long
totals = {}
for sample in probe.take():
    totals[sample.peer] = [sample.probes, sample.late]
probe.close()
print(json.dumps(totals), flush=True)
"""


def test_ring_peers_are_the_next_nodes_round_the_ring() -> None:
    assert ring_peers(2, [0, 1, 3, 4, 5, 6], count=3) == [3, 4, 5]
    assert ring_peers(5, [0, 1, 2, 6], count=3) == [6, 0, 1]
    assert ring_peers(0, [1, 2]) == [1, 2]


def test_on_loopback_every_probe_is_answered_on_time() -> None:
    a, b = LinkProbe("127.0.0.1"), LinkProbe("127.0.0.1")
    try:
        a.probe({1: b.endpoint})
        b.probe({0: a.endpoint})
        counted: dict[int, list[LinkSample]] = {0: [], 1: []}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(s.probes for s in counted[0]) < 10:
            counted[0] += a.take()
            counted[1] += b.take()
            time.sleep(0.1)
        assert sum(s.probes for s in counted[0]) >= 10
        assert all(s.peer == 1 and s.late == 0 for s in counted[0])
        assert all(s.peer == 0 and s.late == 0 for s in counted[1])
        a.probe({})  # a peer left out is forgotten
        a.take()
        time.sleep(0.3)
        assert a.take() == []
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")
def test_a_host_dropping_packets_shows_late_probes_on_its_links_only() -> None:
    names = ["a", "b", "c"]
    with netns.Network(names) as network:
        network.drop("c", netns.Direction.BOTH, 30)
        hosts = [network.hosts[name] for name in names]
        procs = [
            subprocess.Popen(
                host.command([sys.executable, "-c", PROBE, host.address, "4"]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for host in hosts
        ]
        try:
            endpoints = [p.stdout.readline().strip() for p in procs if p.stdout is not None]
            for me, proc in enumerate(procs):
                peers = {n: e for n, e in enumerate(endpoints) if n != me}
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(peers) + "\n")
                proc.stdin.flush()
            out = [proc.communicate(timeout=30)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        totals = [{int(k): v for k, v in json.loads(line).items()} for line in out]
    a, b, c = totals
    assert a[1][0] >= 20 and a[1][1] == 0 and b[0][1] == 0  # a and b: healthy both ways
    assert a[2][1] > 0 and b[2][1] > 0  # their probes of c: lost on its link
    assert c[0][1] > 0 and c[1][1] > 0  # c's own probes too
