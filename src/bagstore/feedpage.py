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
from collections.abc import Iterable
from itertools import accumulate, chain, compress, repeat
from operator import gt, sub
from typing import Any, cast

from bagstore import codec
from bagstore.backends import changesql as sql
from bagstore.errors import InvalidEntity

__all__ = [
    "Change",
    "ChangePage",
    "decode_positions",
    "encode_positions",
    "page_changes",
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

    @property
    def entity(self) -> dict[str, Any] | None:
        body = self[6]
        if body is None:
            return None
        try:
            return _decode(body)
        except InvalidEntity as e:
            raise InvalidEntity(
                f"the body of change {self[1]} of bucket {self[0]} of kind {self.kind!r} "
                f"(entity {self[2].hex()}) cannot be decoded: {e}"
            ) from e

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


_decode = codec.decode
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


#: marks positions as binary (64-bit little-endian ints); text without it is
#: the JSON list of earlier cursors and checkpoints (base64 never holds ``~``)
_BINARY = "~"


def encode_positions(positions: dict[int, int]) -> str:
    """Positions as compact text: bucket deltas and positions as 64-bit
    little-endian ints, zlib, base64 (C loops only, no JSON: a cursor of
    1,024 buckets is made at every page; a reader keeps its positions in
    bucket order, which is checked rather than sorted again)."""
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
    packed = struct.pack(f"<{len(flat)}q", *flat)
    # zlib's default state (~256 kB, cleared) costs ~50 us to set up, most
    # of a small cursor's making; an 8 kB window and a memLevel of 5 compress
    # as well (any zlib stream decodes the same way), at 4,096 buckets too
    packer = zlib.compressobj(1, zlib.DEFLATED, 13, 5)
    raw = packer.compress(packed) + packer.flush()
    return _BINARY + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_positions(text: str) -> dict[int, int]:
    """The inverse of :func:`encode_positions`, or of its JSON form before
    (ValueError if it is neither)."""
    binary = text.startswith(_BINARY)
    text = text[1:] if binary else text
    raw = zlib.decompress(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    if binary:
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
