"""The change feed: what recording costs a put, reading speed, end-to-end lag.

Run from the repository root::

    python -m bench.changes [--backend sqlite|mysql|all] [--quick] [--format ...]

Metrics (each backend; four shards, 64 buckets):

- ``put, feed on vs off``: ``ds.put`` of a ~300-byte entity into a kind whose
  feed is on (with bodies, and without), beside the same puts into a kind
  whose feed is off, rounds interleaved.  Goal: the feed costs <= 10%
  (ratio >= 0.90).
- ``changes read``: ``ds.changes(since=cursor, limit=1000)`` page after page
  over 20,000 changes with bodies (decoded), beside raw DB-API reading the
  same rows by position (one keyset ``SELECT`` of 1,000 rows per page and
  shard, bodies decoded the same way).  Goal: >= 0.8x.
- ``4 writers of one bucket``: four threads putting entities of one shard
  key (one bucket), feed on vs off: with the feed on, writers of one bucket
  wait for each other's commit (its position row).  Reported.
- ``lag p99 at 500 puts/s``: a writer thread puts 500 entities a second while
  a follower reads ``ds.changes`` every 10 ms; the time from each put's
  stamp to its change being read.  Reported (no raw counterpart).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import bagstore
from bagstore import codec
from bench.common import (
    Row,
    Work,
    add_common_args,
    compare,
    friendfeed_entity,
    mysql_connect,
    mysql_url,
    plan,
    print_machine,
    print_rows,
    temp_databases,
)

SHARDS = 4


@contextlib.contextmanager
def open_store(backend: str) -> Iterator[tuple[list[str], Any]]:
    """Shard URLs of a fresh store and a function giving raw connections to shard i."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="bagbench_feed_") as root:
            urls = [f"sqlite:///{root}/s{i}.db" for i in range(SHARDS)]

            def raw_sqlite(i: int) -> Any:
                import sqlite3

                conn = sqlite3.connect(f"{root}/s{i}.db", isolation_level=None)
                conn.execute("PRAGMA journal_mode=WAL")
                return conn

            yield urls, raw_sqlite
        return
    with temp_databases(SHARDS, "bagbench_feed") as names:

        def raw_mysql(i: int) -> Any:
            conn = mysql_connect()
            conn.select_db(names[i])
            return conn

        yield [mysql_url(n) for n in names], raw_mysql


def put_cost(backend: str, urls: list[str], rounds: int, seconds: float) -> list[Row]:
    rows: list[Row] = []
    off = bagstore.Datastore(urls, buckets=64, kind="plain")
    for bodies in (True, False):
        kind = "fed_bodies" if bodies else "fed_ids"
        on = bagstore.Datastore(urls, buckets=64, kind=kind)
        on.feed.enable(bodies=bodies)
        work = Work(
            f"put, feed on ({'with' if bodies else 'without'} bodies) vs off",
            bag=on.put,
            raw=off.put,
            inputs=lambda n, side: [friendfeed_entity() for _ in range(n)],
        )
        r = compare(work, backend, rounds=rounds, seconds=seconds)
        rows.append(
            Row(
                f"{backend}: {work.name}, puts",
                r.bag_rate,
                r.raw_rate,
                r.ratio,
                ">= 0.90x",
                r.ratio >= 0.9,
            )
        )
        on.close()
    off.close()
    return rows


def read_speed(backend: str, urls: list[str], raw_of: Any, total: int, rounds: int) -> Row:
    ds = bagstore.Datastore(urls, buckets=64, kind="readme")
    ds.feed.enable(bodies=True)
    for start in range(0, total, 500):
        ds.put_many([friendfeed_entity() for _ in range(min(500, total - start))])
    conns = [raw_of(i) for i in range(SHARDS)]
    p = "?" if backend == "sqlite" else "%s"

    def bag_all() -> int:
        n, since = 0, None
        while True:
            page = ds.changes(since=since, limit=1000)
            n += len(page)
            since = page.cursor
            if not page:
                return n

    def raw_all() -> int:
        n = 0
        for conn in conns:
            after = (-1, 0)
            while True:
                cur = conn.cursor()
                cur.execute(
                    "SELECT bucket, pos, id, op, version, updated, body FROM bagstore_changes "
                    f"WHERE kind = {p} AND (bucket > {p} OR (bucket = {p} AND pos > {p})) "
                    "ORDER BY bucket, pos LIMIT 1000",
                    ["readme", after[0], after[0], after[1]],
                )
                got = cur.fetchall()
                cur.close()
                for r in got:
                    codec.decode(bytes(r[6]))
                n += len(got)
                if len(got) < 1000:
                    break
                after = (int(got[-1][0]), int(got[-1][1]))
        return n

    bag_rates: list[float] = []
    raw_rates: list[float] = []
    for i in range(rounds):
        for side in ("bag", "raw") if i % 2 == 0 else ("raw", "bag"):
            t0 = time.perf_counter()
            n = bag_all() if side == "bag" else raw_all()
            rate = n / (time.perf_counter() - t0)
            assert n == total, (side, n, total)
            (bag_rates if side == "bag" else raw_rates).append(rate)
    for conn in conns:
        conn.close()
    ds.close()
    ratio = statistics.median(b / r for b, r in zip(bag_rates, raw_rates, strict=True))
    return Row(
        f"{backend}: changes read (pages of 1,000, bodies), changes",
        statistics.median(bag_rates),
        statistics.median(raw_rates),
        ratio,
        ">= 0.80x",
        ratio >= 0.8,
    )


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
    on = bagstore.Datastore(urls, buckets=64, kind="hot_on", shard_key="user")
    on.feed.enable()
    off = bagstore.Datastore(urls, buckets=64, kind="hot_off", shard_key="user")
    bag: list[float] = []
    raw: list[float] = []
    for i in range(rounds):
        for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
            (bag if side == "on" else raw).append(_writers(on if side == "on" else off, 4, seconds))
    on.close()
    off.close()
    ratio = statistics.median(b / r for b, r in zip(bag, raw, strict=True))
    return Row(
        f"{backend}: 4 writers of one bucket, feed on vs off, puts",
        statistics.median(bag),
        statistics.median(raw),
        ratio,
        "report",
        None,
    )


def lag(backend: str, urls: list[str], seconds: float) -> Row:
    ds = bagstore.Datastore(urls, buckets=64, kind="lagged")
    ds.feed.enable()
    reader = bagstore.Datastore(urls, buckets=64, kind="lagged")
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
    return Row(
        f"{backend}: lag p99 at 500 puts/s ({len(lags)} changes)",
        p99,
        None,
        None,
        "report",
        None,
        unit=" ms",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    backends = plan(args.backend)
    if backends is None:
        return 2
    rounds, seconds = (3, 0.3) if args.quick else (args.rounds, args.seconds)
    total = 4000 if args.quick else 20_000
    print_machine(args.format)
    rows: list[Row] = []
    for backend in backends:
        with open_store(backend) as (urls, raw_of):
            rows += put_cost(backend, urls, rounds, seconds)
            rows.append(one_bucket(backend, urls, rounds, seconds))
            rows.append(read_speed(backend, urls, raw_of, total, rounds))
            rows.append(lag(backend, urls, 2.0 if args.quick else 10.0))
    print_rows(
        f"bench.changes: the change feed ({SHARDS} shards), medians of {rounds} rounds",
        rows,
        fmt=args.format,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
