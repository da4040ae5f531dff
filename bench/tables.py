"""Typed tables: ``Table.load(user_id, pk)`` beside ``ds.get(id)`` and raw SQL.

Run from the repository root::

    python -m bench.tables [--backend sqlite|mysql|all] [--rounds N] [--seconds S]
                           [--quick] [--format rich|plain|markdown]

A kind placed by ``user_id`` over 4 shards (SQLite files, or 4 databases on
the MariaDB server) holds ``--rows`` photos (a typed row of 6 fields, ~150
bytes).  Works, on the same random keys, rounds interleaved, medians quoted:

- ``typed load vs ds.get``: ``photos.load(user_id, photo_id)`` (computes the id
  and the bucket, one statement on one shard, a typed row with its version)
  against ``ds.get(id)`` of the same entity (the dict API, the id's bucket
  from the lookup rows cached in the process).  Goal: >= 0.9x.
- ``typed load vs raw SQL``: against raw DB-API on the shard that holds the
  row: ``SELECT body, version FROM photos WHERE id = ?`` and the codec's
  decode (the work bagstore cannot avoid).  For information.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

import bagstore
from bagstore import codec
from bagstore.tables import id_of_pk
from bench.common import Row, Work, compare, fresh_shards, paired, run_suite, suite_args

GOAL = 0.9


class Photo(bagstore.Model, kind="photos", shard_key="user_id"):
    photo_id: int = bagstore.auto_id()
    user_id: int
    title: str = ""
    posted_date: date | None = None
    tags: list[str] = []
    views: int = 0


@contextmanager
def _tables(backend: str) -> Iterator[tuple[bagstore.Table[Photo], Callable[[bytes], Any]]]:
    """The table, and a raw reader ``id -> (body, version)`` of the shard holding it."""
    with fresh_shards(backend, 4, "bench_tables") as shards:
        table = Photo.open(shards.urls)
        conns = [shards.connect(i) for i in range(4)]
        try:
            yield table, _raw_reader(table, conns, "%s" if backend == "mysql" else "?")
        finally:
            table.close()
            for c in conns:
                c.close()


def _raw_reader(
    table: bagstore.Table[Photo], conns: list[Any], param: str
) -> Callable[[bytes], Any]:
    ds = table.ds
    sql = f"SELECT body, version FROM photos WHERE id = {param}"
    cursors = [c.cursor() for c in conns]

    def read(entity_id: bytes) -> Any:
        bucket = ds.bucket_of_id(entity_id)
        assert bucket is not None
        cur = cursors[ds.placement.shard_of_bucket[bucket]]
        cur.execute(sql, (entity_id,))
        body, version = cur.fetchone()
        return codec.decode(body), version

    return read


def run(backend: str, rows: int, rounds: int, seconds: float) -> list[Row]:
    out: list[Row] = []
    with _tables(backend) as (photos, raw):
        rng = random.Random(7)
        made = [
            photos.insert(
                Photo(
                    user_id=rng.randrange(1000),
                    title="How Yupoo shards its photos",
                    posted_date=date(2010, 6, 1 + i % 28),
                    tags=["mysql", "sharding"],
                    views=i,
                )
            )
            for i in range(rows)
        ]
        keys = [(p.user_id, p.photo_id) for p in made]
        ids = {k: id_of_pk(k[1]) for k in keys}
        for k in keys:  # the id -> bucket cache of ds.get warm, as in a running process
            photos.ds.get(ids[k])

        def inputs(n: int, side: str) -> list[tuple[int, int]]:
            return [keys[rng.randrange(len(keys))] for _ in range(n)]

        def load(k: tuple[int, int]) -> object:
            return photos.load(*k)

        versus_get = Work("typed load vs ds.get", load, lambda k: photos.ds.get(ids[k]), inputs)
        versus_raw = Work("typed load vs raw SQL", load, lambda k: raw(ids[k]), inputs)
        for work, goal in ((versus_get, GOAL), (versus_raw, "")):
            r = compare(work, backend, rounds=rounds, seconds=seconds)
            rates = [s.rate for s in r.bag], [s.rate for s in r.raw]
            out.append(paired(f"{backend}: {work.name}", *rates, goal))
    return out


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    return run(backend, args.rows, args.rounds, args.seconds)


def main(argv: list[str] | None = None) -> int:
    options = {
        "rounds": (int, 7, 3, "interleaved rounds"),
        "seconds": (float, 1.0, 0.1, "length of one round"),
        "rows": (int, 5000, 500, "photos"),
    }
    args = suite_args(argv, "typed table load beside ds.get and raw SQL", options)
    title = "bench.tables: typed load(user_id, photo_id) per second, beside ds.get and raw SQL"
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
