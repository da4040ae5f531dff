"""The change feed: what recording costs a put, reading speed, end-to-end lag.

Run from the repository root::

    python -m bench.changes [--backend sqlite|mysql|all] [--rounds N] [--seconds S]
                            [--only put|bucket|read|lag] [--quick] [--format ...]

Metrics (each backend; four shards, 64 buckets unless said):

- ``put, feed on vs off``: ``ds.put`` of a ~300-byte entity into a kind whose
  feed is on (with bodies, and without), beside the same puts into a kind
  whose feed is off, rounds interleaved.  Goal: the feed costs <= 10%
  (ratio >= 0.90).
- ``put, feed on vs raw``: the same puts beside raw SQL doing the same work by
  hand in ONE transaction on one database: the entity's upsert, the bucket's
  position row ``UPDATE ... SET pos = pos + 1`` and the change row's
  ``INSERT ... SELECT`` of that position (with the body, or without); on
  MariaDB sent as one multi-statement (``BEGIN; ...; COMMIT``), one round
  trip like bagstore's triggers.  Goal (issue 25): >= 0.8x.
- ``feed cost, on/off``: bagstore's on/off ratio beside raw SQL's own (the
  same transaction against the upsert alone), measured in the same rounds:
  what the extra row and row lock cost on this machine whoever writes them.
- ``changes read`` (64 buckets, and again with the store's default 1,024 on
  fresh shards): ``ds.changes(since=cursor, limit=1000)`` page after page
  over 20,000 changes of a kind that records bodies, reading every change's
  ``.entity`` (a Change decodes its body when ``.entity`` is read), beside
  raw DB-API reading the same rows by position (one keyset ``SELECT`` of the
  same seven columns, 1,000 rows per statement and shard, its keyset written
  as each server reads it as a range of the primary key) and decoding every
  body with ``codec.decode``: both sides decode every body once.  bagstore
  also merges the buckets by time and signs a cursor per page, which the raw
  side does not; to merge, it reads each bucket by a range of its own (a
  page needs every bucket's next change), where raw scans each shard once
  in (bucket, position) order whatever the bucket count, and it hands out a
  ``Change`` a row (raw: the driver's tuples).  Goal: >= 0.8x.
- ``changes read, raw merging by time by hand``: the raw read's rows
  of every shard held at once, sorted by time (then bucket and position),
  handed out 1,000 at a time and each body decoded, beside the raw read by
  position: what the merge alone costs a read without any bookkeeping (no
  memory bound, no cursor, no ``Change``), the most a merged read can
  reach.  Reported.
- ``changes read, raw merging by time by hand making a Change a row``: the
  same, each page of 1,000 made bagstore's ``Change`` objects as a page of
  ``ds.changes`` is (``bagstore.feedpage.page_changes``) and each
  ``.entity`` read: what a merged read that hands out an object a change
  costs without bagstore's bookkeeping (cursors, sessions, memory bound).
  Reported.
- ``changes read, raw in commit order`` (SQLite, whose change table is
  stored by a shard-wide number in commit order): each shard's rows read by
  that number, 1,000 a statement, the shards merged by time by hand (a row
  is handed out once every shard not read to its end has been read up to
  its time), each page made ``Change`` objects with each ``.entity`` read
  and the buckets' positions updated from its rows, beside the raw read by
  the table's key: what a read in commit order costs without bagstore's
  bookkeeping (cursor, memory bound, checks).  Reported.
- ``... vs raw by the table's key`` (SQLite): bagstore's pages and a
  consumer's batches of 1,000 beside raw reading each shard's rows in the
  order the table keeps them (its primary key), 1,000 a statement, each body
  decoded: on SQLite the fastest raw read of the same rows (by position, it
  goes through the index of (kind, bucket, position)).  Goal: >= 0.8x.
- ``a consumer's polls``: a named consumer (``ds.subscribe``, a new one each
  round, from the oldest change; batches of 1,000, every body decoded by
  its handler) polled until it has handled the 20,000 changes, its set-up
  (its ranges' rows, the leases first taken) not timed, beside the raw
  read by position: each poll renews its leases, reads every bucket's
  position, then each of its 16 bucket ranges' next batch (merged by time
  within the range), renews that range's lease, hands it over and
  checkpoints it in the catalog (one commit a batch: a checkpoint goes
  with the next batch's lease renewal).  Reported.
- ``changes read, pages of 100`` and ``a consumer's polls, batches of 100``
  (the default batch of ``ds.subscribe``): the same reads in smaller pages,
  beside the raw read by position asking 100 rows a statement: what a
  page's own work (its cursor of every bucket's position, the merge of the
  rows read ahead) and a batch's commit cost when a page holds few rows.
  Reported.
- ``changes read vs raw ... asking the columns packed`` (MariaDB): bagstore's
  read beside the raw read asking what bagstore asks through PyMySQL, which
  parses each column of a row in Python: a row's five integers and its id
  packed by the server into one binary value, unpacked in C loops.  Reported.
- ``4 writers of one bucket``: four threads putting entities of one shard
  key (one bucket), feed on vs off: with the feed on, writers of one bucket
  wait for each other's commit (its position row).  Reported.
- ``lag p99 at 500 puts/s``: a writer thread puts 500 entities a second while
  a follower reads ``ds.changes`` every 10 ms; the time from each put's
  stamp to its change being read.  Reported (no raw counterpart).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from operator import add, itemgetter
from typing import Any

import bagstore
from bagstore import codec
from bagstore.backends import changerange
from bagstore.backends.mysql import MySQLDialect
from bagstore.backends.sqlite import SQLiteDialect
from bagstore.catalog import DEFAULT_BUCKETS
from bagstore.feedpage import page_changes
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    Row,
    Shards,
    Work,
    _calibrate,
    alternate,
    fresh_shards,
    friendfeed_entity,
    paired,
    rows_of,
    run_suite,
    suite_args,
)

SHARDS = 4
#: a change row's five integers and id as bagstore asks them of MariaDB
#: through PyMySQL (bagstore.backends.changerange), and their layout
_PACKED_COLUMNS = changerange._PACKED_READ.removeprefix("SELECT ").removesuffix(", body FROM ")
_LAYOUT = changerange._PACKED
BUCKETS = 64
RAW = "entities"
#: the change rows copied in commit order (the sequence read's table)
_CHANGES = "bagstore_changes"
_TIME = itemgetter(5)


class RawFeed:
    """Raw SQL on one database: the entity's upsert alone, or with the work the
    feed's triggers do (the position row bumped, the change row inserted)."""

    def __init__(self, backend: str, shards: Shards, bodies: bool) -> None:
        self.mysql = backend == "mysql"
        d: Any = MySQLDialect() if self.mysql else SQLiteDialect()
        extra: dict[str, Any] = {}
        if self.mysql:
            from pymysql.constants import CLIENT

            extra["client_flag"] = CLIENT.MULTI_STATEMENTS
        self.conn = shards.connect(SHARDS, **extra)
        self.cur = self.conn.cursor()
        self.bodies = bodies
        p, tag = d.param, "b" if bodies else "i"
        self.changes, self.positions = f"raw_changes_{tag}", f"raw_positions_{tag}"
        blob = "MEDIUMBLOB" if self.mysql else "BLOB"
        # SQLite: as bagstore keeps them, in commit order: the row keyed by one
        # past the kind's highest number, a unique index by bucket and position
        seq = "" if self.mysql else "seq INTEGER NOT NULL, "
        key = "kind, bucket, pos" if self.mysql else "kind, seq"
        for sql in [
            *(d.create_entities_sql(RAW) if bodies else []),
            f"CREATE TABLE {self.changes} (kind VARCHAR(64) NOT NULL, {seq}"
            f"bucket INTEGER NOT NULL, pos BIGINT NOT NULL, id {d.id_type} NOT NULL, "
            f"op INTEGER NOT NULL, version BIGINT NOT NULL, updated BIGINT NOT NULL, "
            f"body {blob} NULL, PRIMARY KEY ({key})){'' if self.mysql else ' WITHOUT ROWID'}",
            f"CREATE TABLE {self.positions} (kind VARCHAR(64) NOT NULL, bucket INTEGER NOT NULL, "
            "pos BIGINT NOT NULL, pruned BIGINT NOT NULL, PRIMARY KEY (kind, bucket))",
            *([] if self.mysql else [
                f"CREATE UNIQUE INDEX {self.changes}_at ON {self.changes} (kind, bucket, pos)",
            ]),
        ]:  # fmt: skip
            self.cur.execute(sql)
        for b in range(BUCKETS):
            self.cur.execute(f"INSERT INTO {self.positions} VALUES ('k', {b}, 0, 0)")
        self.upsert = d.upsert_entities_sql(RAW, 1)
        self.bump = f"UPDATE {self.positions} SET pos = pos + 1 WHERE kind = 'k' AND bucket = {p}"
        number = (
            ""
            if self.mysql
            else f"COALESCE((SELECT MAX(seq) FROM {self.changes} WHERE kind = 'k'), 0) + 1, "
        )
        self.record = (
            f"INSERT INTO {self.changes} (kind, {seq.split()[0] + ', ' if seq else ''}bucket, pos, "
            f"id, op, version, updated, body) SELECT kind, {number}bucket, pos, {p}, 0, 1, {p}, "
            f"{p} FROM {self.positions} WHERE kind = 'k' AND bucket = {p}"
        )
        self.together = f"BEGIN; {self.upsert}; {self.bump}; {self.record}; COMMIT"

    def put(self, e: dict[str, Any]) -> None:
        """The entity's upsert alone, autocommit."""
        self.cur.execute(self.upsert, (e["id"], bucket_of(e["id"], BUCKETS), 0, codec.encode(e)))

    def put_fed(self, e: dict[str, Any]) -> None:
        """The upsert, the position bump and the change row in one transaction."""
        eid, body, now = e["id"], codec.encode(e), time.time_ns() // 1000
        bucket = bucket_of(eid, BUCKETS)
        record = (eid, now, body if self.bodies else None, bucket)
        if self.mysql:
            self.cur.execute(self.together, (eid, bucket, now, body, bucket, *record))
            while self.cur.nextset():
                pass
            return
        self.cur.execute("BEGIN IMMEDIATE")
        self.cur.execute(self.upsert, (eid, bucket, now, body))
        self.cur.execute(self.bump, (bucket,))
        self.cur.execute(self.record, record)
        self.cur.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def _rate(fn: Callable[[Any], object], inputs: Sequence[Any]) -> float:
    t0 = time.perf_counter()
    for x in inputs:
        fn(x)
    return len(inputs) / (time.perf_counter() - t0)


def put_cost(backend: str, shards: Shards, rounds: int, seconds: float) -> list[Row]:
    rows: list[Row] = []
    urls = shards.urls[:SHARDS]
    off = bagstore.Datastore(urls, buckets=BUCKETS, kind="plain")
    for bodies in (True, False):
        with_ = "with" if bodies else "without"
        on = bagstore.Datastore(urls, buckets=BUCKETS, kind=f"fed_{with_}")
        on.feed.enable(bodies=bodies)
        raw = RawFeed(backend, shards, bodies)

        def new(n: int, side: str = "") -> list[dict[str, Any]]:
            return [friendfeed_entity() for _ in range(n)]

        n = _calibrate(Work("", on.put, raw.put_fed, new), seconds, 20, 200_000)
        fns = {"on": on.put, "off": off.put, "raw on": raw.put_fed, "raw off": raw.put}
        sides = {k: (lambda fn=fn, n=n: _rate(fn, new(n))) for k, fn in fns.items()}
        r = alternate(sides, rounds)
        b_cost = [a / b for a, b in zip(r["on"], r["off"], strict=True)]
        r_cost = [a / b for a, b in zip(r["raw on"], r["raw off"], strict=True)]
        rows += [
            paired(f"{backend}: put, feed on ({with_} bodies) vs off, puts", r["on"], r["off"],
                   goal=0.9),
            paired(f"{backend}: put, feed on ({with_} bodies) vs raw: entity + change row + "
                   "position update in one transaction, puts", r["on"], r["raw on"], goal=0.8),
            paired(f"{backend}: feed cost ({with_} bodies), on/off: bagstore vs raw SQL "
                   "(same transaction vs the upsert alone)", b_cost, r_cost, goal="report",
                   unit="x"),
        ]  # fmt: skip
        raw.close()
        on.close()
    off.close()
    return rows


def read_speed(backend: str, shards: Shards, total: int, rounds: int, buckets: int) -> list[Row]:
    ds = bagstore.Datastore(shards.urls[:SHARDS], buckets=buckets, kind="readme")
    ds.feed.enable(bodies=True)
    for start in range(0, total, 500):
        ds.put_many([friendfeed_entity() for _ in range(min(500, total - start))])
    conns = [shards.connect(i) for i in range(SHARDS)]
    # The keyset as each server plans it as a range of its primary key:
    # SQLite a row value (it reads the OR below from the kind's first row at
    # every statement), MariaDB the OR (a row value there is read by kind).
    sqlite = backend == "sqlite"
    if sqlite:
        after_sql = "(bucket, pos) > (?, ?)"
    else:
        after_sql = "(bucket > %s OR (bucket = %s AND pos > %s))"

    def params(b: int, p: int) -> list[Any]:
        return ["readme", b, p] if sqlite else ["readme", b, b, p]

    where = (
        f"FROM bagstore_changes WHERE kind = {'?' if sqlite else '%s'} "
        f"AND {after_sql} ORDER BY bucket, pos LIMIT "
    )
    columns = "SELECT bucket, pos, id, op, version, updated, body "
    # What bagstore asks through PyMySQL: five integers and the id packed by
    # the server into one binary value (bagstore.backends.changerange).
    packed_columns = f"SELECT {_PACKED_COLUMNS}, body "

    def decoded(changes: list[bagstore.Change]) -> None:
        for c in changes:
            c.entity  # noqa: B018  (decoded when read)

    def bag_all(limit: int = 1000) -> float:
        n, since, t0 = 0, None, time.perf_counter()
        while page := ds.changes(since=since, limit=limit):
            for c in page:
                c.entity  # noqa: B018  (decoded when read)
            n += len(page)
            since = page.cursor
        assert n == total, (n, total)
        return n / (time.perf_counter() - t0)

    consumers = iter(range(1_000_000))

    def consumer_all(batch: int = 1000) -> float:
        # a new named consumer each round (from the oldest change), its
        # polls timed: the subscription's one-time set-up (its ranges' rows,
        # the leases first taken) is not
        sub = ds.subscribe(f"bench{next(consumers)}", decoded, batch=batch)
        sub.balance()
        n, t0 = 0, time.perf_counter()
        while n < total:
            n += sub.poll()
        rate = n / (time.perf_counter() - t0)
        sub.close()
        assert n == total, (n, total)
        return rate

    def fetched(conn: Any, packed: bool = False, limit: int = 1000) -> Iterator[list[Any]]:
        """The kind's rows on one shard, ``limit`` a statement, by position
        (``packed``: asked packed, unpacked in C loops)."""
        after, cur = (-1, 0), conn.cursor()
        text = f"{packed_columns if packed else columns}{where}{limit}"
        while True:
            cur.execute(text, params(*after))
            got = cur.fetchall()
            if packed and got:
                ints = _LAYOUT.iter_unpack(b"".join(map(itemgetter(0), got)))
                got = list(map(add, ints, zip(map(itemgetter(1), got))))
            yield got
            if len(got) < limit:
                break
            after = got[-1][0], got[-1][1]
        cur.close()

    def raw_all(packed: bool = False, limit: int = 1000) -> float:
        n, t0 = 0, time.perf_counter()
        for conn in conns:
            for got in fetched(conn, packed, limit):
                for r in got:
                    codec.decode(r[6])  # both drivers return a BLOB as bytes
                n += len(got)
        assert n == total, (n, total)
        return n / (time.perf_counter() - t0)

    def by_sequence(conn: Any, limit: int = 1000) -> Iterator[list[Any]]:
        """SQLite: the kind's rows on one shard in the table's own order (its
        primary key, commit order), ``limit`` a statement."""
        text = (f"SELECT bucket, pos, id, op, version, updated, body, seq FROM {_CHANGES} "
                "WHERE kind = ? AND seq > ? ORDER BY seq LIMIT ?")  # fmt: skip
        seq = 0
        while True:
            got = conn.execute(text, ("readme", seq, limit)).fetchall()
            yield got
            if len(got) < limit:
                break
            seq = got[-1][7]

    def raw_by_sequence() -> float:
        # SQLite: each shard's rows by the table's key, each body decoded
        n, t0 = 0, time.perf_counter()
        for conn in conns:
            for got in by_sequence(conn):
                for r in got:
                    codec.decode(r[6])
                n += len(got)
        assert n == total, (n, total)
        return n / (time.perf_counter() - t0)

    # A consumer by hand checkpoints where it stands after each batch it
    # handled, one row written and committed a batch (on the first shard, as
    # bagstore's catalog is).
    mark = "?" if sqlite else "%s"
    rows_of(conns[0], "CREATE TABLE IF NOT EXISTS bench_checkpoints (name VARCHAR(64) NOT NULL "
            "PRIMARY KEY, at VARCHAR(64) NOT NULL)")  # fmt: skip
    rows_of(conns[0], "DELETE FROM bench_checkpoints")
    rows_of(conns[0], f"INSERT INTO bench_checkpoints VALUES ({mark}, '')", ["raw"])
    checkpoint = f"UPDATE bench_checkpoints SET at = {mark} WHERE name = {mark}"

    def raw_consumer(batch: int) -> float:
        # by the table's key on SQLite, by position on MariaDB (each the
        # faster raw read), ``batch`` rows a statement: each batch's bodies
        # decoded (its handler), then its last row's place checkpointed
        n, t0 = 0, time.perf_counter()
        for i, conn in enumerate(conns):
            for got in by_sequence(conn, batch) if sqlite else fetched(conn, limit=batch):
                for r in got:
                    codec.decode(r[6])
                if got:
                    rows_of(conns[0], checkpoint, [f"{i}.{got[-1][0]}.{got[-1][1]}", "raw"])
                n += len(got)
        assert n == total, (n, total)
        return n / (time.perf_counter() - t0)

    def raw_merged(changes: bool = False) -> float:
        # The least a read merged by time can cost: every row held at once
        # and sorted by time (stable sorts: bucket, then position, within a
        # time), pages of 1,000 handed out; no memory bound, no cursor, no
        # object made a row (``changes``: each page made bagstore's
        # `Change`s, as a page is, and each `.entity` read).
        t0 = time.perf_counter()
        rows = [r for conn in conns for got in fetched(conn) for r in got]
        rows.sort(key=itemgetter(0))
        rows.sort(key=itemgetter(5))
        for start in range(0, len(rows), 1000):
            if changes:
                decoded(page_changes(rows[start : start + 1000], "readme"))
                continue
            for r in rows[start : start + 1000]:
                codec.decode(r[6])
        assert len(rows) == total, (len(rows), total)
        return total / (time.perf_counter() - t0)

    def raw_sequence() -> float:
        # One range a shard by its sequence, 1,000 rows a statement; the
        # shards merged by time by hand (a row is handed out once every shard
        # not read to its end has been read to its time at least), each page
        # made bagstore's `Change`s with each `.entity` read and the buckets'
        # positions (what a cursor holds) updated from its rows.
        text = (f"SELECT bucket, pos, id, op, version, updated, body, seq FROM {_CHANGES} "
                "WHERE kind = ? AND seq > ? ORDER BY seq LIMIT 1000")  # fmt: skip
        seqs, reached, held = [0] * len(conns), [0.0] * len(conns), []
        positions: dict[int, int] = {}

        def fill(i: int) -> None:
            got = conns[i].execute(text, ("readme", seqs[i])).fetchall()
            if got:
                seqs[i] = got[-1][7]
            reached[i] = float("inf") if len(got) < 1000 else got[-1][5]
            held.extend(got)

        n, t0 = 0, time.perf_counter()
        for i in range(len(conns)):
            fill(i)
        while True:
            held.sort(key=_TIME)
            k = bisect.bisect_right(held, min(reached), key=_TIME)
            while k < 1000 and min(reached) != float("inf"):
                fill(reached.index(min(reached)))
                held.sort(key=_TIME)
                k = bisect.bisect_right(held, min(reached), key=_TIME)
            page = held[: min(k, 1000)]
            if not page:
                break
            del held[: len(page)]
            positions.update(zip(map(itemgetter(0), page), map(itemgetter(1), page), strict=True))
            decoded(page_changes(page, "readme"))
            n += len(page)
        rate = n / (time.perf_counter() - t0)
        assert n == total, (n, total)
        lasts = "SELECT bucket, MAX(pos) FROM bagstore_changes WHERE kind = ? GROUP BY bucket"
        assert positions == {b: p for c in conns for b, p in c.execute(lasts, ["readme"])}
        return rate

    sides: dict[str, Callable[[], float]] = {
        "bag": bag_all,
        "raw": raw_all,
        "merged": raw_merged,
        "merged_changes": lambda: raw_merged(changes=True),
        "consumer": consumer_all,
        "bag100": lambda: bag_all(100),
        "consumer100": lambda: consumer_all(100),
        "raw100": lambda: raw_all(limit=100),
        "hand": lambda: raw_consumer(1000),
        "hand100": lambda: raw_consumer(100),
    }
    if backend == "mysql":
        sides["packed"] = lambda: raw_all(packed=True)
    else:
        sides["sequence"] = raw_sequence
        sides["rawseq"] = raw_by_sequence
    r = alternate(sides, rounds)
    hand_order = "by the table's key" if sqlite else "by position"
    for conn in conns:
        conn.close()
    ds.close()
    rows = [
        paired(f"{backend}: changes read (pages of 1,000, bodies, {buckets:,} buckets), "
               "changes", r["bag"], r["raw"], goal=0.8),
        paired(f"{backend}: changes read, raw merging by time by hand (all rows held) vs "
               f"raw by position ({buckets:,} buckets)", r["merged"], r["raw"], goal="report"),
        paired(f"{backend}: changes read, raw merging by time by hand making a Change a row "
               f"vs raw by position ({buckets:,} buckets)", r["merged_changes"], r["raw"],
               goal="report"),
        paired(f"{backend}: a consumer's polls (batches of 1,000, each checkpointed) vs raw "
               f"by position ({buckets:,} buckets)", r["consumer"], r["raw"], goal="report"),
        paired(f"{backend}: changes read, pages of 100 vs raw by position 100 rows a statement "
               f"({buckets:,} buckets)", r["bag100"], r["raw100"], goal="report"),
        paired(f"{backend}: a consumer's polls, batches of 100 (the default) vs raw by position "
               f"100 rows a statement ({buckets:,} buckets)", r["consumer100"], r["raw100"],
               goal="report"),
        paired(f"{backend}: a consumer's polls (batches of 1,000) vs a consumer by hand: raw "
               f"{hand_order}, each batch checkpointed, one UPDATE committed ({buckets:,} "
               "buckets)", r["consumer"], r["hand"], goal="report"),
        paired(f"{backend}: a consumer's polls, batches of 100 (the default) vs the consumer by "
               f"hand, batches of 100 ({buckets:,} buckets)", r["consumer100"], r["hand100"],
               goal="report"),
    ]  # fmt: skip
    if sqlite:
        rows += [
            paired(f"{backend}: changes read (pages of 1,000, bodies, {buckets:,} buckets) vs raw "
                   "by the table's key (commit order)", r["bag"], r["rawseq"], goal=0.8),
            paired(f"{backend}: a consumer's polls (batches of 1,000) vs raw by the table's key "
                   f"({buckets:,} buckets)", r["consumer"], r["rawseq"], goal=0.8),
            paired(f"{backend}: changes read, raw in commit order merging the shards by time "
                   f"by hand, a Change a row, vs raw by the table's key ({buckets:,} buckets)",
                   r["sequence"], r["rawseq"], goal="report"),
        ]  # fmt: skip
    if backend == "mysql":
        rows.append(
            paired(f"{backend}: changes read vs raw by position asking the columns packed "
                   f"as bagstore does ({buckets:,} buckets)", r["bag"], r["packed"],
                   goal="report")
        )  # fmt: skip
    return rows


def _writers(ds: bagstore.Datastore, threads: int, seconds: float) -> float:
    """Puts per second of ``threads`` threads putting entities of one user."""
    done = [0] * threads
    stop = threading.Event()

    def run(i: int) -> None:
        while not stop.is_set():
            ds.put({"user": "one", "n": done[i]})
            done[i] += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - t0)


def one_bucket(backend: str, urls: list[str], rounds: int, seconds: float) -> Row:
    """Four threads writing one bucket (a kind placed by a shard key, one key):
    with the feed on, each write holds the bucket's position row until it
    commits, so these writers commit one after another."""
    on = bagstore.Datastore(urls, buckets=BUCKETS, kind="hot_on", shard_key="user")
    on.feed.enable()
    off = bagstore.Datastore(urls, buckets=BUCKETS, kind="hot_off", shard_key="user")
    r = alternate({"on": lambda: _writers(on, 4, seconds),
                   "off": lambda: _writers(off, 4, seconds)}, rounds)  # fmt: skip
    on.close()
    off.close()
    return paired(f"{backend}: 4 writers of one bucket, feed on vs off, puts", r["on"], r["off"],
                  goal="report")  # fmt: skip


def lag(backend: str, urls: list[str], seconds: float) -> Row:
    ds = bagstore.Datastore(urls, buckets=BUCKETS, kind="lagged")
    ds.feed.enable()
    reader = bagstore.Datastore(urls, buckets=BUCKETS, kind="lagged")
    stop = threading.Event()
    lags: list[float] = []
    since = reader.feed.end_cursor()

    def write() -> None:
        interval, next_at = 1 / 500, time.perf_counter()
        while not stop.is_set():
            ds.put({"n": 1})
            next_at += interval
            time.sleep(max(0.0, next_at - time.perf_counter()))

    thread = threading.Thread(target=write)
    thread.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        page = reader.changes(since=since)
        now = time.time_ns() // 1000
        lags += [(now - c.updated) / 1000 for c in page]
        since = page.cursor
        time.sleep(0.01)
    stop.set()
    thread.join()
    ds.close()
    reader.close()
    p99 = statistics.quantiles(lags, n=100)[98] if len(lags) > 100 else float("nan")
    return Row(f"{backend}: lag p99 at 500 puts/s ({len(lags)} changes)", p99, None,
               goal="report", unit=" ms")  # fmt: skip


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with fresh_shards(backend, SHARDS + 1, "bagbench_feed") as shards:
        urls = shards.urls[:SHARDS]
        if args.only in ("all", "put"):
            rows += put_cost(backend, shards, args.rounds, args.seconds)
        if args.only in ("all", "bucket"):
            rows.append(one_bucket(backend, urls, args.rounds, args.seconds))
        if args.only in ("all", "read"):
            rows += read_speed(backend, shards, args.changes, args.rounds, BUCKETS)
        if args.only in ("all", "lag"):
            rows.append(lag(backend, urls, args.lag_seconds))
    if args.only in ("all", "read"):  # the store's default bucket count, fresh shards
        with fresh_shards(backend, SHARDS + 1, "bagbench_feed_dflt") as shards:
            rows += read_speed(backend, shards, args.changes, args.rounds, DEFAULT_BUCKETS)
    return rows


def main(argv: list[str] | None = None) -> int:
    options = {
        "rounds": (int, 5, 3, "interleaved rounds"),
        "seconds": (float, 1.0, 0.1, "one round of puts"),
        "changes": (int, 20_000, 2000, "changes read"),
        "lag-seconds": (float, 10.0, 1.0, "seconds of following"),
        "only": (["all", "put", "bucket", "read", "lag"], "all", "all", "the metrics to run"),
    }
    args = suite_args(argv, "the change feed beside the same puts without it, and raw SQL", options)
    title = f"bench.changes: the change feed ({SHARDS} shards), medians of {args.rounds} rounds"
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
