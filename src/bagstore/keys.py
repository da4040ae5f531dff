"""Order-preserving binary encoding of secondary-index values.

Every column of an index table (MySQL ``VARBINARY``, SQLite ``BLOB``) holds
``encode_value(v)`` of one property value, cut to :data:`KEY_LIMIT` bytes.  Both
backends compare these bytewise (``memcmp``; a proper prefix sorts first), so
the encoding is built to make that byte order *the* order bagstore defines, the
same on every backend:

    >>> encode_value(3) == encode_value(3.0) and encode_value(2) < encode_value(2.5)
    True

Format (one leading *type byte*, then the body; no terminator is needed because
each value lives in a column of its own)::

    bool              10 | 00 (False) or 01 (True)
    int, float        20 | 00                        -inf
                      20 | 01 | ~M(-x) | FF          negative, finite
                      20 | 02                        zero (0, 0.0 and -0.0)
                      20 | 03 | M(x)                 positive, finite
                      20 | 04                        +inf
                      20 | 05                        NaN (every NaN, one value)
    aware datetime    30 | 8 bytes: microseconds since 0001-01-01 UTC, plus one day
    naive datetime    40 | 8 bytes: microseconds since 0001-01-01 (wall clock)
    date              48 | 4 bytes: the proleptic Gregorian ordinal (date.toordinal())
    str               50 | UTF-8 ("surrogatepass": lone surrogates are kept)
    bytes             60 | the bytes themselves

A positive finite number ``x = 1.f * 2**E`` (ints and floats alike: both are
exact dyadic rationals) is ``M(x) = exponent(E) + mantissa(f)``.  ``exponent``
is one length byte (``0x80 + n`` for ``E >= 0``, ``0x80 - n`` for ``E < 0``)
then ``|E|`` in ``n`` big-endian bytes (one's complement when negative), so it
orders like ``E`` and knows its own length.  ``mantissa`` is the fraction bits
after the leading 1, trailing zero bits stripped (so ``3 == 3.0`` gives
identical bytes), in groups of 7 bits per byte with the high bit set.  A
negative number stores its magnitude with every byte inverted and a final
``FF``: the high bit makes every mantissa byte invert to below ``FF``, so a
shorter magnitude (a smaller one) sorts *after* a longer one that extends it.

Order and equality (``memcmp`` of encodings):

* type classes first: bool < number < aware datetime < naive datetime < date < str
  < bytes (a ``date`` is not a ``datetime``: Python refuses to compare them);
* within a class exactly as Python orders and compares: ``1 < 1.5 < 2``,
  ``2**63 == 9.223372036854776e18`` and ``10**30 < 1e30`` as Python says, equal
  numbers (``3``, ``3.0``) encode identically; aware datetimes by UTC instant
  (equal instants with other offsets encode equal); naive ones by wall-clock
  fields (``fold`` ignored); dates by day; str by code point; bytes bytewise.

Deviations from Python, on purpose:

* **bool is not a number.**  Python says ``True == 1``; bagstore treats bool and
  int as different types in indexes and queries, so ``True`` and ``1`` encode
  differently and a query for ``x=1`` does not find ``x=True``.
* NaN is one value, equal to itself, sorting after ``+inf``.
* Aware datetimes compare by UTC instant even when they share a ``tzinfo``
  (Python then compares wall clocks, which differs only inside a DST fold).

Truncation: a stored key is ``encode_value(v)[:KEY_LIMIT]``.  Cutting to a
prefix is monotonic (``a <= b`` implies ``cut(a) <= cut(b)``), so an index scan
over :func:`range_bounds` finds every candidate; distinct long values may share
a stored key, which is why the query layer re-checks each entity with
:func:`compare_key`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from bagstore.errors import InvalidQuery

__all__ = [
    "KEY_LIMIT",
    "OPERATORS",
    "Bounds",
    "UnindexableValue",
    "compare_key",
    "encode_scalars",
    "encode_value",
    "index_values",
    "range_bounds",
    "truncate",
    "type_class_bounds",
]

KEY_LIMIT = 255
"""Bytes of an encoded value stored per index column."""

OPERATORS = frozenset({"eq", "gt", "gte", "lt", "lte"})
"""The comparison operators :func:`range_bounds` understands."""

_BOOL = 0x10
_NUMBER = 0x20
_AWARE = 0x30
_NAIVE = 0x40
_DATE = 0x48
_STR = 0x50
_BYTES = 0x60
_STR_TAG = bytes((_STR,))
_BYTES_TAG = bytes((_BYTES,))

_NEG_INF = b"\x20\x00"
_NEGATIVE = b"\x20\x01"
_ZERO = b"\x20\x02"
_POSITIVE = b"\x20\x03"
_POS_INF = b"\x20\x04"
_NAN = b"\x20\x05"

_ONE_MICROSECOND = timedelta(microseconds=1)
_UTC_EPOCH = datetime(1, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1, 1, 1)
# A UTC offset is strictly within one day, so the earliest aware instant is
# datetime.min minus (almost) one day: the bias keeps the count non-negative.
_AWARE_BIAS = 86_400 * 1_000_000
_INVERT = bytes(range(255, -1, -1))


class UnindexableValue(InvalidQuery):
    """A value of a type that has no index encoding (None, dict, list, Decimal …).

    Writers treat it as "no index row"; in a query filter it is a bad query.
    """


class Bounds(NamedTuple):
    """A range on a stored (possibly truncated) index column."""

    lower: bytes
    lower_inclusive: bool
    upper: bytes
    upper_inclusive: bool

    def contains(self, stored: bytes) -> bool:
        """Whether a stored key lies within these bounds."""
        above = stored >= self.lower if self.lower_inclusive else stored > self.lower
        below = stored <= self.upper if self.upper_inclusive else stored < self.upper
        return above and below


def encode_value(v: object) -> bytes:
    """The full, untruncated order-preserving encoding of one index value.

    Defined for bool, int, float, datetime (naive or aware), date, str and bytes;
    anything else raises :class:`UnindexableValue`.

        >>> encode_value(True).hex(), encode_value(-0.0) == encode_value(0)
        ('1001', True)
    """
    # the common exact types first (narrowed without typing.cast, a call a
    # value); subclasses take the long way
    if type(v) is str:
        return _STR_TAG + v.encode("utf-8", "surrogatepass")
    if type(v) is bytes:
        return _BYTES_TAG + v
    if isinstance(v, bool):
        return bytes((_BOOL, 1 if v else 0))
    if isinstance(v, int):
        return _encode_number(v, 0)
    if isinstance(v, float):
        return _encode_float(v)
    if isinstance(v, datetime):
        return _encode_datetime(v)
    if isinstance(v, date):
        return bytes((_DATE,)) + v.toordinal().to_bytes(4, "big")
    if isinstance(v, str):
        return bytes((_STR,)) + v.encode("utf-8", "surrogatepass")
    if isinstance(v, bytes):
        return bytes((_BYTES,)) + v
    raise UnindexableValue(
        f"cannot index a value of type {type(v).__name__!r}: indexable types are "
        "bool, int, float, datetime, date, str and bytes"
    )


def encode_scalars(values: Iterable[object]) -> list[bytes | None]:
    """``encode_value`` of each value in one loop (a batch's), None for a
    value that has none (a list among them: its items are encoded apart).

        >>> encode_scalars(["a", None]) == [encode_value("a"), None]
        True
    """
    out: list[bytes | None] = []
    append = out.append
    str_tag, bytes_tag = _STR_TAG, _BYTES_TAG
    for v in values:
        # the exact types of encode_value's first tests, inline
        if type(v) is str:
            append(str_tag + v.encode("utf-8", "surrogatepass"))
        elif type(v) is bytes:
            append(bytes_tag + v)
        else:
            try:
                append(encode_value(v))
            except UnindexableValue:
                append(None)
    return out


def compare_key(v: object) -> bytes:
    """The key the query layer re-checks with: ``encode_value(v)``, never truncated.

    Comparing ``compare_key(a) < compare_key(b)`` decides exactly as the index orders.
    """
    return encode_value(v)


def truncate(key: bytes, limit: int = KEY_LIMIT) -> tuple[bytes, bool]:
    """Cut an encoded value to at most ``limit`` bytes; say whether it was cut.

    >>> truncate(b"abcdef", 4)
    (b'abcd', True)
    """
    if limit < 1:
        raise ValueError(f"key limit must be at least 1 byte, not {limit}")
    if len(key) <= limit:
        return key, False
    return key[:limit], True


def type_class_bounds(v: object) -> tuple[bytes, bytes]:
    """``(lower inclusive, upper exclusive)`` around every key of ``v``'s type class.

    >>> type_class_bounds(5)
    (b' ', b'!')
    """
    tag = encode_value(v)[0]
    return bytes((tag,)), bytes((tag + 1,))


def range_bounds(op: str, v: object, limit: int = KEY_LIMIT) -> Bounds:
    """Bounds on the stored column that hold every row whose full value satisfies ``op v``.

    ``op`` is one of ``eq``, ``gt``, ``gte``, ``lt``, ``lte``; the comparison is
    the one :func:`compare_key` defines.  The bounds never leave ``v``'s type
    class (``x > 5`` scans numbers only).  They may hold rows that do *not*
    satisfy the filter (a truncated key stands for many values): the caller
    re-checks every entity.

        >>> range_bounds("gt", 5) == (encode_value(5), False, b"!", False)
        True
    """
    if op not in OPERATORS:
        raise InvalidQuery(f"unknown comparison {op!r}; expected one of {sorted(OPERATORS)}")
    full = encode_value(v)
    key, cut = truncate(full, limit)
    class_low, class_high = bytes((full[0],)), bytes((full[0] + 1,))
    if op == "eq":
        return Bounds(key, True, key, True)
    if op == "gt":
        # A stored key only stays strictly above the query key when the query key
        # is whole and shorter than the limit: otherwise a greater value may be
        # cut down to exactly ``key``.
        return Bounds(key, cut or len(key) >= limit, class_high, False)
    if op == "gte":
        return Bounds(key, True, class_high, False)
    if op == "lt":
        # A whole query key: any smaller value differs within it, or is a proper
        # prefix of it, and stays strictly below after truncation.
        return Bounds(class_low, True, key, cut)
    return Bounds(class_low, True, key, True)


def index_values(v: object) -> list[object]:
    """The values a property yields for an index, each to become one index row.

    A scalar yields itself; a list yields its indexable elements (nested lists,
    dicts, None and other unindexable elements are skipped), duplicates (by
    encoding: ``1`` and ``1.0``, not ``1`` and ``True``) collapsed, first one
    kept, in list order.  None, a dict or any unindexable value yields nothing.

        >>> index_values([3, "a", 3.0, None, [1]])
        [3, 'a']
    """
    return [item for item, _ in _indexed(v if isinstance(v, list) else [v])]


def index_keys(v: object) -> list[bytes]:
    """The encoded keys of :func:`index_values` of ``v`` (each value encoded once).

    >>> index_keys([3, "a", 3.0]) == [encode_value(3), encode_value("a")]
    True
    """
    if not isinstance(v, list):  # the common case, without the generator
        try:
            return [encode_value(v)]
        except UnindexableValue:
            return []
    return [key for _, key in _indexed(v)]


def _indexed(items: list[object]) -> Iterator[tuple[object, bytes]]:
    """``(item, key)`` of the indexable items, the first of each key only."""
    seen: set[bytes] = set()
    for item in items:
        try:
            key = encode_value(item)
        except UnindexableValue:
            continue
        if key not in seen:
            seen.add(key)
            yield item, key


def _encode_float(v: float) -> bytes:
    if math.isnan(v):
        return _NAN
    if math.isinf(v):
        return _POS_INF if v > 0 else _NEG_INF
    numerator, denominator = v.as_integer_ratio()
    return _encode_number(numerator, denominator.bit_length() - 1)


def _encode_number(numerator: int, shift: int) -> bytes:
    """Encode the exact value ``numerator / 2**shift``."""
    if numerator == 0:
        return _ZERO
    if numerator > 0:
        return _POSITIVE + _magnitude(numerator, shift)
    return _NEGATIVE + _magnitude(-numerator, shift).translate(_INVERT) + b"\xff"


def _magnitude(p: int, shift: int) -> bytes:
    """``exponent(E) + mantissa(f)`` of the positive value ``p / 2**shift = 1.f * 2**E``."""
    exponent = p.bit_length() - 1 - shift
    p >>= (p & -p).bit_length() - 1  # strip trailing zero bits: 3.0 encodes as 3
    return _exponent(exponent) + _mantissa(p)


def _exponent(e: int) -> bytes:
    # ``n`` is at most 8 (an int's bit length fits in 64 bits), far below 127.
    if e >= 0:
        n = (e.bit_length() + 7) // 8
        return bytes((0x80 + n,)) + e.to_bytes(n, "big")
    n = ((-e).bit_length() + 7) // 8
    return bytes((0x80 - n,)) + ((1 << (8 * n)) - 1 + e).to_bytes(n, "big")


def _mantissa(p: int) -> bytes:
    """The bits of odd ``p`` after its leading 1, seven per byte, high bit set."""
    nbits = p.bit_length() - 1
    if nbits == 0:
        return b""
    groups = -(-nbits // 7)
    rest = (p ^ (1 << nbits)) << (groups * 7 - nbits)  # padded with 0 bits on the right
    return bytes(0x80 | ((rest >> (7 * i)) & 0x7F) for i in range(groups - 1, -1, -1))


def _encode_datetime(v: datetime) -> bytes:
    if v.utcoffset() is not None:
        micros = (v - _UTC_EPOCH) // _ONE_MICROSECOND + _AWARE_BIAS
        return bytes((_AWARE,)) + micros.to_bytes(8, "big")
    micros = (v.replace(tzinfo=None) - _NAIVE_EPOCH) // _ONE_MICROSECOND
    return bytes((_NAIVE,)) + micros.to_bytes(8, "big")
