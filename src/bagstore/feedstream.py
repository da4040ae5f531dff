"""Reading the change feed of shards that keep their changes in commit order
(SQLite, :mod:`bagstore.backends.changeseq`): each shard read as one range
of its numbers, the shards merged by time, with no merge of their buckets.

A :class:`Stream` is a reader's state between pages of one set of buckets:
for each shard, the last number read, the running maximum of ``updated``
along its rows read, its rows read and not returned, and the last position
read of each bucket it holds.  A row's merge key is that running maximum at
the row (its own time while a shard's times grow, the normal case: then no
key is kept).  A page takes the rows whose key is at most every shard's
running maximum (a search of each shard's rows; ties in no particular
order, each shard's rows in its order), so a change not read yet never
comes before one returned that sorts later; only the rows taken are merged.
Rows so found beyond the page's limit come first in the next page (a row
committed meanwhile with an earlier time comes after them, as it would
after a larger page).  When that is not a page's worth, it reads the next
rows of the shard whose running maximum is least (one statement).

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
from itertools import accumulate, chain, compress, repeat
from operator import gt, itemgetter
from typing import Any

from bagstore.errors import ChangesLost
from bagstore.feedpage import positions_after
from bagstore.rowsize import FIRST, OVERHEAD

__all__ = ["Stream", "next_rows", "start"]

_BUCKET, _POS, _UPDATED, _BODY = (itemgetter(i) for i in (0, 1, 5, 6))
_SHARD = itemgetter(2)  # of an end: (last position, last pruned, shard)
#: rows a statement asks for at least (rows read ahead wait for the next page)
_LEAST = 256
#: past any position (that of a bucket a shard does not hold, in _fast)
_FAR = 2**62
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
    #: positions after the last page returned (the cursor that goes on; a
    #: reader of every bucket's are :class:`bagstore.feedpage.Positions`)
    after: dict[int, int]
    #: of each bucket, the shard holding it as the buckets' positions last
    #: said; of each shard, the last position read of each bucket it holds
    shard_of: dict[int, int] = field(default_factory=dict)
    reads: list[dict[int, int]] = field(default_factory=list)
    #: of each shard: the last number read, the running maximum of
    #: ``updated`` along its rows read, whether its last read reached its end
    seqs: list[int] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    #: the rows read and not returned: those found ready (at most the merge
    #: bound of an earlier page) in merge order, which come first; then each
    #: shard's, in its order
    ready: list[tuple[Any, ...]] = field(default_factory=list)
    queues: list[list[tuple[Any, ...]]] = field(default_factory=list)
    #: of each shard's rows held, their merge keys, or None while each is its
    #: row's own time (the shard's times grew along its rows: the normal case)
    keys: list[list[int] | None] = field(default_factory=list)
    #: of each shard, whether it holds buckets other than the reader's (found
    #: by a read that met their rows: later reads leave them out first)
    mixed: list[bool] = field(default_factory=list)
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
            # (a set compared with itself is walked: ~3 us at 1,024 buckets)
            and (self.buckets is buckets or self.buckets == buckets)
            and (self.oldest or not oldest)
            and (positions is self.after or positions == self.after)
        )

    @property
    def shards(self) -> int:
        """How many shards it reads (as many as their last numbers it read)."""
        return len(self.seqs)

    def held_rows(self) -> int:
        return len(self.ready) + sum(map(len, self.queues))

    @property
    def held(self) -> list[tuple[Any, ...]]:
        """The rows read and not returned (those ready first, then each
        shard's)."""
        return self.ready + list(chain.from_iterable(self.queues))


def start(
    buckets: frozenset[int] | None,
    positions: dict[int, int],
    oldest: bool,
    epoch: int,
    calls: tuple[Tops, Holders, Firsts, Pruned],
) -> Stream:
    """A reader at ``positions`` (a bucket missing: from 0, or from the oldest
    change kept with ``oldest``) of every shard ``calls`` reach."""
    s = Stream(buckets, oldest, epoch, dict(positions))
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
    n = len(seqs)
    after, reads = dict(s.after), [dict[int, int]() for _ in range(n)]
    behind: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    # a shard whose buckets behind are all read from their oldest change
    # kept is read from its first row (no search a bucket)
    whole = [True] * n
    for b, (top, low, shard) in ends.items():
        pos = after.get(b, 0)
        if s.oldest and low > 0 and b not in after:
            pos = after[b] = low  # from the oldest kept
        if pos < low:
            pruned(b, pos, low)
        reads[shard][b] = pos
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
    s.reads, s.seqs, s.times, s.done = reads, seqs, [-(2**63)] * n, [False] * n
    s.ready, s.queues, s.keys, s.mixed = [], [[] for _ in range(n)], [None] * n, [False] * n


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
        cuts = _cuts(s, min(fronts) if waiting else None)
        if len(s.ready) + sum(cuts) >= limit:
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
    page = _take(s, cuts, limit)
    s.after = positions_after(s.after, page, s.buckets is None)
    return page


def _cuts(s: Stream, bound: int | None) -> list[int]:
    """How many of each shard's rows held sort at or before ``bound`` (None:
    all): a search of each shard's, whose keys grow along its rows."""
    cuts = []
    for rows, keys in zip(s.queues, s.keys, strict=True):
        if bound is None or not rows:
            cuts.append(len(rows))
        elif keys is None:
            cuts.append(bisect_right(rows, bound, key=_UPDATED))
        else:
            cuts.append(bisect_right(keys, bound))
    return cuts


def _take(s: Stream, cuts: list[int], limit: int) -> list[tuple[Any, ...]]:
    """The first ``limit`` rows in merge order of those ready and the first
    ``cuts`` rows of each shard's (which then are ready): the rows found
    ready by an earlier page first (each at most that page's bound, which
    every row not ready then exceeded), then the shards' merged by key
    (stable: ties in shard order, each shard's in its order)."""
    ready = s.ready
    if len(ready) < limit and any(cuts):
        parts, keyed = [], False
        for shard, cut in enumerate(cuts):
            if cut:
                rows, keys = s.queues[shard], s.keys[shard]
                parts.append((rows[:cut], None if keys is None else keys[:cut]))
                del rows[:cut]
                if keys is not None:
                    del keys[:cut]
                    keyed = True
                    if not rows:
                        s.keys[shard] = None
        if len(parts) == 1:
            merged = parts[0][0]
        elif not keyed:
            merged = list(chain.from_iterable(rows for rows, _ in parts))
            merged.sort(key=_UPDATED)  # (runs of each shard's rows: merged, not sorted)
        else:
            rows = list(chain.from_iterable(rows for rows, _ in parts))
            keys = list(
                chain.from_iterable(
                    list(map(_UPDATED, rows)) if keys is None else keys for rows, keys in parts
                )
            )
            merged = list(map(rows.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))
        ready = s.ready = ready + merged if ready else merged
    page = ready[:limit]
    del ready[:limit]
    return page


def _ask(s: Stream, limit: int) -> int:
    """Rows the next statement asks for: within the budget by the rows held."""
    most = max(limit, _LEAST)
    if s.budget is None:
        return most
    if not s.row_bytes:
        return min(most, FIRST)
    return max(1, min(most, s.budget // s.row_bytes - s.held_rows()))


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
    # (in order: sorted() finds one run, comparing ints in C, ~40% of the
    # instructions of a pairwise check through map)
    grew = times[0] >= s.times[shard] and times == sorted(times)
    if not grew:  # a shard's times went back: each row keyed by its running maximum
        times = list(accumulate(times, max, initial=s.times[shard]))
        del times[0]
    s.times[shard] = times[-1]
    if s.mixed[shard] and s.buckets is not None:  # (the other buckets' rows left out)
        keep = list(map(s.buckets.__contains__, map(_BUCKET, rows)))
        rows, times = list(compress(rows, keep)), list(compress(times, keep))
    if not _fast(s, shard, rows):
        mask = _slow(s, shard, rows, since, calls)
        if mask is None:
            return True
        rows = list(compress(rows, mask))
        times = list(compress(times, mask))
    queue, keys = s.queues[shard], s.keys[shard]
    if not grew and keys is None:
        keys = s.keys[shard] = list(map(_UPDATED, queue))  # (each its own time so far)
    queue += rows
    if keys is not None:
        keys += times
    return False


def _fast(s: Stream, shard: int, rows: list[tuple[Any, ...]]) -> bool:
    """Whether the rows are all kept: each bucket's are the next positions of
    a bucket this shard holds (the normal case; the shard's last positions
    read moved on past them); checked in C loops.  A bucket's positions are
    unique in a shard and grow along its rows: when each row's is past where
    its bucket was read to, a bucket's rows are at most as many as its last
    is past that, and when those counts add up to the rows, no bucket has a
    gap."""
    reads = s.reads[shard]
    buckets = list(map(_BUCKET, rows))
    positions = list(map(_POS, rows))
    # (a bucket this shard does not hold: read to _FAR, so never past it)
    if not all(map(gt, positions, map(reads.get, buckets, repeat(_FAR)))):
        return False
    before = sum(reads.values())
    was = reads.copy()
    reads.update(zip(buckets, positions, strict=True))
    if sum(reads.values()) - before != len(rows):
        s.reads[shard] = was
        return False
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
    shard_of, read_to, wanted = s.shard_of, s.reads[shard], s.buckets
    if wanted is not None and not wanted.issuperset(map(_BUCKET, rows)):
        s.mixed[shard] = True
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
    shard_of, reads = s.shard_of, s.reads
    for b, (top, low, shard) in fresh.items():
        was = shard_of.get(b)
        at = s.after.get(b, 0) if was is None else reads[was][b]
        if at < low:
            pruned(b, at, low)
        if shard >= s.shards or (was is not None and was != shard):
            return True
        if was is None:  # (known now: read from where the reader stands)
            if top > at:
                first = firsts(shard, [(b, at)])
                if first is not None and first <= s.seqs[shard]:
                    return True
            reads[shard][b] = at
    s.shard_of = dict(zip(fresh, map(_SHARD, fresh.values()), strict=True))
    return False
