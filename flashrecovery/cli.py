"""`flashrecovery` command line: each subcommand lives in the module that owns its concept.

A module listed in COMMANDS provides ``add_arguments(parser)`` and ``run(args) -> int``; the
first line of its docstring is the command's help.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from flashrecovery.logs import configure_logging, quiet_c10d

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
AGENT_COMMANDS = ("run", "control-plane", "engine")  # the agents' own long-running processes

COMMANDS: dict[str, str] = {
    "run": "flashrecovery.agent.launcher",
    "control-plane": "flashrecovery.agent.control_plane",
    "engine": "flashrecovery.agent.engine_service",
    "demo": "flashrecovery.demo.cli",
    "chaos": "flashrecovery.chaos.cli",
    "events": "flashrecovery.replay.events",
    "replay": "flashrecovery.replay.command",
    "metrics": "flashrecovery.observe.exporter",
    "diagram": "flashrecovery.statemachines.diagram",
    "broker": "flashrecovery.connectors.kafka_broker",
    "topics": "flashrecovery.connectors.kafka_topics",
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashrecovery",
        description="Keep PyTorch training running through rank failures.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the chosen command's module is imported (some import torch, which is slow).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name in COMMANDS:
        if chosen is not None and chosen != name:
            sub.add_parser(name)
            continue
        module = _load(name)
        doc = (module.__doc__ or "").strip().splitlines()
        # No abbreviations: a script's own `--out` after `run … script.py` must never be
        # read as a prefix of an option (two spellings of --output-dir made it ambiguous).
        p = sub.add_parser(
            name,
            help=doc[0] if doc else None,
            description=doc[0] if doc else None,
            allow_abbrev=False,
        )
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in AGENT_COMMANDS:
        quiet_c10d()  # before torch loads
    configure_logging()
    args = build_parser(argv).parse_args(argv)
    try:
        code: int = args._module.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading (`| head`): not a failure of the command. What is still
        # buffered goes to /dev/null, so the interpreter's last flush does not raise again (the
        # recipe of the Python documentation's note on SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        # Ctrl-C: what the command started was stopped on the way out (its context managers);
        # one line and the shell's code for SIGINT, never a traceback.
        print(f"flashrecovery {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
