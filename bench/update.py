"""Read-modify-write, bagstore beside raw DB-API: ``ds.update(id, fn)``.

Run from the repository root::

    python -m bench update [--backend sqlite|mysql|all] [--rounds N] [--quick]
                           [--format rich|plain|markdown]

bagstore: a store of ONE shard, no index; ``ds.update(id, fn)`` where ``fn``
adds one to a counter of a ~300-byte entity.  Raw, by hand on one database
holding the same entities table (bagstore's DDL): ``SELECT body, version
... WHERE id = ?``, decode, the same ``fn``, encode, ``UPDATE ... SET body = ?,
version = version + 1 WHERE id = ? AND version = ?``, and when that changes
no row, the same again after the same jittered pause as bagstore's.

- 1 writer: one thread updating its own entities.
- 4 contending writers: 4 threads (bagstore: one Datastore shared by them;
  raw: a connection each) updating the SAME 4 entities, each thread the next
  one in turn, so that they keep running into each other.

Goal (issue 24): >= 0.7x raw.  Rates are successful updates per second; the
conflicts each side retried are shown beside the metric.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bagstore import codec
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    Env,
    Result,
    Row,
    Sample,
    friendfeed_entity,
    in_threads,
    log,
    open_env,
    raw_connector,
    result_row,
    run_suite,
    suite_args,
)

KIND = "entities"
WRITERS = 4
GOAL = 0.7


def bump(entity: dict[str, Any] | None) -> dict[str, Any]:
    """The read-modify-write of both sides: one more on the counter."""
    assert entity is not None
    return {**entity, "n": entity.get("n", 0) + 1}


class RawUpdate:
    """The hand-written read-modify-write on one connection."""

    def __init__(self, env: Env, conn: Any) -> None:
        d = env.dialect
        self.conn = conn
        self.cur = conn.cursor()
        self.select = f"SELECT body, version FROM {d.q(KIND)} WHERE id = {d.param}"
        self.update_sql = (
            f"UPDATE {d.q(KIND)} SET body = {d.param}, version = version + 1 "
            f"WHERE id = {d.param} AND version = {d.param}"
        )
        self.conflicts = 0

    def update(self, entity_id: bytes) -> dict[str, Any]:
        for attempt in range(1000):
            self.cur.execute(self.select, [entity_id])
            body, version = self.cur.fetchone()
            new = bump(codec.decode(bytes(body)))
            self.cur.execute(self.update_sql, [codec.encode(new), entity_id, version])
            if self.cur.rowcount == 1:
                return new
            self.conflicts += 1
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
        raise RuntimeError("raw update: no luck in 1000 tries")


def _seed(env: Env, n: int) -> list[bytes]:
    """``n`` entities stored on both sides (same ids, same bodies)."""
    ds, d = env.ds, env.dialect
    buckets = int(ds.placement.buckets)
    entities = [{**friendfeed_entity(), "n": 0} for _ in range(n)]
    ds.put_many(entities)
    cur = env.raw.cursor()
    sql = d.upsert_entities_sql(KIND, 1)
    for e in entities:
        cur.execute(sql, [e["id"], bucket_of(e["id"], buckets), 0, codec.encode(e)])
    cur.close()
    return [e["id"] for e in entities]


def measure(env: Env, writers: int, *, rounds: int, per_thread: int) -> Result:
    """``writers`` threads each making ``per_thread`` updates, on both sides;
    with one writer each its own entities, with more all on the same ones."""
    ids = _seed(env, max(writers, 4))
    connect = raw_connector(env)
    raws = [RawUpdate(env, connect()) for _ in range(writers)]
    conflicts = {"bag": 0}
    ds = env.ds
    fn_calls = [0]
    lock = threading.Lock()

    def counted(entity: dict[str, Any] | None) -> dict[str, Any]:
        with lock:
            fn_calls[0] += 1
        return bump(entity)

    def bag_update(entity_id: bytes) -> object:
        return ds.update(entity_id, counted, retries=1000)

    def run(fns: list[Callable[[bytes], object]], side: str) -> Sample:
        done = [0] * len(fns)
        before = fn_calls[0]

        def one(k: int) -> None:
            for j in range(per_thread):
                fns[k](ids[(k + j) % len(ids)] if writers > 1 else ids[j % len(ids)])
                done[k] += 1

        elapsed = in_threads(len(fns), one)
        if side == "bag":
            conflicts["bag"] += fn_calls[0] - before - sum(done)
        return Sample(sum(done) / elapsed, elapsed / per_thread)

    bag: list[Sample] = []
    raw: list[Sample] = []
    try:
        run([bag_update] * writers, "bag")  # warm-up: connections, statements
        run([r.update for r in raws], "raw")
        conflicts["bag"] = 0
        for r in raws:
            r.conflicts = 0
        for i in range(rounds):
            order: list[tuple[list[Callable[[bytes], object]], list[Sample], str]] = [
                ([bag_update] * writers, bag, "bag"),
                ([r.update for r in raws], raw, "raw"),
            ]
            for fns, out, side in order if i % 2 == 0 else reversed(order):
                out.append(run(fns, side))
    finally:
        for r in raws:
            r.conn.close()
    label = "1 writer" if writers == 1 else f"{writers} contending writers"
    result = Result(f"update(id, fn), {label}", env.label, bag, raw)
    result.target, result.met = f">= {GOAL}x raw", result.ratio >= GOAL
    result.note = (
        f"conflicts retried: bagstore {conflicts['bag']}, raw {sum(r.conflicts for r in raws)}"
    )
    # the counters add up on both sides: every update counted once
    want = per_thread * writers * (rounds + 1)
    stored = env.ds.fetch_many(ids)
    cur = env.raw.cursor()
    select = f"SELECT body FROM {env.dialect.q(KIND)} WHERE id = {env.dialect.param}"
    raw_total = 0
    for entity_id in ids:
        cur.execute(select, [entity_id])
        raw_total += codec.decode(bytes(cur.fetchone()[0]))["n"]
    cur.close()
    assert sum(codec.decode(stored[e].body)["n"] for e in ids) == want == raw_total
    return result


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    rows = []
    for writers in (1, WRITERS):
        with open_env(
            backend, shards=1, raw_ddl=lambda d: list(d.create_entities_sql(KIND))
        ) as env:
            r = measure(env, writers, rounds=args.rounds, per_thread=args.per_thread)
        log(f"  {r.backend:18} {r.work:40} ({r.note})")
        rows.append(result_row(r))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench update``."""
    options = {
        "rounds": (int, 5, 3, "interleaved rounds"),
        "per-thread": (int, 500, 150, "updates per thread and round"),
    }
    args = suite_args(argv, "ds.update(id, fn) beside raw SELECT + UPDATE", options)
    title = (
        f"bench.update: ds.update(id, fn) (1 shard) vs raw SELECT + conditional UPDATE "
        f"(one database), updates/s, medians of {args.rounds} rounds"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
