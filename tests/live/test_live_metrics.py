"""Prometheus metrics of a live job, scraped over HTTP while a rank is SIGKILLed and replaced;
then `flashrecovery metrics` over the finished log serves the same values."""

from __future__ import annotations

import threading
import urllib.error
from pathlib import Path

import pytest
from livejob import STEPS, Processes, run_job
from scrape import Samples, free_port, scrape, value

from flashrecovery.connectors.chain import read_streams
from flashrecovery.observe.exporter import MetricsServer
from flashrecovery.records import Envelope
from flashrecovery.replay.verify import verify

pytestmark = pytest.mark.timeout(240)
SCRAPE_EVERY_S = 0.1
STABLE = [  # once the incident is closed these no longer move
    ("flashrecovery_incidents_total", {"cause": "rank_exited"}),
    ("flashrecovery_rto_seconds_count", {}),
    ("flashrecovery_rto_seconds_sum", {}),
    ("flashrecovery_detection_seconds_sum", {}),
    ("flashrecovery_steps_recomputed_total", {}),
    ("flashrecovery_steps_lost_total", {}),
]


class Scraper:
    """Scrapes a URL every SCRAPE_EVERY_S until stopped, keeping every answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[Samples] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(SCRAPE_EVERY_S):
            try:
                self.seen.append(scrape(self.url))
            except (urllib.error.URLError, ConnectionError):
                continue  # not serving yet, or the agent has ended

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def collapse(values: list[float | None]) -> list[float]:
    """The values in order with repeats (and gaps) removed: what a graph of them shows."""
    out: list[float] = []
    for v in values:
        if v is not None and (not out or out[-1] != v):
            out.append(v)
    return out


def test_metrics_through_a_kill_and_recovery_and_from_the_finished_log(tmp_path: Path) -> None:
    port = free_port()
    # An early kill; the ranks then hold before step 10 until the refilled spare (spare 1:
    # a new process importing torch and warming up, seconds on two busy cores) is ready, so
    # the scrapes see it back before the job ends.
    gate = tmp_path / "gate"

    def refilled(record: Envelope, known: Processes) -> bool:
        if 1 in known.spares:
            gate.touch()
            return True
        return False

    with Scraper(f"http://127.0.0.1:{port}/metrics") as scraper:
        job = run_job(
            tmp_path,
            spares=1,
            kill_at={1: 3},
            step_time_s=0.2,
            metrics_port=port,
            scenario=[refilled],
            script_args=["--hold-at", "10", "--hold-file", str(gate)],
        )
    assert job.exit_code == 0, job.records(type="job_finished")
    live = scraper.seen
    assert len(live) > 10, "the endpoint never answered"

    spares = collapse([value(s, "flashrecovery_spares_ready") for s in live])
    # Ready, taken for rank 1 and refilled: the refill is forked and ready within tens of ms
    # (agent/forkserver.py), so a scrape may or may not fall between; the log says it all.
    assert spares[:2] == [0, 1] and spares[-1] == 1, spares
    assert len(job.records(type="spare_activated")) == 1
    assert len(job.records(type="spare_ready")) == 2
    incidents = collapse(
        [value(s, "flashrecovery_incidents_total", cause="rank_exited") for s in live]
    )
    assert incidents[-1] == 1
    closed = [s for s in live if value(s, "flashrecovery_rto_seconds_count") == 1]
    assert closed, "no scrape saw the incident closed"
    [incident] = job.decisions("incident_closed")
    assert value(closed[-1], "flashrecovery_rto_seconds_sum") == pytest.approx(incident.rto_s)
    isolated = max(value(s, "flashrecovery_ranks", state="isolated") or 0 for s in live)
    assert isolated in (0, 1)  # a rank may sit isolated between two scrapes, never two ranks
    committed = collapse([value(s, "flashrecovery_steps_committed_total") for s in live])
    assert committed == sorted(committed) and committed[-1] >= STEPS - 5
    lag = [value(s, "flashrecovery_log_lag_records") for s in live]
    assert all(v is not None and v >= 0 for v in lag)

    # Ranks, spares, the agent, the engine and its detectors all wrote to one log at once: every
    # writer's hash chain holds, and the agent's final record seals them all.
    chain = verify(read_streams(job.log, job.job_id))
    assert chain.ok and chain.sealed and chain.unchained == 0, chain.first
    assert chain.writers >= 6  # 3 ranks, a spare, the agent, the engine (and more processes)

    # The finished job, from its log alone, on a port the OS picks.
    server = MetricsServer(job.log.url, job.job_id, 0, host="127.0.0.1").start()
    try:
        assert server.wait_caught_up(30)
        finished = scrape(server.url)
    finally:
        server.stop()
    for name, labels in STABLE:
        assert value(finished, name, **labels) == value(closed[-1], name, **labels), name
    assert value(finished, "flashrecovery_steps_committed_total") == STEPS
    assert value(finished, "flashrecovery_job_state", state="completed") == 1
    assert value(finished, "flashrecovery_step_duration_seconds_count") == len(
        job.records(type="step_completed")
    )
    assert value(finished, "flashrecovery_log_lag_records") is None  # no engine in that process
