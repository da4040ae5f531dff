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
sorted once, and the buckets a page does not reach cost it nothing.

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
one it returned.  Keys are one int each (see :func:`_key`; a store has at
most 65,536 buckets).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, compress, count, islice, repeat
from operator import add, ge, gt, itemgetter, lshift, lt, sub
from typing import Any

__all__ = ["Session", "next_rows"]

_UPDATED, _BUCKET, _POS = itemgetter(5), itemgetter(0), itemgetter(1)
_AT = itemgetter(0, 1)
_HI, _HIGH, _TOP = itemgetter(2), itemgetter(1), itemgetter(0)
_72, _48 = repeat(72), repeat(48)
_BUCKETS, _POSITIONS = (1 << 24) - 1, (1 << 48) - 1
#: ``holders(buckets or None)``: ``{bucket: (last position, last pruned, shard)}``.
Holders = Callable[[set[int] | None], dict[int, tuple[int, int, int]]]
#: ``read({shard: [(bucket, lo, hi), ...]}, ends)``: the change rows of those
#: ranges; ``ends`` the session's ``{bucket: (last position, last pruned,
#: shard)}``, what the reader may know of the rows between the ranges.
Reader = Callable[
    [dict[int, list[tuple[int, int, int]]], dict[int, tuple[int, int, int]]],
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
    #: the merge keys of the rows read and not returned, sorted (see _key)
    pending: list[int] = field(default_factory=list)
    #: those rows by their key (ints sort faster than (key, row) pairs, and a
    #: page's rows come out of a dict in C loops)
    held: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    #: buckets read short of their last position: the least key of the next row
    blocked: list[int] = field(default_factory=list)
    #: of each bucket read: the rows asked the last time
    sizes: dict[int, int] = field(default_factory=dict)

    def goes_on(
        self, positions: dict[int, int], buckets: frozenset[int] | None, oldest: bool, epoch: int
    ) -> bool:
        """Whether ``positions`` are where this session's last page ended (a
        read from the oldest kept goes on only from a session that started so)."""
        return (
            self.epoch == epoch
            and self.buckets == buckets
            and (self.oldest or not oldest)
            and positions == self.after
        )


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
    return s


def _refresh(s: Session, holders: Holders, pruned: Pruned) -> None:
    """Read every bucket's positions afresh; the buckets with changes after
    what was read go to the heap."""
    s.ends = ends = holders(None if s.buckets is None else set(s.buckets))
    read_to, after, blocked = s.read_to, s.after, s.blocked
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
            blocked.append(_key(at[1], b, at[0] + 1))
    heapq.heapify(blocked)


def next_rows(
    s: Session, limit: int, most: int, holders: Holders, read: Reader, pruned: Pruned
) -> list[tuple[Any, ...]]:
    """The next ``limit`` rows (at most) of the session in merge order, and
    the session moved on past them (``s.after``); ``most``: rows read at most
    from one bucket at a time."""
    if not s.blocked and len(s.pending) < limit:
        # Every bucket was read to the positions known: read them afresh.
        s.blocked = []
        _refresh(s, holders, pruned)
    active = max(1, len(s.blocked))
    # a bucket's first read: twice its share of a page; each next one four
    # times the last, up to `most` or that share; any of them all the rest
    # of the bucket when it is at most twice `most` rows (a range costs
    # more than its rows: a bucket read to its end in fewer of them; at
    # 1,024 buckets of ~20 changes, each is read in one range, not two),
    # the first one only while a page is at least an eighth of a row a
    # bucket (a first read reaches every bucket at once: a page of 1 row
    # over 1,024 buckets does not read them all to their end)
    first = min(limit, max(2, -(-2 * limit // active)))
    most = max(first, most)
    whole_first = active <= 8 * limit
    stuck: set[int] = set()  # buckets that read nothing twice in this call
    tried: set[int] = set()
    pending, blocked = s.pending, s.blocked
    while True:
        n = len(pending) if not blocked else bisect_left(pending, blocked[0])
        if n >= limit or not blocked:
            break
        # The buckets whose next row could sort before the page's last row.
        target = pending[limit - 1] if len(pending) >= limit else None
        picked: list[int] = []
        kept: list[int] = []
        while blocked and (target is None or blocked[0] < target):
            bound = heapq.heappop(blocked)
            (kept if (bound >> 48) & _BUCKETS in stuck else picked).append(bound)
        for bound in kept:
            heapq.heappush(blocked, bound)
        if not picked:
            break
        short = _fill(s, picked, first, most, whole_first, read)
        if short:
            _recheck(s, short, holders, pruned, tried, stuck)
    taken = pending[: min(n, limit)]
    del pending[: len(taken)]
    rows = list(map(s.held.pop, taken))
    after = dict(s.after)
    after.update(zip(map(_BUCKET, rows), map(_POS, rows), strict=True))  # no pair a row kept
    s.after = after
    return rows


def _key(high: int, bucket: int, pos: int) -> int:
    """A merge key ``(running max of updated, bucket, position)`` as one int
    (faster to sort than a tuple): buckets below 2**24, positions below 2**48."""
    return (high << 72) + (bucket << 48) + pos


def _fill(
    s: Session, picked: list[int], first: int, most: int, whole_first: bool, read: Reader
) -> list[int]:
    """Read the next rows of the ``picked`` buckets' heap keys (``first`` the
    first time, then four times as many as the last time, up to ``most``, or
    the rest of the bucket when it is at most twice ``most`` rows, the
    first time too with ``whole_first``) into ``s.pending`` (in merge order)
    and push those still short of their last position back onto the heap;
    the buckets that read nothing."""
    ends, read_to, sizes = s.ends, s.read_to, s.sizes
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    asked: list[tuple[int, int, int]] = []
    for bound in picked:
        b, lo = (bound >> 48) & _BUCKETS, (bound & _POSITIONS)
        top, _, shard = ends[b]
        later = b in sizes
        size = sizes[b] = min(most, 4 * sizes[b]) if later else first
        if top - lo < 2 * most and (later or whole_first):  # the rest, in one range, not two
            size = top - lo + 1
        r = (b, lo, min(top, lo - 1 + size))
        asked.append(r)
        by_shard.setdefault(shard, []).append(r)
    asked.sort()
    for ranges in by_shard.values():
        ranges.sort()
    rows = read(by_shard, ends)
    bs = list(map(_BUCKET, rows))
    ps = list(map(_POS, rows))
    places = list(map(add, map(lshift, bs, _48), ps))  # (bucket, position) as one int
    if any(map(ge, places, islice(places, 1, None))):
        # not in (bucket, position) order, as drivers normally return them
        rows.sort(key=_AT)
        bs = list(map(_BUCKET, rows))
        ps = list(map(_POS, rows))
        places = list(map(add, map(lshift, bs, _48), ps))
    times = list(map(_UPDATED, rows))
    # Where `updated` goes back from one row to the next (C loops): normally
    # only from one bucket to the next; then each row's key is its own time.
    back = _steps(times, gt)
    complete = len(rows) == sum(hi - lo + 1 for _, lo, hi in asked)
    if complete and _fill_fast(s, asked, rows, places, times, back):
        return []
    short: list[int] = []
    spans: list[tuple[int, int, int, int]] = []  # (bucket, first row, end, high before)
    blocked, at = s.blocked, 0
    fast = complete
    for b, lo, hi in asked:
        high = read_to[b][1]
        if complete:
            first, end = at, at + hi - lo + 1  # every row asked came: no gap
        else:
            first = end = bisect_left(bs, b, at)
            while end < len(rows) and bs[end] == b and ps[end] == lo + end - first:
                end += 1
            if end == first:
                short.append(b)
                heapq.heappush(blocked, _key(high, b, lo))
                continue
        at = end
        spans.append((b, first, end, high))
        if times[first] < high or (back and not back.isdisjoint(range(first + 1, end))):
            fast = False
            high = max(high, *times[first:end])
        else:
            high = times[end - 1]
        last = ps[end - 1]
        read_to[b] = (last, high)
        if last < ends[b][0]:
            heapq.heappush(blocked, _key(high, b, last + 1))
    if fast:  # one pass over every row: each row's key from its own time
        _hold(s, _row_keys(times, places), rows)
    else:
        for _, first, end, high in spans:
            running = list(accumulate(times[first:end], max, initial=high))[1:]
            _hold(s, _row_keys(running, places[first:end]), rows[first:end])
    s.pending.sort()  # ints, no key function: a sorted run and the new keys
    return short


def _hold(s: Session, keys: list[int], rows: list[tuple[Any, ...]]) -> None:
    """Keep ``rows`` until a page takes them, by their merge ``keys`` (unique:
    each holds its row's bucket and position); ``s.pending`` to sort after."""
    s.held.update(zip(keys, rows, strict=True))
    s.pending += keys


def _steps(values: list[int], op: Callable[[int, int], bool]) -> set[int]:
    """The indexes ``i`` where ``op(values[i - 1], values[i])`` (C loops)."""
    return set(compress(count(1), map(op, values, islice(values, 1, None))))


def _fill_fast(
    s: Session,
    asked: list[tuple[int, int, int]],
    rows: list[tuple[Any, ...]],
    places: list[int],
    times: list[int],
    back: set[int],
) -> bool:
    """:func:`_fill`'s work in C loops when every row asked came (``rows`` in
    (bucket, position) order) and each bucket's times grow from where it was
    read to (the normal case); False, and nothing done, otherwise."""
    buckets = list(map(_BUCKET, asked))
    his = list(map(_HI, asked))
    lasts = list(accumulate(map(sub, his, map(_POS, asked)), lambda a, n: a + n + 1, initial=-1))
    del lasts[0]
    firsts = [0, *map(add, lasts[:-1], repeat(1))]
    highs = list(map(_HIGH, map(s.read_to.__getitem__, buckets)))
    if not back.issubset(firsts) or any(map(lt, map(times.__getitem__, firsts), highs)):
        return False
    new_highs = list(map(times.__getitem__, lasts))
    s.read_to.update(zip(buckets, zip(his, new_highs, strict=True), strict=True))
    tops = map(_TOP, map(s.ends.__getitem__, buckets))
    more = list(map(lt, his, tops))
    s.blocked += _keys(
        list(compress(new_highs, more)),
        list(compress(buckets, more)),
        list(map(add, compress(his, more), repeat(1))),
    )
    heapq.heapify(s.blocked)
    _hold(s, _row_keys(times, places), rows)
    s.pending.sort()  # ints, no key function: a sorted run and the new keys
    return True


def _keys(highs: list[int], buckets: list[int], positions: list[int]) -> list[int]:
    """:func:`_key` of each row, in C loops."""
    return _row_keys(highs, list(map(add, map(lshift, buckets, _48), positions)))


def _row_keys(highs: list[int], places: list[int]) -> list[int]:
    """:func:`_key` of each row from its ``(bucket << 48) + position``, in C loops."""
    return list(map(add, map(lshift, highs, _72), places))


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
            s.blocked[:] = [k for k in s.blocked if (k >> 48) & _BUCKETS != b]
            heapq.heapify(s.blocked)
