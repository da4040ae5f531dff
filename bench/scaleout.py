"""Scale-out while serving: bucket moves to a new shard with a live writer, beside plain SQL copies.

Run from the repository root::

    python -m bench.scaleout [--backend mysql|sqlite|all] [--rows N] [--rounds N]
                             [--rate R] [--updates F] [--settle S] [--before S] [--duty D]
                             [--batch N] [--max-rate R]
                             [--server shared|private [--latches] [--server-option OPT ...]]
                             [--format rich|plain|markdown]

For the issue "Scale-out while serving".

bagstore: a 2-shard store (2 MariaDB databases on 127.0.0.1:3306, or 2 SQLite
files) with ``Index("index_user_id", ["user_id"], shard_on="user_id")``, loaded
with ``--rows`` FriendFeed-style entities (default 200,000; 20 per user) by
``put_many``.  Round 1: ``ds.add_shard(url)`` (a third database / file) and
``ds.rebalance(grace=0)``, which moves a third of the buckets to it.  Later
rounds move the same buckets back to where they came from, then out again
(``ds.move_buckets(..., grace=0)``), so that every round moves the same rows.
The mover runs as a user's would: at its defaults (10-row steps, each followed
by a pause half as long as the step), or at ``--batch N`` / ``--duty D``.

While each round runs, a separate process (no GIL shared with the mover) puts
entities at ``--rate`` per second (default 500; by default 90% rewrites of loaded
entities and 10% new ones, ``--updates``, so that the store grows little while
moves run at a few hundred entities a second), routed by
its own, soon stale, placement (it learns of moves by being refused, or every
``refresh_interval``); each write's latency is recorded.  The writer's first
``--settle`` seconds are not counted (the previous bulk work settles; before
the writer starts, SQLite's WAL files are checkpointed, and on MariaDB the
round waits until InnoDB's checkpoint age is at most 15% of its maximum, at
most 120 s: the load and the previous round's raw copies fill its redo log),
the next ``--before`` seconds give the "before" figures.

Baseline, the floor a move's copy has to be compared with: the same rows (the
entities and index rows of the buckets that round moves) copied with plain SQL
into an empty database with the same tables, then deleted there (the mover
deletes the source copy):

- ``INSERT ... SELECT`` between databases on the same server (SQLite: ``ATTACH``);
- ``SELECT`` + multi-row ``INSERT`` of 500 rows through Python (what a copy
  between two servers has to do).

The baseline runs without the writer: it is the floor, not a competitor.  On
MariaDB a third baseline runs WITH the writer (the same ``--rate``): the same
rows copied and then deleted in the Mover's steps and pauses, by plain SQL
into that empty database (``raw_paced``): the writer's p99 there is what a
copy at that pace costs it at the least (no catalog, freeze or fencing, and
deletes in a table the writer does not write).

After each round: every entity is there once (``ds.count()`` = loaded + the
writer's new entities), and the index holds one row per entity.

A third process watches the machine while each round runs (every 20 ms: how
late it wakes from a sleep, doing no IO itself; Linux's IO pressure, the time
some task and every task was stalled on IO; iowait and steal ticks; the reads
and writes its disks completed and how long they took).  Each write slower
than 250 ms gets a log line saying what the machine did meanwhile: a stall
that every process shares is the machine's, not the store's.

``--server private`` runs the MariaDB side on a ``mariadbd`` of its own, with
the shared server's InnoDB sizes (``--server-option`` changes them, e.g. the
buffer pool).  ``--latches`` turns performance_schema's latch, file IO and
stage instruments on there: the writer's watchdog then lists, for a write
stalled 0.4 s, every latch wait in progress, who holds those latches and what
the holders are doing, and each round ends with the waits whose longest
single occurrence passed 100 ms.

Goals (the issue): no write stalled over 1 s; writer p99 during <= 2x before.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore.scaleout import Mover
from bench.cleaner import STACKS_ENV, STALL_DUMP, Lat, WriterSpec, log, writer
from bench.common import (
    friendfeed_entity,
    mysql_available,
    mysql_connect,
    mysql_url,
    print_machine,
    print_table,
    rows_of,
    temp_databases,
)

KIND = "entities"
TABLE = "index_user_id"
USER_INDEX = bagstore.Index(table=TABLE, properties=["user_id"], shard_on="user_id")
PER_USER = 20
LOAD_BATCH = 5000
COPY_BATCH = 500
GOAL_STALL = 1.0
GOAL_P99_RATIO = 2.0
ENTITY_COLUMNS = "id, bucket, updated, version, body"
INDEX_COLUMNS = "user_id, entity_id, bagstore_bucket"


# -- environment ---------------------------------------------------------------------------


@dataclass
class Side:
    backend: str
    ds: Any
    bag_target: Any  # for the writer: shard URLs or the SQLite root
    shard_dbs: list[str]  # database names (MariaDB) or file paths (SQLite), by shard number
    new_url: str  # the shard to add
    raw: Any  # connection to the baseline's empty database
    raw_name: str
    update_ids: list[bytes] = field(default_factory=list)
    expected: int = 0  # entities there should be

    def exec(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = self.raw.cursor()
        try:
            cur.execute(sql, params)
            return int(cur.rowcount)
        finally:
            cur.close()


@contextlib.contextmanager
def open_side(backend: str) -> Iterator[Side]:
    from bagstore.backends.mysql import MySQLDialect
    from bagstore.backends.sqlite import SQLiteDialect

    with contextlib.ExitStack() as stack:
        if backend == "mysql":
            names = stack.enter_context(temp_databases(4, prefix="bst_bench_out"))
            urls = [mysql_url(n) for n in names[:2]]
            ds = bagstore.Datastore(urls, indexes=[USER_INDEX])
            stack.callback(ds.close)
            raw = mysql_connect(names[3])
            stack.callback(raw.close)
            side = Side(backend, ds, urls, names[:3], mysql_url(names[2]), raw, names[3])
            dialect: Any = MySQLDialect()
        else:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="bst_bench_out_"))
            store = os.path.join(root, "bag")
            ds = bagstore.open(store, indexes=[USER_INDEX], shards=2)
            stack.callback(ds.close)
            files = [os.path.join(store, f"shard_{i}.db") for i in range(2)]
            extra = os.path.join(store, "extra.db")
            raw_path = os.path.join(root, "raw.db")
            raw = sqlite3.connect(raw_path, isolation_level=None)
            raw.execute("PRAGMA journal_mode=WAL")
            raw.execute("PRAGMA synchronous=NORMAL")
            stack.callback(raw.close)
            side = Side(backend, ds, store, [*files, extra], "sqlite:///" + extra, raw, raw_path)
            dialect = SQLiteDialect()
        for sql in dialect.create_entities_sql(KIND):
            side.exec(sql)
        for sql in dialect.create_index_table_sql(TABLE, ["user_id"], False):
            side.exec(sql)
        yield side


def load(side: Side, rows: int) -> None:
    started = time.monotonic()
    done = 0
    last = started
    while done < rows:
        n = min(LOAD_BATCH, rows - done)
        users = [os.urandom(16) for _ in range(max(1, n // PER_USER))]
        entities = [friendfeed_entity(user_id=users[i % len(users)]) for i in range(n)]
        side.ds.put_many(entities)
        if len(side.update_ids) < 5000:
            side.update_ids += [e["id"] for e in entities[::40]]
        done += n
        if time.monotonic() - last > 10 or done == rows:
            last = time.monotonic()
            log(f"  [{side.backend}] loaded {done:,}/{rows:,} ({done / (last - started):,.0f}/s)")
    side.expected = rows


# -- the baseline: plain SQL copies ------------------------------------------------------------


@dataclass
class Copy:
    method: str
    entities: int
    index_rows: int
    copy_s: float
    delete_s: float

    @property
    def seconds(self) -> float:
        return self.copy_s + self.delete_s


def _in(n: int, p: str) -> str:
    return ", ".join([p] * n)


def raw_copy(side: Side, groups: dict[int, list[int]], method: str) -> Copy:
    """Copy the entities and index rows of ``groups`` ({source shard: buckets}) into
    the empty baseline database, then delete them there."""
    p = "%s" if side.backend == "mysql" else "?"
    entities = index_rows = 0
    t0 = time.perf_counter()
    if method == "INSERT ... SELECT":
        for shard, buckets in groups.items():
            src = _source(side, shard)
            entities += side.exec(
                f"INSERT INTO {KIND} ({ENTITY_COLUMNS}) SELECT {ENTITY_COLUMNS} FROM "
                f"{src}.{KIND} WHERE bucket IN ({_in(len(buckets), p)})",
                buckets,
            )
            index_rows += side.exec(
                f"INSERT INTO {TABLE} ({INDEX_COLUMNS}) SELECT {INDEX_COLUMNS} FROM "
                f"{src}.{TABLE} WHERE bagstore_bucket IN ({_in(len(buckets), p)})",
                buckets,
            )
            _detach(side, src)
    else:
        for shard, buckets in groups.items():
            src = _source_conn(side, shard)
            try:
                entities += _pipe(side, src, KIND, ENTITY_COLUMNS, "bucket", buckets, 5)
                index_rows += _pipe(side, src, TABLE, INDEX_COLUMNS, "bagstore_bucket", buckets, 3)
            finally:
                src.close()
    t1 = time.perf_counter()
    every = sorted(b for buckets in groups.values() for b in buckets)
    if side.backend == "sqlite":
        side.exec("BEGIN")
    side.exec(f"DELETE FROM {KIND} WHERE bucket IN ({_in(len(every), p)})", every)
    side.exec(f"DELETE FROM {TABLE} WHERE bagstore_bucket IN ({_in(len(every), p)})", every)
    if side.backend == "sqlite":
        side.exec("COMMIT")
    t2 = time.perf_counter()
    return Copy(method, entities, index_rows, t1 - t0, t2 - t1)


@dataclass
class Paced:
    """The writer's latencies before and during :func:`raw_paced`."""

    before: Lat
    during: Lat
    seconds: float
    steps: int


def raw_paced(side: Side, groups: dict[int, list[int]], args: argparse.Namespace) -> Paced:
    """MariaDB: plain SQL doing a move's copy and delete at the Mover's pace
    while the same writer runs.  The rows of ``groups``' buckets, read where
    they are now, are copied into the baseline's empty database in steps of
    the Mover's batch (``INSERT ... SELECT`` by id, by index key), each step
    followed by a pause of ``duty`` times its length; then deleted there in
    steps the same way.  Less than a move: no catalog, no freeze, no fencing,
    and the deletes hit a table the writer does not write (the Mover's hit
    the source shard's), so the writer's p99 here is a floor for the goal."""
    from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY

    batch = args.batch or DEFAULT_BATCH
    duty = DEFAULT_DUTY if args.duty is None else args.duty
    copy: list[tuple[str, list[Any]]] = []
    delete: list[tuple[str, list[Any]]] = []
    cur = side.raw.cursor()
    try:
        for shard, buckets in groups.items():
            src = f"`{side.shard_dbs[shard]}`"
            for b in buckets:
                cur.execute(f"SELECT id FROM {src}.{KIND} WHERE bucket = %s", [b])
                ids = [r[0] for r in cur.fetchall()]
                for n in range(0, len(ids), batch):
                    part = ids[n : n + batch]
                    where = f"id IN ({_in(len(part), '%s')})"
                    copy.append(
                        (
                            f"INSERT INTO {KIND} ({ENTITY_COLUMNS}) SELECT {ENTITY_COLUMNS} "
                            f"FROM {src}.{KIND} WHERE {where}",
                            part,
                        )
                    )
                    delete.append((f"DELETE FROM {KIND} WHERE {where}", part))
                cur.execute(
                    f"SELECT user_id, entity_id FROM {src}.{TABLE} WHERE bagstore_bucket = %s", [b]
                )
                keys = cur.fetchall()
                for n in range(0, len(keys), batch):
                    part = keys[n : n + batch]
                    where = " OR ".join(["(user_id = %s AND entity_id = %s)"] * len(part))
                    flat = [v for k in part for v in k]
                    copy.append(
                        (
                            f"INSERT INTO {TABLE} ({INDEX_COLUMNS}) SELECT {INDEX_COLUMNS} "
                            f"FROM {src}.{TABLE} WHERE {where}",
                            flat,
                        )
                    )
                    delete.append((f"DELETE FROM {TABLE} WHERE {where}", flat))
    finally:
        cur.close()
    spec = WriterSpec(
        "bag", side.backend, side.bag_target, args.rate, side.update_ids, update_share=args.updates
    )
    settle(side)
    with writer(spec) as w:
        time.sleep(args.settle + args.before)
        t0 = time.monotonic()
        for sql, params in copy + delete:
            started = time.monotonic()
            side.exec(sql, params)
            if duty:
                time.sleep(duty * (time.monotonic() - started))
        t1 = time.monotonic()
        time.sleep(0.5)
        writes = w.stop()
    side.expected += writes.new_ok
    return Paced(
        Lat.of(writes.window(t0 - args.before, t0), args.before),
        Lat.of(writes.window(t0, t1), t1 - t0),
        t1 - t0,
        len(copy) + len(delete),
    )


def _source(side: Side, shard: int) -> str:
    """The source's name in a cross-database statement (SQLite: attached)."""
    if side.backend == "mysql":
        return f"`{side.shard_dbs[shard]}`"
    side.exec("ATTACH DATABASE ? AS src", [side.shard_dbs[shard]])
    return "src"


def _detach(side: Side, src: str) -> None:
    if side.backend == "sqlite":
        side.exec("DETACH DATABASE src")


def _source_conn(side: Side, shard: int) -> Any:
    if side.backend == "mysql":
        return mysql_connect(side.shard_dbs[shard])
    return sqlite3.connect(side.shard_dbs[shard], isolation_level=None)


def _pipe(
    side: Side, src: Any, table: str, columns: str, bucket_col: str, buckets: list[int], n: int
) -> int:
    """SELECT the buckets' rows from ``src``, write them 500 at a time."""
    p = "%s" if side.backend == "mysql" else "?"
    read = src.cursor()
    read.execute(
        f"SELECT {columns} FROM {table} WHERE {bucket_col} IN ({_in(len(buckets), p)})", buckets
    )
    copied = 0
    cur = side.raw.cursor()
    one = "(" + _in(n, p) + ")"
    while rows := read.fetchmany(COPY_BATCH):
        if side.backend == "sqlite":
            cur.execute("BEGIN")
        cur.execute(
            f"INSERT INTO {table} ({columns}) VALUES {', '.join([one] * len(rows))}",
            [v for r in rows for v in r],
        )
        if side.backend == "sqlite":
            cur.execute("COMMIT")
        copied += len(rows)
    read.close()
    cur.close()
    return copied


# -- one round of bagstore moves -----------------------------------------------------------------


@dataclass
class Round:
    backend: str
    label: str
    stats: Any  # MoveStats
    before: Lat
    during: Lat
    errors: list[str]
    consistent: str
    copies: list[Copy]
    paced: Paced | None = None  # MariaDB: plain SQL at the Mover's pace, with the writer


def counts(side: Side) -> tuple[int, int]:
    ds = side.ds
    rows = sum(ds.router.on_all(lambda b: b.count(TABLE)))
    return ds.count(), rows


#: MariaDB: the "before" window starts once InnoDB's checkpoint age (redo
#: written since the last checkpoint) is at most this share of its maximum.
SETTLED_AGE = 0.15  # (InnoDB's adaptive flushing stops pushing near 10%)
SETTLE_LIMIT = 120.0  # seconds, at most


def settle(side: Side) -> None:
    """Let the last bulk work (the load, the previous round's raw copies) finish
    before the writer's "before" window.  SQLite: checkpoint every file's WAL
    (else the writer's first commits pay for copying the bulk pages back).
    MariaDB: wait until InnoDB has flushed what that work left (a bulk load
    fills its redo log, and then writes wait on the page flushing it forces,
    before a move and during one alike)."""
    if side.backend == "sqlite":
        for path in [*side.shard_dbs, side.raw_name]:
            if os.path.exists(path):
                conn = sqlite3.connect(path, isolation_level=None)
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    conn.close()
        return
    t0 = time.monotonic()
    while True:
        age, most = _checkpoint_age(side)
        if not most or age <= SETTLED_AGE * most:
            break
        if time.monotonic() - t0 > SETTLE_LIMIT:
            behind = f"{age / most:.0%} of its redo log"
            log(f"  [{side.backend}] InnoDB still {behind} behind after {SETTLE_LIMIT:.0f} s")
            return
        time.sleep(0.5)
    if time.monotonic() - t0 > 1:
        log(f"  [{side.backend}] waited {time.monotonic() - t0:.0f} s for InnoDB to flush")


def _checkpoint_age(side: Side) -> tuple[int, int]:
    """MariaDB's Innodb_checkpoint_age and _max_age (0, 0 where not reported)."""
    cur = side.raw.cursor()
    try:
        cur.execute("SHOW GLOBAL STATUS LIKE 'Innodb_checkpoint%age'")
        found = {str(k).lower(): int(v) for k, v in cur.fetchall()}
    finally:
        cur.close()
    return found.get("innodb_checkpoint_age", 0), found.get("innodb_checkpoint_max_age", 0)


def one_round(
    side: Side, i: int, moved: list[int], home: dict[int, int], args: argparse.Namespace
) -> tuple[Round, list[int]]:
    """Round 0: add the shard and rebalance; odd rounds: the moved buckets go home;
    even rounds: out to the new shard again.  Then the baseline copies the same
    buckets' rows from where they are now.  Returns the round and the buckets moved."""
    ds = side.ds
    spec = WriterSpec(
        "bag",
        side.backend,
        side.bag_target,
        args.rate,
        side.update_ids,
        update_share=args.updates,
    )
    settle(side)
    longest = Longest(side)
    watch = Watch()
    pool_reads = _pool_reads(side)
    with writer(spec) as w, _deleting() as deletes:
        time.sleep(args.settle + args.before)  # the first seconds are not counted
        t0 = time.monotonic()
        if i == 0:
            ds.add_shard(side.new_url)
            stats = ds.rebalance(grace=0, duty=args.duty, max_rate=args.max_rate, batch=args.batch)
            label = "add_shard + rebalance(grace=0)"
        elif i % 2:
            stats = _move_home(ds, moved, home, args)
            label = "move_buckets back (grace=0)"
        else:
            stats = ds.move_buckets(
                moved,
                len(side.shard_dbs) - 1,
                grace=0,
                duty=args.duty,
                max_rate=args.max_rate,
                batch=args.batch,
            )
            label = "move_buckets out (grace=0)"
        t1 = time.monotonic()
        pool_reads = _pool_reads(side) - pool_reads
        time.sleep(0.5)
        writes = w.stop()
    samples = watch.stop()
    placement = ds.refresh_placement(force=True)
    if i == 0:
        moved = [b for b, s in enumerate(placement.shard_of_bucket) if s != home[b]]
    side.expected += writes.new_ok
    entities, rows = counts(side)
    ok = entities == side.expected and rows == entities
    consistent = "yes" if ok else f"NO ({entities:,} entities for {side.expected:,}; {rows:,} rows)"
    groups = _by(moved, lambda b: placement.shard_of_bucket[b])
    longest_waits = longest.report()  # (before the raw copies' bulk statements)
    copies = [raw_copy(side, groups, m) for m in ("INSERT ... SELECT", "SELECT + INSERT")]
    paced = raw_paced(side, groups, args) if side.backend == "mysql" else None
    r = Round(
        side.backend,
        label,
        stats,
        Lat.of(writes.window(t0 - args.before, t0), args.before),
        Lat.of(writes.window(t0, t1), t1 - t0),
        writes.errors,
        consistent,
        copies,
        paced,
    )
    log(
        f"  [{side.backend}] round {i + 1} {label}: {stats.buckets} buckets, "
        f"{stats.entities:,} entities + {stats.index_rows:,} index rows copied, "
        f"{stats.deleted:,} deleted in {stats.seconds:.1f}s (longest freeze "
        f"{stats.longest_freeze * 1e3:.0f} ms); writer p99 {r.before.p99 * 1e3:.1f} -> "
        f"{r.during.p99 * 1e3:.1f} ms, max {r.during.max * 1e3:.0f} ms, "
        f"{len(writes.errors)} errors; consistent: {consistent}"
        + (f"; first error: {writes.errors[0]}" if writes.errors else "")
    )
    hit = writes.window(t0, t1, troubled=True)
    rest = Lat.of(writes.window(t0, t1, troubled=False), t1 - t0)
    log(
        f"    writes refused or held by a freeze during the move: {len(hit)} of "
        f"{r.during.n}, slowest {max(hit, default=0.0) * 1e3:.0f} ms; the others' p99 "
        f"{rest.p99 * 1e3:.1f} ms"
    )

    log(f"    {io_during(samples, t0, t1, pool_reads)}")
    for line in explain_slow(writes.starts, writes.latencies, samples, t0):
        log(f"    {line}")
    for start, report in writes.stalls:
        log(f"    a write begun at {start - t0:+.1f} s, after {STALL_DUMP} s:\n{report}")
    for line in longest_waits:
        log(f"    {line}")

    def deleting_at(t: float) -> bool:
        return any(a <= t < b for a, b in deletes)

    pairs = zip(writes.starts, writes.latencies, strict=True)
    in_move = [(t, lat) for t, lat in pairs if t0 <= t < t1]
    spent = sum(b - a for a, b in deletes)
    copying = Lat.of([lat for t, lat in in_move if not deleting_at(t)], max(1e-9, t1 - t0 - spent))
    deleting = Lat.of([lat for t, lat in in_move if deleting_at(t)], max(1e-9, spent))
    log(
        f"    writer p99 while copying {copying.p99 * 1e3:.1f} ms ({copying.n} writes), "
        f"while deleting the sources {deleting.p99 * 1e3:.1f} ms ({deleting.n} writes)"
    )
    for c in copies:
        log(
            f"    raw {c.method}: {c.entities:,} entities + {c.index_rows:,} index rows copied "
            f"in {c.copy_s:.2f}s, deleted in {c.delete_s:.2f}s"
        )
    if paced is not None:
        log(
            f"    raw copy + delete at the Mover's pace ({paced.steps:,} steps, "
            f"{paced.seconds:.1f}s) with the writer: p99 {paced.before.p99 * 1e3:.1f} -> "
            f"{paced.during.p99 * 1e3:.1f} ms ({paced.during.p99 / paced.before.p99:.2f}x), "
            f"max {paced.during.max * 1e3:.0f} ms"
        )
    return r, moved


@contextlib.contextmanager
def _deleting() -> Iterator[list[tuple[float, float]]]:
    """The ``(start, end)`` times of the mover's deletes of source copies in the block."""
    spans: list[tuple[float, float]] = []
    original = Mover._finish

    def timed(self: Mover, *a: Any, **kw: Any) -> None:
        start = time.monotonic()
        try:
            original(self, *a, **kw)
        finally:
            spans.append((start, time.monotonic()))

    Mover._finish = timed  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        Mover._finish = original  # type: ignore[method-assign]


# -- what the whole machine did during a slow write ---------------------------------------
WATCH_EVERY = 0.02  # seconds between samples
SLOW_WRITE = 0.25  # a write this slow is explained in the log


#: One sample of the watcher: time, how late it woke, then _machine_counters().
Sample = tuple[float, float, int, int, int, int, int, int, int, int, int, int, int]


def _machine_counters() -> tuple[int, int, int, int, int, int, int, int, int, int, int]:
    """``(io_some_us, io_full_us, iowait_ticks, steal_ticks, reads, read_ms,
    writes, write_ms, in_flight, flushes, flush_ms)``: the time some task / every task of the
    machine was stalled on IO (Linux PSI, ``/proc/pressure/io``; -1 where the
    kernel has no PSI); the CPUs' iowait and steal ticks (``/proc/stat``); and,
    summed over the machine's disks (``/proc/diskstats``, whole devices other
    than loop, ram and zram), the reads and writes completed, the time they
    took, the requests in flight now, and the cache flushes completed (the
    fsyncs that reach the disk) and the time they took."""
    some = full = -1
    try:
        with open("/proc/pressure/io") as f:
            for line in f:
                total = int(line.rsplit("total=", 1)[1])
                if line.startswith("some"):
                    some = total
                elif line.startswith("full"):
                    full = total
    except OSError:
        pass
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    disk = [0] * 7
    disks = _disks()
    with open("/proc/diskstats") as f:
        for line in f:
            col = line.split()
            if col[2] in disks:
                # flushes: the last two of 20 columns (Linux 5.5 and later)
                for n, at in enumerate((3, 6, 7, 10, 11, 18, 19)):
                    disk[n] += int(col[at]) if at < len(col) else 0
    reads, read_ms, writes, write_ms, in_flight, flushes, flush_ms = disk
    return (
        some,
        full,
        int(cpu[5]),
        int(cpu[8]),
        reads,
        read_ms,
        writes,
        write_ms,
        in_flight,
        flushes,
        flush_ms,
    )


@functools.cache
def _disks() -> frozenset[str]:
    """The machine's whole disks (``/sys/block``: no partitions), without
    loop, ram and zram devices."""
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return frozenset()
    return frozenset(n for n in names if not n.startswith(("loop", "ram", "zram")))


def watch_main(pipe: Any, stop: Any) -> None:
    """Sample every WATCH_EVERY seconds until ``stop``: the time, how late this
    process woke (it does no IO: late means the machine ran nothing), and
    :func:`_machine_counters`; send the samples back."""
    samples: list[Sample] = []
    clock = time.monotonic
    try:
        while not stop.is_set():
            t = clock()
            time.sleep(WATCH_EVERY)
            now = clock()
            samples.append((now, now - t - WATCH_EVERY, *_machine_counters()))
    finally:
        pipe.send(samples)
        pipe.close()


class Watch:
    """A :func:`watch_main` process; ``stop()`` returns its samples."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=watch_main, args=(send, self._stop), daemon=True)
        self.proc.start()
        send.close()

    def stop(self) -> list[Sample]:
        self._stop.set()
        samples: list[Sample] = self._recv.recv() if self._recv.poll(30) else []
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
        return samples


class Longest:
    """With performance_schema on (``--latches``): the latch and IO waits
    and the statement stages whose longest single occurrence during a round
    passed LONGEST_SHOWN (the server's own clock, whatever thread waited),
    from its summaries, emptied when the round starts."""

    SUMMARIES = (
        ("waits", "events_waits_summary_global_by_event_name"),
        ("stages", "events_stages_summary_global_by_event_name"),
    )

    def __init__(self, side: Side) -> None:
        self.side = side
        self.on = side.backend == "mysql" and bool(
            rows_of(side.raw, "SELECT @@performance_schema")[0][0]
        )
        for _, table in self.SUMMARIES if self.on else ():
            side.exec(f"TRUNCATE TABLE performance_schema.{table}")

    def report(self) -> list[str]:
        out = []
        for title, table in self.SUMMARIES if self.on else ():
            rows = rows_of(
                self.side.raw,
                "SELECT EVENT_NAME, COUNT_STAR, ROUND(MAX_TIMER_WAIT / 1e9), "
                f"ROUND(SUM_TIMER_WAIT / 1e9) FROM performance_schema.{table} "
                f"WHERE MAX_TIMER_WAIT > {int(LONGEST_SHOWN * 1e12)} "
                "AND EVENT_NAME <> 'idle' AND EVENT_NAME NOT LIKE 'wait/synch/cond/%' "  # idle
                "ORDER BY MAX_TIMER_WAIT DESC",
            )
            shown = f"{LONGEST_SHOWN * 1e3:.0f} ms"
            out.append(f"{title} with one over {shown} (name, count, max ms, total ms):")
            out += [f"  {row}" for row in rows]
        return out


#: Longest waits worth a line in a round's report (seconds).
LONGEST_SHOWN = 0.1


def _pool_reads(side: Side) -> int:
    """MariaDB: pages InnoDB has read from disk since it started (0 on SQLite)."""
    if side.backend != "mysql":
        return 0
    return int(rows_of(side.raw, "SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_reads'")[0][1])


def io_during(samples: Sequence[Sample], t0: float, t1: float, pool_reads: int) -> str:
    """What the disks did from ``t0`` to ``t1`` (the move), from the watcher's
    samples, and (MariaDB) the pages InnoDB read from disk meanwhile."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return "disks during the move: no samples"
    first, last = inside[0], inside[-1]
    d = [b - a for a, b in zip(first, last, strict=True)]
    psi = "n/a" if first[2] < 0 else f"{d[2] / 1e3:,.0f} ms"
    pages = f"; InnoDB read {pool_reads:,} pages from disk" if pool_reads else ""
    return f"disks during the move: {_disk_work(d)}; some task stalled on IO {psi}{pages}"


def _disk_work(d: Sequence[float]) -> str:
    """The reads, writes and flushes in ``d``, the difference of two samples,
    with their mean times."""
    reads, read_ms, writes, write_ms, flushes, flush_ms = d[6], d[7], d[8], d[9], d[11], d[12]
    return (
        f"{reads:,} reads (mean {read_ms / max(reads, 1):.1f} ms), {writes:,} writes "
        f"(mean {write_ms / max(writes, 1):.1f} ms), {flushes:,} flushes "
        f"(mean {flush_ms / max(flushes, 1):.1f} ms)"
    )


def explain_slow(
    starts: Sequence[float],
    latencies: Sequence[float],
    samples: Sequence[Sample],
    t0: float,
) -> list[str]:
    """One line per write slower than SLOW_WRITE: what the machine did while it
    ran (from the samples that cover it)."""
    lines = []
    for start, lat in zip(starts, latencies, strict=True):
        if lat < SLOW_WRITE:
            continue
        end = start + lat
        inside = [s for s in samples if start <= s[0] <= end + WATCH_EVERY]
        first = max((s for s in samples if s[0] < start), default=None, key=lambda s: s[0])
        if not inside or first is None:
            lines.append(f"slow write at {start - t0:+.1f} s: {lat * 1e3:,.0f} ms (no samples)")
            continue
        last = inside[-1]
        late = max(s[1] for s in inside)
        d = [b - a for a, b in zip(first, last, strict=True)]
        psi = "n/a" if first[2] < 0 else f"{d[2] / 1e3:,.0f} ms (some) / {d[3] / 1e3:,.0f} ms (all)"
        lines.append(
            f"slow write at {start - t0:+.1f} s of the move: {lat * 1e3:,.0f} ms; meanwhile "
            f"an idle process woke up to {late * 1e3:,.0f} ms late; tasks stalled on IO "
            f"{psi}; iowait {d[4]} and steal {d[5]} CPU ticks; the disks completed "
            f"{_disk_work(d)}, the longest flush time in one sample "
            f"{_longest_flush(inside, first)}, up to {max(s[10] for s in inside)} requests "
            "in flight"
        )
    return lines


def _longest_flush(inside: Sequence[Sample], first: Sample) -> str:
    """The most flush time the disks added within one sample interval (a
    flush of hundreds of milliseconds shows as that much in one or a few)."""
    prev, most = first, 0
    for s in inside:
        most = max(most, s[12] - prev[12])
        prev = s
    return f"{most} ms"


def _by(buckets: Sequence[int], key: Callable[[int], int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for b in buckets:
        out.setdefault(key(b), []).append(b)
    return {k: sorted(v) for k, v in out.items()}


def _move_home(ds: Any, moved: list[int], home: dict[int, int], args: argparse.Namespace) -> Any:
    """Move each bucket back to its home shard; the MoveStats added up."""
    total = None
    for target, buckets in _by(moved, lambda b: home[b]).items():
        stats = ds.move_buckets(
            buckets, target, grace=0, duty=args.duty, max_rate=args.max_rate, batch=args.batch
        )
        if total is None:
            total = stats
        else:
            total.buckets += stats.buckets
            total.entities += stats.entities
            total.index_rows += stats.index_rows
            total.deleted += stats.deleted
            total.longest_freeze = max(total.longest_freeze, stats.longest_freeze)
            total.seconds += stats.seconds
    return total


# -- printing --------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x == x else "—"


def _med(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def summary_rows(rounds: Sequence[Round]) -> list[list[str]]:
    """One line per backend for bagstore and per baseline method: medians over rounds."""
    out: list[list[str]] = []
    for backend in dict.fromkeys(r.backend for r in rounds):
        rs = [r for r in rounds if r.backend == backend]
        bag_ent = _med([r.stats.entities / r.stats.seconds for r in rs])
        bag_idx = _med([r.stats.index_rows / r.stats.seconds for r in rs])
        p99_ratio = _med([r.during.p99 / r.before.p99 for r in rs])
        worst = max(r.during.max for r in rs)
        p99_before = _ms(_med([r.before.p99 for r in rs]))
        p99_during = _ms(_med([r.during.p99 for r in rs]))
        stall_ok = worst <= GOAL_STALL and all(not r.errors for r in rs)
        out.append(
            [
                "bagstore Mover (with writer)",
                backend,
                f"{_med([r.stats.buckets for r in rs]):,.0f}",
                f"{_med([r.stats.entities for r in rs]):,.0f}",
                f"{_med([r.stats.index_rows for r in rs]):,.0f}",
                f"{_med([r.stats.seconds for r in rs]):.2f}",
                f"{bag_ent:,.0f}",
                f"{bag_idx:,.0f}",
                "1.00",
                f"{_med([r.stats.longest_freeze for r in rs]) * 1e3:.0f}",
                f"{p99_before} → {p99_during}",
                f"{p99_ratio:.2f}",
                f"{_ms(max(r.before.max for r in rs))} → {_ms(worst)}",
                str(sum(len(r.errors) for r in rs)),
                "yes" if all(r.consistent == "yes" for r in rs) else "NO",
                f"{'yes' if p99_ratio <= GOAL_P99_RATIO else 'NO'} / {'yes' if stall_ok else 'NO'}",
            ]
        )
        for m in ("INSERT ... SELECT", "SELECT + INSERT"):
            cs = [c for r in rs for c in r.copies if c.method == m]
            ent = _med([c.entities / c.seconds for c in cs])
            ratio = _med(
                [
                    (r.stats.entities / r.stats.seconds) / (c.entities / c.seconds)
                    for r in rs
                    for c in r.copies
                    if c.method == m
                ]
            )
            out.append(
                [
                    f"raw {m}, then DELETE (no writer)",
                    backend,
                    "—",
                    f"{_med([c.entities for c in cs]):,.0f}",
                    f"{_med([c.index_rows for c in cs]):,.0f}",
                    f"{_med([c.seconds for c in cs]):.2f}"
                    f" ({_med([c.copy_s for c in cs]):.2f} + {_med([c.delete_s for c in cs]):.2f})",
                    f"{ent:,.0f}",
                    f"{_med([c.index_rows / c.seconds for c in cs]):,.0f}",
                    f"{ratio:.2f}",
                    "—",
                    "—",
                    "—",
                    "—",
                    "—",
                    "—",
                    "—",
                ]
            )
        ps = [r.paced for r in rs if r.paced is not None]
        if ps:
            out.append(
                [
                    "raw copy + delete at the Mover's pace (with writer)",
                    backend,
                    "—",
                    "—",
                    "—",
                    f"{_med([p.seconds for p in ps]):.2f}",
                    "—",
                    "—",
                    "—",
                    "—",
                    f"{_ms(_med([p.before.p99 for p in ps]))} → "
                    f"{_ms(_med([p.during.p99 for p in ps]))}",
                    f"{_med([p.during.p99 / p.before.p99 for p in ps]):.2f}",
                    f"{_ms(max(p.before.max for p in ps))} → {_ms(max(p.during.max for p in ps))}",
                    "—",
                    "—",
                    "—",
                ]
            )
    return out


HEADERS = [
    "method",
    "backend",
    "buckets",
    "entities",
    "index rows",
    "s (copy + delete)",
    "entities/s",
    "index rows/s",
    "bagstore/this",
    "longest freeze ms",
    "writer p99 ms before→during",
    "p99 during/before",
    "writer max ms before→during",
    "writer errors",
    "all entities, once",
    "goals: p99 / no stall > 1 s",
]

ROUND_HEADERS = [
    "backend",
    "round",
    "buckets",
    "entities",
    "index rows",
    "deleted",
    "s",
    "entities/s",
    "longest freeze ms",
    "writer p50 ms before→during",
    "p99 ms before→during",
    "max ms before→during",
    "writes/s before→during",
    "errors",
    "consistent",
]


def round_rows(rounds: Sequence[Round]) -> list[list[str]]:
    return [
        [
            r.backend,
            r.label,
            str(r.stats.buckets),
            f"{r.stats.entities:,}",
            f"{r.stats.index_rows:,}",
            f"{r.stats.deleted:,}",
            f"{r.stats.seconds:.2f}",
            f"{r.stats.entities / r.stats.seconds:,.0f}",
            f"{r.stats.longest_freeze * 1e3:.0f}",
            f"{_ms(r.before.p50)} → {_ms(r.during.p50)}",
            f"{_ms(r.before.p99)} → {_ms(r.during.p99)}",
            f"{_ms(r.before.max)} → {_ms(r.during.max)}",
            f"{r.before.rate:,.0f} → {r.during.rate:,.0f}",
            str(len(r.errors)),
            r.consistent,
        ]
        for r in rounds
    ]


# -- main ------------------------------------------------------------------------------------------


def run_backend(backend: str, args: argparse.Namespace) -> list[Round]:
    log(f"[{backend}] {args.rows:,} entities on 2 shards, one index; writer {args.rate:,.0f}/s")
    rounds: list[Round] = []
    with open_side(backend) as side:
        load(side, args.rows)
        home = dict(enumerate(side.ds.refresh_placement(force=True).shard_of_bucket))
        moved: list[int] = []
        for i in range(args.rounds):
            r, moved = one_round(side, i, moved, home, args)
            rounds.append(r)
    return rounds


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that temporary databases and files are removed


#: ``--server private``: the shared server's InnoDB sizes and durability (Debian's
#: defaults).
PRIVATE_OPTIONS = (
    "--innodb-buffer-pool-size=128M",
    "--innodb-log-file-size=96M",
    "--innodb-flush-log-at-trx-commit=1",
)
#: ``--latches``: performance_schema with every latch, file IO and stage timed
#: (it slows the server: the writer's p50 rises by ~0.5 ms here).
LATCH_OPTIONS = (
    "--performance-schema=ON",
    "--performance-schema-instrument=wait/synch/%=ON",
    "--performance-schema-instrument=stage/%=ON",
    "--performance-schema-instrument=wait/io/file/%=ON",
    "--performance-schema-consumer-events-waits-current=ON",
    "--performance-schema-consumer-events-stages-current=ON",
)


@contextlib.contextmanager
def private_server(args: argparse.Namespace) -> Iterator[None]:
    """With ``--server private``: start a ``mariadbd`` and point this process and
    the ones it spawns (through the environment) at it until the block ends."""
    if args.server != "private":
        yield
        return
    from tests.servers import MariaDBServer

    import bench.common

    latches = LATCH_OPTIONS if args.latches else ()
    server = MariaDBServer(extra_options=[*PRIVATE_OPTIONS, *latches, *args.server_option])
    server.start()
    names = ("BAGSTORE_BENCH_MYSQL_HOST", "BAGSTORE_BENCH_MYSQL_PORT", STACKS_ENV)
    saved = {k: os.environ.get(k) for k in names}
    try:
        if args.stacks:
            os.environ[STACKS_ENV] = "1"
        os.environ["BAGSTORE_BENCH_MYSQL_HOST"] = bench.common.MYSQL_HOST = server.host
        os.environ["BAGSTORE_BENCH_MYSQL_PORT"] = str(server.port)
        bench.common.MYSQL_PORT = server.port
        log(f"  private mariadbd on {server.host}:{server.port}: {' '.join(server.extra_options)}")
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="bucket moves while serving, beside plain SQL copies")
    p.add_argument("--backend", choices=["sqlite", "mysql", "all"], default="all")
    p.add_argument("--rows", type=int, default=200_000, help="entities (default 200,000)")
    p.add_argument("--rounds", type=int, default=3, help="move rounds (default 3)")
    p.add_argument("--rate", type=float, default=500.0, help="writer puts per second")
    p.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds the writer runs, not counted, before its 'before' window (default 5)",
    )
    p.add_argument("--before", type=float, default=5.0, help="seconds of writes before")
    p.add_argument(
        "--updates",
        type=float,
        default=0.9,
        help="the writer's share of puts that rewrite a loaded entity; the rest are new "
        "entities (default 0.9, so that the store does not outgrow the moves)",
    )
    p.add_argument(
        "--duty",
        type=float,
        default=None,
        help="the mover's pause after each copy step, in units of the step (default: "
        "bagstore's default; 0: flat out)",
    )
    p.add_argument(
        "--max-rate",
        type=float,
        default=None,
        help="the mover's cap on rows copied or deleted per second (default: none)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="the mover's rows per copy or delete statement (default: bagstore's default)",
    )
    p.add_argument(
        "--server",
        choices=["shared", "private"],
        default="shared",
        help="MariaDB: the shared server on 127.0.0.1:3306 (default), or a private mariadbd "
        "started here with the shared one's InnoDB sizes (Debian's defaults)",
    )
    p.add_argument(
        "--latches",
        action="store_true",
        help="with --server private: performance_schema's latch, file IO and stage "
        "instruments on (the writer's watchdog then names what a stalled write waits on, "
        "and each round lists its longest waits)",
    )
    p.add_argument(
        "--stacks",
        action="store_true",
        help="with --server private: a write stalled 0.4 s also reports the server's "
        "thread stacks, read with gdb (which pauses the server for a moment)",
    )
    p.add_argument(
        "--server-option",
        action="append",
        default=[],
        metavar="OPT",
        help="with --server private: one more mariadbd option (repeatable), e.g. "
        "--server-option=--innodb-buffer-pool-size=1G",
    )
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="rich")
    args = p.parse_args(argv)
    if args.rows < 1000 or args.rounds < 1:
        p.error("--rows must be >= 1000 and --rounds >= 1")
    if (args.latches or args.stacks or args.server_option) and args.server != "private":
        p.error("--latches, --stacks and --server-option need --server private")
    if args.settle < 0 or args.before <= 0:
        p.error("--settle must be >= 0 and --before > 0")
    if not 0.0 <= args.updates <= 1.0:
        p.error("--updates must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.scaleout``."""
    args = parse_args(argv)
    backends = []
    if args.backend in ("sqlite", "all"):
        backends.append("sqlite")
    if args.backend in ("mysql", "all"):
        if args.server == "private" or mysql_available():
            backends.append("mysql")
        elif args.backend == "mysql":
            log("MariaDB is not reachable on 127.0.0.1:3306")
            return 2
        else:
            log("MariaDB not reachable: skipping it")
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _terminate)
    print_machine(args.format)
    started = time.perf_counter()
    rounds: list[Round] = []
    for backend in backends:
        with private_server(args) if backend == "mysql" else contextlib.nullcontext():
            rounds += run_backend(backend, args)
    from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY

    duty = DEFAULT_DUTY if args.duty is None else args.duty
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    pacing = f"{duty:g}, batch={batch}" + (
        f", max_rate={args.max_rate:,.0f}" if args.max_rate else ""
    )
    print_table(
        f"Bucket moves (Mover duty={pacing}) with a writer at {args.rate:,.0f} puts/s "
        f"({args.updates:.0%} rewrites), beside "
        f"plain SQL copies of the same rows (medians over {args.rounds} rounds; writer max = "
        "worst round)",
        [],
        fmt=args.format,
        headers=HEADERS,
        rows=summary_rows(rounds),
    )
    print_table("Each round", [], fmt=args.format, headers=ROUND_HEADERS, rows=round_rows(rounds))
    errors = [(r.backend, e) for r in rounds for e in r.errors if e]
    for backend, e in dict.fromkeys(errors):
        print(f"- writer error on {backend}: {e}")
    log(f"total {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
