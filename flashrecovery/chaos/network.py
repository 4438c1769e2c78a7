"""The network's faults of a chaos run, carried out on a testbed's hosts (agent/testbed.py):
a node cut off both ways or in one direction, then healed once the job has given it up (its
agent then sees it was declared lost and ends, its processes with it); a link that flaps
faster than the silence limit; a link that drops 5 % of its packets for a while; the Kafka
broker leading the job's events SIGKILLed, or cut off for a while and healed (alone, or the
moment a node is SIGKILLed, so that the node is lost while the writers are held up). Each
acts once the job runs at its step and every fault before it is over (chaos/cli.py,
Plan.turn): two on one link at once would undo each other's rules, and one landing in
another's recovery tests neither."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from flashrecovery.agent.netns import Direction
from flashrecovery.agent.testbed import Testbed
from flashrecovery.chaos.schedule import CUT, LEADER_CUT, NETWORK, SLOWED, PlannedFault
from flashrecovery.chaos.verdict import Sent
from flashrecovery.connectors.kafka import KafkaSettings
from flashrecovery.demo.job import LaunchedJob
from flashrecovery.demo.watch import JobWatch, KillOutcome
from flashrecovery.engine import links
from flashrecovery.records import Stream

HEAL_AFTER_LOST_S = 1.0  # a node given up on is healed this long after (it sees it, and ends)
HEAL_AT_LATEST_S = 20.0  # a cut node is healed this long after at the latest
FLAPS = 3  # down and up this many times
FLAP_DOWN_S = 0.6  # each time for less than the silence limit (3 heartbeat intervals)
FLAP_UP_S = 0.6
DEGRADED_S = 15.0  # a degraded link's length: the engine needs a few intervals of probes
DEGRADED_PERCENT = 5
# A node named slow is cleared once its links are good over the engine's whole window of
# samples (engine/links.py, at 1 s heartbeats) and measured again: a slowed link lasts that
# much longer in a run.
CLEARED_S = links.WINDOW + 1.0
BROKER_CUT_S = 8.0  # a broker cut off this long: fenced by its controllers, then back
SETTLE_STEPS = 2  # steps committed after a heal before the next fault may come
CUT_TYPICAL_S = 8.0  # a cut node: given up after its silence limit, healed a second later, margin
# How long each kind holds its link as a rule: what a run must last beyond its steps' pace.
LASTS_S = {
    "partition": CUT_TYPICAL_S,
    "node0_partition": CUT_TYPICAL_S,
    "oneway": CUT_TYPICAL_S,
    "flap": FLAPS * (FLAP_DOWN_S + FLAP_UP_S) + CLEARED_S,
    "degraded": DEGRADED_S + CLEARED_S,
    "broker_kill": 0.0,
    "broker_partition": BROKER_CUT_S,
    "node_kill_leader_cut": BROKER_CUT_S,
}


@dataclass
class NetworkFaults:
    faults: list[PlannedFault]
    sent: dict[int, Sent]
    testbed: Testbed
    turn: Callable[[int, JobWatch], bool]  # whether every fault before this one is over

    def __call__(self, job: LaunchedJob, watch: JobWatch) -> str | None:
        for fault in self.faults:
            if fault.kind not in NETWORK:
                continue
            sent = self.sent.setdefault(fault.index, Sent())
            node = fault.node
            if fault.kind in SLOWED and node is not None and watch.state.node_lost(node):
                job.lose_node(node)  # replaced by the straggler policy: its end is not the job's
            if sent.network_ts is None:
                if fault.kind == "node_kill_leader_cut":
                    if sent.kill is None or sent.kill.outcome is not KillOutcome.KILLED:
                        return None  # the node first (the killer's), then its leader cut
                elif watch.committed() < fault.step - 1 or not watch.running:
                    return None  # in order: a later one waits for this one
                if not self.turn(fault.index, watch):
                    return None  # one before still holds a link, or has not been sent
                return self._start(fault, sent, job)
            if sent.healed_ts is not None and not sent.settled:
                self._settle(fault, sent, watch)
            if sent.healed_ts is None and self._heal_due(fault, sent, watch):
                assert sent.host is not None
                self.testbed.network.heal(sent.host)
                sent.healed_ts = time.time()
                return f"[green]healed[/] {sent.host}'s link"
        return None

    @staticmethod
    def _settle(fault: PlannedFault, sent: Sent, watch: JobWatch) -> None:
        """Over once the job commits steps again after the heal and every node still in it
        is heard from after it: every writer's records flow again (a broker cut off holds some
        writers' appends seconds longer than others'), so the next fault meets a job that got
        over this one, not one still getting over it. A slowed link is over once the engine
        no longer names its node (StragglerCleared): a link slowed again before that would
        find its node named already, and test nothing."""
        assert sent.healed_ts is not None
        if sent.healed_step is None:
            sent.healed_step = watch.committed()
            return
        nodes = [node for node in watch.state.nodes.values() if not node.lost]
        heard = all(node.last_heartbeat_ts > sent.healed_ts for node in nodes)
        progressed = watch.committed() >= sent.healed_step + SETTLE_STEPS
        node = fault.node
        named = (
            fault.kind in SLOWED
            and node is not None
            and node in watch.state.stragglers
            and not watch.state.node_lost(node)
        )
        sent.settled = watch.running and progressed and heard and not named

    @staticmethod
    def _host(fault: PlannedFault) -> str:
        return f"n{fault.node}"

    def _start(self, fault: PlannedFault, sent: Sent, job: LaunchedJob) -> str:
        network = self.testbed.network
        sent.network_ts = time.time()
        if fault.kind == "broker_kill":
            leader = self._events_leader(job)
            broker = self.testbed.kafka.brokers[leader - 1]
            if broker.process is not None:
                broker.process.send_signal(signal.SIGKILL)
            sent.notes.append(f"broker {leader} killed")
            sent.healed_ts = sent.network_ts  # nothing to heal
            return f"[red]SIGKILL[/] broker {leader}, the events' leader"
        if fault.kind in LEADER_CUT:
            leader = self._events_leader(job)
            sent.host = f"b{leader}"
            network.cut(sent.host)
            sent.notes.append(f"broker {leader} cut off")
            return f"[red]cut[/] broker {leader}, the events' leader, off"
        assert fault.node is not None
        host = sent.host = self._host(fault)
        if fault.kind in CUT:
            network.cut(host)
            job.lose_node(fault.node)
            return f"[red]cut[/] node {fault.node} off"
        if fault.kind == "oneway":
            direction = Direction.OUT if fault.direction == "out" else Direction.IN
            network.drop(host, direction)
            job.lose_node(fault.node)
            return f"[red]dropped[/] node {fault.node}'s {fault.traffic}"
        if fault.kind == "flap":
            threading.Thread(target=self._flap, args=(host, sent), daemon=True).start()
            return f"[red]flapping[/] node {fault.node}'s link"
        network.drop(host, Direction.BOTH, DEGRADED_PERCENT)
        return f"[red]degraded[/] node {fault.node}'s link ({DEGRADED_PERCENT} % lost)"

    def _flap(self, host: str, sent: Sent) -> None:
        """Down and up: the fault's own rhythm, not a wait for anything."""
        for _ in range(FLAPS):
            self.testbed.network.cut(host)
            time.sleep(FLAP_DOWN_S)
            self.testbed.network.heal(host)
            time.sleep(FLAP_UP_S)
        sent.healed_ts = time.time()

    def _heal_due(self, fault: PlannedFault, sent: Sent, watch: JobWatch) -> bool:
        assert sent.network_ts is not None
        elapsed = time.time() - sent.network_ts
        if fault.kind == "flap":
            return False  # its thread heals it
        if fault.kind == "degraded":
            return elapsed > DEGRADED_S
        if fault.kind in LEADER_CUT:
            return elapsed > BROKER_CUT_S
        lost = fault.node is not None and watch.state.node_lost(fault.node)
        if lost and sent.lost_ts is None:
            sent.lost_ts = time.time()
        given_up = sent.lost_ts is not None and time.time() - sent.lost_ts > HEAL_AFTER_LOST_S
        return given_up or elapsed > HEAL_AT_LATEST_S

    def _events_leader(self, job: LaunchedJob) -> int:
        settings = KafkaSettings.parse(job.spec.log_url)
        admin = settings.connect("admin")
        try:
            [topic] = admin.describe_topics([settings.topic(Stream.EVENTS)])
        finally:
            admin.close()
        leader: int = topic["partitions"][0]["leader_id"]
        return leader
