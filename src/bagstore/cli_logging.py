"""The command line's log: ``-v`` / ``-vv`` / ``-q`` on the ``bagstore`` group.

The library logs under ``bagstore.*`` and prints nothing (:mod:`bagstore.logs`).
The command line shows those records on stderr: warnings by default (``warning:
...``), INFO with ``-v`` (a backfill's progress, each bucket moved, retries...),
DEBUG with ``-vv``, errors only with ``-q``; with ``-v`` each line carries the
time, level and logger.  stdout keeps the command's own output, so ``--json``
stays machine-readable.
"""

from __future__ import annotations

import logging
import sys

import click

__all__ = ["setup_logging"]

_PACKAGE = "bagstore"


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (click's test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class _Plain(logging.Formatter):
    """``warning: message``: the command line's own style of line."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {super().format(record)}"


def setup_logging(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Show the ``bagstore`` loggers' records on stderr at the level the options
    ask for, until the command ends (then the logger is as it was)."""
    if verbose and quiet:
        raise click.UsageError("give -v or -q, not both")
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO)[min(verbose, 1)]
    if verbose >= 2:
        level = logging.DEBUG
    logger = logging.getLogger(_PACKAGE)
    handler = _Stderr(level)
    if verbose:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    else:
        handler.setFormatter(_Plain("%(message)s"))
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(before)

    ctx.call_on_close(restore)
