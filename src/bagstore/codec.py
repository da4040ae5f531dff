"""Entity body <-> bytes: msgpack with extension types, zstd for large bodies, never pickle.

An entity body is a ``dict`` with ``str`` keys whose values are, recursively:
``str``, ``bytes``, ``int`` (any size), ``float`` (``inf``, ``nan`` and ``-0.0`` too),
``bool``, ``None``, ``list``, ``dict`` with ``str`` keys, ``datetime.datetime``
(naive or aware) and ``datetime.date``.  Every one of them comes back exactly, with
its type: a ``bool`` stays a ``bool``, ``bytes`` stay ``bytes``, a ``date`` stays a
``date`` (never a ``datetime``).  Two conveniences are one-way:

* ``bytearray`` and C-contiguous ``memoryview`` values are stored as their bytes and
  come back as ``bytes``;
* an aware ``datetime`` keeps its wall-clock time, ``microsecond`` and ``fold``; its
  ``tzinfo`` comes back as an equal ``datetime.timezone`` when it was one (the name
  too, when it had one), as ``ZoneInfo(key)`` when it was a ``zoneinfo.ZoneInfo``
  with a loadable key, and as the fixed offset ``timezone(dt.utcoffset())`` for any
  other kind (pytz, dateutil, ...).  A ``tzinfo`` whose ``utcoffset`` is ``None`` is
  refused.

Anything else -- ``tuple``, ``set``, ``Decimal``, ``time``, subclasses of the
types above (``str`` subclasses, ``IntEnum``, ``OrderedDict``...), dict keys that are not
``str``, containers nested more than :data:`MAX_DEPTH` deep or containing themselves --
is refused with :class:`~bagstore.errors.InvalidEntity` naming the property path and
the type, e.g. ``property 'tags'[2]: cannot store value of type tuple (use a list)``.

Format of an encoded body (the first byte says which; unknown bytes are refused)::

    0x01  msgpack payload + CRC-32 of the payload (4 bytes, little-endian)
    0x02  one zstd frame (level 3, content size and content checksum in the frame)
          holding the msgpack payload; used when the payload exceeds
          COMPRESS_THRESHOLD bytes and compression makes it smaller

The msgpack payload is a map, packed with ``use_bin_type`` (``bytes`` are *bin*,
``str`` are UTF-8 *str*, lone surrogates kept with ``surrogatepass``) and these
extension types:

* :data:`EXT_BIGINT` (1): an ``int`` outside ``[-2**63, 2**64)``, as minimal big-endian
  two's complement;
* msgpack's standard *Timestamp* (-1): a ``datetime`` whose ``tzinfo`` is
  ``datetime.timezone.utc`` and whose ``fold`` is 0, when every datetime of the entity
  is such (the common case: msgpack packs and unpacks these in C);
* :data:`EXT_DATETIME` (2): any other ``datetime`` (and UTC ones in an entity that also
  holds others): wall-clock fields, fold and time zone, see :func:`_pack_datetime`;
* :data:`EXT_DATE` (3): a ``date``, as year (2 bytes, big-endian), month and day.

Both checksums mean that a corrupt, truncated or foreign body raises ``InvalidEntity``
rather than decoding to something else (a flipped bit that zstd ignores, such as the
frame header's unused bit, decodes to the very same entity).

The codec does not limit sizes: the datastore refuses an encoded body over
:data:`MAX_BODY_BYTES` (or the store's ``max_body_bytes``) on every backend alike.
The functions are safe to call from many threads at once (packers and zstd contexts
are per thread).

    >>> decode(encode({"a": 1}))
    {'a': 1}
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, time, timedelta, timezone, tzinfo
from decimal import Decimal
from typing import Any, cast
from zoneinfo import ZoneInfo

import msgpack
import zstandard

from bagstore.errors import ConfigurationError, InvalidEntity

#: The largest encoded body (after compression) a store accepts by default, on
#: every backend: 8 MiB less 64 KiB.  A MariaDB/MySQL shard receives a body in a
#: statement's text, escaped to up to twice its size (PyMySQL sends hex), so this
#: is what a server's default 16 MiB ``max_allowed_packet`` carries with room for
#: the statement around it (docs/configuration.md, "The largest entity").  A store
#: may set its own (``Datastore(max_body_bytes=...)``); opening refuses a MySQL
#: shard whose ``max_allowed_packet`` could not carry it.
MAX_BODY_BYTES = 8 * 1024 * 1024 - 64 * 1024

__all__ = [
    "COMPRESS_THRESHOLD",
    "EXT_BIGINT",
    "EXT_DATE",
    "EXT_DATETIME",
    "FORMAT_MSGPACK",
    "FORMAT_MSGPACK_ZSTD",
    "MAX_BODY_BYTES",
    "MAX_DEPTH",
    "ZSTD_LEVEL",
    "body_limit",
    "body_reader",
    "decode",
    "encode",
]

FORMAT_MSGPACK = 0x01
"""First byte of a body stored raw: msgpack payload followed by its CRC-32."""
FORMAT_MSGPACK_ZSTD = 0x02
"""First byte of a compressed body: a zstd frame holding the msgpack payload."""

COMPRESS_THRESHOLD = 1024
"""Payloads of more bytes than this are compressed with zstd (``python -m bench.codec``).

Measured on FriendFeed-style entities carrying prose: zstd-3 saves 9% of a 320-byte
body, 19% at 513, 35% at 1 KiB, 46% at 1.8 KiB, 72% at 16 KiB; it costs 12-19 us to
compress and 5-7 us to decompress up to 1 KiB, about as much as the whole uncompressed
encode + decode.  Below 1 KiB it would double the cost of every read for under a third
of the bytes.  zlib-6 saves 1-3 points more but is 2x slower to compress and 1.3-1.5x
slower to decompress, so zstd it is."""
ZSTD_LEVEL = 3

MAX_DEPTH = 512
"""Deepest nesting of containers accepted, the entity itself counting as depth 1."""

EXT_BIGINT = 1
EXT_DATETIME = 2
EXT_DATE = 3

_RAW_PREFIX = bytes([FORMAT_MSGPACK])
_ZSTD_PREFIX = bytes([FORMAT_MSGPACK_ZSTD])
_ZSTD_HEADER_MAGIC = b"\x28\xb5\x2f\xfd"

# EXT_DATETIME payload: year, month, day, hour, minute, second, microsecond, flags;
# flags = fold | tz_kind << 1, followed by the time zone's own bytes (see _TZ_*).
_DT = struct.Struct(">HBBBBBIB")
_DT_SIZE = _DT.size
# EXT_DATE payload: year, month, day.
_DATE = struct.Struct(">HBB")
_OFFSET = struct.Struct(">q")  # utcoffset in microseconds
_TZ_NAIVE = 0  # nothing follows
_TZ_UTC = 1  # nothing follows: datetime.timezone.utc
_TZ_OFFSET = 2  # _OFFSET follows: timezone(offset)
_TZ_NAMED_OFFSET = 3  # _OFFSET then the UTF-8 name: timezone(offset, name)
_TZ_ZONEINFO = 4  # the UTF-8 key: ZoneInfo(key)

_HINTS: dict[type, str] = {
    tuple: "use a list",
    set: "use a list",
    frozenset: "use a list",
    time: "use a datetime.datetime or a str",
    timedelta: "use an int or a float, e.g. total_seconds()",
    Decimal: "use a str or an int",
    complex: "use two floats",
}
_STORABLE_BASES = (bool, int, float, str, bytes, bytearray, dict, list, datetime, date)
_SCALARS = frozenset({str, bytes, bytearray, int, float, bool, type(None)})


class _Refused(Exception):
    """Raised inside the packer's ``default`` hook; turned into InvalidEntity with a path."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------- helpers


def _type_name(obj: object) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _refusal(obj: object) -> str:
    """Why ``obj`` (of a type msgpack does not pack natively) cannot be stored."""
    name = _type_name(obj)
    hint = _HINTS.get(type(obj))
    if hint is None:
        for base in _STORABLE_BASES:
            if isinstance(obj, base):
                dated = base in (datetime, date)
                base_name = f"datetime.{base.__name__}" if dated else base.__name__
                hint = f"a subclass of {base_name}; convert it to {base_name}"
                break
    if hint is None:
        return f"cannot store value of type {name}"
    return f"cannot store value of type {name} ({hint})"


def _int_to_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)


def _zone_key(tz: ZoneInfo) -> str | None:
    key = tz.key
    if key is None:
        return None
    try:
        ZoneInfo(key)
    except Exception:  # a from_file() key that names no zone here: store the offset
        return None
    return key


def _pack_datetime(value: datetime) -> bytes:
    """EXT_DATETIME payload: wall-clock fields, fold and tz kind, then the tz's bytes."""
    tz = value.tzinfo
    if tz is UTC:
        kind, tail = _TZ_UTC, b""
    elif tz is None:
        kind, tail = _TZ_NAIVE, b""
    else:
        kind, tail = _tz_kind_and_bytes(value, tz)
    head = _DT.pack(
        value.year,
        value.month,
        value.day,
        value.hour,
        value.minute,
        value.second,
        value.microsecond,
        value.fold | kind << 1,
    )
    return head + tail if tail else head


def _tz_kind_and_bytes(value: datetime, tz: tzinfo) -> tuple[int, bytes]:
    if type(tz) is timezone:
        offset = _OFFSET.pack(_micros(tz.utcoffset(None)))
        init_args = tz.__getinitargs__()  # type: ignore[attr-defined]
        if len(init_args) > 1:  # timezone(offset, name): keep the name
            return _TZ_NAMED_OFFSET, offset + str(init_args[1]).encode("utf-8", "surrogatepass")
        return _TZ_OFFSET, offset
    if type(tz) is ZoneInfo:
        key = _zone_key(tz)
        if key is not None:
            return _TZ_ZONEINFO, key.encode("utf-8")
    # any other tzinfo (pytz, dateutil, ZoneInfo subclasses...): its offset at this time
    try:
        offset_td = value.utcoffset()
    except Exception as exc:
        raise _Refused(
            f"cannot store datetime: its tzinfo {_type_name(tz)} failed to give a UTC offset"
            f" ({type(exc).__name__}: {exc})"
        ) from exc
    if offset_td is None:
        raise _Refused(
            f"cannot store datetime: its tzinfo {_type_name(tz)} gives no UTC offset"
            " (use a naive datetime or a datetime.timezone)"
        )
    return _TZ_OFFSET, _OFFSET.pack(_micros(offset_td))


def _micros(offset: timedelta | None) -> int:
    assert offset is not None  # a datetime.timezone always has an offset
    return (offset.days * 86_400 + offset.seconds) * 1_000_000 + offset.microseconds


_ExtType = msgpack.ExtType
_tuple_new = tuple.__new__


def _default(obj: object) -> Any:
    """The packer's hook for everything it does not pack itself (strict_types=True).

    Returns an ``ExtType`` built with ``tuple.__new__``: ``ExtType(code, data)`` checks
    its arguments in Python and costs 3x more; ours are right by construction.
    """
    cls = type(obj)
    if cls is datetime:
        return _tuple_new(_ExtType, (EXT_DATETIME, _pack_datetime(obj)))  # type: ignore[arg-type]
    if cls is int:  # msgpack calls default for ints beyond 64 bits
        return _tuple_new(_ExtType, (EXT_BIGINT, _int_to_bytes(obj)))  # type: ignore[arg-type]
    if cls is date:
        value = cast(date, obj)
        payload = _DATE.pack(value.year, value.month, value.day)
        return _tuple_new(_ExtType, (EXT_DATE, payload))
    raise _Refused(_refusal(obj))


def _unpack_datetime(data: bytes) -> datetime:
    year, month, day, hour, minute, second, micro, flags = _DT.unpack_from(data)
    fold = flags & 1
    kind = flags >> 1
    size = len(data)
    tz: tzinfo | None
    if kind == _TZ_UTC and size == _DT_SIZE:
        tz = UTC
    elif kind == _TZ_NAIVE and size == _DT_SIZE:
        tz = None
    elif kind == _TZ_ZONEINFO and size > _DT_SIZE:
        key = data[_DT_SIZE:].decode("utf-8")
        try:
            tz = ZoneInfo(key)
        except Exception as exc:
            raise InvalidEntity(
                f"cannot decode datetime: time zone {key!r} is not available here"
                " (install the tzdata package?)"
            ) from exc
    elif kind == _TZ_OFFSET and size == _DT_SIZE + _OFFSET.size:
        (micros,) = _OFFSET.unpack_from(data, _DT_SIZE)
        tz = timezone(timedelta(microseconds=micros))
    elif kind == _TZ_NAMED_OFFSET and size >= _DT_SIZE + _OFFSET.size:
        (micros,) = _OFFSET.unpack_from(data, _DT_SIZE)
        name = data[_DT_SIZE + _OFFSET.size :].decode("utf-8", "surrogatepass")
        tz = timezone(timedelta(microseconds=micros), name)
    else:
        raise InvalidEntity(f"corrupt body: bad datetime (flags {flags:#x}, {size} bytes)")
    return datetime(year, month, day, hour, minute, second, micro, tz, fold=fold)


def _ext_hook(code: int, data: bytes) -> object:
    if code == EXT_DATETIME:
        if len(data) == _DT_SIZE:  # fast path for the common naive and UTC datetimes
            year, month, day, hour, minute, second, micro, flags = _DT.unpack(data)
            if flags == _TZ_UTC << 1:
                return datetime(year, month, day, hour, minute, second, micro, UTC)
            if flags == _TZ_NAIVE:
                return datetime(year, month, day, hour, minute, second, micro)
        return _unpack_datetime(data)
    if code == EXT_BIGINT and data:
        return int.from_bytes(data, "big", signed=True)
    if code == EXT_DATE:
        if len(data) != _DATE.size:
            raise InvalidEntity(f"corrupt body: bad date ({len(data)} bytes)")
        try:
            return date(*_DATE.unpack(data))
        except ValueError as exc:
            raise InvalidEntity(f"corrupt body: bad date ({exc})") from None
    raise InvalidEntity(f"corrupt body: unknown msgpack extension type {code}")


# ---------------------------------------------------------------------- per-thread state


class _PerThread(threading.local):
    """msgpack packers and zstd contexts must not be shared between threads."""

    def __init__(self) -> None:
        # For entities whose datetimes are all UTC with fold 0 (or that have none): msgpack
        # packs those as its standard Timestamp extension in C, and decodes them in C too.
        self.utc_packer = msgpack.Packer(
            default=_default, use_bin_type=True, strict_types=True, datetime=True
        )
        # For every other entity: each datetime goes through _default (EXT_DATETIME).
        self.packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)
        self.surrogate_packer: Any = None  # made on the first str with a lone surrogate
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self.decompressor = zstandard.ZstdDecompressor()


_local = _PerThread()


# ------------------------------------------------------------------------- validation

_BAD, _UTC_ONLY, _OTHER_DATETIMES = 0, 1, 2


def _scan(entity: dict[str, Any]) -> int:
    """One fast pass over the containers before packing.

    Finds what msgpack would pack but we refuse (non-str keys, nesting deeper than
    MAX_DEPTH, which also stops cycles) -> _BAD; otherwise says whether every datetime
    is UTC with fold 0 (_UTC_ONLY: the C Timestamp packer keeps them exactly) or some
    other datetime needs EXT_DATETIME (_OTHER_DATETIMES).  Values of other types are
    checked by the packer itself (strict_types, _default).
    """
    result = _UTC_ONLY
    stack: list[tuple[Any, int]] = [(entity, 1)]
    pop = stack.pop
    push = stack.append
    while stack:
        container, depth = pop()
        if type(container) is dict:
            for key in container:
                if type(key) is not str:
                    return _BAD
            values = container.values()
        else:
            values = container
        for value in values:
            cls = type(value)
            if cls is dict or cls is list:
                if depth >= MAX_DEPTH:
                    return _BAD
                push((value, depth + 1))
            elif cls is datetime and (value.tzinfo is not UTC or value.fold):
                result = _OTHER_DATETIMES
    return result


def _find_problem(entity: dict[str, Any]) -> str | None:
    """Describe the first value that cannot be stored, with its property path."""
    path: list[str] = []
    stack: list[tuple[Any, Any]] = [(entity, iter(entity.items()))]
    active = {id(entity)}

    def where() -> str:
        return "property " + "".join(path) if path else "entity"

    while stack:
        container, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            active.discard(id(container))
            if path:
                path.pop()
            continue
        key, value = item
        if type(container) is dict:
            if type(key) is not str:
                return (
                    f"{where()}: property names must be str, got {key!r} of type {_type_name(key)}"
                )
            part = f"[{key!r}]" if path else repr(key)
        else:
            part = f"[{key}]"
        cls = type(value)
        if cls is dict or cls is list:
            if id(value) in active:
                return f"property {''.join(path)}{part}: the value contains itself"
            if len(stack) >= MAX_DEPTH:
                return f"property {''.join(path)}{part}: nested deeper than {MAX_DEPTH} levels"
            path.append(part)
            active.add(id(value))
            stack.append((value, iter(value.items()) if cls is dict else enumerate(value)))
            continue
        if cls in _SCALARS:
            continue
        if cls is memoryview:
            if not value.c_contiguous:
                reason = "cannot store a memoryview that is not C-contiguous"
                return f"property {''.join(path)}{part}: {reason}"
            continue
        try:
            _default(value)
        except _Refused as refused:
            return f"property {''.join(path)}{part}: {refused.reason}"
    return None


def _pack_slow(entity: dict[str, Any], error: Exception) -> bytes:
    """The packer failed: retry lone surrogates, else say exactly what is wrong."""
    if isinstance(error, UnicodeEncodeError):
        packer = _local.surrogate_packer
        if packer is None:
            packer = _local.surrogate_packer = msgpack.Packer(
                default=_default,
                use_bin_type=True,
                strict_types=True,
                unicode_errors="surrogatepass",
            )
        try:
            payload: bytes = packer.pack(entity)
            return payload
        except Exception as exc:
            error = exc
    problem = _find_problem(entity)
    if problem is not None:
        raise InvalidEntity(problem) from None
    raise InvalidEntity(f"cannot encode entity: {type(error).__name__}: {error}") from error


# ---------------------------------------------------------------------------- public


def encode(entity: dict[str, Any]) -> bytes:
    """Encode an entity body (a ``dict`` with ``str`` keys) to bytes; see the module doc.

    Raises :class:`~bagstore.errors.InvalidEntity`, naming the property path and the
    type, for anything that would not come back exactly.

        >>> encode({"a": 1})[:1] == bytes([FORMAT_MSGPACK])
        True
    """
    if type(entity) is not dict:
        name = _type_name(entity)
        if isinstance(entity, dict):
            raise InvalidEntity(f"entity must be a dict, got {name} (convert it with dict())")
        raise InvalidEntity(f"entity must be a dict, got {name}")
    kind = _scan(entity)
    if kind == _BAD:
        raise InvalidEntity(_find_problem(entity) or "entity cannot be encoded")
    local = _local
    try:
        payload: bytes = (local.utc_packer if kind == _UTC_ONLY else local.packer).pack(entity)
    except Exception as exc:
        payload = _pack_slow(entity, exc)
    if len(payload) > COMPRESS_THRESHOLD:
        compressed: bytes = local.compressor.compress(payload)
        if len(compressed) < len(payload) + 4:
            return _ZSTD_PREFIX + compressed
    return b"".join((_RAW_PREFIX, payload, zlib.crc32(payload).to_bytes(4, "little")))


def decode(data: bytes | bytearray | memoryview, *, checksum: bool = True) -> dict[str, Any]:
    """Decode bytes made by :func:`encode` back to the entity body.

    ``bytearray`` and ``memoryview`` are accepted too.  An empty, truncated, corrupt or
    unknown-format body raises :class:`~bagstore.errors.InvalidEntity`; it never
    decodes to something else.  ``checksum=False`` skips the body's own CRC (not
    zstd's): only for bytes the caller has just verified under a checksum of its own.

        >>> decode(encode({"n": 2**70}))
        {'n': 1180591620717411303424}
    """
    if type(data) is not bytes:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidEntity(f"an encoded body must be bytes, got {_type_name(data)}")
        data = bytes(data)
    if not data:
        raise InvalidEntity("corrupt body: empty")
    fmt = data[0]
    try:
        if fmt == FORMAT_MSGPACK:
            payload = data[1:-4]
            if len(data) < 6 or (
                checksum and zlib.crc32(payload) != int.from_bytes(data[-4:], "little")
            ):
                raise InvalidEntity(
                    f"corrupt body: checksum mismatch (format {fmt:#04x}, {len(data)} bytes)"
                )
        elif fmt == FORMAT_MSGPACK_ZSTD:
            frame = memoryview(data)[1:]
            if (
                frame[:4] != _ZSTD_HEADER_MAGIC
                or not zstandard.get_frame_parameters(frame).has_checksum
            ):
                raise InvalidEntity(
                    f"corrupt body: not a checksummed zstd frame ({len(data)} bytes)"
                )
            payload = _local.decompressor.decompress(frame, allow_extra_data=False)
        else:
            raise InvalidEntity(
                f"cannot decode body: unknown format byte {fmt:#04x}"
                f" (known: {FORMAT_MSGPACK:#04x}, {FORMAT_MSGPACK_ZSTD:#04x}); "
                "written by a newer bagstore, or not a bagstore body"
            )
        entity = msgpack.unpackb(
            payload, ext_hook=_ext_hook, timestamp=3, unicode_errors="surrogatepass"
        )
    except InvalidEntity:
        raise
    except Exception as exc:
        raise InvalidEntity(
            f"corrupt body (format {fmt:#04x}, {len(data)} bytes): {type(exc).__name__}: {exc}"
        ) from exc
    if type(entity) is not dict:
        raise InvalidEntity(f"corrupt body: holds a {_type_name(entity)}, not a dict")
    result: dict[str, Any] = entity
    return result


def body_reader(
    index: int, where: Callable[[Any], str]
) -> Callable[[Sequence[Any]], dict[str, Any] | None]:
    """A function decoding a row's body at ``index`` as :func:`decode` does
    (None stays None), for a property of rows read by the thousand: the usual
    body (msgpack, its CRC) decoded in the function itself (a call fewer a
    row), any other by :func:`decode`; InvalidEntity led by ``where(row)``.

        >>> read = body_reader(1, lambda row: f"row {row[0]}")
        >>> read((7, encode({"n": 1}))), read((8, None))
        ({'n': 1}, None)
        >>> read((9, b"\\x01junk"))
        Traceback (most recent call last):
        ...
        bagstore.errors.InvalidEntity: row 9: corrupt body: checksum mismatch (format 0x01, 5 bytes)
    """

    def read(row: Sequence[Any]) -> dict[str, Any] | None:
        data = row[index]
        if data is None:
            return None
        if type(data) is bytes and len(data) >= 6 and data[0] == FORMAT_MSGPACK:
            payload = data[1:-4]
            if zlib.crc32(payload) == int.from_bytes(data[-4:], "little"):
                try:  # (as decode() unpacks; anything amiss is decode()'s to say)
                    entity = msgpack.unpackb(
                        payload, ext_hook=_ext_hook, timestamp=3, unicode_errors="surrogatepass"
                    )
                except Exception:
                    entity = None
                if type(entity) is dict:
                    return cast("dict[str, Any]", entity)
        try:
            return decode(data)
        except InvalidEntity as e:
            raise InvalidEntity(f"{where(row)}: {e}") from e

    return read


def body_limit(value: object) -> int:
    """``max_body_bytes`` checked (None: :data:`MAX_BODY_BYTES`)."""
    if value is None:
        return MAX_BODY_BYTES
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10**9:
        raise ConfigurationError(  # 10**9: SQLite's own longest value
            f"max_body_bytes must be a number of bytes from 1 to 1000000000, not {value!r}"
        )
    return value
