"""Options several commands share, spelled alike everywhere: a user who typed ``--job-id`` to
``run`` types it to ``events`` next, and both spellings must work on every command."""

from __future__ import annotations

import argparse

JOB_SPELLINGS = ("--job", "--job-id")


def add_job_option(
    parser: argparse.ArgumentParser,
    *,
    dest: str,
    help: str,
    required: bool = False,
    also: tuple[str, ...] = (),
) -> None:
    """The job's id, as ``--job`` or ``--job-id`` (and ``also``: torchrun's ``--rdzv-id`` on
    `run`)."""
    parser.add_argument(
        *JOB_SPELLINGS, *also, dest=dest, required=required, default=None, metavar="ID", help=help
    )
