"""The Cleaner's online backfill beside the database's own online DDL, with a live writer.

Run from the repository root::

    python -m bench.cleaner [--backend mysql|sqlite|all] [--rows N] [--sqlite-rows N]
                            [--settings BATCH:DUTY[:MAX_RATE],...] [--rate R]
                            [--ddl-rounds N] [--format rich|plain|markdown]

For the issue "The Cleaner: online index life cycle, backfill and repair".

bagstore: a 4-shard store (4 MariaDB databases on 127.0.0.1:3306, or 4 SQLite
files) is loaded with FriendFeed-style entities (~300-byte bodies with a
``link`` string) by ``put_many``; then, per Cleaner setting,
``ds.add_index(Index("index_link", ["link"], shard_on="link"))`` (state
``building``) and ``Cleaner(ds, batch=..., duty=..., max_rate=...).backfill()``.
Between settings the index is retired and dropped, so every setting fills all
of it again.

Baseline: the same entities in ONE table of one database whose rows also hold
the body as JSON (``doc``); the index is built by the database itself.
MariaDB: ``ADD COLUMN link VARCHAR(255) AS (JSON_VALUE(doc,'$.link')) VIRTUAL,
ALGORITHM=INSTANT`` then ``ADD INDEX link (link), ALGORITHM=INPLACE, LOCK=NONE``
(the method of BASELINES.md); SQLite: the same virtual column with
``json_extract`` then ``CREATE INDEX`` (SQLite has no online index build).

A concurrent writer runs in a separate process (no GIL shared with the
backfill) on each side: single puts at ``--rate`` per second (default 500), 90%
new entities and 10% updates of loaded ones (a new ``link``, so the Cleaner's
take-back of rows that changed under it is exercised).  bagstore's writer calls
``ds.put``; the baseline's sends one upsert of the row.  Each write's latency is
recorded; a few seconds before the backfill give the "before" figures, the
backfill itself "during".  The longest stall is the longest single write.

Ceiling: the index rows bagstore would write, computed from the stored bodies
and made into 1,000-row INSERT statements before the clock starts, then sent
into a table with bagstore's index-table DDL while a writer runs: what any
client-side backfill could reach here, with no per-row work left in Python.
MariaDB: one connection, the baseline's writer.  SQLite: one thread per shard
file, each row in the file that owns its bucket, one transaction per
statement, bagstore's writer putting into the same files (SQLite has one
write lock per file, so this is where the rate and the writer's wait meet).

After each backfill the index must hold exactly one row per entity (checked with
``COUNT(*)``: a missing or stale row would show).

Goals (the issue): backfill >= 80,000 rows/s on MariaDB, >= 100,000 on SQLite;
writer p99 during <= 2x p99 before; no write stalled over 50 ms.

Where the backfill's time goes is measured by timing the Cleaner's own steps
(scan, insert, take-back re-read, checkpoint, throttle pause; the rest is
decoding and computing rows), summed over its worker threads.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import queue
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore import codec
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    friendfeed_entity,
    mysql_available,
    mysql_connect,
    mysql_url,
    print_machine,
    print_table,
    temp_databases,
)

KIND = "entities"
SHARDS = 4
TABLE = "index_link"
LINK_INDEX = bagstore.Index(table=TABLE, properties=["link"], shard_on="link")
LOAD_BATCH = 5000
RAW_BATCH = 1000
UPDATE_SHARE = 0.1
UPDATE_POOL = 5000
GOAL_RATE = {"mysql": 80_000, "sqlite": 100_000}
GOAL_P99_RATIO = 2.0
GOAL_STALL = 0.050
DEFAULT_ROWS = {"mysql": 1_000_000, "sqlite": 200_000}
DEFAULT_SETTINGS = "1000:0.5,1000:0,5000:0"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the writer process ------------------------------------------------------------------


@dataclass
class WriterSpec:
    """What a writer process writes to (picklable: it crosses to a spawned process)."""

    mode: str  # "bag" or "raw"
    backend: str  # "mysql" or "sqlite"
    target: Any  # bag: shard URLs / SQLite root; raw: database name / file path
    rate: float
    update_ids: list[bytes] = field(default_factory=list)
    buckets: int = 1024
    update_share: float = UPDATE_SHARE  # the share of puts that rewrite a loaded entity


def json_doc(e: dict[str, Any]) -> str:
    """The entity as JSON (bytes as hex), the baseline's ``doc`` column."""
    return json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in e.items()})


def raw_row(e: dict[str, Any], buckets: int, now: int) -> tuple[Any, ...]:
    """``(id, bucket, updated, body, doc)`` of the baseline table."""
    return (e["id"], bucket_of(e["id"], buckets), now, codec.encode(e), json_doc(e))


RAW_COLUMNS = "id, bucket, updated, body, doc"


def raw_upsert_sql(backend: str, rows: int) -> str:
    if backend == "mysql":
        values = ", ".join(["(%s, %s, %s, %s, %s)"] * rows)
        return (
            f"INSERT INTO {KIND} ({RAW_COLUMNS}) VALUES {values} ON DUPLICATE KEY UPDATE "
            "updated = VALUES(updated), version = version + 1, body = VALUES(body), "
            "doc = VALUES(doc)"
        )
    values = ", ".join(["(?, ?, ?, ?, ?)"] * rows)
    return (
        f"INSERT INTO {KIND} ({RAW_COLUMNS}) VALUES {values} ON CONFLICT(id) DO UPDATE SET "
        "updated = excluded.updated, version = version + 1, body = excluded.body, "
        "doc = excluded.doc"
    )


def _no_events() -> int:
    return 0


def _open_writer(
    spec: WriterSpec,
) -> tuple[Callable[[dict[str, Any]], object], Callable[[], None], Callable[[], int]]:
    """``(put, close, events)``: ``events()`` counts the writes a shard refused
    and the waits for frozen buckets so far (bagstore's ``stats()``; 0 for raw SQL)."""
    if spec.mode == "bag":
        if spec.backend == "sqlite":
            ds = bagstore.open(spec.target)
        else:
            ds = bagstore.Datastore(spec.target)

        def events() -> int:
            counts = ds.stats()["placement"]
            return counts["refused"] + counts["frozen_waits"]

        return ds.put, ds.close, events
    if spec.backend == "mysql":
        conn = mysql_connect(spec.target)
        cur = conn.cursor()
        sql = raw_upsert_sql("mysql", 1)

        def put_mysql(e: dict[str, Any]) -> None:
            cur.execute(sql, raw_row(e, spec.buckets, time.time_ns() // 1000))

        return put_mysql, conn.close, _no_events
    lite = sqlite3.connect(spec.target, timeout=120, isolation_level=None)
    lite.execute("PRAGMA journal_mode=WAL")
    lite.execute("PRAGMA synchronous=NORMAL")
    sql = raw_upsert_sql("sqlite", 1)

    def put_sqlite(e: dict[str, Any]) -> None:
        lite.execute(sql, raw_row(e, spec.buckets, time.time_ns() // 1000))

    return put_sqlite, lite.close, _no_events


#: A write still running after this long gets its stack (and, on MariaDB, the
#: server's transactions and lock waits) recorded while it waits.
STALL_DUMP = 0.4


def _server_now() -> str:
    """MariaDB's running statements, open transactions and lock waits, as text."""
    conn = mysql_connect()
    try:
        cur = conn.cursor()
        out = []
        cur.execute("SELECT @@performance_schema")
        if cur.fetchone()[0]:  # first: the other queries may wait on the same latches
            out += _latch_waits(cur)
        for title, sql in (
            (
                "statements",
                "SELECT id, command, time_ms, state, LEFT(info, 160) FROM "
                "information_schema.PROCESSLIST WHERE command <> 'Sleep' AND id <> CONNECTION_ID()",
            ),
            (
                "transactions",
                "SELECT trx_id, trx_state, trx_started, trx_mysql_thread_id, "
                "trx_rows_locked, LEFT(trx_query, 160) FROM information_schema.INNODB_TRX",
            ),
            ("lock waits", "SELECT * FROM information_schema.INNODB_LOCK_WAITS"),
            (
                "InnoDB",
                "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_buffer_pool_wait_free', "
                "'Innodb_buffer_pool_pages_free', 'Innodb_buffer_pool_pages_dirty', "
                "'Innodb_checkpoint_age', 'Innodb_buffer_pool_pages_flushed', "
                "'Innodb_buffer_pool_reads')",
            ),
        ):
            cur.execute(sql)
            out.append(f"  {title}:")
            out += [f"    {row}" for row in cur.fetchall()]
        if os.environ.get(STACKS_ENV):  # bench.scaleout --stacks
            out += _server_stacks(cur)
        cur.execute("SHOW ENGINE INNODB STATUS")
        out.append("  InnoDB status (its semaphores, background threads, IO and row operations):")
        out += [f"    {line}" for line in _status_parts(str(cur.fetchone()[2]))]
        return "\n".join(out)
    finally:
        conn.close()


#: Set (by ``bench.scaleout --stacks``): a stalled write's report holds the
#: server's thread stacks, read with gdb (the server must run on this machine).
STACKS_ENV = "BAGSTORE_BENCH_STACKS"


def _server_stacks(cur: Any) -> list[str]:
    """Every thread of the local ``mariadbd``, its stack as gdb reads it (the
    functions' names only; ``??`` where the binary has no symbol), threads
    with the same stack counted together, busiest first."""
    cur.execute("SELECT @@pid_file")
    try:
        with open(str(cur.fetchone()[0])) as f:
            pid = int(f.read().split()[0])
        run = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 14"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return [f"  stacks: not read ({exc})"]
    stacks: dict[tuple[str, ...], int] = {}
    frames: list[str] = []
    for line in [*run.stdout.splitlines(), "Thread"]:
        if line.startswith("Thread"):
            if frames:
                key = tuple(frames)
                stacks[key] = stacks.get(key, 0) + 1
            frames = []
        elif line.startswith("#"):
            # "#3  0x... in name (args) from lib" or, innermost, "#0  name (args)"
            m = re.search(r" in ([^\s(]+)", line) or re.match(r"#\d+\s+([^\s(]+)", line)
            frames.append(m.group(1) if m else "?")
    out = ["  server threads by stack (count: innermost frame first):"]
    for key, n in sorted(stacks.items(), key=lambda kv: -kv[1]):
        out.append(f"    {n}: {' < '.join(key)}")
    return out


#: Sections of SHOW ENGINE INNODB STATUS worth a stalled write's report.
STATUS_PARTS = (
    "BACKGROUND THREAD",
    "SEMAPHORES",
    "TRANSACTIONS",  # up to its list of transactions: purge's state, history length
    "FILE I/O",
    "LOG",
    "BUFFER POOL AND MEMORY",
    "ROW OPERATIONS",
)


def _status_parts(text: str) -> list[str]:
    """The STATUS_PARTS sections of InnoDB's status text, line by line."""
    lines = text.splitlines()
    out: list[str] = []
    keep = False

    def dashes(n: int) -> bool:
        return 0 <= n < len(lines) and bool(lines[n]) and set(lines[n]) == {"-"}

    for n, line in enumerate(lines):
        if dashes(n - 1) and dashes(n + 1):  # a section's title
            keep = line.strip() in STATUS_PARTS
        if line.startswith("LIST OF TRANSACTIONS"):
            keep = False
        if keep and line.strip() and set(line) != {"-"}:
            out.append(line)
    return out


def _latch_waits(cur: Any) -> list[str]:
    """With performance_schema on and its ``wait/synch`` instruments enabled (see
    ``bench.scaleout --server private --latches``): every thread's latch wait in progress,
    who holds each latch waited on, and what the holders are doing."""
    cur.execute(
        "SELECT w.THREAD_ID, t.PROCESSLIST_ID, t.NAME, w.EVENT_NAME, w.SOURCE, "
        "w.OBJECT_INSTANCE_BEGIN, ROUND(w.TIMER_WAIT / 1e9) AS ms "
        "FROM performance_schema.events_waits_current w "
        "JOIN performance_schema.threads t USING (THREAD_ID) "
        "WHERE w.EVENT_NAME LIKE 'wait/synch/%' AND w.EVENT_NAME NOT LIKE 'wait/synch/cond/%' "
        "AND w.END_EVENT_ID IS NULL"  # (condition variables: idle threads)
    )
    waits = cur.fetchall()
    out = ["  latch waits in progress (thread, connection, name, latch, source, object, ms):"]
    out += [f"    {row}" for row in waits]
    objects = sorted({int(row[5]) for row in waits})
    if not objects:
        return out
    marks = ", ".join(["%s"] * len(objects))
    cur.execute(
        "SELECT NAME, OBJECT_INSTANCE_BEGIN, WRITE_LOCKED_BY_THREAD_ID, READ_LOCKED_BY_COUNT "
        f"FROM performance_schema.rwlock_instances WHERE OBJECT_INSTANCE_BEGIN IN ({marks}) "
        "UNION ALL SELECT NAME, OBJECT_INSTANCE_BEGIN, LOCKED_BY_THREAD_ID, NULL "
        f"FROM performance_schema.mutex_instances WHERE OBJECT_INSTANCE_BEGIN IN ({marks})",
        objects + objects,
    )
    held = cur.fetchall()
    out.append("  those latches (name, object, written/locked by thread, readers):")
    out += [f"    {row}" for row in held]
    holders = sorted({int(row[2]) for row in held if row[2] is not None})
    if holders:
        marks = ", ".join(["%s"] * len(holders))
        cur.execute(
            "SELECT t.THREAD_ID, t.PROCESSLIST_ID, t.NAME, t.PROCESSLIST_STATE, "
            "w.EVENT_NAME, w.SOURCE, w.END_EVENT_ID IS NULL, s.EVENT_NAME, s.SOURCE, "
            "LEFT(q.SQL_TEXT, 120) FROM performance_schema.threads t "
            "LEFT JOIN performance_schema.events_waits_current w USING (THREAD_ID) "
            "LEFT JOIN performance_schema.events_stages_current s USING (THREAD_ID) "
            "LEFT JOIN performance_schema.events_statements_current q USING (THREAD_ID) "
            f"WHERE t.THREAD_ID IN ({marks})",
            holders,
        )
        out.append(
            "  the holders (thread, connection, name, state, last wait, its source, "
            "still waiting, stage, its source, statement):"
        )
        out += [f"    {row}" for row in cur.fetchall()]
    return out


def _watch_writes(
    spec: WriterSpec, running: list[float], stop: Any, reports: list[tuple[float, str]]
) -> None:
    """A thread of the writer process: when one write has run STALL_DUMP
    seconds, record where the writer thread is waiting (its stack) and, on
    MariaDB, what the server is doing; once per write."""
    main = threading.main_thread().ident
    dumped = -1.0
    while not stop.is_set():
        time.sleep(0.05)
        t0 = running[0]
        if t0 < 0 or t0 == dumped or time.monotonic() - t0 < STALL_DUMP:
            continue
        dumped = t0
        frame = sys._current_frames().get(main or 0)
        text = "".join(traceback.format_stack(frame)[-14:]) if frame is not None else "?"
        if spec.backend == "mysql":
            try:
                text += "\n" + _server_now()
            except Exception as exc:  # the report must not stop the writer
                text += f"\n  (server state unavailable: {exc})"
        reports.append((t0, text))


def writer_main(spec: WriterSpec, pipe: Any, ready: Any, stop: Any) -> None:
    """Put one entity every ``1/rate`` seconds (open loop: a slow write delays the
    next ones, which then go back to back) until ``stop``; send back the start
    times and latencies of the writes (monotonic clock, shared by the processes of
    one machine), the errors, and how many new entities were written."""
    put, close, events = _open_writer(spec)
    rng = random.Random(os.getpid())
    starts: list[float] = []
    latencies: list[float] = []
    errors: list[str] = []
    troubled: list[int] = []  # writes refused or held by a frozen bucket
    new_ok = 0
    interval = 1.0 / spec.rate
    clock = time.monotonic
    due = clock()
    running = [-1.0]  # the start of the write in progress (-1: none)
    stalls: list[tuple[float, str]] = []
    watcher = threading.Thread(
        target=_watch_writes, args=(spec, running, stop, stalls), daemon=True
    )
    watcher.start()
    try:
        while not stop.is_set():
            entity = friendfeed_entity()
            fresh = True
            if spec.update_ids and rng.random() < spec.update_share:
                entity["id"] = rng.choice(spec.update_ids)  # a new link for an old entity
                fresh = False
            now = clock()
            if now < due:
                time.sleep(due - now)
            seen = events()
            t0 = clock()
            running[0] = t0
            try:
                put(entity)
                new_ok += fresh
            except Exception as exc:  # recorded and reported, the writer goes on
                if len(errors) < 20:
                    errors.append(f"{type(exc).__name__}: {exc}")
                else:
                    errors.append("")
            t1 = clock()
            running[0] = -1.0
            starts.append(t0)
            latencies.append(t1 - t0)
            if events() != seen:
                troubled.append(len(starts) - 1)
            due = max(due + interval, t1 - 1.0)  # catch up at most one second
            if len(starts) == 50:
                ready.set()
    finally:
        ready.set()
        close()
        watcher.join(1.0)
        pipe.send((starts, latencies, errors, new_ok, troubled, stalls))
        pipe.close()


@dataclass
class Writes:
    starts: list[float]
    latencies: list[float]
    errors: list[str]
    new_ok: int = 0  # new entities written (not updates)
    troubled: list[int] = field(default_factory=list)  # positions of refused / frozen writes
    #: ``(start, report)`` of writes that ran over STALL_DUMP: where the writer
    #: waited, and the server's statements, transactions and lock waits then
    stalls: list[tuple[float, str]] = field(default_factory=list)

    def window(self, t_from: float, t_to: float, *, troubled: bool | None = None) -> list[float]:
        """Latencies of the writes begun in ``[t_from, t_to)``; ``troubled``: only
        those a shard refused or a frozen bucket held (True), only the others (False)."""
        marked = set(self.troubled)
        return [
            lat
            for i, (t, lat) in enumerate(zip(self.starts, self.latencies, strict=True))
            if t_from <= t < t_to and (troubled is None or (i in marked) == troubled)
        ]


class Writer:
    """A writer process; ``stop()`` returns what it recorded."""

    def __init__(self, spec: WriterSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=writer_main, args=(spec, send, self._ready, self._stop), daemon=True
        )
        self.proc.start()
        send.close()
        if not self._ready.wait(120) or not self.proc.is_alive():
            self.kill()
            raise RuntimeError("the writer process did not start")

    def stop(self) -> Writes:
        self._stop.set()
        if not self._recv.poll(120):
            self.kill()
            raise RuntimeError("the writer process did not report")
        starts, latencies, errors, new_ok, troubled, stalls = self._recv.recv()
        self.proc.join(30)
        return Writes(starts, latencies, errors, new_ok, troubled, stalls)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


@contextlib.contextmanager
def writer(spec: WriterSpec) -> Iterator[Writer]:
    w = Writer(spec)
    try:
        yield w
    finally:
        w.kill()


@dataclass
class Lat:
    """Latency figures of one window of writes (seconds)."""

    n: int
    rate: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, lats: Sequence[float], seconds: float) -> Lat:
        if not lats:
            return cls(0, 0.0, float("nan"), float("nan"), float("nan"))
        ordered = sorted(lats)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return cls(len(lats), len(lats) / seconds, ordered[len(ordered) // 2], p99, ordered[-1])


# -- where the Cleaner's time goes ---------------------------------------------------------


class PhaseClock:
    """Times the Cleaner's steps by wrapping them (thread time, summed over workers;
    ``wait``: a worker waiting for its server's turn, see ``Cleaner._paced``)."""

    STEPS = (
        ("scan", "bagstore.backends.base", "Backend", "scan_entities"),
        ("insert", "bagstore.cleaner", "Cleaner", "_insert"),
        ("take_back", "bagstore.cleaner", "Cleaner", "_take_back"),
        ("checkpoint", "bagstore.catalog", "Checkpoints", "set"),
        ("total", "bagstore.cleaner", "Cleaner", "_backfill_shard"),
    )

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.spent[name] = self.spent.get(name, 0.0) + seconds

    def reset(self) -> None:
        with self.lock:
            self.spent = {}

    def install(self) -> None:
        import importlib

        for name, module, cls_name, attr in self.STEPS:
            cls = getattr(importlib.import_module(module), cls_name, None)
            orig = getattr(cls, attr, None)
            if orig is None:
                continue
            self._wrap(cls, attr, orig, name)
        throttle = getattr(importlib.import_module("bagstore.cleaner"), "Throttle", None)
        pause_after = getattr(throttle, "pause_after", None)
        if pause_after is not None:

            def timed_pause(obj: Any, *a: Any, **k: Any) -> float:
                pause = float(pause_after(obj, *a, **k))
                self.add("pause", pause)
                return pause

            throttle.pause_after = timed_pause  # type: ignore[union-attr]
            self._undo.append(lambda: setattr(throttle, "pause_after", pause_after))
        cleaner = getattr(importlib.import_module("bagstore.cleaner"), "Cleaner", None)
        gate = getattr(cleaner, "_gate", None)
        if gate is not None:  # time spent waiting for the server's turn
            clock = self

            class TimedGate:
                def __init__(self, gate: Any) -> None:
                    self.gate = gate

                def __enter__(self) -> None:
                    t0 = time.perf_counter()
                    self.gate.__enter__()
                    clock.add("wait", time.perf_counter() - t0)

                def __exit__(self, *exc: object) -> None:
                    self.gate.__exit__(*exc)

            def timed_gate(obj: Any, *a: Any, **k: Any) -> TimedGate:
                return TimedGate(gate(obj, *a, **k))

            cleaner._gate = timed_gate  # type: ignore[union-attr]
            self._undo.append(lambda: setattr(cleaner, "_gate", gate))

    def _wrap(self, cls: Any, attr: str, orig: Callable[..., Any], name: str) -> None:
        clock = time.perf_counter

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return orig(*a, **k)
            finally:
                self.add(name, clock() - t0)

        setattr(cls, attr, timed)
        self._undo.append(lambda: setattr(cls, attr, orig))

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def shares(self) -> dict[str, float]:
        s = dict(self.spent)
        total = s.pop("total", 0.0)
        if total <= 0:
            return {}
        known = sum(s.values())
        s["decode+rows (rest)"] = max(0.0, total - known)
        return {k: v / total for k, v in s.items()}


# -- environments --------------------------------------------------------------------------


@dataclass
class Side:
    """One backend's bagstore store and baseline database."""

    backend: str
    ds: Any
    bag_target: Any
    raw_target: Any
    raw: Any  # DB-API connection to the baseline database
    update_ids: list[bytes] = field(default_factory=list)

    def raw_exec(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.raw.cursor()
        try:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []
        finally:
            cur.close()


@contextlib.contextmanager
def open_side(backend: str) -> Iterator[Side]:
    """A fresh 4-shard store and a fresh baseline database; removed afterwards."""
    from bagstore.backends.mysql import MySQLDialect
    from bagstore.backends.sqlite import SQLiteDialect

    with contextlib.ExitStack() as stack:
        if backend == "mysql":
            names = stack.enter_context(temp_databases(SHARDS + 1, prefix="bst_bench_cln"))
            urls = [mysql_url(n) for n in names[1:]]
            ds = bagstore.Datastore(urls)
            stack.callback(ds.close)
            raw = mysql_connect(names[0])
            stack.callback(raw.close)
            side = Side(backend, ds, urls, names[0], raw)
            dialect: Any = MySQLDialect()
            doc = "ALTER TABLE entities ADD COLUMN doc JSON NOT NULL"
        else:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="bst_bench_cln_"))
            ds = bagstore.open(os.path.join(root, "bag"), shards=SHARDS)
            stack.callback(ds.close)
            path = os.path.join(root, "raw.db")
            raw = sqlite3.connect(path, timeout=120, isolation_level=None)
            raw.execute("PRAGMA journal_mode=WAL")
            raw.execute("PRAGMA synchronous=NORMAL")
            stack.callback(raw.close)
            side = Side(backend, ds, os.path.join(root, "bag"), path, raw)
            dialect = SQLiteDialect()
            doc = "ALTER TABLE entities ADD COLUMN doc TEXT NOT NULL DEFAULT '{}'"
        for sql in dialect.create_entities_sql(KIND):
            side.raw_exec(sql)
        side.raw_exec(doc)
        yield side


def _raw_loader(side: Side, chunks: queue.Queue[list[dict[str, Any]] | None]) -> None:
    """Write the chunks the main thread hands over into the baseline table (its own
    connection, a thread of its own: the server does most of this work)."""
    buckets = int(side.ds.placement.buckets)
    if side.backend == "mysql":
        conn: Any = mysql_connect(side.raw_target)
    else:
        conn = sqlite3.connect(side.raw_target, timeout=120, isolation_level=None)
    try:
        cur = conn.cursor()
        while (entities := chunks.get()) is not None:
            now = time.time_ns() // 1000
            if side.backend == "sqlite":
                cur.execute("BEGIN")
            for start in range(0, len(entities), RAW_BATCH):
                chunk = entities[start : start + RAW_BATCH]
                params = [v for e in chunk for v in raw_row(e, buckets, now)]
                cur.execute(raw_upsert_sql(side.backend, len(chunk)), params)
            if side.backend == "sqlite":
                cur.execute("COMMIT")
        cur.close()
    finally:
        conn.close()


def load(side: Side, rows: int) -> None:
    """The same entities into bagstore (``put_many``) and the baseline (multi-row
    upserts, from a second thread)."""
    rng = random.Random(5)
    started = time.monotonic()
    done = 0
    last_log = started
    stride = max(1, rows // UPDATE_POOL)
    chunks: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(maxsize=4)
    failed: list[BaseException] = []

    def loader() -> None:
        try:
            _raw_loader(side, chunks)
        except BaseException as exc:
            failed.append(exc)
            while chunks.get() is not None:  # let the main thread finish
                pass

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    try:
        while done < rows:
            n = min(LOAD_BATCH, rows - done)
            entities = [friendfeed_entity() for _ in range(n)]
            side.ds.put_many(entities)
            chunks.put(entities)
            room = UPDATE_POOL - len(side.update_ids)
            side.update_ids += [e["id"] for e in entities[::stride]][:room]
            done += n
            if time.monotonic() - last_log > 10 or done == rows:
                last_log = time.monotonic()
                rate = done / (last_log - started)
                log(f"  [{side.backend}] loaded {done:,}/{rows:,} ({rate:,.0f}/s)")
    finally:
        chunks.put(None)
        thread.join()
    if failed:
        raise failed[0]
    rng.shuffle(side.update_ids)


# -- one backfill, one DDL round -------------------------------------------------------------


@dataclass
class Run:
    backend: str
    method: str
    rows: int
    seconds: float
    before: Lat
    during: Lat
    written: int = 0
    removed: int = 0
    consistent: str = "—"
    errors: int = 0
    shares: dict[str, float] = field(default_factory=dict)
    note: str = ""
    kind: str = "cleaner"  # or "ddl" (the database's own build), "ceiling" (raw inserts)

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def index_rows(side: Side) -> tuple[int, int]:
    """(index rows, entities) over every shard."""
    ds = side.ds
    rows = sum(ds.router.on_all(lambda b: b.count(TABLE)))
    return rows, ds.count()


class TailWatch(threading.Thread):
    """Watches a backfill's checkpoints: notes when every shard has passed the
    entities that existed when it started (``ends``), and stops the Cleaner if it
    is still running ``grace`` seconds later (still chasing the writer's new rows)."""

    def __init__(
        self, cleaner: Any, names: list[str], ends: list[int], grace: float, clock: PhaseClock
    ) -> None:
        super().__init__(daemon=True)
        self.cleaner, self.names, self.ends, self.grace = cleaner, names, ends, grace
        self.clock = clock
        self.covered: float | None = None
        self.shares: dict[str, float] = {}
        self.stopped = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            if self.covered is None:
                got = [self.cleaner.checkpoints.get(n) or 0 for n in self.names]
                if all(g >= e for g, e in zip(got, self.ends, strict=True)):
                    self.covered = time.monotonic()
                    self.shares = self.clock.shares()
            elif time.monotonic() - self.covered > self.grace:
                self.stopped = True
                self.cleaner.stop()
                return


def make_cleaner(ds: Any, batch: int, duty: float, max_rate: float | None) -> Any:
    """A Cleaner; without the settle wait when the library has one (the writer
    process opens its store after the index is registered, so it maintains it)."""
    kwargs: dict[str, Any] = {"batch": batch, "duty": duty, "max_rate": max_rate}
    if "settle" in inspect.signature(bagstore.Cleaner).parameters:
        kwargs["settle"] = 0
    return bagstore.Cleaner(ds, **kwargs)


def bag_run(
    side: Side,
    batch: int,
    duty: float,
    max_rate: float | None,
    args: argparse.Namespace,
    clock: PhaseClock,
) -> Run:
    ds = side.ds
    state = ds.indexes().get(TABLE)
    if state is not None:
        ds.retire_index(TABLE)
        ds.drop_index(TABLE)
    cleaner = make_cleaner(ds, batch, duty, max_rate)
    names = [cleaner._checkpoint_name(LINK_INDEX, s) for s in range(len(ds.router.backends))]
    # drop_index leaves a stopped backfill's checkpoints behind: a new index of
    # the same name would resume from them (and miss rows)
    cleaner.checkpoints.clear(cleaner._checkpoint_name(LINK_INDEX, None))
    assert ds.add_index(LINK_INDEX) == "building"
    spec = WriterSpec("bag", side.backend, side.bag_target, args.rate, side.update_ids)
    label = f"Cleaner batch={batch} duty={duty}"
    label += f" max_rate={max_rate:,.0f}" if max_rate else ""
    marks = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - marks[0] >= 5:
            marks[0] = now
            log(f"    backfill {done:,}/{total:,}")

    with writer(spec) as w:
        time.sleep(args.before)
        ends = ds.router.on_all(lambda b: b.max_added_id(KIND))
        initial = ds.count()
        watch = TailWatch(cleaner, names, ends, args.tail_grace, clock)
        clock.reset()
        watch.start()
        t0 = time.monotonic()
        try:
            stats = cleaner.backfill(TABLE, progress=progress)
        finally:
            t1 = time.monotonic()
            watch.done.set()
            watch.join()
        time.sleep(0.5)
        writes = w.stop()
    shares = watch.shares or clock.shares()
    start = t1 - stats.seconds if stats.seconds else t0
    covered = watch.covered if watch.covered is not None else t1
    got, entities = index_rows(side)
    consistent = "yes" if got == entities else f"NO ({got:,} rows, {entities:,} entities)"
    note = ""
    if watch.stopped:
        note = (
            f"did not return: still chasing the writer's new rows {args.tail_grace:.0f}s after "
            f"covering the {initial:,} it started with (stopped; index left building)"
        )
    run = Run(
        side.backend,
        label,
        initial,
        covered - start,
        Lat.of(writes.window(start - args.before, start), args.before),
        Lat.of(writes.window(start, covered), covered - start),
        stats.written,
        stats.removed,
        consistent,
        len(writes.errors),
        shares,
        note,
    )
    log(
        f"  [{side.backend}] {label}: {run.rows:,} rows in {run.seconds:.1f}s = {run.rate:,.0f}/s"
        f" (scanned {stats.entities:,}, written {run.written:,}, taken back {run.removed:,}); "
        f"writer p99 {run.before.p99 * 1e3:.1f} -> {run.during.p99 * 1e3:.1f} ms, max "
        f"{run.during.max * 1e3:.0f} ms; index rows = entities: {consistent}"
        + (f"; writer errors {len(writes.errors)}: {writes.errors[0]}" if writes.errors else "")
        + (f"; NOTE {note}" if note else "")
    )
    return run


def ddl_statements(backend: str) -> tuple[list[str], list[str]]:
    """(build, undo) of the baseline's index on the JSON column."""
    if backend == "mysql":
        return (
            [
                "ALTER TABLE entities ADD COLUMN link VARCHAR(255) "
                "AS (JSON_VALUE(doc, '$.link')) VIRTUAL, ALGORITHM=INSTANT",
                "ALTER TABLE entities ADD INDEX link (link), ALGORITHM=INPLACE, LOCK=NONE",
            ],
            ["ALTER TABLE entities DROP INDEX link, DROP COLUMN link"],
        )
    return (
        [
            "ALTER TABLE entities ADD COLUMN link TEXT "
            "GENERATED ALWAYS AS (json_extract(doc, '$.link')) VIRTUAL",
            "CREATE INDEX link ON entities (link)",
        ],
        ["DROP INDEX link", "ALTER TABLE entities DROP COLUMN link"],
    )


def ddl_run(side: Side, args: argparse.Namespace) -> Run:
    build, undo = ddl_statements(side.backend)
    spec = WriterSpec("raw", side.backend, side.raw_target, args.rate, side.update_ids)
    rows = int(side.raw_exec("SELECT COUNT(*) FROM entities")[0][0])
    with writer(spec) as w:
        time.sleep(args.before)
        t0 = time.monotonic()
        for sql in build:
            side.raw_exec(sql)
        t1 = time.monotonic()
        time.sleep(0.5)
        writes = w.stop()
    for sql in undo:
        side.raw_exec(sql)
    method = (
        "MariaDB ADD COLUMN VIRTUAL INSTANT + ADD INDEX INPLACE LOCK=NONE"
        if side.backend == "mysql"
        else "SQLite ADD COLUMN VIRTUAL + CREATE INDEX"
    )
    return _timed_run(side, "ddl", "DDL", method, rows, t0, t1, writes, args)


def _timed_run(
    side: Side,
    kind: str,
    label: str,
    method: str,
    rows: int,
    t0: float,
    t1: float,
    writes: Writes,
    args: argparse.Namespace,
) -> Run:
    """The Run of a build (DDL or the raw-insert ceiling) that ran from ``t0`` to
    ``t1`` beside the writer, logged."""
    run = Run(
        side.backend,
        method,
        rows,
        t1 - t0,
        Lat.of(writes.window(t0 - args.before, t0), args.before),
        Lat.of(writes.window(t0, t1), t1 - t0),
        errors=len(writes.errors),
        kind=kind,
    )
    log(
        f"  [{side.backend}] {label}: {rows:,} rows in {run.seconds:.2f}s = {run.rate:,.0f}/s; "
        f"writer p99 {run.before.p99 * 1e3:.1f} -> {run.during.p99 * 1e3:.1f} ms, max "
        f"{run.during.max * 1e3:.0f} ms"
        + (f"; writer errors {len(writes.errors)}: {writes.errors[0]}" if writes.errors else "")
    )
    return run


def median_run(runs: list[Run]) -> Run:
    """Medians over DDL rounds (the longest stall: the worst round)."""
    first = runs[0]

    def med(get: Callable[[Run], float]) -> float:
        return float(statistics.median(get(r) for r in runs))

    def lat(which: str) -> Lat:
        ls = [getattr(r, which) for r in runs]
        return Lat(
            int(statistics.median(x.n for x in ls)),
            float(statistics.median(x.rate for x in ls)),
            float(statistics.median(x.p50 for x in ls)),
            float(statistics.median(x.p99 for x in ls)),
            max(x.max for x in ls),
        )

    return Run(
        first.backend,
        first.method + (f" (median of {len(runs)})" if len(runs) > 1 else ""),
        int(med(lambda r: r.rows)),
        med(lambda r: r.seconds),
        lat("before"),
        lat("during"),
        errors=sum(r.errors for r in runs),
        kind=first.kind,
    )


CEILING_TABLE = "index_link_ceiling"


def ceiling_run(side: Side, args: argparse.Namespace) -> Run:
    """What any client-side backfill can reach on this server: the index rows
    bagstore would write (its keys and buckets, computed from the baseline's
    bodies) turned into 1,000-row INSERT statements before the clock starts,
    then sent from one connection into a table of bagstore's index layout
    (primary key plus the ``bagstore_bucket`` and ``entity_id`` keys), with the
    same writer running.  On SQLite the rows go into a table of that layout in
    each of bagstore's own 4 shard files (each row to the file that owns its
    bucket), the files written side by side as the Cleaner writes them, one
    transaction of 1,000 rows at a time, beside bagstore's own writer."""
    if side.backend == "sqlite":
        return _sqlite_ceiling_run(side, args)
    from bagstore.backends.mysql import MySQLDialect

    d = MySQLDialect()
    buckets = int(side.ds.placement.buckets)
    cols = ("link", "entity_id", "bagstore_bucket")
    for sql in d.create_index_table_sql(CEILING_TABLE, ["link"], False):
        side.raw_exec(sql)
    conn = mysql_connect(side.raw_target)
    cur = conn.cursor()
    rows: list[tuple[bytes, bytes, int]] = []
    after = 0
    while True:
        cur.execute(
            "SELECT added_id, id, body FROM entities WHERE added_id > %s ORDER BY added_id "
            "LIMIT 10000",
            (after,),
        )
        got = cur.fetchall()
        if not got:
            break
        for _, entity_id, body in got:
            for r in LINK_INDEX.rows_for(codec.decode(body), bytes(entity_id), buckets):
                rows.append((r.keys[0], r.entity_id, r.bucket))
        after = got[-1][0]
    statements = []
    for start in range(0, len(rows), RAW_BATCH):
        chunk = rows[start : start + RAW_BATCH]
        sql = d.insert_ignore_sql(CEILING_TABLE, cols, len(chunk))
        statements.append(cur.mogrify(sql, [v for r in chunk for v in r]))
    spec = WriterSpec("raw", side.backend, side.raw_target, args.rate, side.update_ids)
    try:
        with writer(spec) as w:
            time.sleep(args.before)
            t0 = time.monotonic()
            for text in statements:
                cur.execute(text)
            t1 = time.monotonic()
            time.sleep(0.5)
            writes = w.stop()
    finally:
        cur.close()
        conn.close()
        side.raw_exec(f"DROP TABLE {CEILING_TABLE}")
    method = f"raw INSERT of the same index rows, prepared beforehand ({RAW_BATCH:,} a statement)"
    return _timed_run(side, "ceiling", "ceiling", method, len(rows), t0, t1, writes, args)


def _sqlite_ceiling_run(side: Side, args: argparse.Namespace) -> Run:
    """:func:`ceiling_run` on SQLite: the index rows of every entity, computed
    and grouped by the shard file that owns their bucket before the clock
    starts, then written by one thread per file, ``RAW_BATCH`` rows a
    transaction (``BEGIN IMMEDIATE``, one multi-row ``INSERT OR IGNORE``,
    ``COMMIT``), while bagstore's writer puts into the same files."""
    from bagstore.backends.sqlite import SQLiteDialect

    d = SQLiteDialect()
    ds = side.ds
    placement = ds.placement
    buckets = int(placement.buckets)
    cols = ("link", "entity_id", "bagstore_bucket")
    paths = [b.path for b in ds.router.backends]
    per_file: list[list[tuple[bytes, bytes, int]]] = [[] for _ in paths]
    for backend in ds.router.backends:
        after = 0
        while True:
            got = backend.scan_entities(KIND, after, 10_000)
            if not got:
                break
            for _, entity_id, body, _ in got:
                for r in LINK_INDEX.rows_for(codec.decode(body), entity_id, buckets):
                    per_file[placement.shard_of_bucket[r.bucket]].append(
                        (r.keys[0], r.entity_id, r.bucket)
                    )
            after = got[-1][0]
    conns = []
    for path in paths:
        conn = sqlite3.connect(path, timeout=120, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for sql in d.create_index_table_sql(CEILING_TABLE, ["link"], False):
            conn.execute(sql)
        conns.append(conn)
    jobs = []
    for conn, rows in zip(conns, per_file, strict=True):
        batches = []
        for start in range(0, len(rows), RAW_BATCH):
            chunk = rows[start : start + RAW_BATCH]
            sql = d.insert_ignore_sql(CEILING_TABLE, cols, len(chunk))
            batches.append((sql, [v for r in chunk for v in r]))
        jobs.append((conn, batches))

    def fill(conn: sqlite3.Connection, batches: list[tuple[str, list[Any]]]) -> None:
        for sql, params in batches:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(sql, params)
            conn.execute("COMMIT")

    spec = WriterSpec("bag", side.backend, side.bag_target, args.rate, side.update_ids)
    try:
        with writer(spec) as w:
            time.sleep(args.before)
            threads = [threading.Thread(target=fill, args=job) for job in jobs]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            t1 = time.monotonic()
            time.sleep(0.5)
            writes = w.stop()
        written = sum(
            conn.execute(f"SELECT COUNT(*) FROM {CEILING_TABLE}").fetchone()[0] for conn in conns
        )
        total = sum(len(rows) for rows in per_file)
        assert written == total, f"ceiling wrote {written:,} of {total:,} rows"
    finally:
        for conn in conns:
            conn.execute(f"DROP TABLE IF EXISTS {CEILING_TABLE}")
            conn.close()
    method = (
        f"raw INSERT of the same index rows, prepared beforehand "
        f"({RAW_BATCH:,} a transaction, {len(paths)} files side by side)"
    )
    return _timed_run(side, "ceiling", "ceiling", method, total, t0, t1, writes, args)


# -- printing ------------------------------------------------------------------------------


HEADERS = [
    "method",
    "backend",
    "rows",
    "s",
    "rows/s",
    "vs DDL",
    "writer p50 ms before→during",
    "p99 ms before→during",
    "p99 during/before",
    "max ms before→during",
    "writes/s before→during",
    "index = entities",
    "goals: rate / p99 / stall",
]


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x == x else "—"


def goal_marks(run: Run, goal_rate: float | None) -> str:
    rate = "—" if goal_rate is None else ("yes" if run.rate >= goal_rate else "NO")
    ratio = run.during.p99 / run.before.p99 if run.before.p99 > 0 else float("inf")
    p99 = "yes" if ratio <= GOAL_P99_RATIO else "NO"
    stall = "yes" if run.during.max <= GOAL_STALL else "NO"
    return f"{rate} / {p99} / {stall}"


def rows_for_table(runs: Sequence[Run], ddl: dict[str, Run]) -> list[list[str]]:
    out = []
    for r in runs:
        base = ddl.get(r.backend)
        is_ddl = r.kind == "ddl"
        vs = f"{r.rate / base.rate:.2f}" if base is not None and base.rate > 0 else "—"
        ratio = r.during.p99 / r.before.p99 if r.before.p99 > 0 else float("nan")
        out.append(
            [
                r.method,
                r.backend,
                f"{r.rows:,}",
                f"{r.seconds:.1f}",
                f"{r.rate:,.0f}",
                "1.00" if is_ddl else vs,
                f"{_ms(r.before.p50)} → {_ms(r.during.p50)}",
                f"{_ms(r.before.p99)} → {_ms(r.during.p99)}",
                f"{ratio:.2f}",
                f"{_ms(r.before.max)} → {_ms(r.during.max)}",
                f"{r.before.rate:,.0f} → {r.during.rate:,.0f}",
                r.consistent,
                goal_marks(r, None if is_ddl else GOAL_RATE[r.backend]),
            ]
        )
    return out


def shares_rows(runs: Sequence[Run]) -> tuple[list[str], list[list[str]]]:
    steps = ["scan", "decode+rows (rest)", "insert", "take_back", "checkpoint", "pause", "wait"]
    headers = ["method", "backend", *steps]
    rows = []
    for r in runs:
        if r.shares:
            rows.append([r.method, r.backend, *(f"{r.shares.get(s, 0.0):.0%}" for s in steps)])
    return headers, rows


# -- main ------------------------------------------------------------------------------------


def parse_settings(text: str) -> list[tuple[int, float, float | None]]:
    out = []
    for part in text.split(","):
        bits = part.strip().split(":")
        if len(bits) not in (2, 3):
            raise argparse.ArgumentTypeError(f"a setting is BATCH:DUTY[:MAX_RATE], not {part!r}")
        out.append((int(bits[0]), float(bits[1]), float(bits[2]) if len(bits) == 3 else None))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="the Cleaner's backfill beside online DDL")
    p.add_argument("--backend", choices=["sqlite", "mysql", "all"], default="all")
    p.add_argument("--rows", type=int, default=None, help="entities on MariaDB (default 1,000,000)")
    p.add_argument(
        "--sqlite-rows", type=int, default=None, help="entities on SQLite (default 200,000)"
    )
    p.add_argument(
        "--settings",
        type=parse_settings,
        default=parse_settings(DEFAULT_SETTINGS),
        help=f"Cleaner settings BATCH:DUTY[:MAX_RATE], comma-separated ({DEFAULT_SETTINGS})",
    )
    p.add_argument("--rate", type=float, default=500.0, help="writer puts per second")
    p.add_argument("--before", type=float, default=4.0, help="seconds of writes before")
    p.add_argument("--ddl-rounds", type=int, default=3, help="rounds of the baseline DDL")
    p.add_argument(
        "--tail-grace",
        type=float,
        default=5.0,
        help="stop a backfill still running this long after it covered its initial rows",
    )
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="rich")
    args = p.parse_args(argv)
    rows = args.rows
    args.rows = {
        "mysql": rows or DEFAULT_ROWS["mysql"],
        "sqlite": args.sqlite_rows
        or (min(rows, DEFAULT_ROWS["sqlite"]) if rows else None)
        or DEFAULT_ROWS["sqlite"],
    }
    return args


def run_backend(backend: str, args: argparse.Namespace, clock: PhaseClock) -> list[Run]:
    rows = args.rows[backend]
    log(f"[{backend}] {rows:,} entities, {SHARDS} shards; writer {args.rate:,.0f} puts/s")
    runs: list[Run] = []
    with open_side(backend) as side:
        load(side, rows)
        ddl_runs = [ddl_run(side, args) for _ in range(max(1, args.ddl_rounds))]
        for batch, duty, max_rate in args.settings:
            runs.append(bag_run(side, batch, duty, max_rate, args, clock))
        runs.append(ceiling_run(side, args))
        runs.append(median_run(ddl_runs))
    return runs


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that temporary databases and files are removed


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.cleaner``."""
    args = parse_args(argv)
    backends = []
    if args.backend in ("sqlite", "all"):
        backends.append("sqlite")
    if args.backend in ("mysql", "all"):
        if mysql_available():
            backends.append("mysql")
        elif args.backend == "mysql":
            log("MariaDB is not reachable on 127.0.0.1:3306")
            return 2
        else:
            log("MariaDB not reachable: skipping it")
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, _terminate)
    print_machine(args.format)
    started = time.perf_counter()
    clock = PhaseClock()
    clock.install()
    runs: list[Run] = []
    try:
        for backend in backends:
            runs += run_backend(backend, args, clock)
    finally:
        clock.uninstall()
    ddl = {r.backend: r for r in runs if r.kind == "ddl"}
    print_table(
        f"Index backfill with a writer at {args.rate:,.0f} puts/s: bagstore Cleaner (4 shards) "
        "beside the database's own index build on one table (DDL: median of rounds; max = worst)",
        [],
        fmt=args.format,
        headers=HEADERS,
        rows=rows_for_table(runs, ddl),
    )
    headers, share_rows = shares_rows(runs)
    print_table(
        "Where the Cleaner's time goes (share of its worker threads' time)",
        [],
        fmt=args.format,
        headers=headers,
        rows=share_rows,
    )
    for r in runs:
        if r.note:
            print(f"- {r.backend}, {r.method}: {r.note}")
    log(f"total {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
