"""The scatter query of bench.indexes over TWO MariaDB servers, beside raw SQL
doing the same work over the same servers (:class:`RawTwoServers`).

The store: 4 shards, 2 databases on the shared server and 2 on a private
``mariadbd`` that the bench starts and stops (``tests.servers``); the row is
left out, with a line saying so, if it cannot start.
"""

from __future__ import annotations

import sys
from typing import Any

from bagstore import codec, keys
from bagstore.backends.scansql import Scan, scan_sql
from bagstore.sharding.hashing import bucket_of
from bench.common import Row, Work, compare, mysql_url, rows_of
from bench.indexes import BASE, KIND, LIMIT, PUB_INDEX, SHARDS


def over_two_servers(
    driver: str,
    q1: Any,
    starts: Any,
    posts: list[dict[str, Any]],
    label: str,
    rounds: int,
    seconds: float,
) -> list[Row]:
    """The scatter over 4 shards on TWO MariaDB servers (2 databases on the
    shared one, 2 on a private ``mariadbd`` started here) beside
    :class:`RawTwoServers` doing the same work over the same servers.  No row
    (and a line saying so) if no second server can start."""
    from tests.servers import MariaDBServer, ServerUnavailable

    import bagstore
    from bench.common import temp_databases

    try:
        second = MariaDBServer().start()
    except ServerUnavailable as exc:
        print(f"skipped: the 2-server scatter (no second MariaDB server: {exc})", file=sys.stderr)
        return []
    try:
        with temp_databases(2) as names:
            urls = [mysql_url(n, driver=driver) for n in names]
            urls += [
                f"mysql://root@{second.host}:{second.port}/bagbench_{i}?driver={driver}"
                for i in range(2)
            ]
            ds2 = bagstore.Datastore(urls, indexes=[PUB_INDEX])
            try:
                for start in range(0, len(posts), 500):
                    ds2.put_many(posts[start : start + 500])

                def q2(t: int) -> list[dict[str, Any]]:
                    return PUB_INDEX.get_all(ds2, published__gte=t, limit=LIMIT)

                since = BASE + 700 * 1000
                assert [e["id"] for e in q2(since)] == [e["id"] for e in q1(since)]
                raw2 = RawTwoServers(ds2, driver, second.host, second.port)
                try:
                    assert [e["id"] for e in raw2.scatter(since)] == [e["id"] for e in q1(since)]
                    vs = Work("2 servers", q2, raw2.scatter, starts)
                    head = compare(vs, label, rounds=rounds, seconds=seconds)
                finally:
                    raw2.close()
            finally:
                ds2.close()
    finally:
        second.stop()
    slower = 1 / head.ratio
    return [
        Row(
            f"{label}: scatter p50 ms, {SHARDS} shards over 2 servers",
            head.bag_p50 * 1e3,
            head.raw_p50 * 1e3,
            slower,
            "<= 1.1x raw",
            slower <= 1.1,
            unit=" ms",
        )
    ]


class RawTwoServers:
    """Raw DB-API over the two-server store's own databases, doing the work of
    its scatter query the way bagstore would at best: on each server, one
    statement (bagstore's own text) that scans its two databases' index
    tables merged in index order and joins each row with those databases'
    entity tables, the two servers in parallel threads; the rows merged in
    Python; then the bodies the first statements could not reach (entities
    on the other server) read by id, one statement a server, in parallel;
    every body decoded.  (bagstore reads all the bodies in the second round
    trip: see ``Datastore.scan_streams``.)"""

    def __init__(self, ds2: Any, driver: str, host: str, port: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from bench.common import mysql_connect

        backends = ds2.router.backends
        self.d = backends[0].dialect
        self.servers: list[tuple[Any, list[str]]] = []
        for pair, where in ((backends[:2], None), (backends[2:], (host, port))):
            schemas = [b.schema for b in pair]
            if where is None:
                conn = mysql_connect(schemas[0], driver=driver)
            else:
                conn = mysql_connect(schemas[0], driver=driver, host=where[0], port=where[1])
            self.servers.append((conn, schemas))
        placement = ds2.placement
        self.shard_of, self.buckets = placement.shard_of_bucket, int(placement.buckets)
        self.pool = ThreadPoolExecutor(2)
        self.number_end = bytes((keys.encode_value(0)[0] + 1,))

    def close(self) -> None:
        self.pool.shutdown()
        for conn, _ in self.servers:
            conn.close()

    def _scan(self, conn: Any, schemas: list[str], since: int) -> list[tuple[Any, ...]]:
        scan = Scan(
            PUB_INDEX.table,
            ("published",),
            lower=(keys.encode_value(since), True),
            upper=(self.number_end, False),
            limit=LIMIT + 1,  # what bagstore reads first from each server (first_page)
            join_kind=KIND,
            join=(None, schemas[1]),
            parts=tuple(schemas),
        )
        sql, params = scan_sql(self.d, scan, schema=schemas[0])
        return rows_of(conn, sql, params)

    def _bodies(self, conn: Any, schemas: list[str], ids: list[list[bytes]]) -> list[Any]:
        q, p = self.d.q, self.d.param
        parts = [
            f"SELECT id, body FROM {q(db)}.{q(KIND)} WHERE id IN ({', '.join([p] * len(some))})"
            for db, some in zip(schemas, ids, strict=True)
            if some
        ]
        return rows_of(conn, " UNION ALL ".join(parts), [i for some in ids for i in some])

    def scatter(self, since: int) -> list[dict[str, Any]]:
        jobs = [self.pool.submit(self._scan, c, s, since) for c, s in self.servers]
        rows = sorted((r for job in jobs for r in job.result()), key=lambda r: r[:2])[:LIMIT]
        bodies = {r[1]: r[-1] for r in rows if r[-1] is not None}
        # the other entities' shards, by server: [server][database] -> ids
        wanted: list[list[list[bytes]]] = [[[], []], [[], []]]
        for r in rows:
            if r[-1] is None:
                shard = self.shard_of[bucket_of(r[1], self.buckets)]
                wanted[shard // 2][shard % 2].append(r[1])
        jobs = [
            self.pool.submit(self._bodies, conn, schemas, ids)
            for (conn, schemas), ids in zip(self.servers, wanted, strict=True)
            if ids[0] or ids[1]
        ]
        for job in jobs:
            bodies.update((r[0], r[1]) for r in job.result())
        return [codec.decode(bodies[r[1]]) for r in rows]
