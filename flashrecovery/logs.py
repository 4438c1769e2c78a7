"""structlog set-up: small processors composed once, JSON for machines or console for humans."""

from __future__ import annotations

import logging
import os
import sys

import structlog

TORCH_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
QUIETED_C10D = "FLASHRECOVERY_QUIETED_C10D"  # the agent set TORCH_LOG_LEVEL, not the user


def quiet_c10d() -> None:
    """An agent's process says in one line that a peer's store is gone; torch's c10d warnings
    about it (with a C++ backtrace each) only bury that line: its warnings, and its errors too
    (a store client that gives up logs one before it raises, which the agent reports itself).
    Called before torch loads, unless the user chose a level; the ranks get the user's own
    (agent/job.py)."""
    if TORCH_LOG_LEVEL not in os.environ:
        os.environ[TORCH_LOG_LEVEL] = "FATAL"
        os.environ[QUIETED_C10D] = "1"


class _CurrentStderr:
    """Writes to whatever sys.stderr is now (a test harness may swap it after set-up)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None) -> None:
    """Configure structlog for this process; FLASHRECOVERY_LOG_FORMAT=json gives JSON lines."""
    level_name = (level or os.environ.get("FLASHRECOVERY_LOG_LEVEL", "warning")).upper()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if os.environ.get("FLASHRECOVERY_LOG_FORMAT") == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.WARNING)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
