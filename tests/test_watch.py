"""``bagstore shard watch``: two watchers, one lease, exactly one failover; a
watcher never fails over the servers that hold its own lease (three servers
started for this module; the catalog on the main MariaDB)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import bagstore
from bagstore.cli import cli
from bagstore.sharding.watch import LEASE, Watcher
from tests import servers
from tests.conftest import MYSQL
from tests.replication import REPL_PASSWORD, REPL_USER, ReplicationGroup, started_group


@pytest.fixture(scope="module")
def group() -> Iterator[ReplicationGroup]:
    reason = servers.mysql_reachable(MYSQL.host, MYSQL.port, MYSQL.user, MYSQL.password)
    if reason:
        pytest.skip(reason)
    with started_group(3) as g:
        yield g


def test_the_watcher_never_fails_over_its_own_lease(group: ReplicationGroup) -> None:
    db = servers.unique_name("watch_own")
    with bagstore.Datastore([group.url(db)]) as ds:  # the catalog on the shard's servers
        watcher = Watcher(ds.router, interval=0.05, failures=1)
        assert watcher.shards() == []
        assert watcher.once() == []
    group.drop([db])
    bad = CliRunner().invoke(cli, ["--config", "/nonexistent.toml", "shard", "watch"])
    assert bad.exit_code == 2 and "error:" in bad.output


def test_two_watchers_exactly_one_fails_over(group: ReplicationGroup, tmp_path: Path) -> None:
    db, cat = servers.unique_name("watch"), servers.unique_name("watch_cat")
    catalog = f"mysql://root@{MYSQL.host}:{MYSQL.port}/{cat}"
    config = tmp_path / "app.toml"
    config.write_text(f'[bagstore]\nshards = ["{group.url(db)}"]\ncatalog = "{catalog}"\n')
    stores = [bagstore.Datastore.from_config(config) for _ in range(3)]
    try:
        writer = stores[2]
        ids = [writer.put({"n": n}) for n in range(5)]
        group.sync()
        options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
        watchers = [
            Watcher(ds.router, interval=0.05, failures=3, lease=2.0, name=f"w{k}", **options)
            for k, ds in enumerate(stores[:2])
        ]
        assert [len(w.shards()) for w in watchers] == [1, 1]
        for w in watchers:
            w.once()  # one holds the lease, the other sees it held
        holder = json.loads(writer.catalog.read_meta()[LEASE])["holder"]
        assert holder in ("w0", "w1")
        group.primary.kill()
        started = time.monotonic()
        stop = threading.Event()
        threads = [threading.Thread(target=w.run, args=(stop,)) for w in watchers]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while not any(w.done for w in watchers):
                assert time.monotonic() < deadline, "no watcher failed over"
                time.sleep(0.02)
            elapsed = time.monotonic() - started
            # a few more rounds of both: the new primary answers, nothing more happens
            rounds = [w.rounds for w in watchers]
            while any(w.rounds < r + 5 for w, r in zip(watchers, rounds, strict=True)):
                assert time.monotonic() < deadline + 30
                time.sleep(0.02)
        finally:
            stop.set()
            for t in threads:
                t.join()
        done = [d for w in watchers for d in w.done]
        assert len(done) == 1 and not done[0]["planned"]
        assert [w.name for w in watchers if w.done] == [holder]
        print(f"watcher: writes possible again {elapsed:.2f} s after the kill")
        # writers follow (the catalog's placement version moved)
        writer.refresh_placement(force=True)
        entity_id = writer.put({"after": 1})
        assert writer.get(entity_id)["after"] == 1
        assert all(e is not None for e in writer.get_many(ids))
        assert writer.router.backends[0].server == done[0]["primary"]
    finally:
        for ds in stores:
            ds.close()
        servers.drop_databases(MYSQL.host, MYSQL.port, [cat])
