"""structlog set-up: small processors composed once, JSON for machines or console for humans."""

from __future__ import annotations

import logging
import os
import sys

import structlog


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
