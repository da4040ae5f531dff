"""Secondary indexes, bagstore beside raw DB-API: lookup, indexed put, scatter query.

Run from the repository root::

    python -m bench.indexes [--backend sqlite|mysql|all] [--driver pymysql|mysqlclient|all]
                            [--rounds N] [--quick] [--format rich|plain|markdown]

bagstore runs over 4 shards with ``Index("index_user_id", ["user_id"])`` and
``Index("index_link", ["link"])``; the raw baseline runs on ONE database whose
entities and index tables come from bagstore's own DDL
(``Dialect.create_entities_sql`` / ``create_index_table_sql``) and whose index
rows hold the same bytes (``keys.encode_value``, cut to ``keys.KEY_LIMIT``,
bucket of the full key); it sends the statements bagstore sends.

- index lookup of a user with 20 entities, ``index.get_all(ds, user_id=u)``.
  Raw: ``SELECT entity_id FROM index_user_id WHERE user_id = ?`` then
  ``SELECT id, body FROM entities WHERE id IN (...)`` + decode.
  Target >= 0.8x raw.
- ``put`` with one index (``user_id``) on a store of ONE shard (the entity and
  its index row together).  Raw, a careful person's hand-written SQL: ONE
  transaction (BEGIN; SELECT the old body FOR UPDATE; upsert; insert-or-ignore
  the index row; COMMIT), retried with a short back-off when MariaDB picks it
  as a deadlock victim.  Goal (issue 25) >= 0.9x raw.
- ``put_many`` of 500 with that index on that store.  Raw: one transaction
  (the 500 old bodies locked, one 500-row upsert, one 500-row index insert).
  Goal >= 0.9x raw.
- ``put`` with both indexes, on 4 shards and on 1 shard; raw as above (one
  transaction, two index rows).  Target >= 0.7x raw.
- 8 concurrent writers, ``put`` with one index on one shard: 8 threads
  sharing one Datastore, beside 8 threads each with its own raw connection
  doing the one-transaction put.  Goal >= 0.8x raw.  Failed puts are counted
  and shown beside the metric (the goal is then not met).
- the same lookup against raw SQL on bagstore's own 4 shard databases
  (``RawLayout``: the statement bagstore sends, the index scan joined with
  every shard's entity table, the SQLite files attached to one connection):
  the ratio is what bagstore's Python adds to its own statement.
- the same lookup on a store of ONE shard: it reads the bodies in its index
  scan, one statement where raw sends two.
- the same lookup on a kind placed by ``shard_key="user_id"`` (a user's
  entities share a bucket): reported beside it, no target of its own.
- a scatter query: ``Index("index_published", ["published"])``, query
  ``published__gte=x, limit=20`` reads every shard.  4 shards against 1 shard
  (and both against raw).  Target: 4-shard latency within 1.5x of 1-shard.
  On MariaDB, the same 4-shard query with the shards over TWO servers beside
  raw SQL doing that query's work over the same two servers (bench.scatter):
  goal <= 1.1x raw's latency.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import sys
import time
from collections.abc import Sequence
from typing import Any

from bagstore import Index, codec, keys
from bagstore.backends.scansql import Scan, scan_sql
from bagstore.sharding.hashing import bucket_of
from bench.common import (
    Env,
    Result,
    Row,
    Sample,
    Work,
    compare,
    friendfeed_entity,
    in_threads,
    open_env,
    raw_connector,
    result_row,
    run_suite,
    suite_args,
)
from bench.core import OPTIONS, drivers

KIND = "entities"
SHARDS = 4
BATCH = 500
USERS = 100
PER_USER = 20
SCATTER_ROWS = 2000
LIMIT = 20
BASE = 1_235_000_000_000_000  # published, in microseconds (an int property)

USER_INDEX = Index("index_user_id", ["user_id"])
LINK_INDEX = Index("index_link", ["link"])
PUB_INDEX = Index("index_published", ["published"])
INDEX_COLUMNS = ("entity_id", "bagstore_bucket")


def raw_ddl(dialect: Any) -> list[str]:
    """The tables bagstore creates on each shard, once, in the raw database."""
    sql = list(dialect.create_entities_sql(KIND))
    for index in (USER_INDEX, LINK_INDEX, PUB_INDEX):
        sql += dialect.create_index_table_sql(index.table, index.properties, index.unique)
    return sql


def index_row(index: Index, entity: dict[str, Any], buckets: int) -> tuple[bytes, bytes, int]:
    """``(stored key, entity id, bucket)`` the way bagstore builds it for a
    one-property index on a scalar: the order-preserving encoding cut to
    ``KEY_LIMIT``, the bucket of the full encoding."""
    full = keys.encode_value(entity[index.properties[0]])
    return keys.truncate(full)[0], entity["id"], bucket_of(full, buckets)


class Raw:
    """The raw DB-API side: statements as bagstore sends them, one database."""

    def __init__(self, env: Env) -> None:
        self.env, self.d = env, env.dialect
        self.cur = env.cursor()
        self.buckets = int(env.ds.placement.buckets)
        p = self.d.param
        self.upsert_one = self.d.upsert_entities_sql(KIND, 1)
        self.lock_one = self.d.select_bodies_sql(KIND, 1, lock=True)
        self.insert_row = {
            i.table: self.d.insert_ignore_sql(i.table, (*i.properties, *INDEX_COLUMNS), 1)
            for i in (USER_INDEX, LINK_INDEX, PUB_INDEX)
        }
        self.user_ids = (
            f"SELECT entity_id FROM index_user_id WHERE user_id = {p} ORDER BY entity_id LIMIT 501"
        )
        self.pub_scan = (
            f"SELECT published, entity_id FROM index_published WHERE published >= {p} "
            f"AND published < {p} ORDER BY published, entity_id LIMIT {LIMIT + 1}"
        )
        self.number_end = bytes((keys.encode_value(0)[0] + 1,))  # end of the number class

    def load(self, entities: Sequence[dict[str, Any]], indexes: Sequence[Index]) -> None:
        """Bulk-insert entities and their index rows (multi-row statements)."""
        now = time.time_ns() // 1000
        for start in range(0, len(entities), 500):
            chunk = entities[start : start + 500]
            params: list[Any] = []
            for e in chunk:
                params += (e["id"], bucket_of(e["id"], self.buckets), now, codec.encode(e))
            self.cur.execute(self.d.upsert_entities_sql(KIND, len(chunk)), params)
            for index in indexes:
                cols = (*index.properties, *INDEX_COLUMNS)
                rows = [v for e in chunk for v in index_row(index, e, self.buckets)]
                self.cur.execute(self.d.insert_ignore_sql(index.table, cols, len(chunk)), rows)

    def fetch(self, ids: list[bytes]) -> list[dict[str, Any]]:
        if not ids:
            return []
        self.cur.execute(self.d.select_bodies_sql(KIND, len(ids), stamps=False), ids)
        found = {bytes(r[0]): r[1] for r in self.cur.fetchall()}
        return [codec.decode(found[i]) for i in ids if i in found]

    def user_lookup(self, user_id: bytes) -> list[dict[str, Any]]:
        self.cur.execute(self.user_ids, (keys.truncate(keys.encode_value(user_id))[0],))
        return self.fetch([bytes(r[0]) for r in self.cur.fetchall()])

    def put_indexed(
        self, e: dict[str, Any], indexes: Sequence[Index] = (USER_INDEX, LINK_INDEX)
    ) -> None:
        """A careful hand-written put: ONE transaction that locks the old row
        (its body tells which index rows to replace), upserts the entity and
        inserts its index rows, then commits once."""
        cur, eid = self.cur, e["id"]
        body = codec.encode(e)

        def work() -> None:
            cur.execute(self.lock_one, (eid,))
            old = cur.fetchone()
            if old is not None:
                codec.decode(old[1])  # bagstore diffs against the old body
            cur.execute(
                self.upsert_one, (eid, bucket_of(eid, self.buckets), time.time_ns() // 1000, body)
            )
            for index in indexes:
                cur.execute(self.insert_row[index.table], index_row(index, e, self.buckets))

        self.transaction(work)

    def transaction(self, work: Any) -> None:
        """``work`` in one transaction, retried when MariaDB picks it as a
        deadlock victim (concurrent writers' gap locks), after a short random
        back-off (bagstore retries too)."""
        conn = self.env.raw
        for attempt in range(20):
            self.cur.execute(self.d.begin_write)
            try:
                work()
            except Exception as exc:
                conn.rollback()
                if attempt < 19 and exc.args and exc.args[0] == 1213:
                    time.sleep(random.random() * 0.002 * (attempt + 1))  # back off
                    continue
                raise
            conn.commit()
            return

    def put_user(self, e: dict[str, Any]) -> None:
        self.put_indexed(e, (USER_INDEX,))

    def put_many_user(self, entities: Sequence[dict[str, Any]]) -> None:
        """``put_many`` by hand on one database: one transaction that locks the
        old rows, upserts the entities and inserts their index rows."""
        cur, d, n = self.cur, self.d, len(entities)
        ids = [e["id"] for e in entities]
        now = time.time_ns() // 1000
        params: list[Any] = []
        for e in entities:
            params += (e["id"], bucket_of(e["id"], self.buckets), now, codec.encode(e))
        rows = [v for e in entities for v in index_row(USER_INDEX, e, self.buckets)]

        def work() -> None:
            cur.execute(d.select_bodies_sql(KIND, n, lock=True), ids)
            for old in cur.fetchall():
                codec.decode(old[1])
            cur.execute(d.upsert_entities_sql(KIND, n), params)
            cur.execute(d.insert_ignore_sql(USER_INDEX.table, ("user_id", *INDEX_COLUMNS), n), rows)

        self.transaction(work)

    def scatter(self, since: int) -> list[dict[str, Any]]:
        self.cur.execute(self.pub_scan, (keys.encode_value(since), self.number_end))
        return self.fetch([bytes(r[1]) for r in self.cur.fetchall()][:LIMIT])


class RawLayout:
    """Raw DB-API over bagstore's OWN shard databases: a user lookup with the
    statement bagstore sends there (the index scan on the shard of the user's
    bucket, LEFT JOINed with every shard's entity table: the databases of
    the MariaDB server, or the SQLite files attached to one connection), then
    the body of each row taken from the shard the placement names.  Against
    this, bagstore's ratio is its own cost; against :class:`Raw` on one
    database, the layout's cost as well."""

    def __init__(self, env: Env) -> None:
        self.d = env.dialect
        ds = env.ds
        placement = ds.placement
        self.shard_of, self.buckets = placement.shard_of_bucket, int(placement.buckets)
        self.schemas = [b.schema for b in ds.router.backends]
        self.shards = len(self.schemas)
        if self.d.name == "sqlite":
            self.conn: Any = sqlite3.connect(":memory:", isolation_level=None)
            for b in ds.router.backends:
                self.conn.execute(f"ATTACH DATABASE ? AS {self.d.q(b.schema)}", (b.path,))
            self.cur = self.conn.cursor()
        else:
            self.conn = None
            self.cur = env.cursor()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def user_lookup(self, user_id: bytes) -> list[dict[str, Any]]:
        full = keys.encode_value(user_id)
        shard = self.shard_of[bucket_of(full, self.buckets)]
        order = [shard, *(k for k in range(self.shards) if k != shard)]
        scan = Scan(
            "index_user_id",
            ("user_id",),
            [[keys.truncate(full)[0]]],
            limit=501,
            join_kind=KIND,
            join=tuple(None if k == shard else self.schemas[k] for k in order),
        )
        sql, params = scan_sql(self.d, scan, schema=self.schemas[shard])
        self.cur.execute(sql, params)
        out = []
        for _, which, bucket, body in self.cur.fetchall():
            if which is not None and self.shard_of[bucket] == order[which]:
                out.append(codec.decode(body))
        return out


def _check_same_bytes(env: Env, sample: dict[str, Any]) -> None:
    """The raw index rows hold exactly what bagstore writes (Index.rows_for)."""
    buckets = int(env.ds.placement.buckets)
    for index in (USER_INDEX, LINK_INDEX, PUB_INDEX):
        (row,) = index.rows_for(sample, sample["id"], buckets)
        key, eid, bucket = index_row(index, sample, buckets)
        assert (row.keys, row.entity_id, row.bucket) == ((key,), eid, bucket), index.table


WRITERS = 8


def concurrent_puts(env: Env, bag_put: Any, label: str, *, rounds: int, per_thread: int) -> Result:
    """``WRITERS`` threads putting ``per_thread`` new entities each, on both
    sides (bagstore: one Datastore shared by the threads; raw: each thread its
    own connection doing the one-transaction put); rounds interleaved."""
    connect = raw_connector(env)
    raws = [Raw(Env(env.label, env.dialect, env.ds, connect())) for _ in range(WRITERS)]

    errors = {"bag": 0, "raw": 0}
    first: list[str] = []

    def run(fns: list[Any], side: str) -> Sample:
        work = [[friendfeed_entity() for _ in range(per_thread)] for _ in fns]
        done = [0] * len(fns)

        def one(k: int) -> None:
            for e in work[k]:
                try:
                    fns[k](e)
                    done[k] += 1
                except Exception as exc:  # counted and reported: the others go on
                    errors[side] += 1
                    if not first:
                        first.append(f"{side}: {type(exc).__name__}: {exc}")

        elapsed = in_threads(len(fns), one)
        return Sample(sum(done) / elapsed, elapsed / per_thread)

    bag: list[Sample] = []
    raw: list[Sample] = []
    try:
        run([bag_put] * WRITERS, "bag")  # warm-up: the pool's connections
        errors["bag"] = 0
        for i in range(rounds):
            order = [([bag_put] * WRITERS, bag, "bag"), ([r.put_user for r in raws], raw, "raw")]
            for fns, out, side in order if i % 2 == 0 else reversed(order):
                out.append(run(fns, side))
    finally:
        for r in raws:
            r.env.raw.close()
    result = Result(label, env.label, bag, raw)
    if errors["bag"] or errors["raw"]:
        result.note = (
            f"failed puts: bagstore {errors['bag']}, raw {errors['raw']} (first: {first[0]})"
        )
        print(f"  {env.label}: {label}: {result.note}", file=sys.stderr)
    return result


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    return [r for driver in drivers(backend, args) for r in run_driver(backend, driver, args)]


def run_driver(backend: str, driver: str, args: argparse.Namespace) -> list[Row]:
    rounds, seconds = args.rounds, args.seconds
    results: list[Result] = []
    stores: dict[str, tuple[int, list[Index], dict[str, Any]]] = {
        "scatter4": (SHARDS, [PUB_INDEX], {}),
        "scatter1": (1, [PUB_INDEX], {}),
        # the same lookup when the kind is placed by user_id: a user's entities
        # share one bucket, so the lookup reads one shard for the bodies too
        "byuser": (SHARDS, [USER_INDEX, LINK_INDEX], {"shard_key": "user_id"}),
        # one shard: the very statements the raw side sends, so the ratio is
        # bagstore's own cost alone (no layout in it)
        "one": (1, [USER_INDEX, LINK_INDEX], {}),
        # one shard, one index: the put goals' setting (entity and index rows together)
        "user1": (1, [USER_INDEX], {}),
    }
    with open_env(
        backend,
        shards=SHARDS,
        indexes=[USER_INDEX, LINK_INDEX],
        raw_ddl=raw_ddl,
        driver=driver,
        extra_stores=stores,
    ) as env:
        ds, ds4, ds1 = env.ds, env.extra["scatter4"], env.extra["scatter1"]
        by_user, one, user1 = env.extra["byuser"], env.extra["one"], env.extra["user1"]
        raw = Raw(env)
        layout = RawLayout(env)
        rng = random.Random(11)
        users = [os.urandom(16) for _ in range(USERS)]
        people = [friendfeed_entity(user_id=u) for u in users for _ in range(PER_USER)]
        rng.shuffle(people)
        _check_same_bytes(env, people[0])
        for start in range(0, len(people), 500):
            ds.put_many(people[start : start + 500])
            by_user.put_many(people[start : start + 500])
            one.put_many(people[start : start + 500])
        raw.load(people, [USER_INDEX, LINK_INDEX])
        posts = [friendfeed_entity(published=BASE + i * 1000) for i in range(SCATTER_ROWS)]
        for start in range(0, len(posts), 500):
            ds4.put_many(posts[start : start + 500])
            ds1.put_many(posts[start : start + 500])
        raw.load(posts, [PUB_INDEX])

        # sanity: both sides give the same answers
        u = users[0]
        mine = [e["id"] for e in USER_INDEX.get_all(ds, user_id=u)]
        assert len(mine) == len(raw.user_lookup(u)) == PER_USER
        assert [e["id"] for e in layout.user_lookup(u)] == mine
        for store in (by_user, one):
            assert len(USER_INDEX.get_all(store, user_id=u)) == PER_USER
        since = BASE + 700 * 1000
        expect = [e["id"] for e in posts[700 : 700 + LIMIT]]
        for got in (
            PUB_INDEX.get_all(ds4, published__gte=since, limit=LIMIT),
            PUB_INDEX.get_all(ds1, published__gte=since, limit=LIMIT),
            raw.scatter(since),
        ):
            assert [e["id"] for e in got] == expect

        def some_users(n: int, side: str) -> list[bytes]:
            return [rng.choice(users) for _ in range(n)]

        def new_people(n: int, side: str) -> list[dict[str, Any]]:
            return [friendfeed_entity() for _ in range(n)]

        def batches(n: int, side: str) -> list[list[dict[str, Any]]]:
            return [[friendfeed_entity() for _ in range(BATCH)] for _ in range(n)]

        def starts(n: int, side: str) -> list[int]:
            return [BASE + rng.randrange(SCATTER_ROWS - LIMIT) * 1000 for _ in range(n)]

        def q4(t: int) -> object:
            return PUB_INDEX.get_all(ds4, published__gte=t, limit=LIMIT)

        def q1(t: int) -> object:
            return PUB_INDEX.get_all(ds1, published__gte=t, limit=LIMIT)

        def lookup(store: Any) -> Any:
            return lambda uid: USER_INDEX.get_all(store, user_id=uid)

        look = f"index lookup, user x{PER_USER}"
        # (name, bagstore, raw, inputs, units, goal: a least ratio or None)
        table: list[tuple[str, Any, Any, Any, int, float | None]] = [
            (look, lookup(ds), raw.user_lookup, some_users, 1, 0.8),
            (f"{look}, raw on the same {SHARDS} shards", lookup(ds), layout.user_lookup,
             some_users, 1, None),
            (f"{look}, 1 shard", lookup(one), raw.user_lookup, some_users, 1, 0.8),
            (f"{look}, shard_key=user_id", lookup(by_user), raw.user_lookup, some_users, 1, None),
            ("put + 1 index, 1 shard", user1.put, raw.put_user, new_people, 1, 0.9),
            (f"put_many x{BATCH} + 1 index, 1 shard", user1.put_many, raw.put_many_user,
             batches, BATCH, 0.9),
            ("put + 2 indexes", ds.put, raw.put_indexed, new_people, 1, 0.7),
            ("put + 2 indexes, 1 shard", one.put, raw.put_indexed, new_people, 1, 0.7),
            (f"scatter gte limit {LIMIT}, {SHARDS} shards", q4, raw.scatter, starts, 1, None),
            (f"scatter gte limit {LIMIT}, 1 shard", q1, raw.scatter, starts, 1, None),
        ]  # fmt: skip
        if args.only == "puts":
            table = [row for row in table if row[0].startswith("put")]
        works = [Work(name, b, r, inputs, units) for name, b, r, inputs, units, _ in table]
        goals = {name: goal for name, *_, goal in table if goal is not None}
        results += [compare(w, env.label, rounds=rounds, seconds=seconds) for w in works]
        layout.close()
        single = next(r for r in results if r.work == "put + 1 index, 1 shard")
        per_thread = max(5, int(single.raw_rate * seconds / WRITERS))
        name = f"{WRITERS} concurrent writers, put + 1 index, 1 shard"
        results.append(concurrent_puts(env, user1.put, name, rounds=rounds, per_thread=per_thread))
        goals[name] = 0.8
        for r in results:
            if r.work in goals:
                r.target, r.met = (
                    f">= {goals[r.work]}x raw",
                    r.ratio >= goals[r.work] and not r.note,
                )
        rows = [result_row(r) for r in results]
        for r, row in zip(results, rows, strict=True):
            if r.note:  # the metric's name stays the same from run to run
                row.goal += f"; {r.note.split(' (first')[0]}"
        if args.only == "puts":
            return rows
        # 4 shards against 1 shard, both bagstore, interleaved round by round
        head = compare(
            Work("4 vs 1 shard", q4, q1, starts), env.label, rounds=rounds, seconds=seconds
        )
        slower = 1 / head.ratio
        metric = f"{env.label}: scatter p50 ms, {SHARDS} shards (raw column: bagstore on 1 shard)"
        ms = head.bag_p50 * 1e3, head.raw_p50 * 1e3
        rows.append(Row(metric, *ms, slower, "<= 1.5x", slower <= 1.5, unit=" ms"))
        if backend == "mysql":
            from bench.scatter import over_two_servers

            rows += over_two_servers(driver, q1, starts, posts, env.label, rounds, seconds)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.indexes`` and ``bagstore bench``."""
    options = {
        **OPTIONS,
        "only": (["all", "puts"], "all", "all", "every metric, or the puts' alone"),
    }
    args = suite_args(argv, "bagstore secondary indexes beside raw DB-API", options)
    title = (
        f"bench.indexes: bagstore vs raw DB-API (one database; puts: ONE transaction each), "
        f"rates in entities/s, medians of {args.rounds} rounds"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
