"""A page of the change feed (bagstore.feedpage): a Change's body decoded when
``.entity`` is read, a damaged body's error, and the merge of the buckets by
time (bagstore.feedread's reading sessions) against the plain algorithm."""

from __future__ import annotations

import base64
import bisect
import json
import random
import sys
import threading
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import bagstore
from bagstore import Change, feedpage, feedread
from bagstore.backends import changesql
from tests.conftest import Topology, as_read, same_pages


def test_entity_is_what_was_written_and_decoded_when_read(topo: Topology) -> None:
    ds = topo.open(buckets=16)
    ds.feed.enable(bodies=True)
    bodies = [{"n": i, "tags": ["a", str(i)], "big": 2**70 + i} for i in range(30)]
    ids = ds.put_many(bodies)
    ds.delete(ids[0])
    page = ds.changes()
    assert len(page) == 31
    written = {i: {**b, "id": i} for i, b in zip(ids, bodies, strict=True)}
    puts = [c for c in page if c.op == "put"]
    assert {c.id: c.entity for c in puts} == written
    (gone,) = [c for c in page if c.op == "delete"]
    assert gone.id == ids[0] and gone.entity is None
    for c in page:
        assert type(c.id) is bytes and type(c.version) is int and type(c.updated) is int
        assert c.kind == ds.kind and type(c.bucket) is int and c.position >= 1
    first = puts[0]
    body = first.entity
    assert body is not None
    body["n"] = -1  # a fresh dict each read: the change itself is unchanged
    assert first.entity == written[first.id]
    assert hash(first) == hash(ds.changes()[page.index(first)])  # immutable, comparable
    text = repr(first)
    assert "op='put'" in text and "bytes>" in text and "tags" not in text


def test_a_change_is_its_row_and_its_class_holds_the_kind(topo: Topology) -> None:
    """A Change is the change row as read, seven values (the kind is not one
    of them: each kind's changes are of a Change subclass of its own, made
    once, that holds it), so a page copies each row once."""
    ds = topo.open(buckets=4)
    other = topo.open(buckets=4, kind="other_kind")
    for store in (ds, other):
        store.feed.enable(bodies=True)
        store.put_many([{"n": i} for i in range(3)])
    mine, theirs = ds.changes(), other.changes()
    assert len(mine) == len(theirs) == 3
    for page, kind in ((mine, ds.kind), (theirs, "other_kind")):
        assert {type(c) for c in page} == {type(page[0])} and isinstance(page[0], Change)
        assert all(c.kind == kind and len(c) == 7 for c in page)
        assert all(tuple(c)[:2] == (c.bucket, c.position) and c[2] == c.id for c in page)
    assert type(mine[0]) is not type(theirs[0]) and type(ds.changes()[0]) is type(mine[0])
    assert f"kind={ds.kind!r}" in repr(mine[0])
    # the kind is compared: the same row values of another kind are another change
    twin = type(theirs[0])(tuple(mine[0]))
    assert tuple(twin) == tuple(mine[0]) and twin != mine[0]
    assert (twin == mine[0]) is False and (mine[0] == twin) is False
    assert type(mine[0])(tuple(mine[0])) == mine[0] and len({twin, mine[0]}) == 2
    assert mine[0] == tuple(mine[0])  # a plain tuple has no kind to differ by


def test_a_damaged_body_raises_when_read_naming_the_change(topo: Topology) -> None:
    ds = topo.open(buckets=4)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": i} for i in range(5)])
    victim = ds.changes()[2]
    shard = ds.feed.holders([victim.bucket])[victim.bucket][2]
    backend = ds.feed.router.backends[shard]
    p = backend.dialect.param
    changed = backend.execute(
        f"UPDATE {changesql.CHANGES} SET body = {p} WHERE kind = {p} AND bucket = {p} "
        f"AND pos = {p}",
        [b"\x01garbage", ds.kind, victim.bucket, victim.position],
    )
    assert changed == 1
    page = ds.changes()  # reading the page decodes nothing
    assert len(page) == len(ids)
    (bad,) = [c for c in page if c.position == victim.position and c.bucket == victim.bucket]
    with pytest.raises(bagstore.InvalidEntity, match="cannot be decoded") as caught:
        _ = bad.entity
    message = str(caught.value)
    assert f"change {victim.position} of bucket {victim.bucket}" in message
    assert repr(ds.kind) in message and victim.id.hex() in message
    others = [c.entity for c in page if c is not bad]
    assert sorted(e["n"] for e in others if e) == sorted(n for n in range(5) if ids[n] != victim.id)


def _reference(
    streams: dict[int, list[tuple[Any, ...]]], truncated: set[int], limit: int
) -> list[tuple[Any, ...]]:
    """The plain merge: every row keyed by the running maximum of `updated`
    along its bucket, then bucket and position; stop before the first row
    after a truncated bucket's last."""
    keyed = []
    stop = None
    for b, rows in streams.items():
        high = 0
        for r in rows:
            high = max(high, r[5])
            keyed.append((high, b, r[1], r))
        if rows and b in truncated:
            end = (high, b, rows[-1][1] + 1)
            stop = end if stop is None or end < stop else stop
    keyed.sort()
    taken = [k[3] for k in keyed if stop is None or k[:3] < stop]
    return taken[:limit]


def _session_pages(
    streams: dict[int, list[tuple[Any, ...]]], rng: random.Random, limit: int, grow: bool
) -> list[list[tuple[Any, ...]]]:
    most = rng.choice([1, 2, 8, 32])
    """Page through ``streams`` (rows of positions 1, 2, ...) with a reading
    session as Feed.read does, the rows read from the lists themselves; with
    ``grow``, rows are appended to some buckets between pages."""
    buckets = sorted(streams)

    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        return {b: (len(streams[b]), 0, b % 3) for b in buckets if wanted is None or b in wanted}

    def read(
        by_shard: dict[int, list[tuple[int, int, int]]],
        ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        for shard, ranges in by_shard.items():
            assert all(b % 3 == shard for b, _, _ in ranges)  # asked where it is
        return as_read(
            [r for rs in by_shard.values() for b, lo, hi in rs for r in streams[b][lo - 1 : hi]],
            bodies,
        )

    def pruned(bucket: int, at: int, low: int) -> None:
        raise AssertionError("nothing is pruned here")

    session = feedread.start(None, {}, False, 0, holders, pruned)
    budget = rng.choice([None, 0, 4_000, 40_000])  # ~400 bytes a row here
    pages = []
    for n in range(10_000):
        session.budget = budget
        page = feedread.next_rows(session, limit, most, holders, read, pruned)
        pages.append(page)
        if grow and n < 30 and rng.random() < 0.5:
            for b in rng.sample(buckets, min(3, len(buckets))):
                at = len(streams[b])
                high = max((r[5] for r in streams[b]), default=0)
                body = rng.choice([None, rng.randbytes(50)])
                streams[b].append((b, at + 1, b"id", 0, 1, high + rng.randint(0, 5), body))
        elif not page:
            break
    return pages


@pytest.mark.parametrize("monotone", [True, False])
def test_session_pages_are_the_plain_merge(monotone: bool) -> None:
    """Pages read with a session, the next rows of only some buckets read at a
    time (as many as a memory budget allows, or without one), are together
    the plain merge of every bucket's rows (the running maximum from the
    start), each at most ``limit`` rows and full while rows are left; rows
    written between pages all come, once, each bucket's in position order;
    rows read without their bodies (a budget too small for them, or a row
    size not known yet) come with them, as stored."""
    rng = random.Random(26)
    for round_no in range(120):
        streams: dict[int, list[tuple[Any, ...]]] = {}
        for b in rng.sample(range(1024), rng.randint(1, 60)):
            times = [rng.randint(1, 50) for _ in range(rng.randint(0, 40))]
            if monotone:
                times.sort()
            bodies = [rng.choice([None, b"", rng.randbytes(rng.randint(1, 900))]) for _ in times]
            streams[b] = [
                (b, i + 1, b"id", 0, 1, t, x)
                for i, (t, x) in enumerate(zip(times, bodies, strict=True))
            ]
        limit = rng.randint(1, 120)
        grow = round_no % 2 == 1
        pages = _session_pages(streams, rng, limit, grow)
        got = [r for page in pages for r in page]
        assert all(len(page) <= limit for page in pages)
        if not grow:
            assert got == _reference(streams, set(), len(got) + 1)
            sizes = [len(page) for page in pages]
            assert all(n == limit for n in sizes[:-2]), sizes  # full while rows are left
        for b, rows in streams.items():
            assert [r for r in got if r[0] == b] == rows  # every row, once, in order


_ROWS = st.lists(
    st.tuples(st.integers(0, 7), st.integers(1, 6)), max_size=60
)  # (bucket, time): few of each, so that times tie across buckets


def _rows_of(pairs: list[tuple[int, int]]) -> list[tuple[Any, ...]]:
    """Rows of ``(bucket, time)`` pairs, in merge order (each its own key)."""
    rows = [(b, n, b"id", 0, 1, t, None) for n, (b, t) in enumerate(pairs)]
    return sorted(rows, key=lambda r: (r[5], r[0], r[1]))


@settings(max_examples=300, deadline=None)
@given(held=_ROWS, added=_ROWS, lo=st.integers(0, 60))
def test_rows_are_merged_in_where_a_sorted_insert_puts_them(
    held: list[tuple[int, int]], added: list[tuple[int, int]], lo: int
) -> None:
    """The search by time then bucket finds what bisect by the merge key
    finds, and rows merged in at once land where inserting each in turn
    puts them (equal keys: after those held), times tied across buckets."""
    rows = _rows_of(held)
    own = feedread._own
    for r in rows + _rows_of(added):
        key = own(r)
        start = min(lo, len(rows))
        assert feedread._after(rows, key, start) == bisect.bisect_right(rows, key, start, key=own)
    new = [(b, 100 + n, b"new", 0, 1, t, None) for n, (b, t) in enumerate(sorted(added))]
    expected = list(rows)
    for r in new:
        bisect.insort(expected, r, key=own)
    assert feedread._insert(rows, list(new)) == expected


def test_session_pages_find_moved_buckets_and_late_rows() -> None:
    """Pages read while some buckets' rows are not where the positions said
    (moved to another shard: read there after a recheck of the positions)
    and some buckets' last rows are not readable yet (read on a later page):
    with only moves, the pages are the plain merge; with late rows too,
    every row comes once, each bucket's in position order, at most
    ``limit`` a page."""
    rng = random.Random(2611)
    for round_no in range(150):
        streams: dict[int, list[tuple[Any, ...]]] = {}
        for b in rng.sample(range(300), rng.randint(1, 40)):
            times = [rng.randint(1, 30) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.7:
                times.sort()
            streams[b] = [(b, i + 1, b"id", 0, 1, t, None) for i, t in enumerate(times)]
        late = {b: rng.randint(1, 3) for b in streams if round_no % 2 and rng.random() < 0.3}
        got = _pages_with_moves(streams, late, rng)
        for b, rows in streams.items():
            assert [r for r in got if r[0] == b] == rows  # every row, once, in order
        if not late:
            assert got == _reference(streams, set(), len(got) + 1)


def _pages_with_moves(
    streams: dict[int, list[tuple[Any, ...]]], late: dict[int, int], rng: random.Random
) -> list[tuple[Any, ...]]:
    """Every row of ``streams`` read page after page by a reading session,
    some buckets' rows on another shard than the positions first say, the
    last ``late[b]`` rows of a bucket readable only after a few reads."""
    where = {b: rng.randrange(3) for b in streams}  # the shard holding the rows
    said = {b: (s + 1) % 3 if rng.random() < 0.3 else s for b, s in where.items()}
    calls = [0]

    def visible(b: int) -> int:
        return len(streams[b]) - (late.get(b, 0) if calls[0] < 6 else 0)

    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        out = {}
        for b in sorted(streams) if wanted is None else wanted & set(streams):
            out[b] = (len(streams[b]), 0, said[b])
            if wanted is not None:  # a recheck finds where the bucket is now
                said[b] = where[b]
        return out

    def read(
        by_shard: dict[int, list[tuple[int, int, int]]],
        ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        calls[0] += 1
        out = []
        for shard in rng.sample(sorted(by_shard), len(by_shard)):  # shards in any order
            for b, lo, hi in by_shard[shard]:
                if where[b] == shard:
                    out += streams[b][lo - 1 : min(hi, visible(b))]
        return as_read(out, bodies)

    def pruned(bucket: int, at: int, low: int) -> None:
        raise AssertionError("nothing is pruned here")

    limit = rng.randint(1, 80)
    session = feedread.start(None, {}, False, 0, holders, pruned)
    got: list[tuple[Any, ...]] = []
    total = sum(map(len, streams.values()))
    session.budget = rng.choice([None, 0, 4_000, 40_000])  # ~400 bytes a row here
    for _ in range(10_000):
        page = feedread.next_rows(session, limit, rng.choice([1, 2, 16]), holders, read, pruned)
        assert len(page) <= limit
        got += page
        if not page and calls[0] >= 6 and len(got) == total:
            break
        calls[0] += 1
    return got


@pytest.mark.parametrize(
    ("changes", "buckets", "limit", "most", "ranges"),
    [
        (30, 64, 64, 16, [30]),
        (100, 64, 64, 16, [2, 8, 32, 58]),
        (30, 64, 4, 16, [2, 28]),
        (300, 64, 1000, 32, [300]),
        (1200, 64, 1000, 32, [32, 128, 512, 528]),
        (100, 2, 10, 4, [100]),
        (300, 2, 10, 4, [10, 40, 80, 80, 90]),
    ],
)
def test_a_bucket_whose_rest_fits_in_one_read_is_read_to_its_end(
    changes: int, buckets: int, limit: int, most: int, ranges: list[int]
) -> None:
    """A bucket's read takes all the rest when that is at most twice ``most``
    rows, its first read too, rather than its share of a page and more
    ranges for what is left (a range costs more than its rows): 64 buckets
    of 30 changes, pages of 64, are read in one range a bucket; buckets of
    100 (more than twice ``most``, 32 here) first by their share of a page
    (2 rows), then 8 (four times that), then 32, then the rest; pages of 4
    rows (less than an eighth of a row a bucket) read a bucket first by its
    share, 2 rows, and the rest after; the pages are the plain merge.  A
    bucket's reads grow past ``most`` up to sixteen times its first read,
    eight pages at most: 64 buckets of 300 changes, pages of 1,000
    (MariaDB's ``most``, 32), read each bucket whole at once (at most twice
    512); of 1,200 they read 32, then 128, then 512, then the rest (528);
    2 buckets of 100, pages of 10, are read whole at once; of 300, they
    read 10, then 40, then 80 at a time (eight pages), then the rest."""
    streams = {
        b: [(b, i + 1, b"id", 0, 1, i * 64 + b, None) for i in range(changes)]
        for b in range(buckets)
    }
    asked: dict[int, list[int]] = {}

    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        return {b: (changes, 0, 0) for b in streams if wanted is None or b in wanted}

    def read(
        by_shard: dict[int, list[tuple[int, int, int]]],
        ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        for b, lo, hi in by_shard[0]:
            asked.setdefault(b, []).append(hi - lo + 1)
        return as_read([r for b, lo, hi in by_shard[0] for r in streams[b][lo - 1 : hi]], bodies)

    def pruned(bucket: int, at: int, low: int) -> None:
        raise AssertionError("nothing is pruned here")

    session = feedread.start(None, {}, False, 0, holders, pruned)
    got: list[tuple[Any, ...]] = []
    while page := feedread.next_rows(session, limit, most, holders, read, pruned):
        got += page
    assert got == _reference(streams, set(), len(got) + 1) and len(got) == buckets * changes
    assert all(sizes == ranges for sizes in asked.values()) and len(asked) == buckets


def test_pages_at_the_default_bucket_count_resume_anywhere(topo: Topology) -> None:
    """1,024 buckets: pages read by one handle (its reading session going on)
    and by another from the same cursors (starting afresh), with writes
    between pages, give every change once, each entity's in version order;
    a cursor of the format before (positions JSON at zlib level 9) still reads
    on."""
    ds = topo.open()
    assert ds.feed.router.placement.buckets == 1024
    other = topo.open()
    ds.feed.enable()
    ids = ds.put_many([{"n": i} for i in range(1500)])
    seen: list[Change] = []
    since = None
    for n in range(200):
        reader = ds if n % 3 else other
        page = reader.changes(since=since, limit=250)
        seen += page
        since = page.cursor
        if n < 4:
            ds.put_many([{"id": i, "n": -1} for i in ids[n * 100 : n * 100 + 100]])
        elif not page:
            break
    assert len(seen) == 1900 == len(set(seen))
    by_id: dict[bytes, list[int]] = {}
    for c in seen:
        by_id.setdefault(c.id, []).append(c.version)
    assert all(v == sorted(v) and len(set(v)) == len(v) for v in by_id.values())
    assert sorted(map(len, by_id.values())) == [1] * 1100 + [2] * 400
    # the cursor as the code before made it: same positions, level 9
    positions = ds.feed.positions_of(since)
    flat: list[int] = []
    last = 0
    for b in sorted(positions):
        flat += [b - last, positions[b]]
        last = b
    raw = zlib.compress(json.dumps(flat, separators=(",", ":")).encode(), 9)
    body = f"{ds.feed.router.placement.version}.{ds.feed.epoch()}."
    body += base64.urlsafe_b64encode(raw).decode().rstrip("=")
    old = f"c1.{body}.{ds.feed._mac(body)}"
    assert old != since and other.feed.positions_of(old) == positions
    ds.put({"id": ids[0], "n": 5})
    (change,) = other.changes(since=old)
    assert change.id == ids[0] and change.version > max(by_id[ids[0]])
    other.close()
    ds.close()


def test_positions_text_round_trips_and_reads_the_json_form_before() -> None:
    """Positions as a cursor or a consumer's checkpoint carry them (64-bit ints,
    zlib, base64) give back what was encoded; the JSON text of cursors and
    checkpoints made before still decodes; damaged text raises ValueError."""
    rng = random.Random(26)
    for n in (0, 1, 7, 1024):
        positions = {b: rng.randint(1, 2**50) for b in rng.sample(range(65_536), n)}
        text = feedpage.encode_positions(positions)
        assert feedpage.decode_positions(text) == positions
        assert "." not in text and ":" not in text  # the separators around it
    for zeros in ({3: 0, 5: 2}, {3: 0, 900: 2}, {900: 2, 3: 0}):  # a run, 64-bit pairs
        assert feedpage.decode_positions(feedpage.encode_positions(zeros)) == {
            b: p for b, p in zeros.items() if p
        }
    # positions are compressed with a small zlib state; those compressed
    # with zlib's default state (earlier versions' cursors) read the same
    small = {3: 7, 10: 2}  # (too far apart for a run: 64-bit pairs)
    made = base64.urlsafe_b64decode(feedpage.encode_positions(small)[1:] + "==")
    default = base64.urlsafe_b64encode(zlib.compress(zlib.decompress(made), 1)).decode()
    assert feedpage.decode_positions("~" + default.rstrip("=")) == small
    flat = [3, 7, 7, 2]  # buckets 3 and 10, as deltas
    old = base64.urlsafe_b64encode(zlib.compress(json.dumps(flat).encode())).decode().rstrip("=")
    assert feedpage.decode_positions(old) == {3: 7, 10: 2}
    three_bytes = base64.urlsafe_b64encode(zlib.compress(b"abc")).decode()
    negative = (
        feedpage.encode_positions({3: 7})[:1]
        + base64.urlsafe_b64encode(
            zlib.compress((-1).to_bytes(8, "little", signed=True) * 2)
        ).decode()
    )
    for bad in ("~" + three_bytes, negative):
        with pytest.raises(ValueError):
            feedpage.decode_positions(bad)


_POSITIONS = st.dictionaries(
    st.integers(0, 65_535),
    st.one_of(st.integers(0, 60), st.integers(0, 2**32 - 1), st.integers(0, 2**62)),
    max_size=300,
)


@given(
    positions=_POSITIONS,
    first=st.integers(0, 65_000),
    run=st.lists(st.one_of(st.integers(0, 9), st.integers(0, 2**33)), max_size=600),
)
@settings(max_examples=300, deadline=None)
def test_positions_of_any_shape_round_trip(
    positions: dict[int, int], first: int, run: list[int]
) -> None:
    """Scattered buckets, runs of buckets in order or not, zeros among them,
    positions of 32 bits or more: each decodes to what was encoded, its
    zeros left out, in a run of buckets or as 64-bit pairs."""
    together = dict(zip(range(first, first + len(run)), run, strict=False))
    in_order = dict(sorted(positions.items()))  # (a reader's: some buckets missing)
    for given_ in (positions, in_order, together, dict(reversed(together.items()))):
        text = feedpage.encode_positions(given_)
        assert feedpage.decode_positions(text) == {b: p for b, p in given_.items() if p}
        assert "." not in text and ":" not in text


@given(
    first=st.integers(0, 2**32),
    values=st.lists(
        st.one_of(st.none(), st.integers(0, 60), st.integers(0, 2**33)).filter(
            lambda v: v is None or v < 2**32 or v % 50 == 0  # (now and then a big one)
        ),
        max_size=300,
    ),
    pages=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(
                st.tuples(
                    st.integers(0, 299),
                    st.one_of(st.integers(0, 60), st.integers(0, 2**33)).filter(
                        lambda v: v < 2**32 or v % 50 == 0
                    ),
                ),
                max_size=120,
            ),
        ),
        max_size=6,
    ),
)
@example(first=2**32, values=[1, 2], pages=[])  # (a bucket number past 32 bits: no run)
@settings(max_examples=300, deadline=None)
def test_a_readers_run_makes_the_text_its_positions_make(
    first: int, values: list[int | None], pages: list[tuple[bool, list[tuple[int, int]]]]
) -> None:
    """A reader's positions, page after page (feedpage.positions_after),
    whose cursor's text is made (or not: a consumer's batch) from a run, made
    from them or from the last page's run with the page's buckets written
    into it: the same text as the same positions in a plain dict, from a run
    exactly where that text is one; an empty page's are the last page's."""
    positions = {first + i: v for i, v in enumerate(values) if v is not None}
    after = feedpage.Positions(sorted(positions.items()))
    for text, page in [(True, []), *pages]:
        keys = list(after)
        buckets = [keys[i % len(keys)] for i, _ in page] if keys else []
        moved = [p for _, p in page][: len(buckets)]
        made = feedpage.positions_after(after, list(zip(buckets, moved, strict=True)), True)
        assert isinstance(made, feedpage.Positions)
        assert made == {**after, **dict(zip(buckets, moved, strict=True))}
        if not buckets:
            assert made is after  # (an empty page: the same, its run kept)
        if text:
            plain = feedpage.encode_positions(dict(made))
            assert feedpage.encode_positions(made) == plain
            if feedpage._RUNS:
                assert (made.run is not None) == plain.startswith("~~")
            assert feedpage.decode_positions(plain) == {b: p for b, p in made.items() if p}
        elif made is not after:
            assert made.run is None  # (made when a cursor is)
        after = made


def test_a_run_of_positions_is_the_compact_form_and_its_damage_is_refused() -> None:
    """A reader's positions (every bucket, in order, small numbers) take the
    run form, smaller than 64-bit pairs (two thirds of their size here); run text that is not
    whole 32-bit numbers, or holds no bucket, raises ValueError."""
    rng = random.Random(7)
    every = {b: rng.randint(1, 5_000) for b in range(1024)}
    text = feedpage.encode_positions(every)
    assert text.startswith("~~") and len(text) < 3_000
    pairs = feedpage._BINARY + feedpage._packed(
        b"".join(p.to_bytes(8, "little") for b in every for p in (1 if b else 0, every[b]))
    )
    assert feedpage.decode_positions(pairs) == every and 3 * len(text) < 2 * len(pairs)
    for raw in (b"abc", b"\0" * 4, b"\0" * 10):
        with pytest.raises(ValueError):
            feedpage.decode_positions("~~" + feedpage._packed(raw))


def test_bucket_sets_hold_bucket_numbers_of_the_store_only() -> None:
    """A set of buckets to read is ints from 0 to the bucket count less one:
    no bool, no float equal to one, nothing outside, nothing not iterable."""
    assert feedpage.bucket_set(range(3, 9), 16) == frozenset(range(3, 9))
    assert feedpage.bucket_set([], 16) == frozenset() and feedpage.bucket_set([15], 16)
    for bad in ([True], [1.0], [-1], [16], [3, "a"], [None], 5, [[1]], {0.5}):
        with pytest.raises(bagstore.InvalidQuery, match="buckets must be bucket numbers"):
            feedpage.bucket_set(bad, 16)  # type: ignore[arg-type]


def test_range_reads_give_the_rows_asked_whatever_their_number(topo: Topology) -> None:
    """The change rows of ranges read on one shard and over several shards
    together: each range's rows, in the order asked, whatever the number of
    ranges (SQLite: a VALUES list padded to one of a few sizes with ranges
    that hold nothing; more than a statement's ranges: several statements)."""
    ds = topo.open(buckets=16)
    ds.feed.enable(bodies=True)
    ds.put_many([{"n": i} for i in range(300)])
    feed = ds.feed
    holders = feed.holders()
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    for b, (top, _, shard) in sorted(holders.items()):
        by_shard.setdefault(shard, []).append((b, 2, max(2, top - 3)))
    expected = [
        (b, pos) for s in sorted(by_shard) for b, lo, hi in by_shard[s] for pos in range(lo, hi + 1)
    ]
    got = feed._read_ranges(by_shard, holders)
    assert sorted((r[0], r[1]) for r in got) == expected
    for shard, ranges in by_shard.items():
        backend = feed.router.backends[shard]
        rows = changesql.read_ranges(backend, ds.kind, ranges)
        assert [(r[0], r[1]) for r in rows] == [
            (b, pos) for b, lo, hi in ranges for pos in range(lo, hi + 1)
        ]
        assert all(type(r[6]) is bytes for r in rows)
        # one row a range, as many ranges as each padded size and one more
        b, _, top = max(ranges, key=lambda r: r[2] - r[1])
        singles = [(b, pos, pos) for pos in range(1, top + 1)]
        for n in (1, 2, 5, 7, 12, 33, 45, 46, min(len(singles), 201)):
            rows = changesql.read_ranges(backend, ds.kind, singles[:n])
            assert [(r[0], r[1]) for r in rows] == [(b, pos) for b, pos, _ in singles[:n]]
    many = [(b, pos, pos) for b, (top, _, s) in holders.items() for pos in range(1, top + 1)]
    shard_of = {b: s for b, (_, _, s) in holders.items()}
    assert len(many) == 300
    got = feed._read_ranges(
        {s: sorted(r for r in many if shard_of[r[0]] == s) for s in set(shard_of.values())},
        holders,
    )
    assert sorted((r[0], r[1]) for r in got) == sorted((b, pos) for b, pos, _ in many)
    ds.close()


def test_reading_sessions_are_bounded_and_shared_by_threads(tmp_path: Path) -> None:
    """A feed keeps at most 64 reading sessions (one a set of buckets read),
    dropping the oldest, with threads reading sets of buckets of their own
    and in common at once: every read gives its buckets' changes, each
    bucket's in position order, and no thread fails."""
    ds = bagstore.open(str(tmp_path / "store"), buckets=256)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(600)])
    tops = {b: top for b, (top, _) in ds.feed.ends().items()}
    errors: list[BaseException] = []

    def work(no: int) -> None:
        try:
            for k in range(40):
                first = (no * 13 + k) % 256 if k % 4 else 0  # bucket set 0-1 in common
                buckets = [first, (first + 1) % 256]
                changes, after = ds.feed.read({}, 500, buckets)
                for b in buckets:
                    positions = [c.position for c in changes if c.bucket == b]
                    assert positions == list(range(1, tops.get(b, 0) + 1))
                    assert after.get(b, 0) == tops.get(b, 0)
        except BaseException as exc:  # (reported below: a thread's failure)
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: races show
    try:
        threads = [threading.Thread(target=work, args=(no,)) for no in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    # threads replacing one another's session of buckets 0-1 may each drop
    # an oldest one: at most 64 are kept
    assert 0 < len(ds.feed._sessions) <= 64
    for first in range(100, 240, 2):  # one thread, 70 sets: the bound is met exactly
        ds.feed.read({}, 500, [first, first + 1])
    assert len(ds.feed._sessions) == 64
    ds.close()


def test_rows_read_ahead_stay_within_the_feed_budget(topo: Topology) -> None:
    """The rows a reader holds read ahead of its pages take at most
    ``ds.feed.read_ahead_bytes`` (their size estimated from the rows read),
    never less than each bucket's first rows: 16 buckets of ~94 changes of
    4 kB, pages of 100, are held nearly whole when the budget allows (a
    bucket's rest fits in one read) and within ~1 MiB when that is the
    budget; the pages are the same whatever the budget."""
    ds = topo.open(buckets=16)
    ds.feed.enable(bodies=True)
    rng = random.Random(26)
    for _ in range(6):
        ds.put_many([{"blob": rng.randbytes(4000)} for _ in range(250)])

    def read_all(budget: int) -> tuple[list[tuple[int, int]], int]:
        ds.feed.read_ahead_bytes = budget
        got: list[tuple[int, int]] = []
        since = None
        tracemalloc.start()
        try:
            while page := ds.changes(since=since, limit=100):
                got += [(c.bucket, c.position) for c in page]
                since = page.cursor
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return got, peak

    read_all(0)  # the feed has measured its rows
    whole, whole_peak = read_all(32 * 2**20)
    bounded, bounded_peak = read_all(2**20)
    least, _ = read_all(0)
    assert len(whole) == 1500
    same_pages(topo, whole, bounded, least)
    if topo.is_mysql:
        assert whole_peak > 5_000_000  # most of the changes' 6 MB of bodies held at once
    else:  # read in commit order, 256 rows a statement at most: a few shards' worth
        assert whole_peak > 2_500_000
    # the budget, the page returned and the one made, the driver's buffers
    # of a read (MariaDB's result as received beside its rows)
    assert bounded_peak < min(3_000_000, whole_peak // 2), (bounded_peak, whole_peak)
    ds.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "1000", True, None])
def test_a_read_ahead_budget_that_is_not_a_size_is_refused(tmp_path: Path, bad: object) -> None:
    ds = bagstore.open(str(tmp_path / "store"), buckets=4)
    with pytest.raises(bagstore.ConfigurationError, match="read_ahead_bytes must be an integer"):
        ds.feed.read_ahead_bytes = bad  # type: ignore[assignment]
    assert ds.feed.read_ahead_bytes == 32 * 2**20
    ds.close()


def test_the_read_ahead_budget_holds_for_every_kind_read(tmp_path: Path) -> None:
    """``ds.feed.read_ahead_bytes`` bounds the reads of another kind through
    the same Datastore (``ds.changes(kind=...)``, its consumers) too."""
    path = str(tmp_path / "store")
    bagstore.open(path, buckets=4, kind="posts").close()
    ds = bagstore.open(path, buckets=4)
    ds.feed.read_ahead_bytes = 4096
    assert ds.feed.other("posts").read_ahead_bytes == 4096
    ds.feed.read_ahead_bytes = 0
    assert ds.feed.other("posts").read_ahead_bytes == 0
    ds.close()


@pytest.mark.parametrize("budget", [32 * 2**20, 200_000])
def test_a_first_page_under_a_budget_reads_every_bucket_again_once_sized(budget: int) -> None:
    """Under a memory budget, with the rows' size not known yet, a first page
    reads each bucket's least (its share of two pages); the size measured,
    when the page needs more, it reads every bucket again as a first read
    would (the rest of a short one), rather than only the few buckets the
    page needs next, one read after another, if the budget allows: 64
    buckets of 20 changes, one bucket after another in time, pages of 100,
    read 4 rows a bucket, then the other 16 of every bucket in one more read;
    with a budget of 500 rows (of 400 bytes), less than the rows read
    and each bucket's least again (512), only the buckets the page needs.
    The pages are the plain merge."""
    streams = {
        b: [(b, i + 1, b"id", 0, 1, b * 1000 + i, None) for i in range(20)] for b in range(64)
    }
    reads: list[dict[int, int]] = []

    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        return {b: (20, 0, 0) for b in streams if wanted is None or b in wanted}

    def read(
        by_shard: dict[int, list[tuple[int, int, int]]],
        ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        reads.append({b: hi - lo + 1 for b, lo, hi in by_shard[0]})
        return as_read([r for b, lo, hi in by_shard[0] for r in streams[b][lo - 1 : hi]], bodies)

    def pruned(bucket: int, at: int, low: int) -> None:
        raise AssertionError("nothing is pruned here")

    session = feedread.start(None, {}, False, 0, holders, pruned)
    got: list[tuple[Any, ...]] = []
    while True:
        session.budget = budget
        page = feedread.next_rows(session, 100, 16, holders, read, pruned)
        if not page:
            break
        got += page
    assert reads[0] == dict.fromkeys(range(64), 4)
    if budget > 204_800:
        assert reads[1:] == [dict.fromkeys(range(64), 16)]
    else:
        assert len(reads[1]) < 64
    assert got == _reference(streams, set(), len(got) + 1) and len(got) == 64 * 20
    assert session.row_bytes == 400  # no bodies: a row's own memory
