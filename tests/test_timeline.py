"""The timeline picture: the data handed to the plot matches replay, and the file is a PNG."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from matplotlib import image

from flashrecovery.cli import main
from flashrecovery.connectors import open_log
from flashrecovery.connectors.memory import MemoryLog
from flashrecovery.records import Stream
from flashrecovery.replay.plot import render
from flashrecovery.replay.replayer import replay_job
from flashrecovery.replay.timeline import build
from flashrecovery.statemachines.incident import PHASES
from flashrecovery.testing.simworld import scripted_failure, scripted_hang

JOB = "scripted"


def test_incident_spans_last_what_replay_says_each_phase_lasted() -> None:
    log = MemoryLog()
    scripted_failure(log, JOB, world_size=3, spares=1, kill_rank=1)
    report = replay_job(log, JOB)
    events = log.read(Stream.EVENTS, JOB)
    line = build(events, report)
    [incident] = report.incidents()
    assert list(line.phases(incident["incident_id"])) == PHASES
    assert line.phases(incident["incident_id"]) == pytest.approx(incident["phases_s"], abs=1e-6)
    phase_spans = [s for s in line.spans if s.kind in PHASES]
    assert {s.lane for s in phase_spans} == {"rank 1"}
    # Back to back: each phase starts where the previous one ended, from the fault on.
    failure = report.state.incidents[0].failure_ts - line.t0
    assert phase_spans[0].start == pytest.approx(failure)
    for before, after in itertools.pairwise(phase_spans):
        assert after.start == pytest.approx(before.end)

    assert line.lanes == ["rank 0", "rank 1", "rank 2", "host sim-host", "spare 0", "engine"]
    commits = [m for m in line.marks if m.kind == "commit"]
    steps = [e.record for e in events if e.record and e.record.type == "step_completed"]
    assert len(commits) == len(steps)
    [fault] = [m for m in line.marks if m.kind == "fault"]
    assert (fault.lane, fault.label) == ("rank 1", "signal 9")
    [spare] = [s for s in line.spans if s.kind == "spare"]
    activated = next(e.record for e in events if e.record and e.record.type == "spare_activated")
    [taken] = [m for m in line.marks if m.kind == "takeover"]
    assert (spare.label, taken.lane, taken.label) == ("ready", "spare 0", "→ rank 1")
    assert spare.end == taken.at == pytest.approx(activated.ts - line.t0)  # where it took over
    [lease] = [s for s in line.spans if s.kind == "lease"]
    assert lease.label == "engine in the agent"


def test_render_writes_a_png_image(tmp_path: Path) -> None:
    log = MemoryLog()
    scripted_failure(log, JOB)
    line = build(log.read(Stream.EVENTS, JOB), replay_job(log, JOB))
    path = render(line, tmp_path / "out" / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(path).shape
    assert width > 1000 and height > 300


def test_replay_plot_option_writes_the_picture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with open_log(url) as log:
        scripted_failure(log, JOB)
    target = tmp_path / "timeline.png"
    assert main(["replay", "--log", url, "--job", JOB, "--plot", str(target)]) == 0
    assert f"timeline: {target}" in capsys.readouterr().out
    assert image.imread(target).shape[2] in (3, 4)


def test_a_hang_is_marked_where_the_silence_began_and_zoomed_in_on(tmp_path: Path) -> None:
    log = MemoryLog()
    scripted_hang(log, "hung")
    report = replay_job(log, "hung")
    line = build(log.read(Stream.EVENTS, "hung"), report)
    [incident] = report.state.incidents
    [fault] = [m for m in line.marks if m.kind == "fault"]
    assert (fault.lane, fault.label) == ("rank 1", "silent from here")
    assert fault.at == pytest.approx(incident.failure_ts - line.t0)
    symptoms = [(m.lane, m.label.split(" ")[0]) for m in line.marks if m.kind == "symptom"]
    assert ("rank 1", "silent") in symptoms  # the detector's finding, when it was made
    assert ("rank 1", "signal") in symptoms  # the hung process killed once isolated
    [(start, end)] = line.incidents().values()
    assert start == pytest.approx(fault.at)
    assert end - start == pytest.approx(sum(line.phases(incident.incident_id).values()))
    assert image.imread(render(line, tmp_path / "hang.png")).shape[0] > 600  # two panels


def test_the_host_lane_spans_the_beats_its_agent_carried() -> None:
    """A recorded demo's ranks beat through their agent's node records: the host was heard
    from for the whole job, not at its ranks' joins only (a hairline)."""
    db = Path(__file__).resolve().parent / "fixtures" / "recovery.db"
    with open_log(f"sqlite://{db}", read_only=True) as log:
        [job] = log.jobs()
        events = log.read(Stream.EVENTS, job)
        line = build(events, replay_job(log, job))
    carried = [e.record.ts - line.t0 for e in events if getattr(e.record, "beats", None)]
    [host] = [s for s in line.spans if s.kind == "heard"]
    assert carried and host.end == pytest.approx(max(carried))
    assert host.end - host.start > 1.0  # the joins alone span a few milliseconds
