"""Reading the change feed page after page (:meth:`bagstore.changes.Feed.read`)
at a cost that follows the rows a page returns, not the number of buckets.

A reader that goes on from the positions its last page ended at (a cursor's
next page, a consumer's next batch) keeps a :class:`Session`: the rows read
ahead and not returned yet, already in merge order; for each bucket read, the
last position read and the running maximum of ``updated`` there; and a heap of
the buckets not read to their last position, by the merge key their next row
would have at the least.  A page takes the rows that sort before the heap's
least key; when that is not a page's worth, it reads the next few rows of only
the buckets whose next row could come before the page's last one (one
statement a shard), and again until the page is full.  Each row is read once,
and the buckets a page does not reach cost it nothing.  How far ahead a
bucket is read is bounded by the memory the reader allows its rows read
ahead (:attr:`Session.budget`, a row's size measured from the rows read).
Rows the budget has no room for with their bodies (before a row's size is
known, or when even each bucket's least read would not fit: large bodies
over many buckets) are read without them, each body's length in its place,
and a page's bodies are read when it is returned (:func:`_with_bodies`).

Whatever does not go on from the session's end (another cursor, the first
page, a session left by a failed read) starts a fresh one: the buckets'
positions read from every shard and each bucket with changes after the
cursor read a few rows, a cost that grows with the bucket count, once.  So
does a page after the reader caught up with the positions read (following
the feed's end): they are read afresh.

The merge order: by the running maximum of ``updated`` along each bucket
(from the session's start), then bucket and position, each bucket's rows in
position order; a page never goes past a bucket's first row not read (its
key is at least the heap's), so a change it has not read cannot come before
one it returned.  A key is ``(running maximum, bucket)`` as one int (see
:func:`_key`; a store has at most 65,536 buckets); rows of one key are one
bucket's, kept in position order by stable sorts.  While every row held is
keyed by its own time (each bucket's times grow: the normal case), no key is
kept: the rows read, in (bucket, position) order, are sorted by time alone.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import add, gt, itemgetter, lshift, lt, or_, sub
from typing import Any, cast

from bagstore.errors import ChangesLost
from bagstore.feedpage import positions_after

__all__ = ["Session", "next_rows"]

_UPDATED, _BUCKET, _POS = itemgetter(5), itemgetter(0), itemgetter(1)
_AT = itemgetter(0, 1)
_FIRST, _LOW = itemgetter(0), itemgetter(1)  # (an end's last position, last pruned)
_LO, _HI = itemgetter(1), itemgetter(2)
_HIGH = itemgetter(1)
_16 = repeat(16)
#: a key's bucket bits (a store has at most 65,536 buckets)
_MASK = (1 << 16) - 1
#: ``holders(buckets or None)``: ``{bucket: (last position, last pruned, shard)}``.
Holders = Callable[[set[int] | None], dict[int, tuple[int, int, int]]]
#: ``read({shard: [(bucket, lo, hi), ...]}, ends, bodies)``: the change rows
#: of those ranges; ``ends`` the session's ``{bucket: (last position, last
#: pruned, shard)}``, what the reader may know of the rows between the
#: ranges; ``bodies`` False: each body's length (an int, or None) in its place.
Reader = Callable[
    [dict[int, list[tuple[int, int, int]]], dict[int, tuple[int, int, int]], bool],
    list[tuple[Any, ...]],
]
#: ``pruned(bucket, at, pruned)``: raises ChangesPruned.
Pruned = Callable[[int, int, int], None]


@dataclass
class Session:
    """What a reader knows between pages of one set of buckets (None: all)."""

    buckets: frozenset[int] | None
    oldest: bool
    #: the feed's epoch when it started (rows read before a failover that
    #: started a new one may be lost writes)
    epoch: int
    #: positions after the last page returned (the cursor that goes on)
    after: dict[int, int]
    #: of each bucket known: (last position, last pruned, shard), as read
    ends: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: of each bucket read: (last position read, running max of updated there)
    read_to: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: the rows read and not returned, in merge order (equal keys: one
    #: bucket's rows, in position order)
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    #: their merge keys (see _key), or None while each is its row's own
    #: (:func:`_own`: its bucket's times grew, the normal case)
    keys: list[int] | None = None
    #: buckets read short of their last position: the least key of the next row
    blocked: list[int] = field(default_factory=list)
    #: of each bucket read: the rows asked the last time
    sizes: dict[int, int] = field(default_factory=dict)
    #: the memory (bytes) its rows read ahead may take, set by the reader
    #: before each page (None: no bound); while :attr:`row_bytes` is not
    #: known, each bucket reads its least (see :func:`_fill`)
    budget: int | None = None
    #: the memory a row read takes, estimated from the rows read (0: none yet)
    row_bytes: int = 0
    #: positions read afresh by :func:`start` and not used by a page yet
    fresh: bool = False
    #: rows held that were read without their bodies (at most: rows read so
    #: and dropped are counted until none is held)
    bodiless: int = 0

    def goes_on(
        self, positions: dict[int, int], buckets: frozenset[int] | None, oldest: bool, epoch: int
    ) -> bool:
        """Whether ``positions`` are where this session's last page ended (a
        read from the oldest kept goes on only from a session that started so)."""
        return (
            self.epoch == epoch
            # (a set compared with itself is walked: ~3 us at 1,024 buckets)
            and (self.buckets is buckets or self.buckets == buckets)
            and (self.oldest or not oldest)
            and (positions is self.after or positions == self.after)
        )

    def held_rows(self) -> int:
        return len(self.rows)


def start(
    buckets: frozenset[int] | None,
    positions: dict[int, int],
    oldest: bool,
    epoch: int,
    holders: Holders,
    pruned: Pruned,
) -> Session:
    """A session at ``positions`` (a bucket missing: from 0, or from the oldest
    change kept with ``oldest``) in the feed's ``epoch``."""
    s = Session(buckets, oldest, epoch, dict(positions))
    _refresh(s, holders, pruned)
    s.fresh = True
    return s


def _refresh(s: Session, holders: Holders, pruned: Pruned) -> None:
    """Read every bucket's positions afresh; the buckets with changes after
    what was read go to the heap."""
    s.ends = ends = holders(None if s.buckets is None else set(s.buckets))
    read_to, after, blocked = s.read_to, s.after, s.blocked
    got = list(map(read_to.get, ends))
    if None not in got:
        ats = cast("list[tuple[int, int]]", got)
        # Every bucket read before (a reader going on, or following the
        # feed's end): in C loops, no bytecode a bucket but for those with
        # changes after what was read, or pruned past it.
        reads = list(map(_FIRST, ats))
        tops, lows = map(_FIRST, ends.values()), map(_LOW, ends.values())
        for b, (top, low, _), (pos, high) in compress(
            zip(ends, ends.values(), ats, strict=True),
            map(or_, map(gt, tops, reads), map(gt, lows, reads)),
        ):
            if pos < low:
                pruned(b, pos, low)
            if top > pos:
                blocked.append(_key(high, b))
        heapq.heapify(blocked)
        return
    if s.oldest:  # (changed below: the positions a page returned are never changed)
        after = s.after = dict(after)
    for b, (top, low, _) in ends.items():
        at = read_to.get(b)
        if at is None:
            pos = after.get(b, 0)
            if s.oldest and low > 0 and b not in after:
                pos = after[b] = low  # from the oldest kept
            at = read_to[b] = (pos, 0)
        if at[0] < low:
            pruned(b, at[0], low)
        if top > at[0]:
            blocked.append(_key(at[1], b))
    heapq.heapify(blocked)


def next_rows(
    s: Session, limit: int, most: int, holders: Holders, read: Reader, pruned: Pruned
) -> list[tuple[Any, ...]]:
    """The next ``limit`` rows (at most) of the session in merge order, and
    the session moved on past them (``s.after``); ``most``: rows read at most
    from one bucket at a time."""
    fresh, s.fresh = s.fresh, False
    if not s.blocked and len(s.rows) < limit and not fresh:
        # Every bucket was read to the positions known: read them afresh
        # (unless the session's start just did).
        s.blocked = []
        _refresh(s, holders, pruned)
    active = max(1, len(s.blocked))
    # a bucket's first read: twice its share of a page; each next one four
    # times the last, up to `most` or to sixteen times the first read
    # (thirty-two shares, eight pages at most); any of them all the rest of
    # the bucket when it is at most twice `most` rows, the first one only
    # while a page is at least an eighth of a row a bucket (a first read
    # reaches every bucket at once: a page of 1 row over 1,024 buckets does
    # not read them all to their end).  The memory held is bounded by the
    # budget (see _fill); within it, fewer and longer reads cost less: a
    # range costs more than its rows (~30 us on MariaDB), and each read
    # costs a statement a shard and a merge with the rows held.  Measured at
    # 64 buckets of ~300 changes, pages of 1,000: a bound of four times the
    # first read (two pages) read each bucket in three ranges over eight
    # reads, and the whole read ran at 0.68-0.70 of raw SQL's on SQLite,
    # 0.85 on MariaDB; reading each bucket's rest at once, 0.78-0.79 and
    # 0.93.  At 1,024 buckets of ~20 changes, each is read in one range.
    first = min(limit, max(2, -(-2 * limit // active)))
    most = max(first, most, min(16 * first, 8 * limit))
    whole_first = active <= 8 * limit
    stuck: set[int] = set()  # buckets that read nothing twice in this call
    tried: set[int] = set()
    # Under a budget, rows of a size not known yet: the first fill reads each
    # bucket's least; the size known, the next reads every bucket again as
    # a first read would (the rest of a short one) when the budget allows.
    probing, again = s.budget is not None and not s.row_bytes, False
    while True:
        held, keys, blocked = s.rows, s.keys, s.blocked
        # A row is returned once its key is at most the heap's least: a key
        # equal to a bound is its bucket's, whose rows read come before its
        # next one.
        if not blocked:
            n = len(held)
            break
        n = _after(held, blocked[0]) if keys is None else bisect_right(keys, blocked[0])
        if n >= limit:
            break
        # The buckets whose next row could sort before the page's last row.
        target = None
        if len(held) >= limit:
            target = _own(held[limit - 1]) if keys is None else keys[limit - 1]
        picked: list[int] = []
        kept: list[int] = []
        while blocked and (again or target is None or blocked[0] < target):
            bound = heapq.heappop(blocked)
            (kept if bound & _MASK in stuck else picked).append(bound)
        for bound in kept:
            heapq.heappush(blocked, bound)
        if not picked:
            break
        short = _fill(s, picked, first, most, whole_first, read)
        again = False
        if probing and s.row_bytes:
            probing = False
            # (only when every bucket's least read again fits in the budget)
            again = s.row_bytes * (len(s.rows) + first * len(blocked)) <= (s.budget or 0)
            if again:
                for bound in picked:
                    s.sizes.pop(bound & _MASK, None)
        if short:
            _recheck(s, short, holders, pruned, tried, stuck)
    n = min(n, limit)
    rows = s.rows[:n]
    del s.rows[:n]
    if s.bodiless:
        rows = _with_bodies(s, rows, read, holders, pruned)
    if s.keys is not None:
        del s.keys[:n]
        if not s.keys:
            s.keys = None
    s.after = positions_after(s.after, rows, s.buckets is None)
    return rows


def _key(high: int, bucket: int) -> int:
    """The merge key of a row of ``bucket`` whose running maximum of
    ``updated`` is ``high``: ``(high, bucket)`` as one int (faster to sort
    than a tuple); a bucket's rows of one key are kept in position order
    by a stable sort."""
    return (high << 16) | bucket


def _keys(highs: list[int], buckets: list[int]) -> list[int]:
    """:func:`_key` of each pair, in C loops."""
    return list(map(or_, map(lshift, highs, _16), buckets))


def _own(row: tuple[Any, ...]) -> int:
    """A row's merge key when its running maximum is its own time."""
    return (row[5] << 16) | row[0]  # type: ignore[no-any-return]


def _after(held: list[tuple[Any, ...]], key: int, lo: int = 0) -> int:
    """``bisect_right(held, key, lo, key=_own)`` of rows each keyed by its own
    time (the first held after ``lo`` whose key is above ``key``), searched
    by C getters rather than a Python call a step: by time, then, among the
    rows of that time (rare), by bucket (their keys' order)."""
    time = key >> 16
    i = bisect_right(held, time, lo, key=_UPDATED)
    if i > lo and held[i - 1][5] == time:
        j = bisect_left(held, time, lo, i, key=_UPDATED)
        i = bisect_right(held, key & _MASK, j, i, key=_BUCKET)
    return i


def _fill(
    s: Session, picked: list[int], first: int, most: int, whole_first: bool, read: Reader
) -> list[int]:
    """Read the next rows of the ``picked`` buckets' heap keys (``first`` the
    first time, then four times as many as the last time, up to ``most``, or
    the rest of the bucket when it is at most twice ``most`` rows, the
    first time too with ``whole_first``) into ``s.rows`` (in merge order)
    and push those still short of their last position back onto the heap;
    the buckets that read nothing."""
    ends, read_to, sizes = s.ends, s.read_to, s.sizes
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    asked: list[tuple[int, int, int]] = []
    # The memory held: a bucket reads no more than its share of the room
    # left, nor less than its first read (a page must reach every bucket).
    cap = first
    if s.budget is None:
        cap = _UNBOUND
    elif s.row_bytes:
        cap = max(first, (s.budget // s.row_bytes - len(s.rows)) // len(picked))
    # Without bodies (their lengths in their place) when the budget has no
    # room for each bucket's least read with them, or a row's size is not
    # known yet: a page's bodies are read when it is returned.
    bodies = s.budget is None or (
        s.row_bytes > 0 and s.row_bytes * (len(s.rows) + first * len(picked)) <= s.budget
    )
    for bound in picked:
        b = bound & _MASK
        lo = read_to[b][0] + 1
        top, _, shard = ends[b]
        later = b in sizes
        size = sizes[b] = min(most, 4 * sizes[b], cap) if later else first
        if top - lo < 2 * most and (later or whole_first):  # the rest, in one range, not two
            size = min(top - lo + 1, cap)
        r = (b, lo, min(top, lo - 1 + size))
        asked.append(r)
        by_shard.setdefault(shard, []).append(r)
    asked.sort()
    for ranges in by_shard.values():
        ranges.sort()
    rows = read(by_shard, ends, bodies)
    if rows:
        _measure(s, rows)
        if not bodies:
            s.bodiless += len(rows)
    buckets = list(map(_BUCKET, asked))
    counts = [hi - lo + 1 for _, lo, hi in asked]
    bs = list(map(_BUCKET, rows))
    if len(rows) == sum(counts):
        want = list(chain.from_iterable(map(repeat, buckets, counts)))
        if bs != want:  # not in bucket order (shards one after another): each
            rows.sort(key=_BUCKET)  # bucket's rows come in position order (checked next)
            bs = list(map(_BUCKET, rows))
        stops = map(add, map(_HI, asked), repeat(1))
        if bs == want and list(map(_POS, rows)) == list(
            chain.from_iterable(map(range, map(_LO, asked), stops))
        ):
            _fill_whole(s, asked, buckets, counts, rows, bs)
            return []
    return _fill_parts(s, asked, rows)


#: what a row read takes in memory beyond its id and body (its tuple, the
#: ints; measured by sys.getsizeof: ~300 bytes), a Change made of it included
_ROW_BYTES = 400
_UNBOUND = 1 << 62
#: the rows a row's size estimate is drawn from, the last read's the newest
_MEASURED = 1024
_BODY = itemgetter(6)


def _measure(s: Session, rows: list[tuple[Any, ...]]) -> None:
    """Update the session's estimate of a row's memory from ~32 of ``rows``,
    a read weighing as its rows against the last :data:`_MEASURED` rows
    (the few rows of a bucket's last read, its deletes, say, do not sway
    it: halving it at each read did, below a tenth of the rows' size)."""
    sample = rows[:: len(rows) // 32 + 1]
    # (a body read without it: its length, an int, in its place)
    bodies = sum(b if type(b) is int else len(b) for b in map(_BODY, sample) if b)
    est = _ROW_BYTES + bodies // len(sample)
    if not s.row_bytes:
        s.row_bytes = est
    else:
        s.row_bytes += (est - s.row_bytes) * min(len(rows), _MEASURED) // _MEASURED


def _fill_whole(
    s: Session,
    asked: list[tuple[int, int, int]],
    buckets: list[int],
    counts: list[int],
    rows: list[tuple[Any, ...]],
    bs: list[int],
) -> None:
    """:func:`_fill`'s work when every row asked came, in the order asked
    (the normal case), in C loops: each row's key its own time while each
    bucket's times grow from where it was read to, else the running maxima."""
    read_to = s.read_to
    his = list(map(_HI, asked))
    firsts = list(accumulate(counts, initial=0))
    del firsts[-1]
    lasts = list(map(sub, map(add, firsts, counts), repeat(1)))
    highs = list(map(_HIGH, map(read_to.__getitem__, buckets)))
    times = list(map(_UPDATED, rows))
    # Where `updated` goes back from one row to the next: normally only
    # from one bucket to the next; then each row's key is its own time.
    back = _steps(times, gt)
    if back.issubset(firsts) and not any(map(lt, map(times.__getitem__, firsts), highs)):
        ktimes = times
    else:
        ktimes = []
        for first, n, high in zip(firsts, counts, highs, strict=True):
            ktimes += accumulate(times[first : first + n], max, initial=high)
            del ktimes[-n - 1]
    tops = list(map(itemgetter(0), map(s.ends.__getitem__, buckets)))
    new_highs = list(map(ktimes.__getitem__, lasts))
    read_to.update(zip(buckets, zip(his, new_highs, strict=True), strict=True))
    more = list(map(lt, his, tops))
    s.blocked += map(_key, compress(new_highs, more), compress(buckets, more))
    heapq.heapify(s.blocked)
    if ktimes is times and s.keys is None:
        # Each row's key its own: sorted by time alone, a stable sort keeping
        # the rows' (bucket, position) order; a few merged in (_insert).
        if not s.rows:
            rows.sort(key=_UPDATED)
            s.rows = rows
        elif 16 * len(rows) <= len(s.rows):
            s.rows = _insert(s.rows, rows)
        else:
            # Two stable sorts by ints (no key tuple made a row): by bucket,
            # each bucket's rows in position order (held ones first, then
            # those read), then by time.
            held = s.rows
            held += rows
            held.sort(key=_BUCKET)
            held.sort(key=_UPDATED)
        return
    _merge(s, _keys(ktimes, bs), rows)


def _insert(held: list[tuple[Any, ...]], rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A few ``rows`` (in (bucket, position) order, each keyed by its own
    time) added to ``held`` (in merge order, each its own key), each after
    the held rows of its key or less as ``insort`` would put it: a new list
    made in one pass, not a list moved a row (a page of 100 over 1,024
    buckets adds some 140 rows at a time to ~10,000 held)."""
    rows.sort(key=_UPDATED)  # stable: by (time, bucket, position), the merge order
    out: list[tuple[Any, ...]] = []
    at = 0
    for row in rows:
        i = _after(held, _own(row), at)
        out += held[at:i]
        out.append(row)
        at = i
    out += held[at:]
    return out


def _fill_parts(
    s: Session, asked: list[tuple[int, int, int]], rows: list[tuple[Any, ...]]
) -> list[int]:
    """:func:`_fill`'s work when rows asked are missing (pruned, moved, not
    committed yet): each bucket's rows from the first asked on, up to the
    first missing; the buckets that read nothing."""
    rows.sort(key=_AT)
    bs = list(map(_BUCKET, rows))
    ps = list(map(_POS, rows))
    ends, read_to, blocked = s.ends, s.read_to, s.blocked
    short: list[int] = []
    keys: list[int] = []
    kept: list[tuple[Any, ...]] = []
    at = 0
    for b, lo, _ in asked:
        high = read_to[b][1]
        first = end = bisect_left(bs, b, at)
        while end < len(rows) and bs[end] == b and ps[end] == lo + end - first:
            end += 1
        if end == first:
            short.append(b)
            heapq.heappush(blocked, _key(high, b))
            continue
        at = end
        running = list(accumulate(map(_UPDATED, rows[first:end]), max, initial=high))
        del running[0]
        keys += map(_key, running, repeat(b))
        kept += rows[first:end]
        high, last = running[-1], ps[end - 1]
        read_to[b] = (last, high)
        if last < ends[b][0]:
            heapq.heappush(blocked, _key(high, b))
    _merge(s, keys, kept)
    return short


def _merge(s: Session, keys: list[int], rows: list[tuple[Any, ...]]) -> None:
    """Add ``rows`` (each bucket's in position order) to those held, by their
    merge ``keys``: one stable sort of the keys' indexes (a row held before
    comes before a later one of its bucket and key)."""
    if not rows:
        return
    if s.rows:
        held = s.keys
        if held is None:
            held = _keys(list(map(_UPDATED, s.rows)), list(map(_BUCKET, s.rows)))
        keys = held + keys
        rows = s.rows + rows
    order = sorted(range(len(keys)), key=keys.__getitem__)
    s.keys = list(map(keys.__getitem__, order))
    s.rows = list(map(rows.__getitem__, order))


def _with_bodies(
    s: Session, rows: list[tuple[Any, ...]], read: Reader, holders: Holders, pruned: Pruned
) -> list[tuple[Any, ...]]:
    """A page's ``rows`` with the bodies of those read without them (see
    :func:`_fill`), read from each bucket's shard, one statement a group of
    shards: a bucket moved meanwhile is read where it is now; a change
    pruned meanwhile raises (``pruned``)."""
    need = [i for i, body in enumerate(map(_BODY, rows)) if type(body) is int]
    s.bodiless = max(0, s.bodiless - len(need)) if s.rows else 0
    for _ in range(3):
        if not need:
            return rows
        by_shard: dict[int, list[tuple[int, int, int]]] = {}
        for b, p in sorted(map(_AT, map(rows.__getitem__, need))):
            ranges = by_shard.setdefault(s.ends[b][2], [])
            if ranges and ranges[-1][0] == b and ranges[-1][2] == p - 1:
                ranges[-1] = (b, ranges[-1][1], p)  # one range of a bucket's run
            else:
                ranges.append((b, p, p))
        found = {_AT(r): r for r in read(by_shard, s.ends, True)}
        missing = []
        for i in need:
            got = found.get(_AT(rows[i]))
            if got is None:
                missing.append(i)
            else:
                rows[i] = got
        need = missing
        if need:  # moved or pruned since: where the buckets are now
            fresh = holders({rows[i][0] for i in need})
            for b, p in map(_AT, map(rows.__getitem__, need)):
                top, low, shard = fresh.get(b, s.ends[b])
                if low >= p:
                    pruned(b, p - 1, low)
                s.ends[b] = (top, low, shard)
    if not need:
        return rows
    b, p = _AT(rows[need[0]])
    raise ChangesLost(
        f"change {p} of bucket {b} was read, then was not found to read its body: gone "
        "from its shard though neither pruned nor moved (lost in a failover?); read from "
        "the start or reset the consumer"
    )


def _steps(values: list[int], op: Callable[[int, int], bool]) -> set[int]:
    """The indexes ``i`` where ``op(values[i - 1], values[i])`` (C loops)."""
    return set(compress(count(1), map(op, values, islice(values, 1, None))))


def _recheck(
    s: Session, short: list[int], holders: Holders, pruned: Pruned, tried: set[int], stuck: set[int]
) -> None:
    """Buckets that read nothing where rows should be: pruned (raise), moved to
    another shard (read there next), or neither twice (stuck for this call)."""
    fresh = holders(set(short))
    for b in short:
        pos = s.read_to[b][0]
        top, low, shard = fresh.get(b, (pos, 0, s.ends[b][2]))
        if low > pos:
            pruned(b, pos, low)
        s.ends[b] = (top, low, shard)
        if b in tried:
            stuck.add(b)
        tried.add(b)
        if top <= pos:  # nothing after what was read, after all
            s.blocked[:] = [k for k in s.blocked if k & _MASK != b]
            heapq.heapify(s.blocked)
