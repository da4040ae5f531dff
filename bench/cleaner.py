"""The Cleaner's backfill beside raw SQL doing the same work, and beside the database's own build.

Run from the repository root::

    python -m bench.cleaner [--backend mysql|sqlite|all] [--rows N] [--rounds N]
                            [--rate R] [--before S] [--quick] [--format rich|plain|markdown]

A one-shard store (a fresh MariaDB database on 127.0.0.1:3306, or a SQLite
file) is loaded with ``--rows`` FriendFeed-style entities (default 100,000;
``--quick``: 5,000) by ``put_many``; the index is
``Index("index_user_id", ["user_id"])``.

Flat out, no writer, ``--rounds`` rounds (default 3) of three builds of the
same index rows, in alternating order, each into an empty table of bagstore's
index layout in the shard's own database (or file):

- bagstore: ``ds.add_index(index)`` then ``Cleaner(ds, duty=0, settle=0).backfill()``
  (between rounds the index is retired and dropped);
- the ceiling: the very rows bagstore writes, computed from the stored bodies
  before the clock starts and sent as 1,000-row ``INSERT`` statements from
  one connection (SQLite: one transaction a statement): what any client-side
  backfill could reach here, with no per-row work left in Python;
- by hand: a plain Python loop doing the whole work: read the bodies in key
  order (10,000 a ``SELECT``), decode them, build the index rows (the key
  encoding and bucket bagstore uses), insert them in 1,000-row statements.

Goals (issue 25): the backfill >= 0.5x the ceiling (aim 0.8x) and >= 0.9x
the loop by hand.

With a writer (a separate process putting ``--rate`` entities a second, 90%
new, 10% rewrites), once: the Cleaner at its default pace beside the
database's own build on one table whose rows also hold the body as JSON
(MariaDB: ``ADD COLUMN ... AS (JSON_VALUE(doc, '$.user_id')) VIRTUAL`` then
``ADD INDEX ... ALGORITHM=INPLACE, LOCK=NONE``; SQLite: the same column with
``json_extract``, then ``CREATE INDEX``), the raw side's writer upserting into
that table.  Goals: the writer's p99 during the build <= 2x before; no write
over 50 ms.  After every build the index holds one row per entity.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore import codec, keys
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    Row,
    alternate,
    fresh_shards,
    friendfeed_entity,
    label_of,
    log,
    paired,
    rows_of,
    run_suite,
    suite_args,
)
from bench.live import KIND, WriterSpec, raw_row, raw_upsert_sql, timed_beside, writer_rows

TABLE = "index_user_id"
INDEX = bagstore.Index(TABLE, ["user_id"])
COLUMNS = ("user_id", "entity_id", "bagstore_bucket")
STATEMENT_ROWS = 1000
READ_ROWS = 10_000
LOAD_BATCH = 5000
GOAL_CEILING, GOAL_HAND = 0.5, 0.9
GOAL_P99_RATIO, GOAL_STALL = 2.0, 0.050


@dataclass
class Side:
    """One backend: the one-shard store, a raw connection to its shard, and the
    baseline database (one table with a JSON copy of each body)."""

    backend: str
    ds: Any
    bag_target: Any  # for the writer: shard URLs
    shard: Any  # DB-API connection to the store's one shard database / file
    doc_target: str  # baseline database name / file path
    doc: Any  # DB-API connection to it
    dialect: Any
    update_ids: list[bytes] = field(default_factory=list)

    def run(self, conn: Any, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        return rows_of(conn, sql, params)

    def write(self, conn: Any, sql: str, params: Any) -> None:
        """One statement in a transaction of its own (autocommit on MariaDB)."""
        cur = conn.cursor()
        try:
            if self.backend == "sqlite":
                cur.execute("BEGIN IMMEDIATE")
            cur.execute(sql, params)
            if self.backend == "sqlite":
                cur.execute("COMMIT")
        finally:
            cur.close()


@contextlib.contextmanager
def open_side(backend: str) -> Iterator[Side]:
    from bagstore.backends.mysql import MySQLDialect
    from bagstore.backends.sqlite import SQLiteDialect

    with fresh_shards(backend, 2, "bst_bench_cln") as shards:
        ds = bagstore.Datastore(shards.urls[:1])
        shard, raw = shards.connect(0), shards.connect(1)
        dialect: Any = MySQLDialect() if backend == "mysql" else SQLiteDialect()
        side = Side(backend, ds, shards.urls[:1], shard, shards.targets[1], raw, dialect)
        doc = "JSON NOT NULL" if backend == "mysql" else "TEXT NOT NULL DEFAULT '{}'"
        try:
            for sql in [*dialect.create_entities_sql(KIND), f"ALTER TABLE {KIND} ADD doc {doc}"]:
                side.run(raw, sql)
            yield side
        finally:
            ds.close()
            shard.close()
            raw.close()


def load(side: Side, rows: int) -> None:
    """The same entities into bagstore (``put_many``) and the baseline table."""
    t0 = time.monotonic()
    buckets = int(side.ds.placement.buckets)
    users = [os.urandom(16) for _ in range(max(1, rows // 20))]
    for done in range(0, rows, LOAD_BATCH):
        n = min(LOAD_BATCH, rows - done)
        entities = [friendfeed_entity(user_id=users[(done + i) % len(users)]) for i in range(n)]
        side.ds.put_many(entities)
        now = time.time_ns() // 1000
        for start in range(0, n, STATEMENT_ROWS):
            chunk = entities[start : start + STATEMENT_ROWS]
            params = [v for e in chunk for v in raw_row(e, buckets, now)]
            side.write(side.doc, raw_upsert_sql(side.backend, len(chunk)), params)
        if len(side.update_ids) < 5000:
            side.update_ids += [e["id"] for e in entities[::20]]
    log(f"  [{side.backend}] loaded {rows:,} entities in {time.monotonic() - t0:.1f}s")


# -- the three flat-out builds ------------------------------------------------------------


def hand_rows(bodies: list[tuple[Any, Any]], buckets: int) -> list[Any]:
    """The index rows of ``(id, body)`` pairs, flattened: the key encoding cut to
    the key limit, the entity id, the bucket of the full key."""
    out: list[Any] = []
    for entity_id, body in bodies:
        full = keys.encode_value(codec.decode(body)["user_id"])
        out += (keys.truncate(full)[0], bytes(entity_id), bucket_of(full, buckets))
    return out


def read_bodies(side: Side, after: bytes) -> list[tuple[Any, Any]]:
    p = side.dialect.param
    return side.run(
        side.shard,
        f"SELECT id, body FROM {KIND} WHERE id > {p} ORDER BY id LIMIT {READ_ROWS}",
        [after],
    )


def by_hand(side: Side, table: str) -> int:
    """The backfill a person writes in plain Python; the rows written."""
    buckets = int(side.ds.placement.buckets)
    d, after, pending, written = side.dialect, b"", [], 0
    per_row = len(COLUMNS)
    while True:
        bodies = read_bodies(side, after)
        if bodies:
            after = bytes(bodies[-1][0])
            pending += hand_rows(bodies, buckets)
        while len(pending) >= STATEMENT_ROWS * per_row or (pending and not bodies):
            chunk = pending[: STATEMENT_ROWS * per_row]
            del pending[: STATEMENT_ROWS * per_row]
            n = len(chunk) // per_row
            side.write(side.shard, d.insert_ignore_sql(table, COLUMNS, n), chunk)
            written += n
        if not bodies:
            return written


def ceiling_statements(side: Side, table: str) -> list[tuple[str, list[Any]]]:
    """The 1,000-row statements of the ceiling, prepared before the clock starts."""
    buckets, after, rows = int(side.ds.placement.buckets), b"", []
    while bodies := read_bodies(side, after):
        after = bytes(bodies[-1][0])
        rows += hand_rows(bodies, buckets)
    step = STATEMENT_ROWS * len(COLUMNS)
    d = side.dialect
    return [
        (d.insert_ignore_sql(table, COLUMNS, len(rows[i : i + step]) // 3), rows[i : i + step])
        for i in range(0, len(rows), step)
    ]


def fresh_table(side: Side, table: str) -> None:
    side.run(side.shard, f"DROP TABLE IF EXISTS {table}")
    for sql in side.dialect.create_index_table_sql(table, ["user_id"], False):
        side.run(side.shard, sql)


def count(side: Side, table: str) -> int:
    return int(side.run(side.shard, f"SELECT COUNT(*) FROM {table}")[0][0])


def bag_backfill(side: Side, duty: float = 0.0, batch: int | None = None) -> float:
    """Build the index with the Cleaner from scratch; the seconds it took."""
    ds = side.ds
    if ds.indexes().get(TABLE) is not None:
        ds.retire_index(TABLE)
        ds.drop_index(TABLE)
    cleaner = bagstore.Cleaner(ds, batch=batch, duty=duty, settle=0)
    # drop_index leaves a backfill's checkpoints behind: a new index of the
    # same name would resume from them
    cleaner.checkpoints.clear(cleaner._checkpoint_name(INDEX, None))
    assert ds.add_index(INDEX) == "building"
    t0 = time.perf_counter()
    cleaner.backfill(TABLE)
    return time.perf_counter() - t0


def flat_out(side: Side, rows: int, rounds: int) -> dict[str, list[float]]:
    """Rates (rows/s) of the three builds, round by round."""

    def bag() -> float:
        seconds = bag_backfill(side)
        got = count(side, TABLE)
        assert got == rows, f"the backfill left {got:,} index rows for {rows:,} entities"
        return rows / seconds

    def ceiling() -> float:
        fresh_table(side, "ceiling_rows")
        statements = ceiling_statements(side, "ceiling_rows")
        t0 = time.perf_counter()
        for sql, params in statements:
            side.write(side.shard, sql, params)
        rate = rows / (time.perf_counter() - t0)
        assert count(side, "ceiling_rows") == rows
        side.run(side.shard, "DROP TABLE ceiling_rows")
        return rate

    def hand() -> float:
        fresh_table(side, "hand_rows")
        t0 = time.perf_counter()
        written = by_hand(side, "hand_rows")
        rate = rows / (time.perf_counter() - t0)
        assert written == rows == count(side, "hand_rows")
        side.run(side.shard, "DROP TABLE hand_rows")
        return rate

    return alternate({"bag": bag, "ceiling": ceiling, "hand": hand}, rounds)


# -- with a writer: the Cleaner's default pace beside the database's own build ---------------


def ddl_statements(backend: str) -> tuple[list[str], list[str]]:
    """(build, undo) of the baseline's index on the JSON column."""
    if backend == "mysql":
        return (
            [
                "ALTER TABLE entities ADD COLUMN user_id VARCHAR(64) "
                "AS (JSON_VALUE(doc, '$.user_id')) VIRTUAL, ALGORITHM=INSTANT",
                "ALTER TABLE entities ADD INDEX user_id (user_id), ALGORITHM=INPLACE, LOCK=NONE",
            ],
            ["ALTER TABLE entities DROP INDEX user_id, DROP COLUMN user_id"],
        )
    return (
        [
            "ALTER TABLE entities ADD COLUMN user_id TEXT "
            "GENERATED ALWAYS AS (json_extract(doc, '$.user_id')) VIRTUAL",
            "CREATE INDEX user_id ON entities (user_id)",
        ],
        ["DROP INDEX user_id", "ALTER TABLE entities DROP COLUMN user_id"],
    )


def with_writer(side: Side, rows: int, args: argparse.Namespace) -> list[Row]:
    label = label_of(side.backend)
    ds = side.ds
    ds.retire_index(TABLE)
    ds.drop_index(TABLE)
    cleaner = bagstore.Cleaner(ds, settle=0)  # its default pace
    cleaner.checkpoints.clear(cleaner._checkpoint_name(INDEX, None))
    assert ds.add_index(INDEX) == "building"
    spec = WriterSpec("bag", side.backend, side.bag_target, args.rate, side.update_ids)
    bag = timed_beside(spec, args.before, lambda: cleaner.backfill(TABLE))
    entities = ds.count()
    assert count(side, TABLE) == entities, "the index does not hold one row per entity"
    build, undo = ddl_statements(side.backend)
    spec = WriterSpec("raw", side.backend, side.doc_target, args.rate, side.update_ids)
    raw = timed_beside(spec, args.before, lambda: [side.run(side.doc, sql) for sql in build])
    for sql in undo:
        side.run(side.doc, sql)
    errors = bag[3].error_count + raw[3].error_count
    if errors:
        log(f"  [{side.backend}] writer errors: {(bag[3].errors + raw[3].errors)[:3]}")
    (bs, bb, bd, _), (rs, rb, rd, _) = bag, raw
    b_ratio, r_ratio = bd.p99 / bb.p99, rd.p99 / rb.p99
    log(
        f"  [{side.backend}] with a writer: Cleaner {rows / bs:,.0f} rows/s, writer p99 "
        f"{bb.p99 * 1e3:.1f} -> {bd.p99 * 1e3:.1f} ms; DDL {rows / rs:,.0f} rows/s, writer p99 "
        f"{rb.p99 * 1e3:.1f} -> {rd.p99 * 1e3:.1f} ms"
    )
    what = "backfill at the default pace vs own DDL|build|rows/s"
    pace = (rows / bs, rows / rs, None)
    return writer_rows(label, args.rate, what, pace, (b_ratio, r_ratio), (bd.max, rd.max),
                       (GOAL_P99_RATIO, GOAL_STALL), errors)  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    rows, label = args.rows, label_of(backend)
    log(f"[{backend}] {rows:,} entities, one shard, {args.rounds} rounds")
    with open_side(backend) as side:
        load(side, rows)
        rates = flat_out(side, rows, args.rounds)
        what = f"backfill flat out vs {{}}, {rows:,} rows (rows/s)"
        out = [
            paired(f"{label}: " + what.format("raw-insert ceiling"), rates["bag"],
                   rates["ceiling"], GOAL_CEILING),
            paired(f"{label}: " + what.format("a Python loop by hand"), rates["bag"],
                   rates["hand"], GOAL_HAND),
        ]  # fmt: skip
        out[0].goal += " (aim 0.8x)"
        if args.rate > 0:
            out += with_writer(side, rows, args)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.cleaner``."""
    options = {
        "rows": (int, 100_000, 5_000, "entities"),
        "rounds": (int, 3, 1, "flat-out rounds"),
        "rate": (float, 500.0, 500.0, "writer puts/s (0: no writer part)"),
        "before": (float, 3.0, 0.5, "seconds of writes before"),
    }
    args = suite_args(argv, "the Cleaner's backfill beside raw SQL", options)
    title = (
        f"bench.cleaner: index backfill, bagstore vs raw SQL doing the same work (rows/s; "
        f"medians of {args.rounds} rounds; the writer rows: one run)"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
