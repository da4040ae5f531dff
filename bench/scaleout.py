"""Scale-out while serving: bucket moves with a live writer, beside plain SQL doing the same copy.

Run from the repository root::

    python -m bench.scaleout [--backend mysql|sqlite|all] [--rows N] [--rounds N]
                             [--rate R] [--before S] [--quick] [--format rich|plain|markdown]

bagstore: a 2-shard store (2 MariaDB databases on 127.0.0.1:3306, or 2 SQLite
files) with ``Index("index_user_id", ["user_id"], shard_on="user_id")``,
loaded with ``--rows`` FriendFeed-style entities (default 100,000;
``--quick``: 2,000 in 64 buckets; 20 per user) by ``put_many``.  Round 1:
``ds.add_shard(url)`` and ``ds.rebalance(grace=0)``, which moves a third of
the buckets to it; later rounds move the same buckets back, then out again
(``ds.move_buckets(..., grace=0)``), so that every round moves the same rows.
The Mover runs at its defaults (small steps, each followed by a pause half as
long).

While each round runs, a separate process puts entities at ``--rate`` per
second (default 500; 90% rewrites of loaded entities), routed by its own,
soon stale, placement; each write's latency is recorded.  ``--before``
seconds of writes before the move give the "before" figures.

Baseline, in the same round and with the same writer: plain SQL copying the
rows of the buckets that round moved (entities and index rows, read where
they are now) into an empty database with the same tables, through Python,
in steps of the Mover's size each followed by the Mover's pause, then
deleting them there the same way: the work of a move with no catalog,
freeze or fencing.

After each round every entity is there once and the index holds one row per
entity (else the bench fails).  Goals (the scale-out issue): writer p99
during <= 2x before; no write stalled over 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY
from bench.common import (
    Row,
    fresh_shards,
    friendfeed_entity,
    label_of,
    log,
    rows_of,
    run_suite,
    suite_args,
)
from bench.live import KIND, Lat, WriterSpec, timed_beside, writer_rows

TABLE = "index_user_id"
USER_INDEX = bagstore.Index(table=TABLE, properties=["user_id"], shard_on="user_id")
PER_USER = 20
LOAD_BATCH = 5000
GOAL_STALL = 1.0
GOAL_P99_RATIO = 2.0
TABLES = {
    KIND: ("bucket", ("id", "bucket", "updated", "version", "body")),
    TABLE: ("bagstore_bucket", ("user_id", "entity_id", "bagstore_bucket")),
}


@dataclass
class Side:
    backend: str
    ds: Any
    bag_target: Any  # for the writer: shard URLs
    new_url: str  # the shard to add
    connect: Any  # connect(shard number or None for the baseline's database) -> DB-API
    update_ids: list[bytes] = field(default_factory=list)
    expected: int = 0  # entities there should be


@contextlib.contextmanager
def open_side(backend: str, buckets: int | None = None) -> Iterator[Side]:
    """Shards 0 and 1 the store's, 2 the one to add, 3 the baseline's copy target."""
    from bagstore.backends.mysql import MySQLDialect
    from bagstore.backends.sqlite import SQLiteDialect

    with fresh_shards(backend, 4, "bst_bench_out") as shards:
        ds = bagstore.Datastore(shards.urls[:2], indexes=[USER_INDEX], buckets=buckets)

        def connect(shard: int | None) -> Any:
            return shards.connect(3 if shard is None else shard)

        dialect: Any = MySQLDialect() if backend == "mysql" else SQLiteDialect()
        raw = connect(None)
        try:
            for sql in [
                *dialect.create_entities_sql(KIND),
                *dialect.create_index_table_sql(TABLE, ["user_id"], False),
            ]:
                rows_of(raw, sql)
        finally:
            raw.close()
        try:
            yield Side(backend, ds, shards.urls[:2], shards.urls[2], connect)
        finally:
            ds.close()


def load(side: Side, rows: int) -> None:
    t0 = time.monotonic()
    for done in range(0, rows, LOAD_BATCH):
        n = min(LOAD_BATCH, rows - done)
        users = [os.urandom(16) for _ in range(max(1, n // PER_USER))]
        entities = [friendfeed_entity(user_id=users[i % len(users)]) for i in range(n)]
        side.ds.put_many(entities)
        if len(side.update_ids) < 5000:
            side.update_ids += [e["id"] for e in entities[::40]]
    side.expected = rows
    log(f"  [{side.backend}] loaded {rows:,} entities in {time.monotonic() - t0:.1f}s")


def raw_copy(side: Side, groups: dict[int, list[int]]) -> int:
    """Plain SQL doing a move's copy: the rows of ``groups`` ({shard: buckets})
    read from where they are, written into the baseline's empty database in
    the Mover's steps and pauses, then deleted there the same way.  Returns
    the entities copied."""
    p = "%s" if side.backend == "mysql" else "?"
    target = side.connect(None)
    steps: list[tuple[str, list[Any]]] = []
    undo: list[tuple[str, list[Any]]] = []
    entities = 0
    try:
        for shard, buckets in groups.items():
            source = side.connect(shard)
            try:
                for table, (bucket_col, cols) in TABLES.items():
                    marks = ", ".join([p] * len(buckets))
                    got = rows_of(
                        source,
                        f"SELECT {', '.join(cols)} FROM {table} WHERE {bucket_col} IN ({marks})",
                        buckets,
                    )
                    entities += len(got) if table == KIND else 0
                    one = "(" + ", ".join([p] * len(cols)) + ")"
                    for i in range(0, len(got), DEFAULT_BATCH):
                        part = got[i : i + DEFAULT_BATCH]
                        steps.append(
                            (
                                f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                                + ", ".join([one] * len(part)),
                                [v for r in part for v in r],
                            )
                        )
                        key = "id" if table == KIND else "entity_id"
                        at = 0 if table == KIND else 1
                        marks = ", ".join([p] * len(part))
                        undo.append(
                            (f"DELETE FROM {table} WHERE {key} IN ({marks})", [r[at] for r in part])
                        )
            finally:
                source.close()
        for sql, params in steps + undo:
            started = time.monotonic()
            rows_of(target, sql, params)  # autocommit: one transaction a step
            time.sleep(DEFAULT_DUTY * (time.monotonic() - started))
    finally:
        target.close()
    return entities


@dataclass
class Round:
    label: str
    moved: int  # entities
    seconds: float
    before: Lat
    during: Lat
    errors: int
    raw_moved: int
    raw_seconds: float
    raw_before: Lat
    raw_during: Lat


def _by_shard(buckets: list[int], shard_of: Any) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for b in buckets:
        out.setdefault(shard_of(b), []).append(b)
    return out


def one_round(
    side: Side, i: int, moved: list[int], home: list[int], args: argparse.Namespace
) -> tuple[Round, list[int]]:
    """Round 0: add the shard and rebalance; odd rounds: the moved buckets go
    home; even rounds: out to the new shard again.  Then plain SQL copies the
    same buckets' rows with the same writer running."""
    ds = side.ds
    spec = WriterSpec(
        "bag", side.backend, side.bag_target, args.rate, side.update_ids, update_share=0.9
    )
    stats: list[Any] = []

    def move() -> None:
        if i == 0:
            ds.add_shard(side.new_url)
            stats.append(ds.rebalance(grace=0))
        elif i % 2:
            for target, buckets in _by_shard(moved, lambda b: home[b]).items():
                stats.append(ds.move_buckets(buckets, target, grace=0))
        else:
            stats.append(ds.move_buckets(moved, len(ds.router.backends) - 1, grace=0))

    label = ["add_shard + rebalance", "move_buckets back", "move_buckets out"][min(i, 2 - i % 2)]
    seconds, before, during, writes = timed_beside(spec, args.before, move)
    side.expected += writes.new_ok
    placement = ds.refresh_placement(force=True)
    if i == 0:
        moved = [b for b, s in enumerate(placement.shard_of_bucket) if s != home[b]]
    entities = ds.count()
    index_rows = sum(ds.router.on_all(lambda b: b.count(TABLE)))
    if not entities == index_rows == side.expected:
        raise AssertionError(
            f"after {label}: {entities:,} entities for {side.expected:,}, {index_rows:,} index rows"
        )
    groups = _by_shard(moved, lambda b: placement.shard_of_bucket[b])
    got: list[int] = []
    raw_s, raw_before, raw_during, raw_writes = timed_beside(
        spec, args.before, lambda: got.append(raw_copy(side, groups))
    )
    side.expected += raw_writes.new_ok
    r = Round(
        label,
        sum(s.entities for s in stats),
        seconds,
        before,
        during,
        writes.error_count,
        got[0],
        raw_s,
        raw_before,
        raw_during,
    )
    log(
        f"  [{side.backend}] round {i + 1} {label}: {r.moved:,} entities in {seconds:.1f}s, "
        f"writer p99 {before.p99 * 1e3:.1f} -> {during.p99 * 1e3:.1f} ms, max "
        f"{during.max * 1e3:.0f} ms, {writes.error_count} errors; raw copy {r.raw_moved:,} in "
        f"{raw_s:.1f}s, p99 {raw_before.p99 * 1e3:.1f} -> {raw_during.p99 * 1e3:.1f} ms"
        + (f"; first error: {writes.errors[0]}" if writes.errors else "")
    )
    return r, moved


def rows_for(label: str, rounds: list[Round], rate: float) -> list[Row]:
    def med(xs: Any) -> float:
        return float(statistics.median(list(xs)))

    b_ratio = med(r.during.p99 / r.before.p99 for r in rounds)
    r_ratio = med(r.raw_during.p99 / r.raw_before.p99 for r in rounds)
    worst, raw_worst = max(r.during.max for r in rounds), max(r.raw_during.max for r in rounds)
    errors = sum(r.errors for r in rounds)
    pace = (
        med(r.moved / r.seconds for r in rounds),
        med(r.raw_moved / r.raw_seconds for r in rounds),
        med((r.moved / r.seconds) / (r.raw_moved / r.raw_seconds) for r in rounds),
    )
    what = "move at the default pace vs plain SQL copy|move|entities/s"
    return writer_rows(label, rate, what, pace, (b_ratio, r_ratio), (worst, raw_worst),
                       (GOAL_P99_RATIO, GOAL_STALL), errors)  # fmt: skip


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    log(f"[{backend}] {args.rows:,} entities on 2 shards, one index; writer {args.rate:,.0f}/s")
    rounds: list[Round] = []
    with open_side(backend, args.buckets) as side:
        load(side, args.rows)
        home = list(side.ds.refresh_placement(force=True).shard_of_bucket)
        moved: list[int] = []
        for i in range(args.rounds):
            r, moved = one_round(side, i, moved, home, args)
            rounds.append(r)
    return rows_for(label_of(backend), rounds, args.rate)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.scaleout``."""
    options = {
        "rows": (int, 100_000, 2_000, "entities"),
        "rounds": (int, 3, 1, "move rounds"),
        "rate": (float, 500.0, 500.0, "writer puts per second"),
        "before": (float, 3.0, 0.5, "seconds of writes before"),
        # --quick: 64 buckets, since a move's time goes by bucket as much as by row
        "buckets": (int, None, 64, "the store's buckets (None: bagstore's default)"),
    }
    args = suite_args(argv, "bucket moves with a live writer, beside plain SQL", options)
    title = (
        f"bench.scaleout: bucket moves with a live writer vs plain SQL doing the copy at the "
        f"same pace (medians of {args.rounds} rounds; longest write: the worst round)"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
