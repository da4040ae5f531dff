"""Reading the change feed's ranges as spans of buckets (MariaDB,
bagstore.backends.changerange): a run of ranges of buckets close together is
read as one span whose rows not asked the server drops; the rows returned
are exactly the ranges' rows, in order, whatever the reader knows (or
wrongly believes) of the rows between them."""

from __future__ import annotations

import random
from typing import Any

from bagstore.backends import changerange, changesql
from tests.conftest import DRIVER, Topology


def _ends(tops: dict[int, int], shard_of: dict[int, int]) -> dict[int, tuple[int, int, int]]:
    return {b: (top, 0, shard_of[b]) for b, top in tops.items()}


def test_spans_join_close_buckets_whose_rows_not_asked_are_few() -> None:
    """Whole rests of adjacent buckets are one run; a run stops where the rows
    it would pass over (the asked buckets' rows outside their ranges, the
    buckets between without a range) pass 16 a range saved, at a gap of more
    than 8 buckets, or at a bucket held by another shard's rows counted as
    none, or at a bucket's second range; without what the reader knows, one
    range a run."""
    ends = _ends({b: 20 for b in range(40)}, {b: 0 for b in range(40)})
    whole = [(b, 1, 20) for b in range(10)]
    assert changerange._spans(whole, (ends, 0)) == [10]
    assert changerange._spans(whole, None) == [1] * 10
    assert changerange._spans(whole, (ends, 1)) == [10]  # none of these rows here: none passed
    # 2 rows passed over a bucket: within 16 a range saved
    assert changerange._spans([(b, 2, 19) for b in range(10)], (ends, 0)) == [10]
    # 10 rows passed over a bucket (of 20): two buckets a run at most
    assert changerange._spans([(b, 6, 15) for b in range(6)], (ends, 0)) == [1, 1, 1, 1, 1, 1]
    # a bucket between without a range: its 20 rows passed over
    assert changerange._spans([(0, 1, 20), (2, 1, 20), (3, 1, 20)], (ends, 0)) == [1, 2]
    # nine buckets between (without rows here): not joined
    far = {**ends, **{b: (20, 20, 0) for b in range(1, 10)}}
    assert changerange._spans([(0, 1, 20), (10, 1, 20)], (far, 0)) == [1, 1]
    near = {**ends, **{b: (20, 20, 0) for b in range(1, 9)}}
    assert changerange._spans([(0, 1, 20), (9, 1, 20)], (near, 0)) == [2]
    # a bucket's second range starts another run
    assert changerange._spans([(0, 1, 10), (0, 11, 20), (1, 1, 20)], (ends, 0)) == [1, 2]


def test_range_reads_as_spans_give_exactly_the_rows_asked(topo: Topology) -> None:
    """Random ranges of each shard's buckets (some buckets skipped, ranges
    with rows before and after them not asked, bounds past the last
    position), read with what the reader knows of the rows (true, or tops
    and shards made up) and without: each range's rows and no other, in the
    order asked; on MariaDB runs of them are read as spans."""
    ds = topo.open(buckets=32)
    ds.feed.enable(bodies=True)
    ds.put_many([{"n": i} for i in range(700)])
    holders = ds.feed.holders()
    backends = ds.router.backends
    by_shard: dict[int, list[int]] = {}
    for b, (_, _, shard) in sorted(holders.items()):
        by_shard.setdefault(shard, []).append(b)
    rng = random.Random(26)
    spans = 0
    counted = changerange._spans

    def spans_counted(ranges: list[tuple[int, int, int]], known: object) -> list[int]:
        nonlocal spans
        runs = counted(ranges, known)  # type: ignore[arg-type]
        spans += sum(1 for n in runs if n > 1)
        return runs

    changerange._spans = spans_counted  # type: ignore[assignment]
    try:
        for _ in range(60):
            for shard, buckets in by_shard.items():
                ranges = []
                for b in buckets:
                    top = holders[b][0]
                    if rng.random() < 0.2:
                        continue
                    lo = rng.choice([1, 1, 2, rng.randint(1, top + 1)])
                    hi = rng.choice([top, top + 3, max(lo, top - 1), rng.randint(lo, top + 2)])
                    if rng.random() < 0.1 and lo < hi:  # two ranges of one bucket
                        ranges += [(b, lo, (lo + hi) // 2), (b, (lo + hi) // 2 + 1, hi)]
                    else:
                        ranges.append((b, lo, hi))
                if not ranges:
                    continue
                expected = [
                    (b, pos)
                    for b, lo, hi in ranges
                    for pos in range(lo, min(hi, holders[b][0]) + 1)
                ]
                made_up = {
                    b: (max(0, top + rng.randint(-15, 5)), 0, rng.choice([s, s, shard]))
                    for b, (top, _, s) in holders.items()
                }
                for known in (None, (holders, shard), (made_up, shard)):
                    rows = changerange.read_ranges(backends[shard], ds.kind, ranges, known)
                    assert [(r[0], r[1]) for r in rows] == expected, (ranges, known)
                    assert all(type(r[6]) is bytes for r in rows)
        whole = {s: [(b, 1, holders[b][0]) for b in bs] for s, bs in by_shard.items()}
        rows = ds.feed._read_ranges(whole, holders)  # several shards a statement on MariaDB
        assert sorted((r[0], r[1]) for r in rows) == sorted(
            (b, pos) for b, (top, _, _) in holders.items() for pos in range(1, top + 1)
        )
    finally:
        changerange._spans = counted  # type: ignore[assignment]
    if topo.is_mysql:
        assert spans > 0
    ds.close()


def test_positions_read_as_one_text_agree_with_rows(topo: Topology) -> None:
    """A shard's positions (MariaDB: one text a shard, parsed) are the
    position rows as they are, alone and several shards a statement,
    buckets without changes and kinds without rows included, with what they
    add up to; a text that does not hold its count of positions or does not
    add up (cut short) is read as rows.  Given the sums read last, a shard
    whose positions still add up to them answers None, and its positions
    once a write moved them."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(300)])
    backends = ds.router.backends

    def as_rows(backend: object, kind: str) -> dict[int, tuple[int, int]]:
        b: Any = backend
        rows = b.fetchall(
            f"SELECT bucket, pos, pruned FROM {changesql.POSITIONS} WHERE kind = {b.dialect.param}",
            [kind],
        )
        return {int(x): (int(p), int(q)) for x, p, q in rows}

    def sums(found: dict[int, tuple[int, int]]) -> tuple[int, int, int, int]:
        return (len(found), sum(found), sum(p for p, _ in found.values()),
                sum(q for _, q in found.values()))  # fmt: skip

    for kind in (ds.kind, "nothing_here"):
        expected = {no: as_rows(b, kind) for no, b in enumerate(backends)}
        read = {no: changesql.positions(b, kind) for no, b in enumerate(backends)}
        assert read == {no: (sums(e), e) for no, e in expected.items()}
        if len(backends) > 1:
            triples = [(no, b, None) for no, b in enumerate(backends)]
            assert changesql.positions_together(kind, triples) == read
            known = [(no, b, read[no][0]) for no, b in enumerate(backends)]
            assert changesql.positions_together(kind, known) == {
                no: (read[no][0], None) for no in read
            }
        for no, b in enumerate(backends):
            assert changesql.positions(b, kind, read[no][0]) == (read[no][0], None)
    assert sum(map(len, expected.values())) == 0
    assert sum(len(as_rows(b, ds.kind)) for b in backends) >= 32  # (not vacuous)
    # a write moves its shard's sums on: its positions are read again
    before = {no: changesql.positions(b, ds.kind)[0] for no, b in enumerate(backends)}
    ds.put({"n": 300})
    after = {no: changesql.positions(b, ds.kind, before[no]) for no, b in enumerate(backends)}
    moved = [no for no, (_, found) in after.items() if found is not None]
    assert len(moved) == 1 and after[moved[0]][1] == as_rows(backends[moved[0]], ds.kind)
    assert after[moved[0]][0] == sums(as_rows(backends[moved[0]], ds.kind)) != before[moved[0]]
    whole = changesql._concatenated
    assert whole((0, 0, 0, 0), None) == {}
    assert whole((2, 7, 16, 1), "3,7,0,4,9,1") == {3: (7, 0), 4: (9, 1)}
    assert whole((2, 7, 16, 1), b"3,7,0,4,9,1") == {3: (7, 0), 4: (9, 1)}
    assert whole((3, 7, 16, 1), "3,7,0,4,9,1") is None  # cut short
    assert whole((2, 7, 16, 10), "3,7,0,4,9,1") is None  # cut within its last number (10)
    assert whole((2, 7, 16, 1), "3,7,0,4,9,") is None  # cut after a comma
    assert whole((2, 7, 16, 1), None) is None
    if topo.is_mysql:  # a session that cuts the text: what it reads is refused
        backend: Any = backends[0]
        sql, params = changesql._positions_sql(backend, 0, ds.kind, False, None)
        with backend.connection() as conn:
            cur = conn.cursor()
            for cut in (4, 5, 17, 33):  # (4: the least MariaDB takes)
                cur.execute(f"SET SESSION group_concat_max_len = {cut}")
                cur.execute(sql, params)
                row = cur.fetchall()[0]
                cut_sums = tuple(int(x) for x in row[1:5])
                assert row[1] > 1 and whole(cut_sums, row[5]) is None, (cut, row)
            cur.execute("SET SESSION group_concat_max_len = 16777216")
            cur.execute(sql, params)
            row = cur.fetchall()[0]
            assert whole(tuple(int(x) for x in row[1:5]), row[5]) == as_rows(backend, ds.kind)
    ds.close()


def test_change_rows_read_packed_are_the_rows_stored(topo: Topology) -> None:
    """Through PyMySQL a range read asks MariaDB for a change row's five
    integers and its id packed as one binary value (changerange._PACKED_READ):
    the rows read are the rows stored, value for value and type for type, at
    the ends of each column's range (a bucket up to 65,535, a BIGINT's least
    and greatest, ids of zero and 0xff bytes, no body, an empty one, one of
    100 kB), alone and several shards a statement, and the same as read
    column by column."""
    ds = topo.open(buckets=64)
    ds.put({"n": 1})  # the shards' tables made
    backends = ds.router.backends
    rng = random.Random(2612)
    big, least = 2**63 - 1, -(2**63)
    stored: dict[int, list[tuple[Any, ...]]] = {}
    for no, backend in enumerate(backends[:2]):
        changesql.ensure_change_tables(backend)
        rows: list[tuple[Any, ...]] = []
        for bucket in [0, 1, 2, 65_535] if no == 0 else [7, 65_534]:
            ints = [(1, 0, 0, 0), (2, 1, big, big), (3, 0, least, least), (big, 1, -1, 1)]
            ints += [(4 + j, rng.choice((0, 1)), rng.randint(least, big), rng.randint(0, big))
                     for j in range(20)]  # fmt: skip
            for pos, op, version, updated in ints:
                ident = rng.choice([bytes(16), b"\xff" * 16, b"ab" + bytes(14), rng.randbytes(16)])
                body = rng.choice([None, b"", rng.randbytes(100_000), rng.randbytes(30)])
                rows.append((bucket, pos, ident, op, version, updated, body))
        changesql.copy_change_rows(backend, [changesql.ChangeRow("edges", *row) for row in rows])
        stored[no] = sorted(rows)
    ranges = {no: sorted({(r[0], 1, big) for r in rows}) for no, rows in stored.items()}
    packed = [b.parses_in_python for b in backends]
    assert packed == [topo.is_mysql and not DRIVER] * len(backends)
    for as_packed in (True, False) if topo.is_mysql else (False,):
        for b in backends:
            b.parses_in_python = as_packed
        for no, rows in stored.items():
            got = changerange.read_ranges(backends[no], "edges", ranges[no])
            assert got == rows
            assert [tuple(map(type, r)) for r in got] == [tuple(map(type, r)) for r in rows]
        parts = [(backends[no], ranges[no], None) for no in stored]
        assert sorted(changerange.ranges_together("edges", parts)) == sorted(stored[0] + stored[1])
    for b, was in zip(backends, packed, strict=True):
        b.parses_in_python = was
