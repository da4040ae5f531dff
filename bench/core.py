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
    Result,
    Work,
    compare,
    friendfeed_entity,
    mysql_available,
    open_env,
    print_machine,
    print_rows,
    print_table,
    result_row,
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


def run_backend(
    backend: str, *, driver: str, rounds: int, seconds: float, log: Any = None
) -> list[Result]:
    results = []
    with open_env(backend, shards=SHARDS, raw_ddl=_entities_ddl, driver=driver) as env:
        ids = prefill(env)
        for work in works(env, ids):
            t0 = time.perf_counter()
            r = judge(compare(work, env.label, rounds=rounds, seconds=seconds), backend)
            results.append(r)
            if log is not None:
                log(
                    f"  {env.label:18} {r.work:15} bagstore {r.bag_rate:>10,.0f}/s  "
                    f"raw {r.raw_rate:>10,.0f}/s  ratio {r.ratio:.2f}  "
                    f"({time.perf_counter() - t0:.1f}s)"
                )
    return results


def driver_table(by_driver: dict[str, list[Result]]) -> tuple[list[str], list[list[str]]]:
    """bagstore and raw rates under each MySQL driver, side by side."""
    drivers = list(by_driver)
    headers = ["work"]
    for drv in drivers:
        headers += [f"bagstore {drv}", f"raw {drv}"]
    if len(drivers) == 2:
        headers.append(f"bagstore {drivers[1]}/{drivers[0]}")
    rows = []
    for i, r0 in enumerate(by_driver[drivers[0]]):
        row = [r0.work]
        for drv in drivers:
            r = by_driver[drv][i]
            row += [f"{r.bag_rate:,.0f}", f"{r.raw_rate:,.0f}"]
        if len(drivers) == 2:
            a, b = by_driver[drivers[0]][i], by_driver[drivers[1]][i]
            row.append(f"{b.bag_rate / a.bag_rate:.2f}")
        rows.append(row)
    return headers, rows


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", choices=["sqlite", "mysql", "all"], default="all")
    p.add_argument(
        "--driver",
        choices=["pymysql", "mysqlclient", "all"],
        default="pymysql",
        help="MySQL driver for bagstore and the raw baseline alike (all: each in turn)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    p.add_argument("--seconds", type=float, default=None, help="length of one round")
    p.add_argument("--quick", action="store_true", help="3 short rounds: a smoke run")
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="rich")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.seconds is None:
        args.seconds = 0.06 if args.quick else 0.3
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be >= 1 and --seconds > 0")
    return args


def plan_backends(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """``(backend, driver)`` pairs to run, or None when MariaDB was asked for
    explicitly and is not reachable."""
    drivers = ["pymysql", "mysqlclient"] if args.driver == "all" else [args.driver]
    plan: list[tuple[str, str]] = []
    if args.backend in ("sqlite", "all"):
        plan.append(("sqlite", ""))
    if args.backend in ("mysql", "all"):
        if mysql_available():
            plan += [("mysql", d) for d in drivers]
        elif args.backend == "mysql":
            print("MariaDB is not reachable on 127.0.0.1:3306", file=sys.stderr)
            return None
        else:
            print("MariaDB not reachable: skipping it", file=sys.stderr)
    return plan


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.core`` and ``bagstore bench``."""
    args = parse_args(argv, "bagstore core operations beside raw DB-API")
    plan = plan_backends(args)
    if plan is None:
        return 2
    print_machine(args.format)
    print(
        f"bagstore: {SHARDS} shards; raw: one database; {args.rounds} rounds of "
        f"~{args.seconds}s per side; rates in entities/s",
        file=sys.stderr,
    )
    started = time.perf_counter()
    results: list[Result] = []
    by_driver: dict[str, list[Result]] = {}
    failed = []
    for backend, driver in plan:
        try:
            part = run_backend(
                backend,
                driver=driver or "pymysql",
                rounds=args.rounds,
                seconds=args.seconds,
                log=lambda s: print(s, file=sys.stderr),
            )
        except Exception as exc:  # report and go on with the other backends
            where = backend + (f"/{driver}" if driver else "")
            failed.append(f"{where}: {type(exc).__name__}: {exc}")
            print(f"FAILED {failed[-1]}", file=sys.stderr)
            continue
        results += part
        if backend == "mysql":
            by_driver[driver] = part
    print_rows(
        f"bench.core: bagstore ({SHARDS} shards) vs raw DB-API (one database), entities/s, "
        f"medians of {args.rounds} rounds",
        [result_row(r) for r in results],
        fmt=args.format,
    )
    if len(by_driver) > 1:
        headers, rows = driver_table(by_driver)
        print_table("MariaDB drivers (entities/s, medians)", rows, fmt=args.format, headers=headers)
    for line in failed:
        print(f"FAILED {line}")
    print(f"total {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
