"""Multi-row statements cut to what a server takes: at most so many rows, and
values of at most so many bytes (a MariaDB/MySQL statement travels in one
packet of at most ``max_allowed_packet``; see ``Backend.max_statement_bytes``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["by_size", "row_bytes"]

T = TypeVar("T")

#: what a value takes in a statement beyond its bytes (its separators, its
#: quotes, or a number's digits), counted for every value
_VALUE = 16


def row_bytes(row: Sequence[Any]) -> int:
    """What a row's values take in a statement, about: the length of each
    ``bytes`` or ``str`` value and :data:`_VALUE` for every value."""
    return sum(len(v) for v in row if isinstance(v, bytes | str)) + _VALUE * len(row)


def by_size(
    rows: Sequence[T], sizes: Sequence[int], max_bytes: int, max_rows: int
) -> Iterator[Sequence[T]]:
    """``rows`` (``sizes``: what each takes in a statement) cut, in order,
    into runs of at most ``max_rows`` whose sizes add up to at most
    ``max_bytes``; a row larger than that alone is a run of its own.

    >>> list(by_size("abcde", [4, 4, 4, 9, 1], 8, 10))
    ['ab', 'c', 'd', 'e']
    >>> list(by_size("abcde", [1] * 5, 100, 2))
    ['ab', 'cd', 'e']
    """
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (size + n > max_bytes or i - start >= max_rows):
            yield rows[start:i]
            start, size = i, 0
        size += n
    if start < len(rows):
        yield rows[start:]
