"""Options several commands share, spelled alike everywhere: a user who typed ``--job-id`` to
``run`` types it to ``events`` next, and both spellings must work on every command."""

from __future__ import annotations

import argparse

JOB_SPELLINGS = ("--job", "--job-id")


def add_job_option(
    parser: argparse.ArgumentParser, *, dest: str, help: str, required: bool = False
) -> None:
    """The job's id, as ``--job`` or ``--job-id``."""
    parser.add_argument(
        *JOB_SPELLINGS, dest=dest, required=required, default=None, metavar="ID", help=help
    )
