"""Progress bars of the long ``bagstore`` commands (clean, check, shard move,
rebalance and resume, key migrate), drawn on stderr.

A bar is drawn only when stderr is a terminal (as rich decides it:
``TTY_COMPATIBLE=1`` forces one, ``TTY_COMPATIBLE=0`` turns it off); otherwise
nothing is printed while the work runs, and the command's result (its line on
stdout, or its ``--json``) says what was done.  A bar appears with its first
update, which the library makes only once it has validated its arguments (and a
command validates its own before it opens one): an error is never preceded by
an empty bar.

    with bar("backfill index_link", "entities") as b:
        cleaner.backfill("index_link", progress=b.update)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

__all__ = ["Bar", "RateColumn", "bar"]


class RateColumn(ProgressColumn):
    """Items per second with their unit, e.g. ``1,250 entities/s`` (rich's own
    speed column formats bytes: ``1.3 kB/s``)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("")
        return Text(f"{speed:,.0f} {self.unit}/s", style="progress.data.speed")


class Bar:
    """One bar: what a library progress callback advances.  It appears with
    the first call (the first sign of work, so never before the library has
    validated its arguments); without a terminal every method does nothing."""

    def __init__(self, description: str, columns: list[ProgressColumn] | None, total: int | None):
        self._columns = columns
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._task = TaskID(0)
        self._state: dict[str, Any] = {
            "description": escape(description),
            "total": total,
            "completed": 0,
            "rows": 0,
        }

    def _show(self, **changes: Any) -> None:
        """Apply ``changes`` and redraw; the first call starts the bar (after
        its task holds them, so that it never flashes an empty ``0/?``)."""
        with self._lock:
            self._state.update(changes)
            if self._columns is None:
                return
            if self._progress is None:
                self._progress = Progress(*self._columns, console=_stderr(), transient=False)
                self._task = self._progress.add_task("", start=True)
                self._progress.update(self._task, **self._state)
                self._progress.start()
            else:
                self._progress.update(self._task, **self._state)

    def update(self, done: int, total: int | None) -> None:
        """``done`` of ``total`` items (``total`` None: not known yet)."""
        self._show(completed=done, total=total)

    def describe(self, text: str) -> None:
        """What is being done now (shown before the bar)."""
        self._show(description=escape(text))

    def add_rows(self, rows: int) -> None:
        """Count ``rows`` more in the bar's row counter (see :func:`bar`)."""
        with self._lock:
            self._state["rows"] += rows
        self._show()

    def close(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.stop()


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def bar(
    description: str, unit: str, *, total: int | None = None, rows: str | None = None
) -> Iterator[Bar]:
    """A bar on stderr counting ``unit`` (shown as ``{unit}/s``), drawn when
    stderr is a terminal, from the bar's first update; ``rows``: the label of
    an extra counter advanced with :meth:`Bar.add_rows` (e.g. ``"rows copied"``)."""
    columns: list[ProgressColumn] | None = None
    if _stderr().is_terminal:
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            RateColumn(unit),
        ]
        if rows is not None:
            columns.append(TextColumn("{task.fields[rows]:,} " + escape(rows)))
        columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    shown = Bar(description, columns, total)
    try:
        yield shown
    finally:
        shown.close()
