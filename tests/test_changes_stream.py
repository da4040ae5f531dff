"""The reader of shards that keep their change rows in commit order
(bagstore.feedstream), driven by shards held in lists: every row comes
once, each shard's in its order, merged by time; a reader started again
from any page's positions goes on where that page ended."""

from __future__ import annotations

import random
from itertools import accumulate
from typing import Any

import pytest

import bagstore
from bagstore import feedstream
from bagstore.feedpage import encode_positions

Row = tuple[Any, ...]


class Shards:
    """Shards as lists of rows ``(bucket, pos, id, op, version, updated,
    body)`` in commit order (a row's number: its index + 1); bucket ``b``
    is held by shard ``b % count``."""

    def __init__(self, count: int, buckets: int, rng: random.Random, monotone: bool) -> None:
        self.rows: list[list[Row]] = [[] for _ in range(count)]
        self.tops = [0] * buckets
        self.clock = [0] * count
        self.rng, self.monotone = rng, monotone

    def write(self, n: int) -> None:
        for _ in range(n):
            b = self.rng.randrange(len(self.tops))
            shard = b % len(self.rows)
            step = self.rng.choice([0, 1, 1, 2, 5])
            if not self.monotone and self.rng.random() < 0.2:
                step = -self.rng.randint(1, 8)  # the shard's clock went back
            self.clock[shard] += step
            self.tops[b] += 1
            body = self.rng.choice([None, self.rng.randbytes(40)])
            self.rows[shard].append((b, self.tops[b], b"id", 0, 1, self.clock[shard], body))

    def calls(self) -> tuple[Any, ...]:
        count = len(self.rows)

        def tops() -> list[int]:
            return [len(rows) for rows in self.rows]

        def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
            return {  # (a bucket no change was written to has no positions)
                b: (top, 0, b % count)
                for b, top in enumerate(self.tops)
                if top and (wanted is None or b in wanted)
            }

        def firsts(shard: int, after: list[tuple[int, int]]) -> int | None:
            at = dict(after)
            for seq, r in enumerate(self.rows[shard], 1):
                if r[0] in at and r[1] > at[r[0]]:
                    return seq
            return None

        def pruned(bucket: int, at: int, low: int) -> None:
            raise AssertionError("nothing is pruned here")

        return tops, holders, firsts, pruned

    def fetch(self, shard: int, seq: int, limit: int) -> tuple[list[Row], int]:
        rows = self.rows[shard][seq : seq + limit]
        return rows, seq + len(rows)

    def keyed(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """Of each row (bucket, position): its shard, number and merge key
        (the running maximum of ``updated`` along its shard)."""
        out = {}
        for shard, rows in enumerate(self.rows):
            keys = accumulate((r[5] for r in rows), max)
            for seq, (r, key) in enumerate(zip(rows, keys, strict=True), 1):
                out[r[0], r[1]] = (shard, seq, key)
        return out


def _read(
    shards: Shards,
    positions: dict[int, int],
    limit: int,
    rng: random.Random,
    grow: bool,
    buckets: frozenset[int] | None = None,
) -> tuple[list[list[Row]], list[dict[int, int]]]:
    calls = shards.calls()
    s = feedstream.start(buckets, positions, False, 0, calls)
    pages, afters = [], []
    for n in range(100_000):
        s.budget = rng.choice([None, 0, 2_000, 20_000])  # ~150 bytes a row here
        page = feedstream.next_rows(s, limit, shards.fetch, calls)
        assert len(page) <= limit
        pages.append(page)
        afters.append(s.after)
        # its cursor's text, made from the run kept beside the positions
        assert encode_positions(s.after) == encode_positions(dict(s.after))
        if grow and n < 20 and rng.random() < 0.5:
            shards.write(rng.randint(1, 30))
        elif not page:
            break
    if buckets is not None and not grow and not positions:
        # a shard found to hold others' rows, theirs left out first (each
        # shard with rows of the reader's read from its first row)
        for shard, rows in enumerate(shards.rows):
            mine = {r[0] in buckets for r in rows}
            assert s.mixed[shard] == (mine == {True, False})
    return pages, afters


def _check_pages(shards: Shards, pages: list[list[Row]], grow: bool) -> None:
    keyed = shards.keyed()
    got = [(r[0], r[1]) for page in pages for r in page]
    assert sorted(got) == sorted(keyed), "every row once"
    seqs: dict[int, int] = {}
    for b, pos in got:
        shard, seq, _ = keyed[b, pos]
        assert seq > seqs.get(shard, 0), "each shard's rows in its order"
        seqs[shard] = seq
    if not grow:  # (rows written between pages may come after later keys)
        keys = [keyed[k][2] for k in got]
        assert keys == sorted(keys), "merged by time"


@pytest.mark.parametrize("seed", range(40))
def test_pages_are_every_row_once_in_each_shard_s_order(seed: int) -> None:
    """Pages of any size, within any memory budget, over shards whose times
    may go back, with rows written between pages or not: every row once,
    each shard's in its order, merged by the running maximum of their
    times while no row is written meanwhile."""
    rng = random.Random(seed)
    grow = seed % 2 == 1
    shards = Shards(rng.randint(1, 4), rng.choice([1, 3, 8, 64]), rng, monotone=seed % 4 < 2)
    shards.write(rng.randint(0, 300))
    pages, _ = _read(shards, {}, rng.choice([1, 2, 7, 50, 1000]), rng, grow)
    _check_pages(shards, pages, grow)


@pytest.mark.parametrize("seed", range(12))
def test_a_reader_started_from_a_page_s_positions_goes_on_there(seed: int) -> None:
    """A new reader started from the positions after any page (a cursor,
    in a process with no reader of its own) returns exactly the rows after
    that page, each shard's in its order."""
    rng = random.Random(seed)
    shards = Shards(rng.randint(1, 4), rng.choice([3, 8, 64]), rng, monotone=seed % 2 == 0)
    shards.write(rng.randint(50, 200))
    limit = rng.choice([1, 7, 30])
    pages, afters = _read(shards, {}, limit, rng, grow=False)
    for n in sorted(rng.sample(range(len(pages)), min(6, len(pages)))):
        rest, _ = _read(shards, afters[n], rng.choice([1, 7, 1000]), rng, grow=False)
        want = [(r[0], r[1]) for page in pages[n + 1 :] for r in page]
        got = [(r[0], r[1]) for page in rest for r in page]
        assert sorted(got) == sorted(want)
        keyed = shards.keyed()
        for shard in range(len(shards.rows)):
            mine = [keyed[k][1] for k in got if keyed[k][0] == shard]
            assert mine == sorted(mine)


@pytest.mark.parametrize("seed", range(12))
def test_a_reader_started_from_any_positions_skips_the_rows_before_them(seed: int) -> None:
    """Positions that are no prefix of a shard's rows (a cursor of another
    layout's reader, or one before rows were written in between): each
    shard is read from the first row after any of its buckets' positions,
    and each bucket's rows up to its position are skipped."""
    rng = random.Random(seed)
    shards = Shards(rng.randint(1, 4), rng.choice([3, 8, 64]), rng, monotone=seed % 2 == 0)
    shards.write(rng.randint(50, 300))
    positions = {b: rng.randint(0, top) for b, top in enumerate(shards.tops) if top}
    pages, afters = _read(shards, positions, rng.choice([1, 7, 1000]), rng, grow=False)
    got = [(r[0], r[1]) for page in pages for r in page]
    want = [k for k in shards.keyed() if k[1] > positions.get(k[0], 0)]
    assert sorted(got) == sorted(want)
    assert afters[-1] == {b: top for b, top in enumerate(shards.tops) if top}


def test_a_row_missing_is_found_whatever_rows_read_again_make_up_for_it() -> None:
    """A bucket's row missing from its shard (not pruned) raises ChangesLost,
    also when another bucket's row read again (before its position) makes
    the count of the rows read what it would be without the gap."""
    from bagstore import ChangesLost

    shards = Shards(1, 2, random.Random(0), monotone=True)
    shards.rows[0] = [
        (1, 1, b"id", 0, 1, 10, None),
        (0, 1, b"id", 0, 1, 11, None),
        # (1, 2): missing
        (0, 2, b"id", 0, 1, 13, None),
        (1, 3, b"id", 0, 1, 14, None),
    ]
    shards.tops = [2, 3]
    calls = shards.calls()
    s = feedstream.start(None, {0: 1}, False, 0, calls)
    with pytest.raises(ChangesLost, match="change 2 of bucket 1 is missing"):
        feedstream.next_rows(s, 1000, shards.fetch, calls)


@pytest.mark.parametrize("seed", range(12))
def test_positions_ahead_of_a_bucket_s_rows_while_rows_are_written(seed: int) -> None:
    """A cursor may hold positions of buckets with fewer rows than that, or
    none yet (a bucket no change was written to has no positions): rows
    written to them while the reader reads come once they pass it."""
    rng = random.Random(seed)
    shards = Shards(rng.randint(1, 4), rng.choice([3, 8, 64]), rng, monotone=seed % 2 == 0)
    shards.write(rng.randint(0, 100))
    positions = {b: p for b in range(len(shards.tops)) if (p := rng.randint(0, shards.tops[b] + 3))}
    pages, afters = _read(shards, positions, rng.choice([1, 7, 1000]), rng, grow=True)
    got = [(r[0], r[1]) for page in pages for r in page]
    want = [k for k in shards.keyed() if k[1] > positions.get(k[0], 0)]
    assert sorted(got) == sorted(want)
    tops = {b: max(top, positions.get(b, 0)) for b, top in enumerate(shards.tops)}
    assert afters[-1] == {b: top for b, top in tops.items() if top}


@pytest.mark.parametrize("seed", range(12))
def test_a_reader_of_some_buckets_reads_theirs_only(seed: int) -> None:
    """A reader of some of the buckets (a consumer process's ranges), each
    shard holding others too: every row of its buckets once, in each
    shard's order, none of the others'; their rows are left out before the
    per-bucket check once a shard is found to hold them."""
    rng = random.Random(seed)
    shards = Shards(rng.randint(1, 4), rng.choice([8, 64]), rng, monotone=seed % 2 == 0)
    shards.write(rng.randint(20, 300))
    mine = frozenset(rng.sample(range(len(shards.tops)), len(shards.tops) // 2))
    pages, afters = _read(
        shards, {}, rng.choice([1, 7, 1000]), rng, grow=seed % 3 == 0, buckets=mine
    )
    got = [(r[0], r[1]) for page in pages for r in page]
    keyed = shards.keyed()
    assert sorted(got) == sorted(k for k in keyed if k[0] in mine)
    for shard in range(len(shards.rows)):
        seqs = [keyed[k][1] for k in got if keyed[k][0] == shard]
        assert seqs == sorted(seqs)
    assert afters[-1] == {b: shards.tops[b] for b in sorted(mine) if shards.tops[b]}


class Numbered:
    """Shards as ``{number: row}`` (rows can be deleted, numbers stay), each
    bucket's holder, last position and last pruned, for a bucket move or a
    prune while a reader reads."""

    def __init__(self) -> None:
        self.rows: list[dict[int, Row]] = [{}, {}]
        self.top = [0, 0]
        self.holder = {0: 0, 1: 1, 2: 0}
        self.tops = dict.fromkeys(self.holder, 0)
        self.low = dict.fromkeys(self.holder, 0)
        #: (shard, number) -> done before that shard is read after that number
        self.on_fetch: dict[tuple[int, int], Any] = {}

    def add(self, shard: int, bucket: int, pos: int, updated: int) -> None:
        self.top[shard] += 1
        self.rows[shard][self.top[shard]] = (bucket, pos, b"id", 0, 1, updated, None)
        self.tops[bucket] = max(self.tops[bucket], pos)

    def calls(self) -> tuple[Any, ...]:
        def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
            return {
                b: (self.tops[b], self.low[b], shard)
                for b, shard in self.holder.items()
                if self.tops[b] and (wanted is None or b in wanted)
            }

        def firsts(shard: int, after: list[tuple[int, int]]) -> int | None:
            at = dict(after)
            found = [n for n, r in self.rows[shard].items() if r[0] in at and r[1] > at[r[0]]]
            return min(found, default=None)

        def pruned(bucket: int, at: int, low: int) -> None:
            raise bagstore.ChangesPruned(f"bucket {bucket} at {at}, pruned to {low}")

        return lambda: list(self.top), holders, firsts, pruned

    def fetch(self, shard: int, seq: int, limit: int) -> tuple[list[Row], int]:
        if (shard, seq) in self.on_fetch:
            self.on_fetch.pop((shard, seq))()
        numbers = sorted(n for n in self.rows[shard] if n > seq)[:limit]
        return [self.rows[shard][n] for n in numbers], (numbers[-1] if numbers else seq)

    def start(self) -> None:
        for pos in range(1, 5):
            self.add(0, 0, pos, 10 * pos)  # bucket 0 on shard 0
        self.add(0, 2, 1, 100)  # (shard 0 read to a later time than shard 1's rows)
        self.add(1, 1, 1, 1)
        self.add(1, 1, 2, 2)  # bucket 1 on shard 1


def test_a_move_completed_behind_the_reader_is_found_once_every_shard_is_read() -> None:
    """A bucket's copies read on the destination while the source still held
    it (skipped, as copies under way), then the move completed before the
    reader came back to the source: its last change lies on the destination
    behind where the reader stands.  Once every shard is read to its end the
    buckets' holders are read again, the move is found and the reader starts
    again from its last page: that change comes, once."""
    shards = Numbered()
    shards.start()
    calls = shards.calls()
    s = feedstream.start(None, {}, False, 0, calls)
    first = feedstream.next_rows(s, 1000, shards.fetch, calls)
    assert sorted((r[0], r[1]) for r in first) == [
        (0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (2, 1)
    ]  # fmt: skip
    shards.add(0, 0, 5, 50)  # a write to bucket 0, then the move's copies
    for pos in range(1, 6):
        shards.add(1, 0, pos, 10 * pos)

    def complete() -> None:  # the source's rows deleted, the bucket held by shard 1
        shards.rows[0] = {n: r for n, r in shards.rows[0].items() if r[0] != 0}
        shards.holder[0] = 1

    shards.on_fetch[0, 5] = complete
    s.budget = 0  # (a row a statement: shard 1's copies are read before shard 0 again)
    rest = []
    while page := feedstream.next_rows(s, 1000, shards.fetch, calls):
        rest += [(r[0], r[1]) for r in page]
    assert rest == [(0, 5)]
    assert s.after == {0: 5, 1: 2, 2: 1}


def test_changes_pruned_behind_the_reader_are_told_once_every_shard_is_read() -> None:
    """A bucket's changes the reader has not read pruned while it reads (it
    fell behind retention), with no later change of the bucket to show the
    gap: once every shard is read to its end the buckets' positions are read
    again and the reader is told (ChangesPruned), not left to skip them."""
    shards = Numbered()
    shards.start()

    def prune() -> None:  # bucket 0's changes 3 and 4 (and those before) pruned
        shards.rows[0] = {n: r for n, r in shards.rows[0].items() if r[0] != 0}
        shards.low[0] = 4

    shards.on_fetch[0, 2] = prune
    calls = shards.calls()
    s = feedstream.start(None, {}, False, 0, calls)
    s.budget, s.row_bytes = 0, 100  # (a row a statement: bucket 0's first two read first)
    got = []
    with pytest.raises(bagstore.ChangesPruned, match="bucket 0 at 2, pruned to 4"):
        while page := feedstream.next_rows(s, 1000, shards.fetch, calls):
            got += [(r[0], r[1]) for r in page]
    assert not {(0, 3), (0, 4)} & set(got)  # (the pruned changes never handed out)


def test_a_position_missing_from_a_bucket_s_rows_is_lost_not_skipped() -> None:
    """A bucket's change missing from the shard that holds it, not pruned
    (every row read past where its bucket was read to, so only what the
    positions add up to shows it): ChangesLost, not a silent skip."""
    shards = Numbered()
    shards.start()
    shards.rows[0] = {n: r for n, r in shards.rows[0].items() if r[:2] != (0, 3)}
    calls = shards.calls()
    s = feedstream.start(None, {}, False, 0, calls)
    with pytest.raises(bagstore.ChangesLost, match="change 3 of bucket 0 is missing"):
        feedstream.next_rows(s, 1000, shards.fetch, calls)
