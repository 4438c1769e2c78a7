"""The dashboard against a real Prometheus: Debian's `prometheus` scrapes a live job through a
SIGKILL and a recovery, and every PromQL expression of docs/grafana-dashboard.json, asked through
its HTTP API as Grafana asks it, returns a series.

Two targets, as a large job has them: the agent's /metrics (per-rank heartbeat ages, the engine's
log lag) and a `flashrecovery metrics` server that folds the same log with the per-host heartbeat
ages a job past --per-rank-limit ranks serves (only that family is kept from it, so nothing the
panels sum is counted twice).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from livejob import Processes, run_job
from scrape import free_port

from flashrecovery.observe.exporter import MetricsServer
from flashrecovery.records import Envelope

pytestmark = pytest.mark.timeout(240)
DASHBOARD = Path(__file__).parent.parent.parent / "docs" / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
READY_S = 60.0  # Prometheus opening its TSDB, on two busy cores
SERIES_S = 60.0  # every expression has a series within this, or the test says which did not
HOST_FAMILY = "flashrecovery_host_heartbeat_age_seconds"
Answers = dict[str, list[dict[str, Any]]]  # expression -> its instant vector


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


class Prometheus:
    """Debian's prometheus on loopback, scraping ``targets`` (job name -> host:port) every
    half second, with its TSDB in ``directory``."""

    def __init__(self, directory: Path, targets: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = len(targets)
        jobs = []
        for name, target in targets.items():
            job: dict[str, Any] = {"job_name": name, "static_configs": [{"targets": [target]}]}
            if name == "per-host":
                job["metric_relabel_configs"] = [
                    {"source_labels": ["__name__"], "regex": HOST_FAMILY, "action": "keep"}
                ]
            jobs.append(job)
        config = {
            "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
            "scrape_configs": jobs,
        }
        (directory / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.output = open(directory / "prometheus.out", "w")  # noqa: SIM115 (closed in stop)
        assert PROMETHEUS is not None
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.output,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        """Until it scrapes every target (``up`` has a sample of each, 0 while its process is
        not there yet): it is ready before its first scrape, which may come seconds later (its
        discovery hands the targets over in batches), and a job that reached its hold by then
        left one sample of its counters and no increase for a rate."""
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "prometheus exited; see prometheus.out"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200 and len(self.query("up")) == self.targets:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)  # polling an HTTP endpoint: there is no event to wait on
        raise AssertionError(f"prometheus not scraping within {READY_S:.0f}s")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector an expression gives now (Grafana's instant query)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.load(response)
        assert answer["status"] == "success", (expr, answer)
        assert answer["data"]["resultType"] == "vector", (expr, answer["data"]["resultType"])
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.output.close()


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    yield free_port(), free_port()


@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus is not installed (apt-get install prometheus; .ci/run does)",
)
def test_every_dashboard_expression_returns_a_series_from_a_live_job(
    tmp_path: Path, ports: tuple[int, int]
) -> None:
    agent_port, host_port = ports
    prometheus = Prometheus(
        tmp_path, {"agent": f"127.0.0.1:{agent_port}", "per-host": f"127.0.0.1:{host_port}"}
    )
    gate = tmp_path / "gate"  # the ranks hold before step 10 until the queries are done
    log_url = f"sqlite:///{tmp_path / 'log.db'}"
    per_host: list[MetricsServer] = []
    answers: Answers = {}
    expressions = [expr.replace("$job_id", "live") for expr in dashboard_expressions()]
    assert len(expressions) >= 15, "the dashboard lost its panels"

    def serve_per_host(record: Envelope, known: Processes) -> bool:
        # The log exists once a record is in it: fold it with per-host heartbeat ages.
        per_host.append(MetricsServer(log_url, "live", host_port, per_rank_limit=0).start())
        return True

    def ask_every_expression(record: Envelope, known: Processes) -> bool:
        if 1 not in known.spares:  # the refilled spare: the incident is over or nearly
            return False
        deadline = time.monotonic() + SERIES_S
        while time.monotonic() < deadline:
            answers.update({expr: prometheus.query(expr) for expr in expressions})
            if at_the_hold(answers):
                break
            time.sleep(0.5)  # one scrape interval: the next answers can only differ after it
        gate.touch()
        return True

    try:
        prometheus.wait_ready()
        job = run_job(
            tmp_path,
            spares=1,
            kill_at={1: 3},
            step_time_s=0.2,
            log_url=log_url,
            metrics_port=agent_port,
            scenario=[serve_per_host, ask_every_expression],
            script_args=["--hold-at", "10", "--hold-file", str(gate)],
        )
    finally:
        for server in per_host:
            server.stop()
        prometheus.stop()
    assert job.exit_code == 0, job.records(type="job_finished")

    empty = [expr for expr in expressions if not answers.get(expr)]
    assert not empty, f"no series from Prometheus for: {empty}"

    # What the panels show is what the log says.
    [incident] = job.decisions("incident_closed")
    assert one(answers, "sum by (job_id) (flashrecovery_incidents_total") == 1
    increase = one(answers, "sum by (cause) (increase", cause="rank_exited")
    assert math.isfinite(increase) and increase >= 0  # 0 if its first scrape already counted it
    assert one(answers, "flashrecovery_rto_seconds_sum") == pytest.approx(incident.rto_s)
    assert one(answers, "max by (job_id) (flashrecovery_steps_committed_total") == 10  # held
    assert one(answers, "flashrecovery_job_state", state="running") == 1
    assert one(answers, "sum by (job_id) (flashrecovery_spares_ready") == 1
    assert one(answers, "sum by (state) (flashrecovery_ranks", state="healthy") == 3
    p50 = one(answers, "histogram_quantile(0.5")
    # a step sleeps 0.2 s: the bucket up to 0.25 s, interpolated, or on a loaded machine (CI
    # read 0.30 s once) the next one, up to 0.5 s; never below the sleep's bucket
    assert 0.1 < p50 <= 0.5
    hosts = answers[f'{HOST_FAMILY}{{job_id=~"live"}}']
    assert [series["metric"]["job"] for series in hosts] == ["per-host"]


def one(answers: Answers, expr_part: str, **labels: str) -> float:
    """The value of the one series with ``labels`` of the expression containing ``expr_part``."""
    [expr] = [e for e in answers if expr_part in e]
    matching = [
        float(series["value"][1])
        for series in answers[expr]
        if all(series["metric"].get(k) == v for k, v in labels.items())
    ]
    assert len(matching) == 1, (expr, answers[expr])
    return matching[0]


def at_the_hold(answers: Answers) -> bool:
    """Every expression has a series, and the last scrape saw the ranks at the hold (steps
    0..9 committed), the incident closed."""
    return all(answers.values()) and one(answers, "max by (job_id) (flashrecovery_steps") >= 10
