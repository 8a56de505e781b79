"""Logging set-up shared by every entry point."""
from __future__ import annotations

import logging

from utils.dist import is_main_process


def setup_logging(level: int = logging.INFO) -> None:
    """Plain one-line log records on every rank; ranks > 0 only report warnings."""
    logging.basicConfig(
        level=level if is_main_process() else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
