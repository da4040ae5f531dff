"""Tests of bagstore.codec: exact round trips, refusals with paths, corruption, threads."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import doctest
import enum
import math
import os
import threading
import zlib
import zoneinfo
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagstore import codec
from bagstore.codec import FORMAT_MSGPACK, FORMAT_MSGPACK_ZSTD, decode, encode
from bagstore.errors import BagstoreError, InvalidEntity

UTC = dt.UTC


# ----------------------------------------------------------------------------- helpers


def assert_identical(got: Any, want: Any, path: str = "") -> None:
    """Equal *and* of the same type all the way down (bool is not int, -0.0 is not 0.0)."""
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), path
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys differ"
        for key in want:
            assert_identical(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{path}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{path}[{i}]")
    elif isinstance(want, dt.datetime):
        assert_same_datetime(got, want)
    else:
        assert got == want, path


def assert_same_datetime(got: dt.datetime, want: dt.datetime) -> None:
    fields = ("year", "month", "day", "hour", "minute", "second", "microsecond", "fold")
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    assert got.utcoffset() == want.utcoffset()
    if want.tzinfo is None:
        assert got.tzinfo is None
    elif type(want.tzinfo) is zoneinfo.ZoneInfo and want.tzinfo.key is not None:
        assert type(got.tzinfo) is zoneinfo.ZoneInfo
        assert got.tzinfo.key == want.tzinfo.key
    elif type(want.tzinfo) is dt.timezone:
        assert got.tzinfo == want.tzinfo
        assert got.tzname() == want.tzname()
    else:  # other tzinfo kinds come back as their fixed offset
        assert got.tzinfo == dt.timezone(want.utcoffset())  # type: ignore[arg-type]


def roundtrip(entity: dict[str, Any]) -> dict[str, Any]:
    data = encode(entity)
    assert type(data) is bytes
    assert data[0] in (FORMAT_MSGPACK, FORMAT_MSGPACK_ZSTD)
    return decode(data)


def raw_body(payload: bytes) -> bytes:
    """A format-0x01 body around any msgpack payload (valid checksum)."""
    return bytes([FORMAT_MSGPACK]) + payload + zlib.crc32(payload).to_bytes(4, "little")


NY = zoneinfo.ZoneInfo("America/New_York")


class FixedNoName(dt.tzinfo):
    """A tzinfo that is neither timezone nor ZoneInfo (like pytz or dateutil)."""

    def utcoffset(self, _: dt.datetime | None) -> dt.timedelta:
        return dt.timedelta(hours=5, minutes=30)

    def dst(self, _: dt.datetime | None) -> dt.timedelta:
        return dt.timedelta(0)

    def tzname(self, _: dt.datetime | None) -> str:
        return "IST?"


class NoOffset(dt.tzinfo):
    def utcoffset(self, _: dt.datetime | None) -> None:
        return None

    def dst(self, _: dt.datetime | None) -> None:
        return None

    def tzname(self, _: dt.datetime | None) -> None:
        return None


class BrokenTz(NoOffset):
    def utcoffset(self, _: dt.datetime | None) -> None:
        raise RuntimeError("no idea")


# ------------------------------------------------------------------------ round trips

SCALARS: list[Any] = [
    "",
    "plain",
    "naïve ☃ 𝄞 \x00 nul",
    "lone \ud800 surrogate",
    b"",
    b"\x00\xff" * 10,
    0,
    1,
    -1,
    2**31,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    2**64,
    -(2**64),
    -(2**63) - 1,
    2**200,
    -(2**200),
    2**200 + 12345,
    0.0,
    -0.0,
    1.5,
    -2.25e-308,
    5e-324,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
    None,
    [],
    {},
    [1, "a", b"b", None, [True, [False, [2.5]]]],
    {"nested": {"deeper": {"list": [{"x": 1}, {"y": [2**70]}]}}},
]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_every_type_round_trips_exactly(value: Any) -> None:
    entity = {"v": value, "in_list": [value], "in_dict": {"k": value}}
    assert_identical(roundtrip(entity), entity)


def test_bool_stays_bool_and_int_stays_int() -> None:
    got = roundtrip({"t": True, "f": False, "one": 1, "zero": 0})
    assert got["t"] is True and got["f"] is False
    assert type(got["one"]) is int and type(got["zero"]) is int


# ids by type name: a memoryview's repr holds its address, which differs between
# the pytest-xdist workers, and they must collect the same test ids
@pytest.mark.parametrize(
    "value", [bytearray(b"abc"), memoryview(b"abc")], ids=lambda v: type(v).__name__
)
def test_bytearray_and_memoryview_come_back_as_bytes(value: Any) -> None:
    got = roundtrip({"b": value, "l": [value]})
    assert_identical(got, {"b": b"abc", "l": [b"abc"]})


def test_big_ints_use_the_extension_type_and_small_ones_do_not() -> None:
    small = encode({"n": 2**64 - 1})
    big = encode({"n": 2**64})
    assert (
        msgpack.ExtType(codec.EXT_BIGINT, (2**64).to_bytes(9, "big", signed=True))
        == (msgpack.unpackb(big[1:-4], strict_map_key=False)["n"])
    )
    assert msgpack.unpackb(small[1:-4])["n"] == 2**64 - 1


DATETIMES = [
    dt.datetime(2009, 2, 27, 18, 43, 5),
    dt.datetime(2009, 2, 27, 18, 43, 5, 123456),
    dt.datetime(1, 1, 1),
    dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
    dt.datetime(2021, 11, 7, 1, 30, fold=1),  # fold on a naive datetime is kept too
    dt.datetime(2009, 2, 27, 18, 43, 5, 1, tzinfo=UTC),
    dt.datetime(2009, 2, 27, 18, 43, 5, tzinfo=dt.timezone(dt.timedelta(hours=-3))),
    dt.datetime(2009, 2, 27, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=45))),
    dt.datetime(2009, 2, 27, tzinfo=dt.timezone(dt.timedelta(seconds=1, microseconds=7))),
    dt.datetime(2009, 2, 27, tzinfo=dt.timezone(-dt.timedelta(hours=23, minutes=59))),
    dt.datetime(2009, 2, 27, tzinfo=dt.timezone(dt.timedelta(hours=1), "CET")),
    dt.datetime(2009, 2, 27, tzinfo=dt.timezone(dt.timedelta(0), "")),
    dt.datetime(2009, 7, 1, 12, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")),
    dt.datetime(2021, 11, 7, 1, 30, tzinfo=NY),  # ambiguous: EDT
    dt.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=NY),  # ambiguous: EST
    dt.datetime(2021, 3, 14, 2, 30, tzinfo=NY),  # imaginary wall time, kept as written
    dt.datetime(2009, 2, 27, tzinfo=zoneinfo.ZoneInfo("UTC")),
]


@pytest.mark.parametrize("value", DATETIMES, ids=repr)
def test_datetimes_round_trip(value: dt.datetime) -> None:
    got = roundtrip({"when": value})["when"]
    assert_same_datetime(got, value)
    assert got == value


def test_all_datetimes_in_one_entity_round_trip() -> None:
    entity = {f"d{i}": value for i, value in enumerate(DATETIMES)}
    entity["list"] = list(DATETIMES)  # type: ignore[assignment]
    assert_identical(roundtrip(entity), entity)


def test_utc_only_entities_use_the_standard_msgpack_timestamp() -> None:
    utc = dt.datetime(2009, 2, 27, 18, 43, 5, 123456, tzinfo=UTC)
    data = encode({"t": utc, "l": [utc]})
    stored = msgpack.unpackb(data[1:-4])
    assert isinstance(stored["t"], msgpack.Timestamp)
    assert stored["t"].to_datetime() == utc
    # one naive datetime elsewhere sends every datetime through EXT_DATETIME
    mixed = encode({"t": utc, "l": [dt.datetime(2009, 2, 27)]})
    ext = msgpack.unpackb(mixed[1:-4])["t"]
    assert isinstance(ext, msgpack.ExtType) and ext.code == codec.EXT_DATETIME
    got = decode(mixed)
    assert got["t"].tzinfo is UTC and got["l"][0].tzinfo is None


def test_utc_datetime_with_fold_keeps_its_fold() -> None:
    value = dt.datetime(2020, 1, 1, tzinfo=UTC, fold=1)
    got = roundtrip({"t": value})["t"]
    assert got.fold == 1 and got.tzinfo is UTC


def test_fold_changes_the_instant_and_is_kept() -> None:
    first = dt.datetime(2021, 11, 7, 1, 30, tzinfo=NY)
    second = first.replace(fold=1)
    got1, got2 = roundtrip({"a": first, "b": second}).values()
    assert got2.timestamp() - got1.timestamp() == 3600
    assert (got1.fold, got2.fold) == (0, 1)
    assert got1.tzinfo is NY  # ZoneInfo(key) is cached: the very same object


def test_timezone_utc_comes_back_as_the_utc_singleton() -> None:
    assert roundtrip({"t": dt.datetime(2020, 1, 1, tzinfo=UTC)})["t"].tzinfo is UTC


def test_other_tzinfo_kinds_come_back_as_fixed_offsets() -> None:
    value = dt.datetime(2020, 5, 17, 8, 0, 0, 42, tzinfo=FixedNoName())
    got = roundtrip({"t": value})["t"]
    assert got.tzinfo == dt.timezone(dt.timedelta(hours=5, minutes=30))
    assert got == value and got.microsecond == 42


def test_zoneinfo_without_a_loadable_key_comes_back_as_fixed_offset() -> None:
    path = next(
        (os.path.join(root, "Europe", "Paris") for root in zoneinfo.TZPATH),
        None,
    )
    if path is None or not os.path.exists(path):
        pytest.skip("no system time zone files")
    with open(path, "rb") as f:
        tz = zoneinfo.ZoneInfo.from_file(f, key="Nowhere/Atlantis")
    value = dt.datetime(2009, 7, 1, 12, tzinfo=tz)
    got = roundtrip({"t": value})["t"]
    assert got.tzinfo == dt.timezone(dt.timedelta(hours=2))
    assert got == value


def test_keys_with_lone_surrogates_round_trip() -> None:
    entity = {"k\udc80": "v\ud800", "nested": {"\ud83d": [1]}}
    assert_identical(roundtrip(entity), entity)


def test_dict_key_order_is_kept() -> None:
    entity = {k: i for i, k in enumerate("zyxabc")}
    assert list(roundtrip(entity)) == list("zyxabc")


def test_module_doctests_pass() -> None:
    failed, attempted = doctest.testmod(codec)
    assert attempted >= 2 and failed == 0


# ------------------------------------------------------------------------------ dates


def test_dates_round_trip_as_dates_never_datetimes() -> None:
    entity = {
        "posted": dt.date(2010, 6, 1),
        "bounds": [dt.date.min, dt.date.max],
        "beside": {"when": dt.datetime(2010, 6, 1, 12), "day": dt.date(2010, 6, 1)},
    }
    back = roundtrip(entity)
    assert_identical(back, entity)
    assert type(back["posted"]) is dt.date and type(back["beside"]["when"]) is dt.datetime


def test_a_date_beside_utc_datetimes_round_trips() -> None:
    # the C Timestamp packer handles the UTC datetimes; the date still goes through EXT_DATE
    entity = {"at": dt.datetime(2020, 1, 1, tzinfo=dt.UTC), "on": dt.date(2020, 1, 2)}
    assert_identical(roundtrip(entity), entity)


def test_a_date_is_packed_as_its_extension_type() -> None:
    body = encode({"d": dt.date(2010, 6, 1)})
    payload = msgpack.unpackb(body[1:-4], ext_hook=lambda code, data: (code, data))
    assert payload == {"d": (codec.EXT_DATE, bytes.fromhex("07da0601"))}


@pytest.mark.parametrize("data", [b"\x07\xda\x06", bytes.fromhex("07da0d01"), b""])
def test_a_corrupt_date_is_refused(data: bytes) -> None:
    payload = msgpack.packb({"d": msgpack.ExtType(codec.EXT_DATE, data)})
    body = bytes([codec.FORMAT_MSGPACK]) + payload + zlib.crc32(payload).to_bytes(4, "little")
    with pytest.raises(InvalidEntity, match="bad date"):
        decode(body)


@settings(max_examples=200, deadline=None)
@given(st.dates(), st.dates(), st.datetimes())
def test_generated_dates_round_trip_as_dates(a: dt.date, b: dt.date, c: dt.datetime) -> None:
    entity = {"a": a, "b": [b, c], "c": {"d": a}}
    assert_identical(roundtrip(entity), entity)


# ------------------------------------------------------------------------- hypothesis

naive_or_aware = st.one_of(
    st.datetimes(),
    st.datetimes(timezones=st.timezones()),
    st.datetimes(
        timezones=st.builds(
            dt.timezone,
            st.timedeltas(
                min_value=-dt.timedelta(hours=23, minutes=59, seconds=59),
                max_value=dt.timedelta(hours=23, minutes=59, seconds=59),
            ),
        )
    ),
    st.just(dt.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=NY)),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**300), max_value=2**300),
    st.sampled_from([2**64, -(2**64), 2**63, -(2**63) - 1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, math.nan, math.inf, -math.inf]),
    st.text(),
    st.binary(),
    naive_or_aware,
    st.dates(),
)
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.text(max_size=8), children, max_size=5),
    ),
    max_leaves=25,
)
entities = st.dictionaries(st.text(max_size=10), values, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entities)
def test_generated_entities_round_trip_exactly(entity: dict[str, Any]) -> None:
    assert_identical(roundtrip(entity), entity)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_escape_as_another_error(data: bytes) -> None:
    try:
        got = decode(data)
    except InvalidEntity:
        return
    assert type(got) is dict  # only ever a dict, never garbage of another type


@settings(max_examples=100, deadline=None)
@given(entities, st.data())
def test_any_single_byte_corruption_is_detected(entity: dict[str, Any], data: Any) -> None:
    body = bytearray(encode(entity))
    position = data.draw(st.integers(0, len(body) - 1))
    body[position] ^= data.draw(st.integers(1, 255))
    assert_refused_or_unchanged(bytes(body), entity)


_READ = codec.body_reader(0, lambda row: "the row")


def _read_agrees_with_decode(body: Any) -> None:
    """body_reader's row read decodes what decode() does, and refuses what it
    refuses, with decode()'s message after its own lead."""
    try:
        want = decode(body)
    except InvalidEntity as e:
        with pytest.raises(InvalidEntity) as caught:
            _READ((body,))
        assert str(caught.value) == f"the row: {e}"
        return
    assert_identical(_READ((body,)), want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entities, st.data())
def test_a_row_s_body_read_is_decode_s_whole_or_damaged(entity: dict[str, Any], data: Any) -> None:
    body = encode(entity)
    _read_agrees_with_decode(body)
    damaged = bytearray(body)
    position = data.draw(st.integers(0, len(body) - 1))
    damaged[position] ^= data.draw(st.integers(1, 255))
    _read_agrees_with_decode(bytes(damaged))
    _read_agrees_with_decode(bytes(damaged[: data.draw(st.integers(0, len(body)))]))
    _read_agrees_with_decode(bytearray(body))  # (not bytes: decode()'s own path)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(lambda b: b"\x01" + b)))
def test_a_row_s_body_read_is_decode_s_for_any_bytes(body: bytes) -> None:
    _read_agrees_with_decode(body)
    with_crc = b"\x01" + body + zlib.crc32(body).to_bytes(4, "little")  # msgpack or not
    _read_agrees_with_decode(with_crc)


def test_a_row_s_missing_body_reads_as_none() -> None:
    assert _READ((None,)) is None


def assert_refused_or_unchanged(corrupt: bytes, entity: dict[str, Any]) -> None:
    """A damaged body raises InvalidEntity -- or, only when the damage hit bits zstd
    ignores (the frame header's unused bit, unused bits of a Huffman header), decodes to
    exactly the original entity.  Never to anything else."""
    try:
        got = decode(corrupt)
    except InvalidEntity:
        return
    assert corrupt[0] == FORMAT_MSGPACK_ZSTD, "a CRC-checked raw body must always be refused"
    assert_identical(got, entity)


# ------------------------------------------------------------------------ compression


def big_entity() -> dict[str, Any]:
    text = " ".join(f"word{i % 37} and some prose about sharding" for i in range(200))
    return {"id": os.urandom(16), "body": text, "tags": ["mysql"] * 50}


def test_large_bodies_are_compressed() -> None:
    entity = big_entity()
    data = encode(entity)
    assert data[0] == FORMAT_MSGPACK_ZSTD
    assert len(data) < len(entity["body"]) / 2
    assert zstandard.get_frame_parameters(data[1:]).has_checksum
    assert_identical(decode(data), entity)


def test_tiny_bodies_are_stored_raw() -> None:
    for entity in ({}, {"a": 1}, {"id": os.urandom(16), "title": "short " * 10}):
        data = encode(entity)
        assert data[0] == FORMAT_MSGPACK
        assert len(data) == len(msgpack.packb(entity)) + 5  # format byte + CRC-32


def test_incompressible_large_bodies_are_stored_raw() -> None:
    entity = {"blob": os.urandom(codec.COMPRESS_THRESHOLD * 4)}
    data = encode(entity)
    assert data[0] == FORMAT_MSGPACK
    assert_identical(decode(data), entity)


def test_threshold_boundary() -> None:
    def body_of(payload_len: int) -> dict[str, Any]:
        entity = {"s": "a" * payload_len}
        overhead = len(msgpack.packb(entity)) - payload_len
        return {"s": "a" * (payload_len - overhead)}

    at = body_of(codec.COMPRESS_THRESHOLD)
    over = body_of(codec.COMPRESS_THRESHOLD + 1)
    assert encode(at)[0] == FORMAT_MSGPACK
    assert encode(over)[0] == FORMAT_MSGPACK_ZSTD


# -------------------------------------------------------------------------- refusals


class Color(enum.IntEnum):
    RED = 1


class MyStr(str):
    __slots__ = ()


class MyDatetime(dt.datetime):
    pass


class MyDate(dt.date):
    pass


REFUSED: list[tuple[Any, str]] = [
    (("a",), "tuple (use a list)"),
    ({1, 2}, "set (use a list)"),
    (frozenset(), "frozenset (use a list)"),
    (decimal.Decimal("1.5"), "decimal.Decimal (use a str or an int)"),
    (MyDate(2020, 1, 1), "MyDate (a subclass of datetime.date"),
    (dt.time(12, 0), "datetime.time"),
    (dt.timedelta(seconds=1), "datetime.timedelta"),
    (object(), "type object"),
    (1j, "complex"),
    (MyStr("x"), "MyStr (a subclass of str"),
    (Color.RED, "Color (a subclass of int"),
    (collections.OrderedDict(a=1), "collections.OrderedDict (a subclass of dict"),
    (collections.defaultdict(list), "collections.defaultdict (a subclass of dict"),
    (MyDatetime(2020, 1, 1), "MyDatetime (a subclass of datetime.datetime"),
    (dt.datetime(2020, 1, 1, tzinfo=NoOffset()), "NoOffset gives no UTC offset"),
    (dt.datetime(2020, 1, 1, tzinfo=BrokenTz()), "BrokenTz failed to give a UTC offset"),
    (memoryview(b"abcdef")[::2], "memoryview that is not C-contiguous"),
    (range(3), "type range"),
    (b"x".decode, "builtin_function_or_method"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_refused_values_name_path_and_type(value: Any, message: str) -> None:
    with pytest.raises(InvalidEntity, match=r"^property 'v': cannot store") as top:
        encode({"ok": 1, "v": value})
    assert message in str(top.value)
    with pytest.raises(InvalidEntity) as nested:
        encode({"ok": [1], "tags": ["a", "b", value]})
    assert str(nested.value).startswith("property 'tags'[2]: ")
    assert message in str(nested.value)
    with pytest.raises(InvalidEntity) as deep:
        encode({"a": {"b": [{"c": value}]}})
    assert str(deep.value).startswith("property 'a'['b'][0]['c']: ")


def test_message_matches_the_documented_example() -> None:
    with pytest.raises(InvalidEntity) as info:
        encode({"title": "x", "tags": ["a", "b", ("c",)]})
    assert str(info.value) == "property 'tags'[2]: cannot store value of type tuple (use a list)"
    assert isinstance(info.value, BagstoreError)
    assert info.value.__cause__ is None  # no msgpack internals leak out


@pytest.mark.parametrize("key", [1, 2**70, 1.5, None, True, b"k", ("t",), MyStr("k")], ids=repr)
def test_non_str_keys_are_refused(key: Any) -> None:
    with pytest.raises(InvalidEntity, match=r"^entity: property names must be str"):
        encode({"ok": 1, key: "v"})
    with pytest.raises(InvalidEntity, match=r"^property 'a'\[0\]: property names must be str"):
        encode({"a": [{"ok": 1, key: "v"}]})


@pytest.mark.parametrize(
    ("entity", "kind"),
    [
        ([("a", 1)], "list"),
        (None, "NoneType"),
        ("{}", "str"),
        (b"{}", "bytes"),
        (collections.OrderedDict(a=1), "collections.OrderedDict"),
    ],
)
def test_top_level_must_be_a_dict(entity: Any, kind: str) -> None:
    with pytest.raises(InvalidEntity, match=f"^entity must be a dict, got {kind}"):
        encode(entity)


def test_self_containing_values_are_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(InvalidEntity, match=r"^property 'x'\[1\]: the value contains itself"):
        encode({"x": loop})
    d: dict[str, Any] = {}
    d["me"] = d
    with pytest.raises(InvalidEntity, match=r"^property 'x'\['me'\]: the value contains itself"):
        encode({"x": d})


@pytest.mark.parametrize("depth", [codec.MAX_DEPTH + 1, 1100, 5000])
def test_too_deep_nesting_is_refused(depth: int) -> None:
    value: Any = []
    for _ in range(depth - 2):
        value = [value]
    with pytest.raises(InvalidEntity, match=f"nested deeper than {codec.MAX_DEPTH} levels"):
        encode({"x": value})


def test_deepest_allowed_nesting_round_trips() -> None:
    value: Any = {"leaf": 1}
    for _ in range(codec.MAX_DEPTH - 2):
        value = [value]
    entity = {"x": value}
    assert_identical(roundtrip(entity), entity)


def test_encoder_is_still_usable_after_a_refusal() -> None:
    bad: Any
    for bad in ({"t": (1,)}, {1: 2}, {"d": MyDate.today()}):
        with pytest.raises(InvalidEntity):
            encode(bad)
        assert decode(encode({"a": [1, 2]})) == {"a": [1, 2]}


# ------------------------------------------------------------------ corruption on read


def test_empty_and_unknown_format_bytes_are_refused() -> None:
    with pytest.raises(InvalidEntity, match="empty"):
        decode(b"")
    for fmt in (0x00, 0x03, 0x7F, 0xFF):
        with pytest.raises(InvalidEntity, match=f"unknown format byte {fmt:#04x}"):
            decode(bytes([fmt]) + encode({"a": 1})[1:])


def test_a_json_or_pickled_body_is_refused() -> None:
    for data in (b'{"a": 1}', b"\x80\x04\x95", zlib.compress(b'{"a": 1}')):
        with pytest.raises(InvalidEntity):
            decode(data)


@pytest.mark.parametrize("entity", [{"a": 1, "s": "x" * 40}, big_entity()], ids=["raw", "zstd"])
def test_every_truncation_and_extension_is_refused(entity: dict[str, Any]) -> None:
    data = encode(entity)
    for end in range(len(data)):
        with pytest.raises(InvalidEntity):
            decode(data[:end])
    with pytest.raises(InvalidEntity):
        decode(data + b"\x00")


@pytest.mark.parametrize("entity", [{"a": 1, "s": "x" * 40}, big_entity()], ids=["raw", "zstd"])
def test_every_single_bit_flip_is_refused(entity: dict[str, Any]) -> None:
    data = encode(entity)
    for position in range(len(data)):
        for bit in range(8):
            corrupt = bytearray(data)
            corrupt[position] ^= 1 << bit
            assert_refused_or_unchanged(bytes(corrupt), entity)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (msgpack.packb([1, 2]), "holds a list, not a dict"),
        (msgpack.packb(7), "holds a int, not a dict"),
        (msgpack.packb({1: 2}), "corrupt body"),
        (msgpack.packb({"a": msgpack.ExtType(99, b"x")}), "unknown msgpack extension type 99"),
        (msgpack.packb({"a": msgpack.ExtType(codec.EXT_BIGINT, b"")}), "corrupt body"),
        (msgpack.packb({"a": msgpack.ExtType(codec.EXT_DATETIME, b"\x00" * 12)}), "corrupt"),
        (msgpack.packb({"a": msgpack.ExtType(codec.EXT_DATETIME, b"\x07" * 3)}), "corrupt"),
        (msgpack.packb({"a": msgpack.ExtType(codec.EXT_DATETIME, b"\x07" * 40)}), "corrupt body"),
        (msgpack.packb({"a": b"\xff"})[:-1], "corrupt body"),
        (b"\x81\xa1a\xa2\xff\xfe", "corrupt body"),  # invalid UTF-8 in a str
        (b"\x81\xa1a\xc7\x05\xff" + b"\x00" * 5, "corrupt body"),  # a 5-byte Timestamp
    ],
)
def test_well_checksummed_but_invalid_payloads_are_refused(payload: bytes, message: str) -> None:
    with pytest.raises(InvalidEntity, match=message):
        decode(raw_body(payload))


def test_unknown_time_zone_key_is_a_clear_error() -> None:
    good = encode({"t": dt.datetime(2020, 1, 1, tzinfo=zoneinfo.ZoneInfo("Europe/Paris"))})
    payload = good[1:-4].replace(b"Europe/Paris", b"Nowhere/Atla")
    with pytest.raises(InvalidEntity, match="time zone 'Nowhere/Atla' is not available"):
        decode(raw_body(payload))


def test_zstd_frame_without_checksum_is_refused() -> None:
    payload = msgpack.packb({"a": "b" * 2000})
    frame = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(payload)
    with pytest.raises(InvalidEntity, match="checksummed zstd frame"):
        decode(bytes([FORMAT_MSGPACK_ZSTD]) + frame)


def test_decode_accepts_bytes_like_and_refuses_str() -> None:
    data = encode({"a": 1})
    assert decode(bytearray(data)) == {"a": 1}
    assert decode(memoryview(data)) == {"a": 1}
    with pytest.raises(InvalidEntity, match="must be bytes, got str"):
        decode(data.decode("latin-1"))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- threads


def test_concurrent_encode_and_decode_in_many_threads() -> None:
    threads = 8
    barrier = threading.Barrier(threads)
    failures: list[BaseException] = []

    def work(n: int) -> None:
        try:
            mine = [
                {"n": n, "i": i, "big": 2**64 * n + i, "at": dt.datetime(2020, 1, 1 + n, tzinfo=NY)}
                for i in range(50)
            ]
            mine.append({**big_entity(), "n": n})
            barrier.wait()
            for _ in range(20):
                for entity in mine:
                    assert_identical(decode(encode(entity)), entity)
                with pytest.raises(InvalidEntity):
                    encode({"bad": {n}})
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures[0]


def test_decode_without_the_checksum_is_only_for_verified_bytes() -> None:
    """``checksum=False`` decodes the same entity; the default still refuses a
    flipped bit that msgpack alone would decode to something else."""
    entity = {"name": "Ann", "n": 7, "tags": ["a", "b"]}
    data = codec.encode(entity)
    assert codec.decode(data, checksum=False) == codec.decode(data) == entity
    flipped = bytearray(data)
    flipped[data.index(b"Ann") + 1] ^= 0x01  # "Aon": still valid msgpack
    assert codec.decode(bytes(flipped), checksum=False) == {**entity, "name": "Aon"}
    with pytest.raises(InvalidEntity, match="checksum"):
        codec.decode(bytes(flipped))
    big = {"text": "x" * 10_000}  # zstd: its frame checksum is always checked
    packed = bytearray(codec.encode(big))
    assert codec.decode(bytes(packed), checksum=False) == big
    packed[-5] ^= 0x40
    with pytest.raises(InvalidEntity):
        codec.decode(bytes(packed), checksum=False)
