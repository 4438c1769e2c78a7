"""Become the user's script in this process, as `python script.py` (or `python -m module`)
would run it, with flashrecovery's two guards installed first: the exit note (the exception a
process dies of, for the agent's one line) and the guard on torch's own
``init_process_group`` (an unported script is told the fix at once, never crash-looped).

The fork server's children call ``run``; with ``--start-method exec`` each process starts as
``python -m flashrecovery.agent.script_main script.py args…``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from flashrecovery.agent import deathwatch
from flashrecovery.trainer_hooks import exit_note, own_init_guard

MODULE = "flashrecovery.agent.script_main"


def wrapped(command: list[str]) -> list[str]:
    """``[python, script, args…]`` (or ``[python, -m, module, args…]``) as run through this
    module; a program of its own (``--no-python``) as it is."""
    if command[0] != sys.executable:
        return command
    return [command[0], "-m", MODULE, *command[1:]]


def run(argv: list[str]) -> None:
    """``argv``: ``[script, args…]`` or ``[-m, module, args…]``."""
    deathwatch.hold()  # first: a death from here on is seen as it happens
    exit_note.install()
    own_init_guard.install()
    if argv[0] == "-m":  # python -m pkg.mod: the working directory first on the path
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    run(sys.argv[1:])
