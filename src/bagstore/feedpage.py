"""A page of the change feed (:mod:`bagstore.changes`): :class:`Change`, the
buckets' rows merged by time, and positions as the text a cursor carries."""

from __future__ import annotations

import base64
import bisect
import json
import zlib
from collections.abc import Iterable
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import gt, itemgetter, sub
from typing import Any

from bagstore import codec
from bagstore.backends import changesql as sql
from bagstore.errors import InvalidEntity

__all__ = [
    "Change",
    "ChangePage",
    "decode_positions",
    "encode_positions",
    "merge",
    "page_changes",
    "positions_after",
]


class Change(tuple[Any, ...]):
    """One committed write: ``op`` ``"put"`` or ``"delete"``; ``version`` the
    entity's version after a put (a delete: the version it removed);
    ``updated`` µs since the epoch (UTC); ``entity`` the body after a put when
    the kind records bodies, else None; ``kind``, ``bucket`` and ``position``
    where it sits in the feed.

    Made by the feed, not by hand: an immutable tuple of the change row as
    read (``bucket, position, id, op code, version, updated, encoded body,
    kind``), so that a page costs little more than its rows.  ``entity`` is
    decoded from the stored body each time it is read (a fresh dict: read it
    once and keep it to use it twice); a body that cannot be decoded raises
    :class:`bagstore.InvalidEntity` then, naming the change."""

    __slots__ = ()

    @property
    def id(self) -> bytes:
        return self[2]  # type: ignore[no-any-return]

    @property
    def op(self) -> str:
        return _OPS[self[3]]

    @property
    def version(self) -> int:
        return self[4]  # type: ignore[no-any-return]

    @property
    def updated(self) -> int:
        return self[5]  # type: ignore[no-any-return]

    @property
    def entity(self) -> dict[str, Any] | None:
        body = self[6]
        if body is None:
            return None
        try:
            return codec.decode(body)
        except InvalidEntity as e:
            raise InvalidEntity(
                f"the body of change {self[1]} of bucket {self[0]} of kind {self[7]!r} "
                f"(entity {self[2].hex()}) cannot be decoded: {e}"
            ) from e

    @property
    def kind(self) -> str:
        return self[7]  # type: ignore[no-any-return]

    @property
    def bucket(self) -> int:
        return self[0]  # type: ignore[no-any-return]

    @property
    def position(self) -> int:
        return self[1]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        body = "None" if self[6] is None else f"<{len(self[6])} bytes>"
        return (
            f"Change(id={self[2]!r}, op={self.op!r}, version={self[4]}, updated={self[5]}, "
            f"body={body}, kind={self[7]!r}, bucket={self[0]}, position={self[1]})"
        )


_OPS = {sql.PUT: "put", sql.DELETE: "delete"}
_new = tuple.__new__
_AT, _UPDATED = itemgetter(0, 1), itemgetter(5)
_MERGE_KEY = itemgetter(5, 0, 1)


def page_changes(rows: list[tuple[Any, ...]], kind: str) -> list[Change]:
    """Changes of ``kind`` from rows ``(bucket, pos, id, op, version, updated,
    body)`` as read: each the row and the kind in one tuple, no Python call a
    row (``tuple.__new__``), no body decoded."""
    tail = (kind,)
    return [_new(Change, r + tail) for r in rows]


def positions_after(positions: dict[int, int], rows: list[tuple[Any, ...]]) -> dict[int, int]:
    """``positions`` moved on past ``rows`` (each bucket's in position order:
    its last row read is the one kept)."""
    after = dict(positions)
    after.update(map(_AT, rows))
    return after


def merge(
    streams: dict[int, list[tuple[Any, ...]]], truncated: set[int], limit: int
) -> list[tuple[Any, ...]]:
    """The first ``limit`` rows of the buckets' ``streams`` (each in position
    order) merged by time, each bucket's rows kept in their order: sorted by
    the running maximum of ``updated`` along each bucket, then bucket and
    position; stopping before any row that sorts after a ``truncated``
    bucket's last row read (its next change, not read, may be older)."""
    order = sorted(b for b, rows in streams.items() if rows)
    merged: list[tuple[Any, ...]] = []
    for b in order:
        merged += streams[b]
    # Where `updated` goes back from one row to the next (C loops: a page may
    # hold a thousand buckets): only between two buckets, normally.
    times = list(map(_UPDATED, merged))
    back = compress(count(), map(gt, times, islice(times, 1, None)))
    if all(merged[i][0] != merged[i + 1][0] for i in back):
        # every bucket's times grow: the running maximum is `updated` itself,
        # a bucket's last row its highest; the rows are in (bucket, position)
        # order and the sort is stable: sorting by `updated` alone sorts by
        # (updated, bucket, position)
        ends = [(streams[b][-1][5], b, streams[b][-1][1] + 1) for b in order if b in truncated]
        merged.sort(key=_UPDATED)
        n = limit if not ends else bisect.bisect_left(merged, min(ends), key=_MERGE_KEY)
        return merged[: min(n, limit)]
    keyed: list[tuple[int, int, int, tuple[Any, ...]]] = []
    stop: tuple[int, int, int] | None = None
    for b in order:
        high = 0
        for r in streams[b]:
            u = r[5]
            if u > high:
                high = u
            keyed.append((high, b, r[1], r))
        if b in truncated:  # its next change may be older than the others' next
            end = (high, b, streams[b][-1][1] + 1)
            stop = end if stop is None or end < stop else stop
    keyed.sort()
    n = limit if stop is None else min(limit, bisect.bisect_left(keyed, stop))
    return [k[3] for k in keyed[:n]]


class ChangePage(list[Change]):
    """A page of changes; ``cursor`` reads the changes after it."""

    def __init__(self, changes: Iterable[Change], cursor: str) -> None:
        super().__init__(changes)
        self.cursor = cursor


def encode_positions(positions: dict[int, int]) -> str:
    """Positions as compact text: bucket deltas and positions, JSON, zlib, base64
    (C loops only: a cursor of 1,024 buckets is made at every page)."""
    buckets = sorted(compress(positions, map(gt, positions.values(), repeat(0))))
    flat = [0] * (2 * len(buckets))
    flat[0::2] = map(sub, buckets, chain((0,), buckets))
    flat[1::2] = map(positions.__getitem__, buckets)
    raw = zlib.compress(json.dumps(flat, separators=(",", ":")).encode(), 1)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_positions(text: str) -> dict[int, int]:
    """The inverse of :func:`encode_positions` (ValueError if it is not one)."""
    raw = zlib.decompress(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    flat = json.loads(raw)
    if not isinstance(flat, list) or len(flat) % 2 or not set(map(type, flat)) <= {int}:
        raise ValueError("not a list of positions")
    if flat and min(flat) < 0:
        raise ValueError("negative position")
    return dict(zip(accumulate(flat[0::2]), flat[1::2], strict=True))
