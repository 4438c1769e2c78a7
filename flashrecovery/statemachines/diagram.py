"""Print the rank, job and incident state machines as mermaid diagrams.

`flashrecovery diagram [--machine rank|job|incident|all] [--markdown PATH]`. The diagrams are
generated from each machine's declaration (STATES, TRANSITIONS, INITIAL), so they cannot drift
from what the engine runs; ``docs/machines.md`` is this command's output with ``--markdown``.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any, NamedTuple

from flashrecovery.statemachines.base import StateMachine
from flashrecovery.statemachines.incident import IncidentMachine
from flashrecovery.statemachines.job import JobMachine
from flashrecovery.statemachines.rank import RankMachine
from flashrecovery.statemachines.session import SessionMachine

MACHINES: dict[str, type[StateMachine[Any]]] = {
    "rank": RankMachine,
    "job": JobMachine,
    "incident": IncidentMachine,
    "session": SessionMachine,
}
DOC_PATH = Path("docs/machines.md")


class Edge(NamedTuple):
    """One (source, trigger, dest) arc of a declaration, a list of sources spelled out."""

    source: str
    trigger: str
    dest: str


def edges(machine: type[StateMachine[Any]]) -> list[Edge]:
    """Every arc of the declaration, in declaration order (``"*"`` means every state)."""
    out: list[Edge] = []
    for transition in machine.TRANSITIONS:
        sources = transition["source"]
        if sources == "*":
            sources = machine.STATES
        elif isinstance(sources, str):
            sources = [sources]
        out.extend(Edge(source, transition["trigger"], transition["dest"]) for source in sources)
    return out


def mermaid(machine: type[StateMachine[Any]]) -> str:
    """The machine as a `stateDiagram-v2`: start arrow, one labelled arrow per arc, and an
    end arrow from every state nothing leaves."""
    arcs = edges(machine)
    lines = ["stateDiagram-v2", f"    [*] --> {machine.INITIAL}"]
    lines += [f"    {e.source} --> {e.dest}: {e.trigger}" for e in arcs]
    left = {e.source for e in arcs}
    lines += [f"    {state} --> [*]" for state in machine.STATES if state not in left]
    return "\n".join(lines) + "\n"


def _summary(machine: type[StateMachine[Any]]) -> str:
    module = inspect.getmodule(machine)
    doc = (module.__doc__ if module else None) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def markdown(names: list[str]) -> str:
    """A markdown page with one mermaid fence per machine, headed by its module's summary."""
    parts = [
        "# State machines",
        "",
        "Generated from the machines' declarations by "
        f"`flashrecovery diagram --markdown {DOC_PATH}`; do not edit by hand.",
    ]
    for name in names:
        machine = MACHINES[name]
        parts += ["", f"## {name}", "", _summary(machine), "", "```mermaid"]
        parts.append(mermaid(machine).rstrip("\n"))
        parts.append("```")
    return "\n".join(parts) + "\n"


def selected(choice: str) -> list[str]:
    return list(MACHINES) if choice == "all" else [choice]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--machine", choices=[*MACHINES, "all"], default="all", help="which machine (default all)"
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="PATH",
        help=f"write a markdown page with mermaid fences to PATH (the repo keeps {DOC_PATH})",
    )


def run(args: argparse.Namespace) -> int:
    names = selected(args.machine)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(names))
        return 0
    if len(names) > 1:  # one mermaid fence each: a renderer takes one diagram at a time
        print(markdown(names), end="")
    else:  # one machine: mermaid as it is, for a renderer's standard input
        print(f"%% {names[0]}\n{mermaid(MACHINES[names[0]])}", end="")
    return 0
