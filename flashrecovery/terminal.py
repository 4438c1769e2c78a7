"""Output of the commands that show records: record text as it is, and a reader that stops
reading ends the command quietly.

Records carry text from outside (gloo errors hold ``[host]:port``, exception reprs hold
brackets): it goes through ``Text``/``escape`` so rich never reads it as markup. A reader that
closes the pipe (``flashrecovery events | head -1``) is not a failure of the command:
``cli.main`` catches the BrokenPipeError once, for every command, and exits 0.
"""

from __future__ import annotations

import sys

from rich.console import Console

WIDE = 220  # a table piped into a file or a pager is read unfolded


class PipeConsole(Console):
    """A console that leaves a closed pipe to ``cli.main`` (rich would exit 1 by itself)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def console(*, stderr: bool = False) -> Console:
    """A console for record output: the terminal's width, or WIDE when stdout is not one."""
    stream = sys.stderr if stderr else sys.stdout
    return PipeConsole(stderr=stderr, width=None if stream.isatty() else WIDE)
