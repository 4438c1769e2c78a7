"""The machines do exactly what their declarations say: every declared arc fires from every
source, every other (state, trigger) pair is refused loudly and changes nothing. The cases are
generated from STATES/TRANSITIONS/INITIAL, so a new arc or state is covered without editing."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from flashrecovery import cli
from flashrecovery.errors import IllegalTransition
from flashrecovery.statemachines import diagram
from flashrecovery.statemachines.base import Stamp, StateMachine, Step
from flashrecovery.statemachines.diagram import MACHINES, Edge, edges

REPO = Path(__file__).resolve().parent.parent


def path_to(machine: type[StateMachine], target: str) -> list[str]:
    """The shortest list of triggers leading from INITIAL to ``target`` (BFS over the arcs)."""
    paths: dict[str, list[str]] = {machine.INITIAL: []}
    queue = deque([machine.INITIAL])
    while queue:
        state = queue.popleft()
        for arc in edges(machine):
            if arc.source == state and arc.dest not in paths:
                paths[arc.dest] = [*paths[state], arc.trigger]
                queue.append(arc.dest)
    if target not in paths:
        raise AssertionError(f"{machine.__name__}: state {target!r} is unreachable")
    return paths[target]


def machine_in(name: str, state: str) -> StateMachine:
    """A fresh machine walked to ``state`` by legal triggers, one stamp per step."""
    machine = MACHINES[name](f"{name}:0")
    for position, trigger in enumerate(path_to(MACHINES[name], state)):
        machine.fire(trigger, Stamp(position, 100.0 + position, "walk"))
    assert machine.state == state
    return machine


def triggers(machine: type[StateMachine]) -> list[str]:
    return sorted({arc.trigger for arc in edges(machine)})


LEGAL = [
    pytest.param(name, arc, id=f"{name}:{arc.source}-{arc.trigger}->{arc.dest}")
    for name, machine in MACHINES.items()
    for arc in edges(machine)
]
ILLEGAL = [
    pytest.param(name, state, trigger, id=f"{name}:{state}-{trigger}")
    for name, machine in MACHINES.items()
    for state in machine.STATES
    for trigger in triggers(machine)
    if (state, trigger) not in {(a.source, a.trigger) for a in edges(machine)}
]
STATES = [
    pytest.param(name, state, id=f"{name}:{state}")
    for name, machine in MACHINES.items()
    for state in machine.STATES
]


@pytest.mark.parametrize(("name", "arc"), LEGAL)
def test_every_declared_transition_fires_and_is_stamped(name: str, arc: Edge) -> None:
    machine = machine_in(name, arc.source)
    before = list(machine.history)
    stamp = Stamp(position=42, ts=123.5, cause="heartbeat_missed")

    machine.fire(arc.trigger, stamp)

    assert machine.state == arc.dest
    assert machine.history == [*before, Step(arc.trigger, arc.source, arc.dest, stamp)]
    assert machine.entered(arc.dest) == stamp


@pytest.mark.parametrize(("name", "state", "trigger"), ILLEGAL)
def test_every_undeclared_pair_is_refused_without_effect(
    name: str, state: str, trigger: str
) -> None:
    machine = machine_in(name, state)
    before = list(machine.history)
    stamp = Stamp(position=7, ts=1.0, cause="rank_exited")

    with pytest.raises(IllegalTransition) as raised:
        machine.fire(trigger, stamp)

    message = str(raised.value)
    assert f"{name}:0" in message and f"'{trigger}'" in message and f"'{state}'" in message
    assert (raised.value.machine, raised.value.trigger, raised.value.state) == (
        f"{name}:0",
        trigger,
        state,
    )
    assert raised.value.stamp == stamp
    assert machine.state == state
    assert machine.history == before


@pytest.mark.parametrize("name", list(MACHINES))
def test_unknown_trigger_is_refused(name: str) -> None:
    machine = MACHINES[name](name)
    with pytest.raises(IllegalTransition, match="'no_such_trigger'"):
        machine.fire("no_such_trigger", Stamp(0, 0.0, "test"))
    assert machine.state == MACHINES[name].INITIAL and machine.history == []


@pytest.mark.parametrize(("name", "state"), STATES)
def test_can_lists_exactly_the_declared_triggers(name: str, state: str) -> None:
    machine = machine_in(name, state)
    declared = {arc.trigger for arc in edges(MACHINES[name]) if arc.source == state}
    assert {t for t in triggers(MACHINES[name]) if machine.can(t)} == declared
    assert not machine.can("no_such_trigger")


def test_entered_gives_the_latest_entry_and_none_before_any() -> None:
    rank = MACHINES["rank"]("rank:3")
    assert rank.entered("pending") is None  # the initial state is not entered by a record
    stamps = [Stamp(i, 10.0 + i, cause) for i, cause in enumerate("abcd")]
    for trigger, stamp in zip(["join", "ready", "suspect", "clear"], stamps, strict=True):
        rank.fire(trigger, stamp)
    assert rank.entered("healthy") == stamps[3]
    assert rank.entered("suspect") == stamps[2]
    assert rank.entered("failed") is None


def test_machines_are_independent_instances() -> None:
    """Stamps and states live on the instance, not the class (one machine per rank)."""
    first, second = MACHINES["rank"]("rank:0"), MACHINES["rank"]("rank:1")
    first.fire("join", Stamp(0, 0.0, "rank_joined"))
    assert (first.state, second.state) == ("joining", "pending")
    assert second.history == []


# ------------------------------------------------------------------ diagrams


@pytest.mark.parametrize("name", list(MACHINES))
def test_diagram_has_every_state_and_arc_of_the_declaration(name: str) -> None:
    machine = MACHINES[name]
    lines = diagram.mermaid(machine).splitlines()
    assert lines[:2] == ["stateDiagram-v2", f"    [*] --> {machine.INITIAL}"]
    for arc in edges(machine):
        assert f"    {arc.source} --> {arc.dest}: {arc.trigger}" in lines
    mentioned = {word for line in lines[1:] for word in line.replace(":", " ").split()}
    assert set(machine.STATES) <= mentioned


def test_committed_diagram_page_is_up_to_date() -> None:
    page = REPO / diagram.DOC_PATH
    assert page.read_text() == diagram.markdown(list(MACHINES)), (
        f"{diagram.DOC_PATH} is stale: run `flashrecovery diagram --markdown {diagram.DOC_PATH}`"
    )


def run_cli(argv: list[str]) -> int:
    """Through the command registry, but without cli.main's logging set-up, which would bind
    structlog to this test's captured stderr for every later test."""
    args = cli.build_parser(argv).parse_args(argv)
    code: int = args._module.run(args)
    return code


def test_diagram_command_prints_one_machine_or_writes_markdown(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_cli(["diagram", "--machine", "incident"]) == 0
    out = capsys.readouterr().out
    assert out == "%% incident\n" + diagram.mermaid(MACHINES["incident"])
    assert run_cli(["diagram"]) == 0  # every machine: a fence each, never run together
    every = capsys.readouterr().out
    assert every == diagram.markdown(list(MACHINES))
    assert every.count("```mermaid\nstateDiagram-v2\n") == every.count("\n```\n") == len(MACHINES)

    target = tmp_path / "docs" / "machines.md"
    assert run_cli(["diagram", "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.count("```mermaid\nstateDiagram-v2\n") == len(MACHINES)
    assert text == diagram.markdown(list(MACHINES))
