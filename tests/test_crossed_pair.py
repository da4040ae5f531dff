"""Yupoo's crossed master-master pair: two servers replicating each other,
logical shards active on alternating sides; one shard's active side switched
while writers run (two servers started for this module)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import bagstore
from tests import servers
from tests.replication import CrossedPair, started_pair


@pytest.fixture(scope="module")
def pair() -> Iterator[CrossedPair]:
    with started_pair() as p:
        yield p


def test_switch_one_shards_side_under_writers(pair: CrossedPair) -> None:
    dbs = [servers.unique_name("pair0"), servers.unique_name("pair1")]
    urls = [pair.url(dbs[0], 0), pair.url(dbs[1], 1)]  # shard 0 on A, shard 1 on B
    ds = bagstore.Datastore(urls, buckets=16)
    stale = bagstore.Datastore(urls)
    acked: list[bytes] = []
    errors: list[BaseException] = []
    pauses: list[float] = []
    stop = threading.Event()

    def write(store: bagstore.Datastore) -> None:
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                acked.append(store.put({"n": n}))
            except Exception as exc:  # any error fails the test
                errors.append(exc)
            pauses.append(time.monotonic() - started)
            n += 1

    threads = [threading.Thread(target=write, args=(s,)) for s in (ds, stale, ds)]
    for t in threads:
        t.start()
    try:
        while len(acked) < 60:
            time.sleep(0.01)
        a, b = pair.servers
        done = ds.failover(1, to=a.addr)
        assert done["planned"] and done["primary"] == a.addr and done["old_primary"] == b.addr
        count = len(acked)
        while len(acked) < count + 60:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    try:
        assert errors == []
        assert max(pauses) < 10
        pair.sync()
        assert pair.replicating()  # no duplicate key stopped either side
        assert not b.one("SELECT @@read_only")  # B stays active for its other databases
        got = ds.get_many(acked)
        assert all(e is not None for e in got)
        table = f"{servers.quote_ident(dbs[1])}.entities"
        ids_a = a.sql(f"SELECT added_id FROM {table}")
        ids_b = b.sql(f"SELECT added_id FROM {table}")
        assert sorted(ids_a) == sorted(ids_b)
        parities = {int(r[0]) % 2 for r in ids_a}
        assert parities == {0, 1}  # rows inserted on B (even) then on A (odd)
        assert ds.router.backends[1].server == a.addr
        assert ds.router.backends[0].server == a.addr
    finally:
        ds.close()
        stale.close()
        for name in dbs:
            a.sql(f"DROP DATABASE IF EXISTS {servers.quote_ident(name)}")
