"""The package's shape: every import between its parts points down the layers below, so no two
parts import each other (no cycle) and a reader of the log never pulls in a writer's process.

A part is a subpackage of ``flashrecovery`` or a module at its root. Imports made only for type
checking count too: a cycle of types is still a cycle a reader must hold in mind.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import flashrecovery

PACKAGE = Path(flashrecovery.__file__).resolve().parent

# Lowest first; a part may import only parts of lower layers (and itself). README
# "Architecture" and docs/protocol.md describe the same table.
LAYERS: list[set[str]] = [
    {"errors", "logs", "terminal", "heap", "line_sender", "options"},
    {"records"},
    {"statemachines", "connectors"},
    {"engine"},
    {"testing"},
    {"replay", "observe", "trainer_hooks"},
    {"integrations"},  # other trainers over the hook (they import those trainers)
    {"agent"},
    {"demo"},
    {"chaos"},
    {"cli"},
]


def part_of(module: str) -> str | None:
    """``flashrecovery.engine.decide`` -> ``engine``; the package itself is no part."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flashrecovery" and len(parts) > 1 else None


def imports() -> dict[str, set[str]]:
    """Part -> the other parts its modules import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).with_suffix("").parts
        here = part_of(".".join(("flashrecovery", *module)))
        if here is None or here == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "flashrecovery":  # from flashrecovery import heap
                    names = [f"flashrecovery.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                there = part_of(name)
                if there is not None and there != here:
                    graph[here].add(there)
    return graph


def layer_of(part: str) -> int:
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise AssertionError(f"flashrecovery.{part} is in no layer of LAYERS: place it there")


def test_every_part_is_placed_in_a_layer() -> None:
    parts = {part_of(f"flashrecovery.{p.stem}") for p in PACKAGE.iterdir() if p.suffix == ".py"}
    parts |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    parts.discard("__init__")
    for part in parts:
        layer_of(str(part))


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that point up or sideways."""
    return [
        f"{here} (layer {layer_of(here)}) imports {there} (layer {layer_of(there)})"
        for here, theirs in sorted(graph.items())
        for there in sorted(theirs)
        if layer_of(there) >= layer_of(here)
    ]


def test_imports_only_point_down_so_no_part_imports_another_that_imports_it() -> None:
    found = upward(imports())
    assert not found, "imports that point up or sideways:\n" + "\n".join(found)


def test_the_graph_is_read_from_the_sources_and_an_upward_import_is_named() -> None:
    graph = imports()
    assert "statemachines" in graph["engine"]  # decide's machines: edges are found at all
    assert "connectors" in graph["replay"]
    engine, replay = layer_of("engine"), layer_of("replay")
    assert upward({"engine": {"replay"}, "replay": {"engine"}}) == [
        f"engine (layer {engine}) imports replay (layer {replay})"
    ]
