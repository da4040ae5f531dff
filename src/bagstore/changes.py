"""The change feed: every committed write of a kind, in order, resumable.

A kind's feed is off until switched on (:meth:`Feed.enable`); from then on
every put, update and delete of the kind records a change in the same
statement as the entity (triggers, see :mod:`bagstore.backends.changesql`).
Each bucket numbers its changes 1, 2, 3... in commit order; a cursor holds
the last position read of every bucket, so it survives bucket moves and never
skips a change.  A page merges the buckets (of every shard) by time, each
bucket's changes in their order (on SQLite, whose shards keep their changes
in commit order, each shard's changes in that order, the shards merged by
time: :mod:`bagstore.feedstream`).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.feed.enable(bodies=True)
    >>> entity_id = ds.put({"n": 1})
    >>> ds.put({"id": entity_id, "n": 2}) == entity_id
    True
    >>> ds.delete(entity_id)
    True
    >>> page = ds.changes()
    >>> [(c.op, c.entity and c.entity["n"]) for c in page]
    [('put', 1), ('put', 2), ('delete', None)]
    >>> page[0].version < page[1].version == page[2].version  # the delete: the version removed
    True
    >>> ds.changes(since=page.cursor)
    []
    >>> ds.close()

Guarantees: docs/changes.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from operator import add, methodcaller
from typing import TYPE_CHECKING, Any, cast

from bagstore import feedread, feedstream
from bagstore.backends import Backend, changeseq, check_identifier
from bagstore.backends import changesql as sql
from bagstore.backends.consumersql import bump_epoch, create_feed_catalog
from bagstore.errors import ChangesLost, ChangesPruned, ConfigurationError, InvalidQuery
from bagstore.feedpage import (
    Change,
    ChangePage,
    bucket_set,
    check_positions,
    decode_positions,
    encode_positions,
    page_changes,
)

if TYPE_CHECKING:
    from bagstore.sharding.router import Router

__all__ = ["Change", "ChangePage", "Feed", "FeedSettings"]

#: Changes kept at least this long (seconds) unless every consumer has them.
DEFAULT_MAX_AGE = 7 * 24 * 3600
#: At most this many changes kept per bucket, whatever the consumers.
DEFAULT_MAX_CHANGES = 1_000_000
#: the most ``max_age`` (100 years) and ``max_changes`` a feed takes: kept as
#: 64-bit ints, the age also in microseconds by the Cleaner
MOST_MAX_AGE = 100 * 365 * 24 * 3600
MOST_MAX_CHANGES = 10**15
MAX_LIMIT = 10_000
_CURSOR_PREFIX = "c1."
#: reading sessions kept (one a set of buckets read: a consumer's ranges)
_SESSIONS = 64
_HELD = methodcaller("held_rows")
#: the default of :attr:`Feed.read_ahead_bytes`
READ_AHEAD_BYTES = 32 * 2**20
#: seconds a reader's positions read afresh may be taken again when their
#: sums have not moved (then they are read whole again): the longest a
#: change could wait if a bucket's rows leaving a shard and others arriving
#: there ever added up the same (see Feed.holders)
_POLLED_TRUST = 1.0


@dataclass(frozen=True)
class FeedSettings:
    """A kind's feed: bodies recorded or not; retention (``max_age`` seconds,
    ``max_changes`` per bucket)."""

    bodies: bool
    max_age: int
    max_changes: int


class Feed:
    """The change feed of one kind (``ds.feed``; ``ds.changes`` reads it)."""

    def __init__(self, kind: str, router: Router) -> None:
        self.kind = check_identifier(kind, "kind")
        self.router = router
        self.catalog = router.catalog_backend
        create_feed_catalog(self.catalog)
        self._key: bytes | None = None
        self._epoch: int | None = None
        self._epoch_at = 0.0
        self._epoch_version = -1  # the placement version when the epoch was read
        #: the reading sessions of the last pages read, by the buckets read
        self._sessions: dict[frozenset[int] | None, feedread.Session | feedstream.Stream] = {}
        self._others: dict[str, Feed] = {}  # other kinds' feeds (see other())
        #: the last cursor made: (cursor, its positions, its epoch)
        self._issued: tuple[str, dict[int, int], int, int] | None = None
        self._read_ahead = READ_AHEAD_BYTES
        self._row_bytes = 0  # a row's memory, as the last read measured it
        #: of each shard, the positions a reader read last (see holders):
        #: (backend, placement version, when read whole, sums, positions)
        self._polled: dict[int, tuple[Backend, int, float, sql.Sums, dict[int, tuple[int, int]]]]
        self._polled = {}
        self._on_at = -1e9  # when check_on last found the feed on
        #: the last set of buckets read found to be this store's buckets
        self._checked: frozenset[int] | None = None

    @property
    def read_ahead_bytes(self) -> int:
        """The memory (bytes, estimated from the rows read) that rows read
        ahead and not returned yet may take, all of this feed's readers
        together; a read never reads less than each bucket's first rows,
        whatever this says, but reads them without their bodies when they
        would not fit (a page's bodies read when it is returned).  Default
        32 MiB."""
        return self._read_ahead

    @read_ahead_bytes.setter
    def read_ahead_bytes(self, value: int) -> None:
        if type(value) is not int or value < 0:
            raise ConfigurationError(
                f"read_ahead_bytes must be an integer, 0 or more, not {value!r}"[:200]
            )
        self._read_ahead = value

    # -- settings ------------------------------------------------------------------
    def settings(self) -> FeedSettings | None:
        """The kind's feed settings, or None while it is off."""
        rows = self.catalog.select_all(
            "bagstore_feeds", ("bodies", "max_age", "max_changes"), {"kind": self.kind}
        )
        if not rows:
            return None
        return FeedSettings(bool(rows[0][0]), int(rows[0][1]), int(rows[0][2]))

    def enable(
        self,
        *,
        bodies: bool = False,
        max_age: int = DEFAULT_MAX_AGE,
        max_changes: int = DEFAULT_MAX_CHANGES,
    ) -> None:
        """Record every write of the kind from now on (``bodies``: with the new
        body); keep changes ``max_age`` seconds unless every consumer has read
        them, and at most ``max_changes`` per bucket."""
        for name, value, most in (
            ("max_age", max_age, MOST_MAX_AGE),
            ("max_changes", max_changes, MOST_MAX_CHANGES),
        ):
            if type(value) is not int or not 1 <= value <= most:
                raise ConfigurationError(
                    f"{name} must be an integer from 1 to {most}, not {value!r}"
                )
        if type(bodies) is not bool:
            raise ConfigurationError(f"bodies must be True or False, not {bodies!r}")
        self.catalog.upsert(
            "bagstore_feeds",
            {"kind": self.kind},
            {"bodies": int(bodies), "max_age": max_age, "max_changes": max_changes},
        )
        self.router.on_all(lambda b: sql.set_triggers(b, self.kind, on=True, bodies=bodies))

    def disable(self) -> None:
        """Stop recording the kind's writes (the changes kept stay readable)."""
        self.router.on_all(lambda b: sql.set_triggers(b, self.kind, on=False))
        self.catalog.delete_where("bagstore_feeds", {"kind": self.kind})
        self._on_at = -1e9

    def prepare(self, backend: Backend) -> None:
        """A new shard records the kind's changes as the others do."""
        settings = self.settings()
        sql.ensure_change_tables(backend)
        if settings is not None:
            sql.set_triggers(backend, self.kind, on=True, bodies=settings.bodies)

    # -- positions -----------------------------------------------------------------
    def ends(self, buckets: Iterable[int] | None = None) -> dict[int, tuple[int, int]]:
        """``{bucket: (last position, last pruned)}``; see :meth:`holders`."""
        return {b: (top, pruned) for b, (top, pruned, _) in self.holders(buckets).items()}

    def holders(
        self, buckets: Iterable[int] | None = None, *, polled: bool = False
    ) -> dict[int, tuple[int, int, int]]:
        """``{bucket: (last position, last pruned, shard)}``: of each bucket, the
        shard holding its newest changes.  Every shard is asked: during and
        just after a bucket move, two hold the bucket's changes (the newer
        copy a superset of the older), and this process's placement may be
        out of date; a tie goes to the shard the placement names.

        ``polled`` (a reader's positions read afresh): a shard whose positions
        add up to what they did at this feed's last such read, within
        :data:`_POLLED_TRUST` seconds and the same placement, answers with
        one row and those positions are taken again (see
        :data:`bagstore.backends.changesql.Sums`)."""
        placement = self.router.refresh()
        backends = self.router.backends
        wanted = None if buckets is None else bucket_set(buckets, self.router.placement.buckets)
        now = time.monotonic()
        known: dict[int, sql.Sums | None] = dict.fromkeys(range(len(backends)))
        last = self._polled.copy() if polled else {}
        for s, (backend, version, at, sums, _) in last.items():
            trusted = version == placement.version and now - at < _POLLED_TRUST
            if s in known and backends[s] is backend and trusted:
                known[s] = sums

        def on(group: list[int]) -> dict[int, sql.Positions]:
            if len(group) == 1:
                return {group[0]: sql.positions(backends[group[0]], self.kind, known[group[0]])}
            return sql.positions_together(self.kind, [(s, backends[s], known[s]) for s in group])

        found: dict[int, dict[int, tuple[int, int]]] = {}
        for part in self.router.map(on, self._groups(list(range(len(backends))))):
            for s, (sums, got) in part.items():
                if got is None:  # as read before
                    got = last[s][4]
                elif polled:
                    self._polled[s] = (backends[s], placement.version, now, sums, got)
                found[s] = got
        return _holders(found, placement, wanted)

    def read(
        self,
        positions: dict[int, int],
        limit: int,
        buckets: Iterable[int] | None = None,
        *,
        who: str = "",
        oldest: bool = False,
        ends: dict[int, tuple[int, int, int]] | None = None,
    ) -> tuple[list[Change], dict[int, int]]:
        """The next changes after ``positions`` (of ``buckets``, default all),
        at most ``limit``, and the positions after them.  ``oldest``: a bucket
        missing from ``positions`` starts at the oldest change kept.
        ``ends``: :meth:`holders` as the caller read them just before, taken
        once for the buckets' positions read afresh (a consumer's poll: once
        for all its ranges; changes committed since wait for its next poll).

        A read that goes on from where the last one of the same buckets ended
        costs what its rows cost (:mod:`bagstore.feedread`); another starts
        afresh, reading every bucket's positions."""
        if type(limit) is not int or not 1 <= limit <= MAX_LIMIT:
            raise InvalidQuery(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
        key = cast("frozenset[int] | None", buckets)  # (a consumer's: the same set each batch)
        if buckets is not None and buckets is not self._checked:
            key = self._checked = bucket_set(buckets, self.router.placement.buckets)
        # Taken out while in use: a thread reading the same buckets at the
        # same time starts its own session.
        session = self._sessions.pop(key, None)

        def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
            # all the session's buckets read afresh (a page after the rows
            # known, or following the feed's end): the caller's once, or polled
            nonlocal ends
            if wanted != key or ends is None:
                return self.holders(wanted, polled=wanted == key)
            known, ends = ends, None
            return known if wanted is None else {b: known[b] for b in sorted(wanted) if b in known}

        def pruned(bucket: int, at: int, low: int) -> None:
            self._pruned(bucket, at, low, who)

        epoch = self.epoch()
        backends = self.router.backends
        stream = self.in_commit_order()
        if (
            session is None
            or isinstance(session, feedstream.Stream) != stream
            or not session.goes_on(positions, key, oldest, epoch)
            or (isinstance(session, feedstream.Stream) and session.shards != len(backends))
        ):
            check_positions(positions, self.router.placement.buckets)
            session = None
        router = self.router
        calls = (
            lambda: [changeseq.tops(b, self.kind) for b in router.backends],
            holders,
            lambda shard, at: changeseq.first_after(router.backends[shard], self.kind, at),
            pruned,
        )
        if session is None:
            session = (
                feedstream.start(key, positions, oldest, epoch, calls)
                if stream
                else feedread.start(key, positions, oldest, epoch, holders, pruned)
            )
        sessions = self._sessions
        # What its rows read ahead may take: the budget less what the other
        # sessions hold (a row's size as last measured, 0 before any read).
        size = session.row_bytes = session.row_bytes or self._row_bytes
        others = sum(map(_HELD, sessions.copy().values()))
        session.budget = max(0, self._read_ahead - others * size)
        if isinstance(session, feedstream.Stream):
            fetch = partial(_fetch_after, router, self.kind)
            rows = feedstream.next_rows(session, limit, fetch, calls)
        else:
            most = sql.rows_per_range(backends[0])
            rows = feedread.next_rows(session, limit, most, holders, self._read_ranges, pruned)
        self._row_bytes = session.row_bytes
        # the oldest dropped (threads may race here, and drop one too many)
        while len(sessions) >= _SESSIONS and key not in sessions:
            sessions.pop(next(iter(sessions.copy()), None), None)
        sessions[key] = session
        # (a new dict a page, never changed after)
        return page_changes(rows, self.kind), session.after

    def in_commit_order(self) -> bool:
        """Whether every shard keeps its change rows in commit order (SQLite,
        :mod:`bagstore.backends.changeseq`): a shard's rows are read as they
        lie, whatever buckets are asked (:mod:`bagstore.feedstream`)."""
        return all(map(changeseq.sequenced, self.router.backends))

    def _read_ranges(
        self,
        by_shard: dict[int, list[tuple[int, int, int]]],
        ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[Any]:
        """The change rows of ``{shard: [(bucket, lo, hi), ...]}``, one
        statement a group of shards (see :meth:`_groups`); ``ends``: the
        buckets' ``(last position, last pruned, shard)`` as the reader knows
        them (how many rows lie between the ranges, see
        :func:`bagstore.backends.changerange.read_ranges`); ``bodies``
        False: each body's length in its place."""
        backends = self.router.backends

        def on(group: list[int]) -> list[tuple[Any, ...]]:
            if len(group) == 1:
                s = group[0]
                return sql.read_ranges(backends[s], self.kind, by_shard[s], (ends, s), bodies)
            parts = [(backends[s], by_shard[s], (ends, s)) for s in group]
            return sql.ranges_together(self.kind, parts, bodies)

        parts = self.router.map(on, self._groups(sorted(by_shard)))
        rows = parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))
        asked = (hi - lo + 1 for r in by_shard.values() for _, lo, hi in r)  # (summed if polled)
        if self._polled and len(rows) < sum(asked):
            # rows missing where positions said (moved, pruned): positions
            # are read whole again (see holders)
            self._polled.clear()
        return rows

    def _groups(self, shards: list[int]) -> list[list[int]]:
        """Shards grouped so that one statement reads each group (databases of
        one server reached with one login, see ``Backend.together``)."""
        backends = self.router.backends
        keyed: dict[Any, list[int]] = {}
        for s in shards:
            b = backends[s]
            key = b.together if b.union_reads and b.together is not None else ("alone", s)
            keyed.setdefault(key, []).append(s)
        out: list[list[int]] = []
        for group in keyed.values():
            size = backends[group[0]].max_together or len(group)
            out += [group[n : n + size] for n in range(0, len(group), size)]
        return out

    def _pruned(self, bucket: int, at: int, pruned: int, who: str) -> None:
        whom = f"consumer {who!r}" if who else "this cursor"
        fix = f"`bagstore consumers reset {who}`" if who else "read from the start (since=None)"
        raise ChangesPruned(
            f"{whom} of kind {self.kind!r} fell behind the changes kept: bucket {bucket} "
            f"was read to position {at}, but changes up to {pruned} were deleted by "
            f"retention (max_age / max_changes); {fix}",
            bucket=bucket,
        )

    # -- cursors -------------------------------------------------------------------
    def key(self) -> bytes:
        """The store's secret for signing cursors (made once, kept in the catalog)."""
        if self._key is None:
            self.catalog.insert_ignore(
                "bagstore_meta", ("name", "value"), [("cursor_key", secrets.token_hex(16))]
            )
            rows = self.catalog.select_all("bagstore_meta", ("value",), {"name": "cursor_key"})
            self._key = bytes.fromhex(str(rows[0][0]))
        return self._key

    def _mac(self, body: str) -> str:
        store = self.router.placement.store_id
        data = f"{store}|{self.kind}|{body}".encode()
        return hmac.new(self.key(), data, hashlib.blake2b).hexdigest()[:24]

    def epoch(self) -> int:
        """The feed's epoch: 0 until a failover that may have lost committed
        writes moves it on (:meth:`new_epoch`).  Read from the catalog at most
        every ``refresh_interval`` seconds, as the placement is."""
        now = time.monotonic()
        version = self.router.placement.version  # a failover moves it on too
        if (
            self._epoch is None
            or version != self._epoch_version
            or now - self._epoch_at >= self.router.refresh_interval
        ):
            rows = self.catalog.select_all("bagstore_meta", ("value",), {"name": "feed_epoch"})
            self._epoch, self._epoch_at = (int(rows[0][0]) if rows else 0), now
            self._epoch_version = version
        return self._epoch

    def new_epoch(self) -> int:
        """Start a new epoch (every kind's feed), for a failover that may have
        lost committed writes: every cursor and consumer position made before
        is refused with :class:`bagstore.ChangesLost`, since the changes it had
        not read may be gone and their positions given to later writes.
        Returns the new epoch."""
        epoch = bump_epoch(self.catalog)
        self._epoch, self._epoch_at = epoch, time.monotonic()
        return epoch

    def check_epoch(self, epoch: int, what: str) -> None:
        """Raise ChangesLost unless ``epoch`` (of a cursor or a consumer's
        position, named by ``what``) is the feed's current one."""
        now = self.epoch()
        if epoch != now:
            raise ChangesLost(
                f"{what} of kind {self.kind!r} dates from before a failover (feed epoch "
                f"{epoch}, now {now}): changes it had not read may be lost and their "
                "positions reused; read from the start (since=None) or "
                "ds.feed.end_cursor(), or reset the consumer (bagstore consumers reset NAME)"
            )

    def cursor(self, positions: dict[int, int], epoch: int | None = None) -> str:
        """An opaque, signed cursor of ``positions`` and their epoch (default: now's)."""
        epoch = self.epoch() if epoch is None else epoch
        version = self.router.placement.version
        issued = self._issued
        if (
            issued is not None
            and issued[2:] == (epoch, version)
            and (issued[1] is positions or issued[1] == positions)
        ):
            return issued[0]  # the same again (a reader at the feed's end)
        body = f"{version}.{epoch}.{encode_positions(positions)}"
        cursor = f"{_CURSOR_PREFIX}{body}.{self._mac(body)}"
        # Kept, not copied (the positions a page ends at are never changed),
        # zeros and all: decoding leaves a position of 0 out, which reads the
        # same from a cursor (a bucket missing is read from position 0).
        self._issued = (cursor, positions, epoch, version)
        return cursor

    def positions_of(self, cursor: object) -> dict[int, int]:
        """The positions a cursor of this store and kind holds (InvalidQuery if
        it is not one)."""
        if cursor is None:
            return {}
        issued = self._issued
        if issued is not None and cursor == issued[0]:
            # the last cursor made here (the next page's): known, not decoded;
            # the reader's own positions (never changed), so that it goes on
            self.check_epoch(issued[2], "this cursor")
            return issued[1]
        positions, epoch = self._decode(cursor)
        self.check_epoch(epoch, "this cursor")
        if positions and max(positions) >= self.router.placement.buckets:
            raise InvalidQuery("a change feed cursor naming buckets this store lacks")
        return positions

    def _decode(self, cursor: object) -> tuple[dict[int, int], int]:
        """A cursor's positions and epoch, its signature checked."""
        if (
            not isinstance(cursor, str)
            or not cursor.isascii()  # (a signature compares ASCII only)
            or not cursor.startswith(_CURSOR_PREFIX)
        ):
            raise InvalidQuery(f"not a change feed cursor: {str(cursor)[:40]!r}")
        body, _, mac = cursor[len(_CURSOR_PREFIX) :].rpartition(".")
        if not hmac.compare_digest(mac, self._mac(body)):
            raise InvalidQuery(
                f"this cursor is not one of the change feed of kind {self.kind!r} of this "
                "store (another store's or kind's, or altered)"
            )
        try:
            _, epoch, text = body.split(".", 2)
            return decode_positions(text), int(epoch)
        except (ValueError, zlib.error):
            raise InvalidQuery("a damaged change feed cursor") from None

    def changes(self, since: str | None = None, limit: int = 1000) -> ChangePage:
        """The changes after the cursor ``since`` (from the oldest kept when
        None), at most ``limit`` (1 to 10,000); the page's ``cursor`` reads on."""
        positions = self.positions_of(since)
        epoch = self.epoch()  # (a failover during the read: the next page is refused)
        changes, after = self.read(positions, limit, oldest=since is None)
        if not changes:
            self.check_on()
        return ChangePage(changes, self.cursor(after, epoch))

    def check_on(self) -> None:
        """ConfigurationError if the kind's feed is off and keeps no change
        (nothing to read, nor ever will be until it is switched on)."""
        now = time.monotonic()
        if now - self._on_at < self.router.refresh_interval:
            return  # found on that recently (a reader polling the feed's end)
        if self.settings() is None and not self.ends():
            raise ConfigurationError(
                f"the change feed of kind {self.kind!r} is off (ds.feed.enable(), or "
                "`bagstore feed on`)"
            )
        self._on_at = now

    # -- other kinds, consumers (bagstore.subscriber) ------------------------------
    def other(self, kind: str | None) -> Feed:
        """The feed of ``kind`` (this one when None or the same); InvalidQuery
        for a kind the store does not have."""
        if kind is None or kind == self.kind:
            return self
        feed = self._others.get(kind) if isinstance(kind, str) else None
        if feed is None:
            if not isinstance(kind, str) or kind not in self.router.catalog.kinds():
                raise InvalidQuery(f"no kind {kind!r} in this store")
            feed = self._others[kind] = Feed(kind, self.router)
        feed._read_ahead = self._read_ahead  # (ds.feed's setting: every kind's)
        return feed

    def consumers(self) -> list[dict[str, Any]]:
        """Every consumer of the store (all kinds) and its lag: ``name``,
        ``kind``, ``lag_changes``, ``lag_seconds``, ``lag_pruned``,
        ``processes`` (see :func:`bagstore.consumeradmin.consumer_lags`)."""
        from bagstore.consumeradmin import consumer_lags

        return consumer_lags(self.other, self)

    def drop_consumer(self, name: str) -> None:
        """Forget a consumer: its positions and leases (InvalidQuery if unknown)."""
        from bagstore.consumeradmin import drop_consumer

        drop_consumer(self, name)

    def reset_consumer(self, name: str, *, to: str = "start") -> None:
        """Set a consumer back to the oldest change kept (``"start"``) or on to
        after the newest (``"end"``)."""
        from bagstore.consumeradmin import reset_consumer

        reset_consumer(self.other, self, name, to=to)

    def end_cursor(self) -> str:
        """A cursor after every change committed so far (to follow from now)."""
        epoch = self.epoch()  # (before the positions are read, as for a page)
        return self.cursor({b: top for b, (top, _) in self.ends().items()}, epoch)


def _fetch_after(router: Router, kind: str, shard: int, seq: int, n: int) -> tuple[list[Any], int]:
    return changeseq.read_after(router.backends[shard], kind, seq, n)


def prepare_feeds(catalog: Backend, backend: Backend) -> None:
    """A shard joining the store records the changes of every kind whose feed is on."""
    create_feed_catalog(catalog)
    sql.ensure_change_tables(backend)
    for kind, bodies in catalog.select_all("bagstore_feeds", ("kind", "bodies")):
        sql.set_triggers(backend, str(kind), on=True, bodies=bool(bodies))


def _holders(
    found: dict[int, dict[int, tuple[int, int]]], placement: Any, wanted: frozenset[int] | None
) -> dict[int, tuple[int, int, int]]:
    """:meth:`Feed.holders` of the shards' positions ``found``."""
    out: dict[int, tuple[int, int, int]] = {}
    if sum(map(len, found.values())) == len(set(chain.from_iterable(found.values()))):
        # Each bucket on one shard (no move under way nor left): in C loops,
        # no bytecode a bucket (1,024 a read afresh, at every poll of a
        # reader that follows the feed's end).
        for shard in sorted(found):
            mine = found[shard]
            out.update(zip(mine, map(add, mine.values(), repeat((shard,))), strict=True))
        if wanted is not None:
            out = {b: out[b] for b in sorted(wanted) if b in out}
        elif out and max(out) >= placement.buckets:
            out = {b: v for b, v in out.items() if b < placement.buckets}
        return out
    for shard in sorted(found):
        for b, (top, pruned) in found[shard].items():
            if b >= placement.buckets or (wanted is not None and b not in wanted):
                continue
            best = out.get(b)
            if (
                best is None
                or top > best[0]
                or (top == best[0] and placement.shard_of_bucket[b] == shard)
            ):
                out[b] = (top, pruned, shard)
    return out
