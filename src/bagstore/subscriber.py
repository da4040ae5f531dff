"""Named consumers of a change feed: checkpointed, resumable, shared by processes.

A consumer's buckets are split into ranges (16, or one per bucket when there
are fewer).  Each range has a row in the catalog (``bagstore_consumer_ranges``)
with the positions handled so far and a lease: the process holding the lease
reads the range's next changes, calls the handler, then writes the new
positions (only while it still holds the lease).  Processes of one consumer
take an even share of the ranges each (live processes heartbeat in
``bagstore_consumer_members``); a process that dies leaves its leases to
expire, and another takes its ranges over from their last checkpoint.

Delivery is at least once: a batch handled but not checkpointed (the process
died, or the handler raised) is delivered again.  Two processes never handle
one range at once as long as a handler returns within ``lease`` seconds (each
batch renews the lease; a process whose lease lapsed skips its checkpoint).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.feed.enable()
    >>> _ = ds.put_many([{"n": i} for i in range(3)])
    >>> seen = []
    >>> consumer = ds.subscribe("example", lambda changes: seen.extend(changes))
    >>> consumer.poll(), len(seen)
    (3, 3)
    >>> consumer.poll()
    0
    >>> consumer.close()
    >>> ds.close()
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

from bagstore.backends.consumersql import checkpoint_ranges, renew_leases
from bagstore.changes import Feed
from bagstore.errors import ChangesPruned, ConfigurationError, InvalidQuery
from bagstore.feedpage import Change, decode_positions, encode_positions, positions_after
from bagstore.throttle import check_seconds

__all__ = ["Subscriber", "lifted", "range_buckets"]

log = logging.getLogger(__name__)

RANGES = 16
#: SQLite (ranges read together): seconds between a poll's checkpoints of
#: the ranges it handled (and at its end); a batch's leases are renewed
#: before it is handled whatever
CHECKPOINT_EVERY = 1.0
#: SQLite: changes read at a time (at least a batch; at most the batches the
#: poll may still handle), handed to the handler a batch at a time
READ_TOGETHER = 1000
#: seconds a poll goes on after its batch a range held, so that what a poll
#: costs beyond its batches (heartbeat, renewals, positions, the last
#: checkpoint) is paid once for many (:meth:`Subscriber._young_until`)
POLL_SECONDS = 0.1
CONSUMERS, RANGE_ROWS, MEMBERS = (
    "bagstore_consumers",
    "bagstore_consumer_ranges",
    "bagstore_consumer_members",
)
Handler = Callable[[list[Change]], Any]
#: a poll's reads again after moving a range that had handled nothing on
#: past changes pruned (:meth:`Subscriber._lift`), at most
_LIFTS = 4
_BUCKET = itemgetter(0)


def _now() -> int:
    return time.time_ns() // 1000


def _stored(epoch: int, positions: dict[int, int]) -> str:
    """A range's positions as its row holds them: the feed's epoch they were
    read in (taken before they were read), then them."""
    return f"{epoch}:{encode_positions(positions)}"


def _loaded(text: str) -> tuple[int, dict[int, int]]:
    """``(epoch, positions)`` of a range's row."""
    epoch, _, positions = text.rpartition(":")
    return int(epoch or 0), decode_positions(positions) if positions else {}


def _check_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= 64
        or not all(c.isalnum() or c in "_-." for c in name)
    ):
        raise ConfigurationError(
            f"a consumer name is 1 to 64 letters, digits, '_', '-' or '.', not {name!r}"
        )
    return name


def range_buckets(buckets: int, ranges: int, no: int) -> range:
    """The buckets of range ``no`` of ``ranges``."""
    return range(no * buckets // ranges, (no + 1) * buckets // ranges)


def lifted(
    at: dict[int, int], ends: dict[int, tuple[int, int]], buckets: Iterable[int]
) -> dict[int, int]:
    """``at`` (positions in bucket order) with each of ``buckets`` moved on to
    its last pruned position (``ends``: :meth:`Feed.ends`) where that is past
    it, in bucket order: where a range not yet read starts (:meth:`Subscriber._lift`)."""
    moved = {b: ends[b][1] for b in buckets if b in ends and ends[b][1] > at.get(b, 0)}
    if not moved:
        return at
    out = {**at, **moved}
    return out if len(out) == len(at) else dict(sorted(out.items()))


def _consumer(feed: Feed, name: str) -> tuple[str, int] | None:
    rows = feed.catalog.select_all(CONSUMERS, ("kind", "ranges"), {"name": name})
    return (str(rows[0][0]), int(rows[0][1])) if rows else None


def _known(feed: Feed, name: str) -> tuple[str, int]:
    found = _consumer(feed, _check_name(name))
    if found is None:
        known = [str(r[0]) for r in feed.catalog.select_all(CONSUMERS, ("name",))]
        raise InvalidQuery(f"no consumer {name!r} (consumers: {sorted(known)})")
    return found


class Subscriber:
    """A process of the named consumer ``name`` of ``feed``'s kind, calling
    ``handler(changes)`` with batches of at most ``batch`` changes, in order
    (on MariaDB one bucket range's; on SQLite, whose feed is in commit order,
    of any of the ranges it holds, read together)."""

    def __init__(
        self,
        feed: Feed,
        name: str,
        handler: Handler,
        *,
        batch: int = 100,
        lease: float = 30.0,
    ) -> None:
        if type(batch) is not int or not 1 <= batch <= 10_000:
            raise ConfigurationError(f"batch must be an integer from 1 to 10000, not {batch!r}")
        check_seconds("lease", lease, 0.001)
        if not callable(handler):
            raise ConfigurationError("handler must be callable (it receives a list of changes)")
        self.name = _check_name(name)
        feed.check_on()  # (a consumer of a feed that is off would wait for ever)
        self.feed = feed
        self.handler = handler
        self.batch = batch
        self.lease_us = int(lease * 1_000_000)
        self.member = secrets.token_hex(8)
        self.catalog = feed.catalog
        buckets = feed.router.placement.buckets
        ranges = min(RANGES, buckets)
        self.catalog.insert_ignore(
            CONSUMERS, ("name", "kind", "ranges", "created"), [(name, feed.kind, ranges, _now())]
        )
        kind, self.ranges = _known(feed, name)
        if kind != feed.kind:
            raise ConfigurationError(f"consumer {name!r} follows kind {kind!r}, not {feed.kind!r}")
        if not self.catalog.select_all(RANGE_ROWS, ("range_no",), {"name": name}):
            # a new consumer starts at the oldest change kept (of the epoch
            # taken before they are read: a failover meanwhile is not hidden)
            epoch = feed.epoch()
            ends = feed.ends()
            start = [
                {b: ends[b][1] for b in range_buckets(buckets, self.ranges, r) if b in ends}
                for r in range(self.ranges)
            ]
            self.catalog.insert_ignore(
                RANGE_ROWS,
                ("name", "range_no", "positions", "owner", "lease_until", "checkpointed"),
                [(name, r, _stored(epoch, start[r]), "", 0, 0) for r in range(self.ranges)],
            )
        self.buckets = buckets
        #: bucket -> its range
        self._range_of = [
            no for no in range(self.ranges) for _ in range_buckets(buckets, self.ranges, no)
        ]
        #: the ranges last read together, and their buckets
        self._union: tuple[tuple[int, ...], frozenset[int]] | None = None
        #: range -> positions, of the ranges this process holds
        self.held: dict[int, dict[int, int]] = {}
        #: range -> the feed's epoch its positions were read in
        self.epochs: dict[int, int] = {}
        #: ranges held not yet read by a poll that ended well since the
        #: consumer was made or reset (their start: the oldest change kept;
        #: see _lift)
        self._unstarted: set[int] = set()
        self._closed = False
        self._in_handler = False  # (run() tells a handler's failure from the feed's)
        self._handled = 0  # changes handled by the poll going on

    # -- leases --------------------------------------------------------------------
    def _rows(self) -> list[tuple[int, str, str, int, int]]:
        columns = ("range_no", "positions", "owner", "lease_until", "checkpointed")
        rows = self.catalog.select_all(RANGE_ROWS, columns, {"name": self.name})
        return [(int(r), str(p), str(o), int(u), int(c)) for r, p, o, u, c in rows]

    def balance(self) -> None:
        """Heartbeat; renew this process's leases; take or give ranges so that
        each live process holds an even share."""
        if self._closed:
            raise InvalidQuery(
                f"this process of consumer {self.name!r} was closed; subscribe again to go on"
            )
        rows = self._rows()
        if not rows:  # every consumer has its ranges' rows from its start
            self.held.clear()
            self.catalog.delete_where(MEMBERS, {"name": self.name, "member": self.member})
            raise InvalidQuery(
                f"consumer {self.name!r} no longer exists (dropped, `bagstore consumers "
                "drop`); subscribe again to start it anew from the oldest change kept"
            )
        now = _now()
        self.catalog.upsert(MEMBERS, {"name": self.name, "member": self.member}, {"seen": now})
        seen = self.catalog.select_all(MEMBERS, ("member", "seen"), {"name": self.name})
        live = sum(1 for _, s in seen if int(s) > now - self.lease_us)
        share = -(-self.ranges // max(1, live))
        for no, _, owner, until, _ in rows:
            if no in self.held and (owner != self.member or until <= now):
                del self.held[no]  # lapsed: another process may have it now
        held = sorted(self.held)
        if held and renew_leases(
            self.catalog, self.name, self.member, held, now + self.lease_us
        ) < len(held):
            for no in held:  # some lost meanwhile: which (renewed again, one by one)
                if not self._renew(no, now):
                    del self.held[no]
        for no in sorted(self.held)[share:]:
            self.catalog.update(
                RANGE_ROWS,
                {"owner": "", "lease_until": 0},
                {"name": self.name, "range_no": no, "owner": self.member},
            )
            del self.held[no]
        for no, _positions, owner, until, _ in rows:
            if len(self.held) >= share:
                break
            if no in self.held or (owner and until > now):
                continue
            taken = self.catalog.update(
                RANGE_ROWS,
                {"owner": self.member, "lease_until": now + self.lease_us},
                {"name": self.name, "range_no": no, "owner": owner, "lease_until": until},
            )
            if taken:
                fresh = [(p, c) for r, p, _, _, c in self._rows() if r == no]
                text, checkpointed = fresh[0] if fresh else ("", 0)
                self.epochs[no], self.held[no] = _loaded(text)
                if checkpointed:
                    self._unstarted.discard(no)
                else:
                    self._unstarted.add(no)

    def _owned(self) -> set[int]:
        """The ranges whose lease this process holds, as the catalog says."""
        rows = self.catalog.select_all(
            RANGE_ROWS, ("range_no",), {"name": self.name, "owner": self.member}
        )
        return {int(no) for (no,) in rows}

    def _renew(self, no: int, now: int) -> bool:
        return bool(
            self.catalog.update(
                RANGE_ROWS,
                {"lease_until": now + self.lease_us},
                {"name": self.name, "range_no": no, "owner": self.member},
            )
        )

    # -- work ----------------------------------------------------------------------
    def poll(self) -> int:
        """One round: balance the leases, then the next changes of each range
        held, in batches (each handled, then checkpointed): a batch a range,
        then more while the poll is younger than :data:`POLL_SECONDS`.
        Returns the changes handled.  A handler's exception propagates; its
        batch's position is not advanced."""
        handled = 0
        for attempt in range(_LIFTS + 1):
            try:
                handled += self._poll()
                break
            except ChangesPruned as exc:
                handled += self._handled  # (the batches handled before it)
                if attempt == _LIFTS or self._in_handler or not self._lift(exc):
                    raise
        # a range read by a poll that ended well has started (checkpointed
        # with its first batch, or now): from now on it is told what
        # retention deletes before it handles it
        begun = {no: self.held[no] for no in self._unstarted if no in self.held}
        if begun:
            self._checkpoints(begun)
        return handled

    def _lift(self, exc: ChangesPruned) -> bool:
        """Whether ``exc``'s bucket is of a range not yet read by a poll that
        ended well (:meth:`poll`) since the consumer was made or reset (it
        started at the oldest change kept then), whose start retention
        deleted since (by the cap, which heeds no consumer; a pass by age
        keeps it: :mod:`bagstore.retention`): if so, every such range held
        starts at the oldest change kept now, as a consumer made now would
        (one read of their buckets' positions).  Any other range is told
        (the error is raised)."""
        no = None if exc.bucket is None else self._range_of[exc.bucket]
        if type(exc) is not ChangesPruned or no not in self._unstarted or no not in self.held:
            return False
        spans = {r: range_buckets(self.buckets, self.ranges, r) for r in self._unstarted}
        spans = {r: span for r, span in spans.items() if r in self.held}
        ends = self.feed.ends(chain.from_iterable(spans.values()))
        for r, span in spans.items():
            self.held[r] = lifted(self.held[r], ends, span)
        log.info("consumer %s: ranges not yet read start at the oldest change kept (%s)",
                 self.name, exc)  # fmt: skip
        return True

    def _poll(self) -> int:
        self._in_handler, self._handled = False, 0
        self.balance()
        if self.held and self.feed.in_commit_order():
            return self._poll_together()
        # every bucket's positions read once for all the ranges held (one
        # statement, not one a range: ~2 ms each on MariaDB)
        batches = self._read_ranges(self.feed.holders(polled=True) if self.held else None)
        # A batch handled and not checkpointed yet: its checkpoint goes with
        # the next batch's lease renewal, one commit (not two) a batch.
        done: dict[int, dict[int, int]] = {}
        try:
            for no, changes, after in batches:
                renewed = self._checkpoints(done, renew=[no])
                done = {}
                if not renewed:
                    continue  # (lost meanwhile: given up)
                self._in_handler = True
                self.handler(changes)
                self._in_handler = False
                self._handled += len(changes)
                done = {no: after}
        except BaseException:
            if done:  # (a later range's read failed)
                try:
                    self._checkpoints(done)
                except Exception:
                    log.warning("consumer %s: a checkpoint failed", self.name, exc_info=True)
            raise
        self._checkpoints(done)
        return self._handled

    def _young_until(self) -> float:
        """When (``time.monotonic()``) a poll starting now stops going on past
        its batch a range held: :data:`POLL_SECONDS` on, a quarter of the lease
        at most (the poll's heartbeat is at its start)."""
        return time.monotonic() + min(POLL_SECONDS, self.lease_us / 4e6)

    def _read_ranges(self, ends: Any) -> Iterator[tuple[int, list[Change], dict[int, int]]]:
        """One batch of each range held, read a range at a time (``ends``: the
        buckets' positions, read once for all of them); then, while the poll
        is younger than :data:`POLL_SECONDS`, another of each range whose
        last batch was whole, up to the same positions."""
        young = self._young_until()
        todo = sorted(self.held)
        # where each range's next batch starts: after its last one handled
        # (whose checkpoint is written with the next batch's renewal)
        at: dict[int, dict[int, int]] = {}
        while todo:
            whole = []
            for no in todo:
                if no not in self.held:
                    continue  # lost meanwhile
                self.feed.check_epoch(self.epochs[no], f"consumer {self.name!r}")
                changes, after = self.feed.read(
                    at.get(no, self.held[no]),
                    self.batch,
                    range_buckets(self.buckets, self.ranges, no),
                    who=self.name,
                    ends=ends,
                )
                if changes:
                    yield no, changes, after
                    at[no] = after  # (handled, or its range lost: the generator goes on)
                if len(changes) == self.batch:
                    whole.append(no)
            if time.monotonic() >= young:
                break
            todo = whole

    def _poll_together(self) -> int:
        """:meth:`poll` of a feed in commit order (SQLite): the ranges held read
        as one (each shard's rows read once for them all, not once a range),
        a batch at a time in the feed's order: a batch a range held, then more,
        a read at a time, while the poll is younger than :data:`POLL_SECONDS`;
        each batch's ranges' leases renewed before it is handled (one statement;
        its changes of a range lost meanwhile dropped: delivered again to the
        range's new holder).  Up to :data:`READ_TOGETHER` changes (of the
        batches the poll may still handle) are read at a time and handed out
        a batch at a time: what a read costs beyond its rows is paid once for
        them.  The ranges handled are checkpointed with a
        batch's renewal once :data:`CHECKPOINT_EVERY` seconds have passed
        since the last checkpoint, and at the end of the poll: a batch spans
        many ranges, and a range's positions are written whole."""
        pending: set[int] = set()  # ranges handled, not checkpointed yet
        # every range's positions before the last read (``start``) and after
        # it (``end``, the feed's: a read from it goes on), and how many of
        # its changes (``read``) were handled
        start: dict[int, int] = {}
        read: list[Change] = []
        end: dict[int, int] = {}
        done = 0
        written = time.monotonic()
        of = self._range_of

        def now() -> dict[int, int]:  # the positions after the changes handled
            if done == len(read):
                return end if read else start
            return positions_after(start, read[:done], False)  # (start itself at 0)

        # at least a batch a range held, then more while the poll is young
        # (read and handled to a read's end: rows read are never dropped)
        left = len(self.held)
        young = self._young_until()
        try:
            while self.held:
                if left <= 0 and done == len(read) and time.monotonic() >= young:
                    break
                left -= 1
                held = tuple(sorted(self.held))
                for epoch in {self.epochs[no] for no in held}:
                    self.feed.check_epoch(epoch, f"consumer {self.name!r}")
                if done == len(read):  # all handled: read on from after them
                    start = end if read else start
                    if not start:
                        for no in held:
                            start.update(self.held[no])
                    buckets = self._buckets_of(held)
                    most = max(self.batch, READ_TOGETHER)
                    if left >= 0:  # within its batch a range held: those left at most
                        most = min(self.batch * (left + 1), most)
                    read, end = self.feed.read(start, most, buckets, who=self.name)
                    done = 0
                    if not read:
                        break
                changes = read[done : done + self.batch]
                touched = sorted(set(map(of.__getitem__, map(_BUCKET, changes))))
                if pending and time.monotonic() - written >= CHECKPOINT_EVERY:
                    kept = self._checkpoints(self._slices(now(), pending), renew=touched)
                    pending, written = set(), time.monotonic()
                else:
                    kept = self._checkpoints({}, renew=touched)
                afresh = None
                if len(kept) < len(touched) or len(self.held) < len(held):
                    # ranges lost meanwhile: their changes not handled, the
                    # others' checkpointed now, the positions read afresh
                    # (the changes read after this batch read again)
                    before = now()
                    pending &= set(self.held)
                    if pending:
                        self._checkpoints(self._slices(before, pending))
                        pending, written = set(), time.monotonic()
                    after = positions_after(before, changes, False)
                    changes = [c for c in changes if of[c[0]] in kept]
                    if not changes:
                        start, read, end, done = {}, [], {}, 0
                        continue
                    afresh = {b: p for b, p in after.items() if of[b] in self.held}
                self._in_handler = True
                self.handler(changes)
                self._in_handler = False
                self._handled += len(changes)
                pending |= set(kept)
                if afresh is not None:
                    start, read, end, done = afresh, [], {}, 0
                    continue
                done += len(changes)
                if done == len(read) and len(read) < most:
                    break  # read to the positions the feed knows
        except BaseException:
            if pending:  # (a later read failed, or a handler)
                try:
                    self._checkpoints(self._slices(now(), pending))
                except Exception:
                    log.warning("consumer %s: a checkpoint failed", self.name, exc_info=True)
            raise
        if pending:
            self._checkpoints(self._slices(now(), pending))
        return self._handled

    def _slices(self, positions: dict[int, int], ranges: set[int]) -> dict[int, dict[int, int]]:
        """Each of ``ranges``' positions, from ``positions`` (in bucket order)."""
        items, keys = list(positions.items()), list(positions)
        out: dict[int, dict[int, int]] = {}
        for no in ranges:
            rng = range_buckets(self.buckets, self.ranges, no)
            at = bisect_left(keys, rng.start)
            out[no] = dict(items[at : bisect_left(keys, rng.stop, at)])
        return out

    def _buckets_of(self, held: tuple[int, ...]) -> frozenset[int]:
        """The buckets of ranges ``held`` (the last set asked, kept)."""
        if self._union is None or self._union[0] != held:
            rngs = (range_buckets(self.buckets, self.ranges, no) for no in held)
            self._union = (held, frozenset(chain.from_iterable(rngs)))
        return self._union[1]

    def _checkpoints(self, done: dict[int, dict[int, int]], renew: Sequence[int] = ()) -> set[int]:
        """Write the checkpoints ``done`` (ranges and their positions after
        the batch handled) and renew the leases of those ranges and of
        ``renew``, in one statement, of the ranges this process still holds;
        a range whose lease was lost meanwhile is given up (a batch not
        checkpointed is delivered again).  The ranges of ``renew`` still held."""
        if not done and not renew:
            return set()
        now = _now()
        # stamped with the epoch each range was read in, not the feed's now
        texts = {no: _stored(self.epochs[no], after) for no, after in done.items()}
        written = checkpoint_ranges(
            self.catalog, self.name, self.member, texts, now, renew, now + self.lease_us
        )
        if not done and written == len(renew):
            return set(renew)  # (a batch's renewal, every range still held: the usual)
        asked = set(done) | set(renew)
        held = asked if written == len(asked) else self._owned() & asked
        for no in asked - held:
            if no in done:
                log.warning("consumer %s lost range %d before its checkpoint", self.name, no)
            self.held.pop(no, None)
        for no in held & set(done):
            self.held[no] = done[no]
        self._unstarted -= held & set(done)
        return held & set(renew)

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        idle: float = 0.1,
        retry_wait: float = 1.0,
    ) -> None:
        """Poll until ``stop`` is set, waiting ``idle`` seconds when there was
        nothing to do; a handler that raises is logged and its batch retried
        after ``retry_wait`` seconds, as is a failed read of the feed (a
        shard unreachable).  What retrying cannot mend ends the run, raised:
        :class:`bagstore.ChangesPruned` (fell behind retention),
        :class:`bagstore.ChangesLost` (a failover's new epoch), the consumer
        dropped (:class:`bagstore.InvalidQuery`)."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                try:
                    n = self.poll()
                except Exception as exc:
                    in_handler, self._in_handler = self._in_handler, False
                    if not in_handler and isinstance(exc, InvalidQuery):
                        raise
                    what = "handler failed" if in_handler else "reading the feed failed"
                    log.exception("consumer %s: %s; retrying the batch", self.name, what)
                    stop.wait(retry_wait)
                    continue
                if n == 0:
                    stop.wait(idle)
        finally:
            self.close()

    def close(self) -> None:
        """Give back this process's leases (others take them at once); the
        process cannot poll afterwards."""
        self._closed = True
        for no in list(self.held):
            self.catalog.update(
                RANGE_ROWS,
                {"owner": "", "lease_until": 0},
                {"name": self.name, "range_no": no, "owner": self.member},
            )
        self.held.clear()
        self.catalog.delete_where(MEMBERS, {"name": self.name, "member": self.member})
