"""structlog set-up: small processors composed once, JSON for machines or console for humans."""

from __future__ import annotations

import logging
import os
import sys

import structlog


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
