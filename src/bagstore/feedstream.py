"""Reading the change feed of shards that keep their changes in commit order
(SQLite, :mod:`bagstore.backends.changeseq`): each shard read as one range
of its numbers, the shards merged by time, with no merge of their buckets.

A :class:`Stream` is a reader's state between pages of one set of buckets:
for each shard, the last number read and the running maximum of ``updated``
along its rows read; the rows read and not returned; for each bucket the
last position read.  A row's merge key is that running maximum at the row
(its own time while a shard's times grow, the normal case: then no key is
kept and the rows held are sorted by time, each shard's runs merged); a
page takes the rows held whose key is at most every shard's running
maximum (ties in no particular order, each shard's rows in its order), so
a change not read yet never comes before one returned that sorts later.
When that is not a page's worth, it reads the next rows of the shard whose
running maximum is least (one statement).

Start (a cursor other than the last page's end, the first page): each
shard's last number is read, then every bucket's positions; a shard is read
from the first row after the cursor of any bucket it holds (one index
search a bucket behind), rows read before that are skipped by position.

What the positions held when the reader started may stop being true:

* a bucket moved to another shard: its rows there (copies, numbered when
  copied) are not where this reader stands in that shard.  A row of a
  bucket held elsewhere is either a move's copy under way (skipped) or the
  sign that it moved (the buckets' positions asked again): then the reader
  starts again from its last page's end.  So does one that finds, once
  every shard is read to its end, a bucket held elsewhere than it knew;
* a bucket's next position missing: pruned (:class:`bagstore.ChangesPruned`)
  or, with no reason found, lost (:class:`bagstore.ChangesLost`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, compress, islice, repeat
from operator import eq, itemgetter, le, sub
from typing import Any

from bagstore.errors import ChangesLost
from bagstore.rowsize import FIRST, OVERHEAD

__all__ = ["Stream", "next_rows", "start"]

_BUCKET, _POS, _UPDATED, _BODY = (itemgetter(i) for i in (0, 1, 5, 6))
_SHARD = itemgetter(2)  # of an end: (last position, last pruned, shard)
#: rows a statement asks for at least (rows read ahead wait for the next page)
_LEAST = 256
#: a position no bucket was read to
_NOWHERE = -(2**62)
#: ``holders(buckets or None)``: ``{bucket: (last position, last pruned, shard)}``
Holders = Callable[[set[int] | None], dict[int, tuple[int, int, int]]]
#: ``tops()``: each shard's last number handed out
Tops = Callable[[], list[int]]
#: ``firsts(shard, [(bucket, position), ...])``: the least number of the rows
#: after those positions, or None
Firsts = Callable[[int, list[tuple[int, int]]], "int | None"]
#: ``fetch(shard, after number, limit)``: rows ``(bucket, pos, id, op,
#: version, updated, body)`` in the shard's order, and the last one's number
Fetch = Callable[[int, int, int], tuple[list[tuple[Any, ...]], int]]
#: ``pruned(bucket, at, pruned)``: raises ChangesPruned
Pruned = Callable[[int, int, int], None]


@dataclass
class Stream:
    """What a reader knows between pages of one set of buckets (None: all)."""

    buckets: frozenset[int] | None
    oldest: bool
    #: the feed's epoch when it started
    epoch: int
    #: positions after the last page returned (the cursor that goes on)
    after: dict[int, int]
    shards: int
    #: of each bucket: the last position read, and the shard holding it as
    #: the buckets' positions last said
    read_to: dict[int, int] = field(default_factory=dict)
    shard_of: dict[int, int] = field(default_factory=dict)
    #: of each shard: the last number read, the running maximum of
    #: ``updated`` along its rows read, whether its last read reached its end
    seqs: list[int] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    #: the rows read and not returned, every shard's, in merge order once
    #: sorted (:func:`_sort`)
    held: list[tuple[Any, ...]] = field(default_factory=list)
    #: their merge keys, or None while each is its row's own time (every
    #: shard's times grew along its rows: the normal case)
    keys: list[int] | None = None
    #: the memory (bytes) its rows read ahead may take (None: no bound)
    budget: int | None = None
    #: the memory a row read takes, from the last rows read (0: none yet)
    row_bytes: int = 0
    #: where each shard is read from was just found (by :func:`start`): the
    #: positions read then are not read again for moves by the first page
    fresh: bool = False

    def goes_on(
        self, positions: dict[int, int], buckets: frozenset[int] | None, oldest: bool, epoch: int
    ) -> bool:
        """Whether ``positions`` are where this reader's last page ended."""
        return (
            self.epoch == epoch
            and self.buckets == buckets
            and (self.oldest or not oldest)
            and (positions is self.after or positions == self.after)
        )

    def held_rows(self) -> int:
        return len(self.held)


def start(
    buckets: frozenset[int] | None,
    positions: dict[int, int],
    oldest: bool,
    epoch: int,
    shards: int,
    calls: tuple[Tops, Holders, Firsts, Pruned],
) -> Stream:
    """A reader at ``positions`` (a bucket missing: from 0, or from the oldest
    change kept with ``oldest``) of ``shards`` shards."""
    s = Stream(buckets, oldest, epoch, dict(positions), shards)
    _begin(s, calls)
    s.fresh = True
    return s


def _begin(s: Stream, calls: tuple[Tops, Holders, Firsts, Pruned]) -> None:
    """Where each shard is read from, for the buckets' positions after
    ``s.after``; rows held are dropped."""
    tops, holders, firsts, pruned = calls
    while True:
        # each shard's last number first: a change committed after it is read
        # comes after it, whatever the positions read next say
        seqs = tops()
        ends = holders(None if s.buckets is None else set(s.buckets))
        s.shard_of = dict(zip(ends, map(_SHARD, ends.values()), strict=True))
        if all(shard < len(seqs) for _, _, shard in ends.values()):
            break  # (else a shard joined in between: read both again)
    s.shards = len(seqs)
    after, read_to = dict(s.after), {}
    behind: list[list[tuple[int, int]]] = [[] for _ in range(s.shards)]
    # a shard whose buckets behind are all read from their oldest change
    # kept is read from its first row (no search a bucket)
    whole = [True] * s.shards
    for b, (top, low, shard) in ends.items():
        pos = after.get(b, 0)
        if s.oldest and low > 0 and b not in after:
            pos = after[b] = low  # from the oldest kept
        if pos < low:
            pruned(b, pos, low)
        read_to[b] = pos
        if top > pos:
            behind[shard].append((b, pos))
            whole[shard] = whole[shard] and pos == low
    for shard, there in enumerate(behind):
        if there and whole[shard]:
            seqs[shard] = 0
            continue
        first = firsts(shard, there) if there else None
        if first is not None and first <= seqs[shard]:
            seqs[shard] = first - 1
    s.after = after if list(after) == sorted(after) else dict(sorted(after.items()))
    n = s.shards
    s.read_to, s.seqs, s.times, s.done = read_to, seqs, [-(2**63)] * n, [False] * n
    s.held, s.keys = [], None


def next_rows(
    s: Stream, limit: int, fetch: Fetch, calls: tuple[Tops, Holders, Firsts, Pruned]
) -> list[tuple[Any, ...]]:
    """The next ``limit`` rows (at most) in merge order, and the reader moved
    on past them (``s.after``)."""
    n = s.shards
    s.done = [False] * n  # each shard's end is read again (changes since)
    fresh, s.fresh = s.fresh, False
    while True:
        # a shard's next row sorts after its rows read (its key is at least
        # the running maximum of their times); one not read yet, first
        waiting = [shard for shard in range(n) if not s.done[shard]]
        fronts = list(map(s.times.__getitem__, waiting))
        bound = min(fronts) if waiting else None
        ready = _sort(s, bound)
        if ready >= limit:
            break
        if waiting:
            if _fetch(s, waiting[fronts.index(min(fronts))], limit, fetch, calls):
                _begin(s, calls)
                fresh = True
            continue
        if fresh or not _moved(s, calls):
            break
        _begin(s, calls)
        fresh = True
    page = s.held[: min(limit, ready)]
    del s.held[: len(page)]
    if s.keys is not None:
        del s.keys[: len(page)]
        if not s.held:
            s.keys = None
    # a new dict a page (the last one is the caller's, a cursor's), kept in
    # bucket order (what a cursor's text is made from)
    after = dict(s.after)
    known = len(after)
    after.update(zip(map(_BUCKET, page), map(_POS, page), strict=True))
    s.after = after if len(after) == known else dict(sorted(after.items()))
    return page


def _sort(s: Stream, bound: int | None) -> int:
    """Sort the rows held into merge order (stable: each shard's in its
    order); how many sort at or before ``bound`` (None: all)."""
    held, keys = s.held, s.keys
    if keys is None:
        held.sort(key=_UPDATED)  # (runs of each shard's rows: merged, not sorted)
        return len(held) if bound is None else bisect_right(held, bound, key=_UPDATED)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    s.held = list(map(held.__getitem__, order))
    s.keys = keys = list(map(keys.__getitem__, order))
    return len(keys) if bound is None else bisect_right(keys, bound)


def _ask(s: Stream, limit: int) -> int:
    """Rows the next statement asks for: within the budget by the rows held."""
    most = max(limit, _LEAST)
    if s.budget is None:
        return most
    if not s.row_bytes:
        return min(most, FIRST)
    return max(1, min(most, s.budget // s.row_bytes - len(s.held)))


def _fetch(
    s: Stream, shard: int, limit: int, fetch: Fetch, calls: tuple[Tops, Holders, Firsts, Pruned]
) -> bool:
    """Read the next rows of ``shard``; whether the reader must start again
    (a bucket moved)."""
    ask, since = _ask(s, limit), s.seqs[shard]
    rows, s.seqs[shard] = fetch(shard, since, ask)
    if len(rows) < ask:
        s.done[shard] = True
    if not rows:
        return False
    sample = rows[:: max(1, len(rows) // 32)]  # (a row's size, about)
    s.row_bytes = sum(map(len, filter(None, map(_BODY, sample)))) // len(sample) + OVERHEAD
    times = list(map(_UPDATED, rows))
    grew = times[0] >= s.times[shard] and all(map(le, times, islice(times, 1, None)))
    if not grew:  # a shard's times went back: each row keyed by its running maximum
        times = list(accumulate(times, max, initial=s.times[shard]))
        del times[0]
    s.times[shard] = times[-1]
    if not _fast(s, shard, rows):
        mask = _slow(s, shard, rows, since, calls)
        if mask is None:
            return True
        rows = list(compress(rows, mask))
        times = list(compress(times, mask))
    if not grew and s.keys is None:
        s.keys = list(map(_UPDATED, s.held))  # (each its own time so far)
    s.held += rows
    if s.keys is not None:
        s.keys += times
    return False


def _fast(s: Stream, shard: int, rows: list[tuple[Any, ...]]) -> bool:
    """Whether the rows are all kept: each bucket's are the next positions of
    a bucket this shard holds (the normal case; ``s.read_to`` moved on past
    them); checked in C loops, a bucket at a time.  A bucket's positions
    grow along a shard's rows: when each bucket's first row is the one after
    the last read, its rows are at most as many as its last is past that,
    and when those counts add up to the rows, each bucket has no gap."""
    buckets = list(map(_BUCKET, rows))
    positions = list(map(_POS, rows))
    last = dict(zip(buckets, positions, strict=True))
    first = dict(zip(reversed(buckets), reversed(positions), strict=True))
    seen = list(last)
    ats = list(map(s.read_to.get, seen, repeat(_NOWHERE)))
    if not (
        all(map(eq, map(s.shard_of.get, seen), repeat(shard)))
        and all(map(eq, map(sub, map(first.__getitem__, seen), ats), repeat(1)))
        and sum(map(sub, map(last.__getitem__, seen), ats)) == len(rows)
    ):
        return False
    s.read_to.update(last)
    return True


def _slow(
    s: Stream,
    shard: int,
    rows: list[tuple[Any, ...]],
    since: int,
    calls: tuple[Tops, Holders, Firsts, Pruned],
) -> list[bool] | None:
    """Which rows (read after number ``since``) to keep, row by row: not
    those of buckets not read, or held by another shard (a move's copies
    under way), or read already; None when the reader must start again (a
    bucket moved here, or one it did not know has rows behind it).  Raises
    ChangesPruned, ChangesLost for a position missing."""
    _, holders, firsts, pruned = calls
    shard_of, read_to, wanted = s.shard_of, s.read_to, s.buckets
    odd = {r[0] for r in rows if wanted is None or r[0] in wanted} - {
        b for b, held_by in shard_of.items() if held_by == shard
    }
    if odd:
        fresh = holders(odd)
        for b in sorted(odd):
            now = fresh.get(b)
            if now is None or now[2] != shard:
                continue  # a move's copies under way, or its rows held elsewhere
            if b in shard_of:
                return None  # moved here: its rows here may lie behind the reader
            at = s.after.get(b, now[1] if s.oldest else 0)
            if at < now[1]:
                pruned(b, at, now[1])
            first = firsts(shard, [(b, at)])
            if first is not None and first <= since:
                return None  # a bucket not known, with rows behind the reader
            read_to[b], shard_of[b] = at, shard
    mask: list[bool] = []
    gaps: dict[int, int] = {}
    for r in rows:
        b, pos = r[0], r[1]
        at = read_to.get(b, 0)
        if shard_of.get(b) != shard:  # (a bucket not read is not there)
            mask.append(False)
        elif pos <= at:
            mask.append(False)  # read already (rows after where the reader started)
        elif pos != at + 1 or b in gaps:
            gaps.setdefault(b, at)
            mask.append(False)
        else:
            read_to[b] = pos
            mask.append(True)
    if gaps:
        fresh = holders(set(gaps))
        for b, at in sorted(gaps.items()):
            now = fresh.get(b)
            if now is None or now[2] != shard:
                return None  # moved away meanwhile
            if now[1] > at:
                pruned(b, at, now[1])
            raise ChangesLost(
                f"the change feed's change {at + 1} of bucket {b} is missing from the shard "
                "that holds the bucket: read from an earlier cursor, or reset the consumer"
            )
    return mask


def _moved(s: Stream, calls: tuple[Tops, Holders, Firsts, Pruned]) -> bool:
    """Whether a bucket's rows lie where the reader will not read them (held
    by another shard than it knew, or a bucket it did not know whose rows
    lie behind where it stands in its shard), read once every shard was
    read to its end; each pruned past is raised."""
    _, holders, firsts, pruned = calls
    fresh = holders(None if s.buckets is None else set(s.buckets))
    shard_of, read_to = s.shard_of, s.read_to
    for b, (top, low, shard) in fresh.items():
        at = read_to.get(b, s.after.get(b, 0))
        if at < low:
            pruned(b, at, low)
        was = shard_of.get(b)
        if shard >= s.shards or (was is not None and was != shard):
            return True
        if was is None and top > at:
            first = firsts(shard, [(b, at)])
            if first is not None and first <= s.seqs[shard]:
                return True
            read_to[b] = at
    s.shard_of = dict(zip(fresh, map(_SHARD, fresh.values()), strict=True))
    return False
