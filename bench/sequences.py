"""Integer ids: a bagstore sequence (blocks of 1,000) beside Flickr's ticket server.

Run from the repository root::

    python -m bench.sequences [--backend sqlite|mysql|all] [--rounds N] [--seconds S]
                              [--threads N] [--quick] [--format rich|plain|markdown]

Works, each timed for ``--seconds`` per round, rounds interleaved, medians quoted:

- ``bagstore seq next()``: ``ds.sequence(name, block=1000).next()`` from one thread.
  Goal: >= 1,000,000 ids/s from one process.
- ``bagstore seq next(), N threads``: the same object shared by ``--threads`` threads.
- ``bagstore seq next_many(1000)``.
- ``Flickr ticket (raw)``: raw DB-API, ``REPLACE INTO Tickets64 (stub) VALUES ('a')``
  then ``SELECT LAST_INSERT_ID()`` per id (InnoDB on MariaDB; on SQLite the
  REPLACE and ``cursor.lastrowid``: SQLite has no LAST_INSERT_ID()).
- ``bagstore ticket mode``: ``open_sequence(ds, name, mode="ticket")``, one
  ``REPLACE INTO`` per id, the id read from ``cursor.lastrowid``.
- ``raw block UPDATE``: raw DB-API, one reservation statement per 1,000 ids and
  no per-id work at all: the ceiling for the database side.

"round trips / 1,000 ids" counts the statements actually sent (bagstore's are
counted by wrapping its backend's cursors).  ``ratio`` is each work's rate over
the raw Flickr ticket server's, round by round, median.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore.ids.sequence import Sequence, TicketSequence, open_sequence
from bench.common import (
    Counter,
    Row,
    count_statements,
    fresh_shards,
    in_threads,
    run_suite,
    suite_args,
)

BLOCK = 1000
GOAL = 1_000_000
FLICKR = "Flickr ticket (raw)"


@dataclass
class Env:
    label: str
    ds: bagstore.Datastore
    raw: Any  # DB-API connection, autocommit
    is_mysql: bool


@contextlib.contextmanager
def open_env(backend: str) -> Iterator[Env]:
    """A one-shard datastore (its catalog holds the sequences) and a raw
    connection to another database, both fresh; removed afterwards."""
    with fresh_shards(backend, 2, "bagbench_seq") as shards:
        ds = bagstore.Datastore(shards.urls[:1])
        raw = shards.connect(1)
        env = Env("mariadb/pymysql" if backend == "mysql" else backend, ds, raw, backend == "mysql")
        try:
            _raw_tables(env)
            yield env
        finally:
            raw.close()
            ds.close()


def _raw_tables(env: Env) -> None:
    cur = env.raw.cursor()
    if env.is_mysql:
        cur.execute(
            "CREATE TABLE Tickets64 (id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT, "
            "stub CHAR(1) NOT NULL DEFAULT '', PRIMARY KEY (id), UNIQUE KEY stub (stub)) "
            "ENGINE=InnoDB"
        )
        cur.execute(
            "CREATE TABLE sequence (name VARCHAR(50) NOT NULL PRIMARY KEY, "
            "id BIGINT UNSIGNED NOT NULL DEFAULT 0) ENGINE=InnoDB"
        )
    else:
        cur.execute(
            "CREATE TABLE Tickets64 (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "stub TEXT NOT NULL UNIQUE)"
        )
        cur.execute("CREATE TABLE sequence (name TEXT PRIMARY KEY, id INTEGER NOT NULL)")
    cur.execute("INSERT INTO sequence (name, id) VALUES ('photos', 0)")
    cur.close()


# -- the works: each step() hands out some ids and returns how many ----------------------


@dataclass
class Work:
    name: str
    step: Callable[[], int]
    statements: Callable[[], int]  # statements sent so far
    rates: list[float] = field(default_factory=list)
    ids: int = 0
    sent: int = 0
    goal: bool = False


def works(env: Env, threads: int) -> list[Work]:
    ds = env.ds
    counter = Counter()
    count_statements(ds.router.catalog_backend, counter, commits=False)

    seq = open_sequence(ds, "photos", block=BLOCK)
    assert isinstance(seq, Sequence)
    seq.next()  # creates the table and the row

    def block_step() -> int:
        nx = seq.next
        for _ in range(10_000):
            nx()
        return 10_000

    shared = open_sequence(ds, "shared", block=BLOCK)
    assert isinstance(shared, Sequence)
    shared.next()

    def threaded_step() -> int:
        per = 20_000

        def run(k: int) -> None:
            nx = shared.next
            for _ in range(per):
                nx()

        in_threads(threads, run)
        return per * threads

    many = open_sequence(ds, "many", block=BLOCK)
    assert isinstance(many, Sequence)

    def many_step() -> int:
        for _ in range(10):
            many.next_many(BLOCK)
        return 10 * BLOCK

    tickets = open_sequence(ds, "tickets", mode="ticket")
    assert isinstance(tickets, TicketSequence)
    tickets.next()

    def ticket_step() -> int:
        tickets.next()
        return 1

    cur = env.raw.cursor()
    raw_sent = [0]
    replace = "REPLACE INTO Tickets64 (stub) VALUES ('a')"
    if env.is_mysql:  # Flickr's two statements; the block: one, LAST_INSERT_ID() its answer
        ticket = [replace, "SELECT LAST_INSERT_ID()"]
        block = ["UPDATE sequence SET id = LAST_INSERT_ID(id + 1000) WHERE name = 'photos'"]
    else:  # SQLite has no LAST_INSERT_ID(): cursor.lastrowid, RETURNING
        ticket = [replace]
        block = ["UPDATE sequence SET id = id + 1000 WHERE name = 'photos' RETURNING id"]

    def raw_step(statements: list[str], ids: int) -> Callable[[], int]:
        def step() -> int:
            for sql in statements:
                cur.execute(sql)
                cur.fetchall()
            _ = cur.lastrowid
            raw_sent[0] += len(statements)
            return ids

        return step

    flickr_step, update_step = raw_step(ticket, 1), raw_step(block, BLOCK)

    def bag() -> int:
        return counter.db

    def raw() -> int:
        return raw_sent[0]

    return [
        Work("bagstore seq next()", block_step, bag, goal=True),
        Work(f"bagstore seq next(), {threads} threads", threaded_step, bag),
        Work("bagstore seq next_many(1000)", many_step, bag),
        Work(FLICKR, flickr_step, raw),
        Work("bagstore ticket mode", ticket_step, bag),
        Work("raw block UPDATE (ceiling)", update_step, raw),
    ]


def _round(work: Work, seconds: float) -> None:
    sent = work.statements()
    ids = 0
    clock = time.perf_counter
    start = clock()
    while True:
        ids += work.step()
        elapsed = clock() - start
        if elapsed >= seconds:
            break
    work.rates.append(ids / elapsed)
    work.ids += ids
    work.sent += work.statements() - sent


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    rounds, seconds, threads = args.rounds, args.seconds, max(1, args.threads)
    with open_env(backend) as env:
        ws = works(env, threads)
        for w in ws:  # warm-up
            _round(w, seconds / 4)
            w.rates.clear()
            w.ids = w.sent = 0
        for i in range(rounds):
            for w in ws if i % 2 == 0 else reversed(ws):
                _round(w, seconds)
        flickr = next(w for w in ws if w.name == FLICKR)
        rows = []
        for w in ws:
            rate = statistics.median(w.rates)
            ratio = statistics.median(a / b for a, b in zip(w.rates, flickr.rates, strict=True))
            per_k = 1000 * w.sent / w.ids if w.ids else 0.0
            trips = f"{per_k:,.2f}" if per_k < 10 else f"{per_k:,.0f}"
            goal = f">= {GOAL:,}/s" if w.goal else ""
            met = (rate >= GOAL) if w.goal else None
            rows.append(
                Row(
                    f"{env.label}: {w.name} ({trips} round trips / 1,000 ids)",
                    rate,
                    statistics.median(flickr.rates),
                    ratio,
                    goal,
                    met,
                )
            )
            print(
                f"  {env.label:16} {w.name:34} {rate:>12,.0f} ids/s  "
                f"{trips:>8} round trips/1,000 ids  x{ratio:,.1f}",
                file=sys.stderr,
            )
        return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.sequences``."""
    options = {
        "rounds": (int, 5, 3, "interleaved rounds"),
        "seconds": (float, 0.5, 0.1, "one round"),
        "threads": (int, 4, 4, "threads sharing one sequence"),
    }
    args = suite_args(argv, "bagstore sequences beside Flickr's ticket server", options)
    title = (
        f"bench.sequences: ids/s (raw column: Flickr's ticket server by hand), medians of "
        f"{args.rounds} rounds of {args.seconds}s"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
