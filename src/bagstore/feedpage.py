"""A page of the change feed (:mod:`bagstore.changes`): :class:`Change`, and
positions as the text a cursor carries (the buckets' rows are merged by time
in :mod:`bagstore.feedread`)."""

from __future__ import annotations

import base64
import functools
import json
import struct
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, compress, repeat
from operator import gt, itemgetter, setitem, sub
from typing import Any, cast

from bagstore import codec
from bagstore.backends import changesql as sql
from bagstore.errors import InvalidQuery

__all__ = [
    "Change",
    "ChangePage",
    "Positions",
    "bucket_set",
    "check_positions",
    "decode_positions",
    "encode_positions",
    "page_changes",
    "positions_after",
    "run_after",
    "run_of",
]


class Change(tuple[Any, ...]):
    """One committed write: ``op`` ``"put"`` or ``"delete"``; ``version`` the
    entity's version after a put (a delete: the version it removed);
    ``updated`` µs since the epoch (UTC); ``entity`` the body after a put when
    the kind records bodies, else None; ``kind``, ``bucket`` and ``position``
    where it sits in the feed.

    Made by the feed, not by hand: an immutable tuple of the change row as
    read (``bucket, position, id, op code, version, updated, encoded body``),
    of a subclass made once per kind that holds the kind, so that a page
    costs little more than its rows.  ``entity`` is
    decoded from the stored body each time it is read (a fresh dict: read it
    once and keep it to use it twice); a body that cannot be decoded raises
    :class:`bagstore.InvalidEntity` then, naming the change."""

    __slots__ = ()
    #: the kind (set by each kind's subclass, see :func:`page_changes`)
    kind: str = ""

    # The kind is part of what a change is: two kinds' changes with the same
    # row values are not equal (their hashes may be; tuples' order ignores it).
    def __eq__(self, other: object) -> bool:
        if isinstance(other, Change) and other.kind != self.kind:
            return False
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__

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

    entity = property(
        codec.body_reader(
            6,
            lambda c: (
                f"the body of change {c[1]} of bucket {c[0]} of kind {c.kind!r} "
                f"(entity {c[2].hex()}) cannot be decoded"
            ),
        ),
        doc="the body after a put (a new dict each read), None for a delete or "
        "when the kind records no bodies",
    )

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
            f"body={body}, kind={self.kind!r}, bucket={self[0]}, position={self[1]})"
        )


_OPS = {sql.PUT: "put", sql.DELETE: "delete"}


def page_changes(rows: list[tuple[Any, ...]], kind: str) -> list[Change]:
    """Changes of ``kind`` from rows ``(bucket, pos, id, op, version, updated,
    body)`` as read: each row copied once into the kind's :class:`Change`
    subclass, in a C loop (no bytecode a row; the kind a class attribute
    rather than a tuple ``row + (kind,)`` made and dropped a row: ~460
    instructions a change fewer, measured), no body decoded."""
    return list(map(_change_class(kind), rows))


@functools.cache
def _change_class(kind: str) -> type[Change]:
    """The :class:`Change` subclass of ``kind`` (one a kind, kept)."""
    made = type("Change", (Change,), {"__slots__": (), "kind": kind})
    return cast("type[Change]", made)


class ChangePage(list[Change]):
    """A page of changes; ``cursor`` reads the changes after it."""

    def __init__(self, changes: Iterable[Change], cursor: str) -> None:
        super().__init__(changes)
        self.cursor = cursor


def bucket_set(buckets: Iterable[int], count: int) -> frozenset[int]:
    """``buckets`` as a set, each a bucket number below ``count``
    (InvalidQuery if not); checked in C loops (a consumer's read passes its
    range's buckets at every batch)."""
    try:
        found = frozenset(buckets)
    except TypeError:
        found = None
    if (
        found is None
        or not set(map(type, found)) <= {int}  # (no bool, no 1.0)
        or (found and not 0 <= min(found) <= max(found) < count)
    ):
        raise InvalidQuery(
            f"buckets must be bucket numbers from 0 to {count - 1}, not {buckets!r}"[:200]
        )
    return found


def check_positions(positions: object, count: int) -> None:
    """InvalidQuery unless ``positions`` is ``{bucket: position}`` of buckets
    below ``count``."""
    if not isinstance(positions, dict) or not all(
        type(b) is int and type(p) is int and 0 <= b < count and p >= 0
        for b, p in positions.items()
    ):
        raise InvalidQuery(
            "positions must be a dict of bucket numbers (from 0 to "
            f"{count - 1}) to positions (0 or more), not {positions!r}"[:200]
        )


#: marks positions as binary (64-bit little-endian ints); text without it is
#: the JSON list of earlier cursors and checkpoints (base64 never holds ``~``)
_BINARY = "~"
#: marks positions as a run of buckets (see :func:`_run`)
_RUN = "~~"
#: a run holds no more buckets than twice those with a position
_RUN_SPAN = 2


class Positions(dict[int, int]):
    """Positions a reader's page ends at, never changed once made, that know
    how the run of buckets their cursor's text is made of comes from the
    last page's (:meth:`made_run`), so that a cursor of 1,024 buckets is made
    without walking them.  ``base``: ``(run, buckets, moved)``, the last
    page's run and the page's buckets and their positions, written into it
    when a cursor is made (a consumer's batch makes none); None when the
    buckets are not the last page's, or its run was not made."""

    __slots__ = ("base", "run")

    def __init__(self, positions: Iterable[tuple[int, int]] | dict[int, int]) -> None:
        super().__init__(positions)
        self.base: tuple[tuple[int, bytes], Sequence[int], Sequence[int]] | None = None
        self.run: tuple[int, bytes] | None = None

    def made_run(self) -> tuple[int, bytes] | None:
        """The run of these positions (:func:`run_of`), made once: from the
        last page's when there is one, the page's buckets written into it."""
        if self.run is None:
            base, self.base = self.base, None
            if base is None:
                self.run = run_of(self)
            else:
                run, buckets, moved = base
                self.run = run_after(run, self, buckets, moved)
        return self.run


def positions_after(
    was: dict[int, int], rows: Sequence[tuple[Any, ...]], every: bool
) -> dict[int, int]:
    """The positions after change ``rows`` read from ``was`` (in bucket
    order): a new dict a page, in bucket order, never changed once made (the
    last one is a cursor's, or a consumer's).  A reader of every bucket (a
    cursor's, made text at every page; not a consumer's) gets
    :class:`Positions`, whose run is made from the last page's when the
    buckets are the same and the page's are few (:func:`written_into`).
    An empty page's are ``was`` itself (a reader at the feed's end: its
    cursor the same again, its run kept)."""
    if not rows:
        return was
    made = Positions(was) if every else dict(was)
    run = was.run if every and type(was) is Positions else None
    if run is None or not written_into(run, len(rows)):
        # (no run to write into, or one made afresh: no lists kept)
        made.update(zip(map(_ROW_BUCKET, rows), map(_ROW_POS, rows), strict=True))
    else:
        buckets, moved = list(map(_ROW_BUCKET, rows)), list(map(_ROW_POS, rows))
        made.update(zip(buckets, moved, strict=True))
        if len(made) == len(was):
            cast("Positions", made).base = (run, buckets, moved)
    # (buckets new to them: in bucket order again, what a cursor is made from)
    return made if len(made) == len(was) else type(made)(sorted(made.items()))


_ROW_BUCKET, _ROW_POS = itemgetter(0), itemgetter(1)


#: runs are made as arrays of 32-bit ints in little-endian order: where the
#: machine's are not, none is made (each cursor made from its positions)
_RUNS = sys.byteorder == "little" and array("I").itemsize == 4


def run_of(positions: dict[int, int]) -> tuple[int, bytes] | None:
    """The run of ``positions`` (in bucket order) that :func:`encode_positions`
    would make of them, or None when it would not make one (buckets too far
    apart, a number of 2**32 or more)."""
    if not positions or not _RUNS:
        return None
    n = len(positions)
    first, last = next(iter(positions)), next(reversed(positions))
    if not 0 < last - first + 1 <= _RUN_SPAN * n or not 0 <= first < 2**32:
        return None
    try:
        if last - first + 1 == n:  # (n buckets in order from first to last: each one)
            return first, struct.pack(f"<{n}I", *positions.values())
        return first, array("I", map(positions.get, range(first, last + 1), repeat(0))).tobytes()
    except (struct.error, OverflowError):
        return None


def written_into(run: tuple[int, bytes], rows: int) -> bool:
    """Whether :func:`run_after` writes ``rows`` buckets into ``run`` (a few
    of its buckets) rather than making the run afresh (a third or more)."""
    return 3 * rows < len(run[1]) // 4


def run_after(
    run: tuple[int, bytes], positions: dict[int, int], buckets: Sequence[int], moved: Sequence[int]
) -> tuple[int, bytes] | None:
    """The run of ``positions``: those of ``run`` with each of ``buckets``
    (each one of them) moved to the position of ``moved`` beside it, the last
    one of a bucket counting; the few written where they lie, else made
    afresh (:func:`run_of`)."""
    first, data = run
    if not written_into(run, len(buckets)):
        return run_of(positions)
    ints = array("I")
    ints.frombytes(data)
    try:
        deque(map(setitem, repeat(ints), map(sub, buckets, repeat(first)), moved), 0)
    except OverflowError:
        return None
    return first, ints.tobytes()


def encode_positions(positions: dict[int, int]) -> str:
    """Positions as compact text, zlib-compressed and base64: as a run of
    buckets (:func:`_run`) when they lie close together and fit in 32
    bits, the normal case of a reader's positions; else bucket deltas and
    positions as 64-bit little-endian ints (C loops only, no JSON: a cursor
    of 1,024 buckets is made at every page; a reader keeps its positions in
    bucket order, which is checked rather than sorted again; a reader of
    every bucket's :class:`Positions` give their run as made from the last
    page's).  A position of 0 is left out (as if not there)."""
    made = positions.made_run() if type(positions) is Positions else None
    if made is not None:
        return _RUN + _packed(_planes(struct.pack("<I", made[0]) + made[1]))
    run = _run(positions)
    if run is not None:
        return _RUN + _packed(run)
    buckets = list(positions)
    values = list(positions.values())
    if 0 in values:
        buckets = sorted(compress(buckets, map(gt, values, repeat(0))))
        values = list(map(positions.__getitem__, buckets))
    elif (order := sorted(buckets)) != buckets:
        buckets = order
        values = list(map(positions.__getitem__, buckets))
    flat = [0] * (2 * len(buckets))
    flat[0::2] = map(sub, buckets, chain((0,), buckets))
    flat[1::2] = values
    # struct packs a list of ints ~4 times as fast as array("q") does
    # (which parses each as a call's argument)
    return _BINARY + _packed(struct.pack(f"<{len(flat)}q", *flat))


def _run(positions: dict[int, int]) -> bytes | None:
    """Positions of buckets ``first`` to ``last`` as 32-bit little-endian
    ints, ``first`` then each bucket's position (0 where none), their
    bytes in four planes (every first byte, then every second...): the
    high bytes of small numbers are zeros, which zlib passes over at a
    fraction of the cost of 64-bit pairs (~100 us against ~285 us for
    1,024 buckets, and a half to two thirds of the size); None when they do
    not lie so close together (:data:`_RUN_SPAN`) or a position needs more
    than 32 bits."""
    if not positions:
        return None
    n = len(positions)
    first, last = next(iter(positions)), next(reversed(positions))
    span = last - first + 1
    if span == n and list(positions) == _span(first, span):
        values = list(positions.values())  # every bucket, in order: the normal case
    else:
        # in bucket order (a reader's), some buckets missing: its first and
        # last are the least and greatest when every other lies between them
        values = list(map(positions.get, range(first, last + 1), repeat(0))) if span > 0 else []
        if not 0 < span <= _RUN_SPAN * n or len(values) - values.count(0) != n:
            first, last = min(positions), max(positions)
            span = last - first + 1
            if span > _RUN_SPAN * n:
                return None
            values = list(map(positions.get, range(first, last + 1), repeat(0)))
    try:
        packed = struct.pack(f"<{span + 1}I", first, *values)
    except struct.error:  # a position of 2**32 or more
        return None
    return _planes(packed)


def _planes(packed: bytes) -> bytes:
    """32-bit ints' bytes in four planes: every first byte, then every second..."""
    return b"".join([packed[0::4], packed[1::4], packed[2::4], packed[3::4]])


@functools.lru_cache(maxsize=16)
def _span(first: int, count: int) -> list[int]:
    """Buckets ``first`` to ``first + count - 1`` (kept: never changed)."""
    return list(range(first, first + count))


def _packed(data: bytes) -> str:
    """``data`` compressed by zlib, as unpadded URL-safe base64."""
    # zlib's default state (~256 kB, cleared) costs ~50 us to set up, most
    # of a small cursor's making; an 8 kB window and a memLevel of 5 compress
    # as well (any zlib stream decodes the same way), at 4,096 buckets too
    packer = zlib.compressobj(1, zlib.DEFLATED, 13, 5)
    raw = packer.compress(data) + packer.flush()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_positions(text: str) -> dict[int, int]:
    """The inverse of :func:`encode_positions`, or of its JSON form before
    (ValueError if it is neither)."""
    form = _RUN if text.startswith(_RUN) else _BINARY if text.startswith(_BINARY) else ""
    text = text[len(form) :]
    raw = zlib.decompress(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    if form == _RUN:
        return _unrun(raw)
    if form:
        ints = array("q")
        ints.frombytes(raw)  # ValueError unless whole ints
        if sys.byteorder != "little":
            ints.byteswap()
        flat: Any = ints.tolist()
    else:
        flat = json.loads(raw)
    if not isinstance(flat, list) or len(flat) % 2 or not set(map(type, flat)) <= {int}:
        raise ValueError("not a list of positions")
    if flat and min(flat) < 0:
        raise ValueError("negative position")
    return dict(zip(accumulate(flat[0::2]), flat[1::2], strict=True))


def _unrun(raw: bytes) -> dict[int, int]:
    """The positions of a run of buckets (:func:`_run`'s bytes), those of 0
    left out."""
    n = len(raw) // 4
    if n < 2 or len(raw) % 4:
        raise ValueError("not a run of positions")
    packed = bytearray(len(raw))
    for plane in range(4):
        packed[plane::4] = raw[plane * n : (plane + 1) * n]
    first, *values = struct.unpack(f"<{n}I", packed)
    return dict(compress(zip(range(first, first + n - 1), values, strict=True), values))
