"""Core operations, bagstore beside raw DB-API: put, put_many, get, get_many.

Run from the repository root::

    python -m bench.core [--backend sqlite|mysql|all] [--driver pymysql|mysqlclient|all]
                         [--rounds N] [--quick] [--format rich|plain|markdown]

bagstore runs over 4 shards (SQLite files in a temp directory, or freshly
created MariaDB databases on 127.0.0.1:3306, dropped afterwards); the raw
baseline runs on ONE database holding the same entities table (the DDL is
bagstore's own, from ``Dialect.create_entities_sql``), sends the same SQL
(``Dialect.upsert_entities_sql`` / ``select_bodies_sql``) and encodes and
decodes with ``bagstore.codec``: raw SQL to one database is the floor.

- ``put``: one entity, no indexes.  Raw: the same upsert, autocommit.  Target >= 0.7x raw.
- ``put_many`` of 500.  Raw: one 500-row upsert per call.  Target on MariaDB >= 20,000/s.
- ``get``.  Raw: ``SELECT id, body ... WHERE id = ?`` + decode.
  Targets >= 0.8x raw; on SQLite >= 50,000/s.
- ``get_many`` of 50.  Raw: one ``SELECT id, body ... IN (...)`` on one database + decode.

Rates are entities per second; figures are medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from bagstore import codec
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    Env,
    Option,
    Result,
    Row,
    Work,
    compare,
    friendfeed_entity,
    open_env,
    result_row,
    run_suite,
    suite_args,
)

KIND = "entities"
SHARDS = 4
BATCH = 500
MANY = 50
PREFILL = 2000


def _buckets(env: Env) -> int:
    return int(env.ds.placement.buckets)


def _entities_ddl(dialect: Any) -> list[str]:
    return list(dialect.create_entities_sql(KIND))


def raw_put_fn(env: Env, rows: int) -> Any:
    """The raw upsert of ``rows`` entities per call (bagstore's own statement)."""
    sql = env.dialect.upsert_entities_sql(KIND, rows)
    cur = env.cursor()
    buckets = _buckets(env)

    def put(entities: Sequence[dict[str, Any]]) -> None:
        now = time.time_ns() // 1000
        params: list[Any] = []
        for e in entities:
            eid = e["id"]
            params += (eid, bucket_of(eid, buckets), now, codec.encode(e))
        cur.execute(sql, params)

    return put


def prefill(env: Env, n: int = PREFILL) -> list[bytes]:
    """Store the same ``n`` entities through bagstore and raw; return their ids."""
    entities = [friendfeed_entity() for _ in range(n)]
    raw_put = raw_put_fn(env, BATCH)
    for start in range(0, n, BATCH):
        chunk = entities[start : start + BATCH]
        env.ds.put_many(chunk)
        if len(chunk) == BATCH:
            raw_put(chunk)
        else:
            raw_put_fn(env, len(chunk))(chunk)
    return [e["id"] for e in entities]


def works(env: Env, ids: list[bytes]) -> list[Work]:
    ds, d = env.ds, env.dialect
    raw_one = raw_put_fn(env, 1)
    raw_batch = raw_put_fn(env, BATCH)
    # the columns bagstore reads when no cache needs the stamps: id and body
    sel_one = d.select_bodies_sql(KIND, 1, stamps=False)
    sel_many = d.select_bodies_sql(KIND, MANY, stamps=False)
    cur = env.cursor()

    def raw_get(eid: bytes) -> dict[str, Any] | None:
        cur.execute(sel_one, (eid,))
        row = cur.fetchone()
        return codec.decode(row[1]) if row is not None else None

    def raw_get_many(wanted: list[bytes]) -> list[dict[str, Any] | None]:
        cur.execute(sel_many, wanted)
        found = {bytes(r[0]): r[1] for r in cur.fetchall()}
        return [codec.decode(found[i]) if i in found else None for i in wanted]

    rng = random.Random(7)

    def new_entities(n: int, side: str) -> list[dict[str, Any]]:
        return [friendfeed_entity() for _ in range(n)]

    def batches(n: int, side: str) -> list[list[dict[str, Any]]]:
        return [[friendfeed_entity() for _ in range(BATCH)] for _ in range(n)]

    def some_ids(n: int, side: str) -> list[bytes]:
        return [rng.choice(ids) for _ in range(n)]

    def id_lists(n: int, side: str) -> list[list[bytes]]:
        return [rng.sample(ids, MANY) for _ in range(n)]

    return [
        Work("put", ds.put, lambda e: raw_one([e]), new_entities),
        Work(f"put_many x{BATCH}", ds.put_many, raw_batch, batches, units=BATCH),
        Work("get", ds.get, raw_get, some_ids),
        Work(f"get_many x{MANY}", ds.get_many, raw_get_many, id_lists, units=MANY),
    ]


def judge(r: Result, backend: str) -> Result:
    """Attach the target of each work and whether it was met."""
    mysql = backend == "mysql"
    if r.work == "put":
        r.target, r.met = ">= 0.7x raw", r.ratio >= 0.7
    elif r.work.startswith("put_many"):
        if mysql:
            r.target, r.met = ">= 20,000/s", r.bag_rate >= 20_000
    elif r.work == "get":
        if mysql:
            r.target, r.met = ">= 0.8x raw", r.ratio >= 0.8
        else:
            r.target = ">= 0.8x raw, >= 50,000/s"
            r.met = r.ratio >= 0.8 and r.bag_rate >= 50_000
    return r


#: the options of bench.core and bench.indexes
OPTIONS: dict[str, Option] = {
    "driver": (["pymysql", "mysqlclient", "all"], "pymysql", "pymysql", "MySQL driver, both sides"),
    "rounds": (int, 7, 3, "interleaved rounds"),
    "seconds": (float, 0.3, 0.06, "length of one round"),
}


def drivers(backend: str, args: argparse.Namespace) -> list[str]:
    if backend == "sqlite":
        return ["pymysql"]  # unused
    return ["pymysql", "mysqlclient"] if args.driver == "all" else [args.driver]


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    rows = []
    for driver in drivers(backend, args):
        with open_env(backend, shards=SHARDS, raw_ddl=_entities_ddl, driver=driver) as env:
            ids = prefill(env)
            for work in works(env, ids):
                r = compare(work, env.label, rounds=args.rounds, seconds=args.seconds)
                rows.append(result_row(judge(r, backend)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.core`` and ``bagstore bench``."""
    args = suite_args(argv, "bagstore core operations beside raw DB-API", OPTIONS)
    title = (
        f"bench.core: bagstore ({SHARDS} shards) vs raw DB-API (one database), entities/s, "
        f"medians of {args.rounds} rounds of ~{args.seconds}s a side"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
