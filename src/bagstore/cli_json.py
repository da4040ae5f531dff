"""JSON in and out of the ``bagstore`` command line.

Every value an entity can hold has one JSON form, and every line the command line
prints is strict JSON (RFC 8259: no ``NaN``, no ``Infinity``), so ``jq`` and any
other JSON reader take it::

    bytes                      {"$hex": "00ff"}
    datetime                   {"$datetime": "2009-08-03T12:00:00+00:00"}
    date                       {"$date": "2010-06-01"}
    int of over 640 digits     {"$int": "-1234...5678"}     (shorter ints: plain numbers)
    float nan, inf, -inf       {"$float": "nan"}, {"$float": "inf"}, {"$float": "-inf"}
    a dict that reads as a tag {"$dict": {"$hex": "not bytes"}}

A *tag* is an object with exactly one key, one of ``$hex``, ``$datetime``, ``$date``,
``$int``, ``$float`` and ``$dict``.  Any other object is a plain dict, including one that merely
looks like a tag (``{"$int": "5", "note": "x"}``, ``{"$colour": "red"}``).  A tag with a
bad value (``{"$hex": "xyz"}``, ``{"$int": 5}``) is an error, never read as a dict.  A
stored dict that is itself one-key with a tag's key is printed wrapped in ``$dict``
(``{"$dict": OBJECT}`` reads as OBJECT with its keys taken literally and its values
read as usual), so that everything printed reads back as what was stored.

Input is kinder than output: plain JSON ints of any length are read exactly (in
O(n**1.6) time, and without touching the process-wide
:func:`sys.set_int_max_str_digits`), and the non-standard ``NaN``, ``Infinity`` and
``-Infinity`` that Python's :mod:`json` writes are read as floats (and printed back
tagged).  Ints of up to 640 digits -- ``sys.int_info.str_digits_check_threshold``, the
lowest limit a Python process can set -- are printed as plain numbers, which every
Python reads whatever its limit; longer ones as ``{"$int": "..."}``.  JSON nested
deeper than Python's parser can follow is refused (an entity nests at most
:data:`bagstore.codec.MAX_DEPTH` levels anyway).

Bad input raises :class:`JsonInputError` (a ``ValueError``); the command line turns it
into one ``error: ...`` line with exit code 2.

    >>> loads_json('{"id": {"$hex": "00ff"}, "x": {"$float": "nan"}}')
    {'id': b'\\x00\\xff', 'x': nan}
    >>> dumps_entity({"x": float("-inf"), "big": -(10**700)})[:48]
    '{"x": {"$float": "-inf"}, "big": {"$int": "-1000'
"""

from __future__ import annotations

import decimal
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from datetime import date, datetime
from typing import Any

from bagstore.codec import MAX_DEPTH

__all__ = [
    "PLAIN_INT_DIGITS",
    "TAGS",
    "JsonInputError",
    "dumps_entity",
    "dumps_json",
    "int_from_digits",
    "int_to_digits",
    "jsonable",
    "loads_json",
    "parse_value",
]

PLAIN_INT_DIGITS = sys.int_info.str_digits_check_threshold
"""Ints of up to this many decimal digits (640) are printed as plain JSON numbers."""

TAGS = frozenset({"$hex", "$datetime", "$date", "$int", "$float", "$dict"})
"""The keys that make a one-key JSON object a tag."""

_PLAIN_BOUND = 10**PLAIN_INT_DIGITS  # |value| below this: at most PLAIN_INT_DIGITS digits
_DIGITS = re.compile(r"-?[0-9]+")
_FLOATS = {
    "nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-infinity": -math.inf,
}
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"}
_EXACT = decimal.Context(
    prec=decimal.MAX_PREC,
    Emax=decimal.MAX_EMAX,
    Emin=decimal.MIN_EMIN,
    traps=[decimal.Inexact, decimal.Rounded, decimal.Overflow, decimal.InvalidOperation],
)


class JsonInputError(ValueError):
    """Input that is not JSON, or holds a tag with a bad value."""


# -- ints of any size, without int(str)'s process-wide digit limit ----------------------
def int_from_digits(digits: str) -> int:
    """A decimal string (``-?[0-9]+``) as an int, however long.

    Splits the digits in halves and joins them with Python's Karatsuba
    multiplication (O(n**1.6)); only pieces of at most :data:`PLAIN_INT_DIGITS`
    digits go through ``int(str)``, which every digit limit allows.

    >>> int_from_digits("-" + "9" * 5000) == -(10**5000 - 1)
    True
    """
    if digits.startswith("-"):
        return -int_from_digits(digits[1:])
    leaf = PLAIN_INT_DIGITS
    powers: dict[int, int] = {}

    def power(k: int) -> int:  # 10**k for k = leaf * 2**j
        if k not in powers:
            powers[k] = 10**k if k <= leaf else power(k // 2) ** 2
        return powers[k]

    def join(start: int, end: int) -> int:
        if end - start <= leaf:
            return int(digits[start:end])
        low = leaf
        while 2 * low < end - start:
            low *= 2
        return join(start, end - low) * power(low) + join(end - low, end)

    return join(0, len(digits))


def int_to_digits(value: int) -> str:
    """An int as its decimal string, however long (the inverse of
    :func:`int_from_digits`), through :mod:`decimal`'s exact big-number arithmetic.

    >>> int_to_digits(-(10**5000)) == "-1" + "0" * 5000
    True
    """
    if -_PLAIN_BOUND < value < _PLAIN_BOUND:
        return str(value)
    powers: dict[int, decimal.Decimal] = {}

    def power(k: int) -> decimal.Decimal:  # 2**k, exactly
        if k not in powers:
            powers[k] = _EXACT.power(decimal.Decimal(2), k)
        return powers[k]

    def split(n: int, bits: int) -> decimal.Decimal:
        if bits <= 2048:
            return decimal.Decimal(n)
        low = bits // 2
        high = split(n >> low, bits - low)
        return _EXACT.add(_EXACT.multiply(high, power(low)), split(n & ((1 << low) - 1), low))

    magnitude = abs(value)
    text = format(split(magnitude, magnitude.bit_length()), "f")
    return "-" + text if value < 0 else text


def _parse_int(text: str) -> int:
    return int(text) if len(text) <= PLAIN_INT_DIGITS else int_from_digits(text)


# -- reading -------------------------------------------------------------------------
def _tag_error(tag: str, value: Any, expected: str) -> JsonInputError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return JsonInputError(f'bad {{"{tag}": ...}} value {shown}: expected {expected}')


def _read_hex(value: Any) -> bytes:
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise _tag_error("$hex", value, "hex digits") from None


def _read_datetime(value: Any) -> datetime:
    try:
        return datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise _tag_error("$datetime", value, 'ISO-8601, e.g. "2009-08-03T12:00:00+00:00"') from None


def _read_date(value: Any) -> date:
    try:
        if isinstance(value, str) and len(value) == 10:
            return date.fromisoformat(value)
    except ValueError:
        pass
    raise _tag_error("$date", value, 'YYYY-MM-DD, e.g. "2010-06-01"')


def _read_int(value: Any) -> int:
    if not isinstance(value, str) or not _DIGITS.fullmatch(value):
        raise _tag_error("$int", value, 'a string of decimal digits, e.g. "-1234"')
    return _parse_int(value)


def _read_float(value: Any) -> float:
    found = _FLOATS.get(value.lower()) if isinstance(value, str) else None
    if found is None:
        raise _tag_error("$float", value, '"nan", "inf" or "-inf"')
    return found


def _read_dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _tag_error("$dict", value, "a JSON object")
    return {k: _decode(v) for k, v in value.items()}


_READERS: dict[str, Callable[[Any], Any]] = {
    "$hex": _read_hex,
    "$datetime": _read_datetime,
    "$date": _read_date,
    "$int": _read_int,
    "$float": _read_float,
    "$dict": _read_dict,
}


def _decode(value: Any) -> Any:
    """Plain parsed JSON -> entity values, top down (so ``$dict`` can keep its keys)."""
    if isinstance(value, dict):
        if len(value) == 1:
            ((key, inner),) = value.items()
            reader = _READERS.get(key)
            if reader is not None:
                return reader(inner)
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _parse(text: str) -> Any:
    """Parse and decode; lets JSONDecodeError through, turns too deep into an error."""
    try:
        return _decode(json.loads(text, parse_int=_parse_int))
    except RecursionError:
        raise JsonInputError(
            f"JSON nested too deeply (an entity nests at most {MAX_DEPTH} levels)"
        ) from None


def loads_json(text: str, what: str = "input") -> Any:
    """Parse JSON, reading the tags (``{"$hex": ...}`` -> bytes and so on); bad JSON
    or a bad tag raises :class:`JsonInputError` naming ``what``.

    >>> loads_json('{"id": {"$hex": "00ff"}}')
    {'id': b'\\x00\\xff'}
    """
    try:
        return _parse(text)
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"bad JSON in {what}: {exc}") from None


def parse_value(text: str) -> Any:
    """A filter value: JSON when it parses (``5``, ``true``, ``"5"``, ``{"$hex": ..}``),
    else the text itself as a string.  A bad tag is an error, not a string.

    >>> parse_value("5"), parse_value("ann"), parse_value('{"$int": "7"}')
    (5, 'ann', 7)
    """
    try:
        return _parse(text)
    except json.JSONDecodeError:
        return text


# -- writing -------------------------------------------------------------------------
def jsonable(value: Any) -> Any:
    """An entity value as plain JSON data: the tagged forms above for bytes,
    datetimes, dates, long ints, nan/inf and tag-like dicts; everything else as is."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -_PLAIN_BOUND < value < _PLAIN_BOUND else {"$int": int_to_digits(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$hex": bytes(value).hex()}
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, Mapping):
        out = {k: jsonable(v) for k, v in value.items()}
        if len(out) == 1 and next(iter(out)) in TAGS:
            return {"$dict": out}
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dumps_json(doc: Any, *, indent: int | None = None) -> str:
    """Strict JSON text of ``doc`` (through :func:`jsonable`); non-ASCII characters
    as themselves, except lone surrogates and the characters other than newline
    that Python's ``str.splitlines`` breaks at (U+0085, U+2028, U+2029) as ``\\u``
    escapes: without ``indent``, the text is always exactly one line."""
    data = jsonable(doc)
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, indent=indent)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them as \\u escapes
        text = json.dumps(data, allow_nan=False, indent=indent)
    return text.translate(_LINE_BREAKS)  # (only ever inside strings, where escapes are valid)


def dumps_entity(entity: Mapping[str, Any]) -> str:
    """One entity as one line of strict JSON, in the forms above.

    >>> dumps_entity({"id": b"\\x01", "n": 1})
    '{"id": {"$hex": "01"}, "n": 1}'
    """
    return dumps_json(dict(entity))
