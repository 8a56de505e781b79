"""Logging set-up shared by every entry point."""
from __future__ import annotations

import contextlib
import logging
import sys

from utils.dist import is_main_process


def setup_logging(level: int = logging.INFO) -> None:
    """Plain one-line log records on every rank; ranks > 0 only report warnings."""
    logging.basicConfig(
        level=level if is_main_process() else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def deepspeed_logs_to_stderr() -> None:
    """DeepSpeed's log records on standard error, for a tool whose standard output scripts read (the chatbot's and
    prompt_eval's answers): DeepSpeed's logger writes to the standard output it finds when first imported, and warns
    there as it imports on a machine without a GPU ('Setting accelerator to CPU'). Called before anything imports
    DeepSpeed; the records are still shown."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils import logger
    for handler in logger.handlers:  # where DeepSpeed was imported before, its later records
        if type(handler) is logging.StreamHandler:
            with contextlib.suppress(ValueError):  # a stream closed under it: a test's captured output, since gone
                handler.flush()
            handler.stream = sys.stderr
