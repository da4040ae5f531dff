"""Connections handed back by threads that ended, for new threads to take.

SQLite's backend gives each thread a connection of its own, kept in a
``threading.local``.  A thread's local data goes when the thread ends; what
it held would then stay open, unused, until the store closes (two file
descriptors a thread, without bound in a program that starts a thread per
request), and every new thread would pay for a connection of its own
(~0.4 ms: open, pragmas, its statements prepared again).  A :class:`Spares`
gives the thread, beside its connection, a token (:meth:`Spares.token`)
whose end, with the thread's local data, hands the connection back: kept for
the next new thread (:meth:`Spares.take`) if it is idle and still open
(``keep``), else given to ``drop``.

    >>> spares = Spares(keep=lambda item: item != "broken", drop=print)
    >>> token = spares.token("conn")
    >>> del token  # (what the end of the thread holding it does)
    >>> spares.take(), spares.take()
    ('conn', None)
    >>> token = spares.token("broken")
    >>> del token
    broken
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Spares", "Token"]

T = TypeVar("T")


class Token(Generic[T]):
    """Held in a thread's local data beside ``item``: hands it back to its
    :class:`Spares` when freed (the thread ended), unless :meth:`disarm`\\ ed."""

    __slots__ = ("_back", "_item")

    def __init__(self, back: Callable[[T], None], item: T) -> None:
        self._back: Callable[[T], None] | None = back
        self._item = item

    def disarm(self) -> None:
        """The item is not to be handed back (closed, discarded)."""
        self._back = None

    def __del__(self) -> None:
        back, self._back = self._back, None
        if back is not None:
            back(self._item)


class Spares(Generic[T]):
    """Items (connections) handed back by threads that ended."""

    def __init__(self, keep: Callable[[T], bool], drop: Callable[[T], None]) -> None:
        #: whether an item handed back may be taken again (open, idle)
        self.keep = keep
        #: what becomes of one that may not
        self.drop = drop
        self._items: list[T] = []

    def token(self, item: T) -> Token[T]:
        """The token to keep with ``item`` in the thread's local data."""
        return Token(self._back, item)

    def take(self) -> T | None:
        """An item handed back, or None (``list.pop`` is atomic: two threads
        never take the same one)."""
        try:
            return self._items.pop()
        except IndexError:
            return None

    def clear(self) -> list[T]:
        """Forget and return the items kept (the store is closing them)."""
        items, self._items = self._items, []
        return items

    def _back(self, item: T) -> None:
        if self.keep(item):
            self._items.append(item)
        else:
            self.drop(item)
