"""The ownership gate (backends/gate.py): a write of many buckets checks one
row whose token changes with every change of ownership, never a stale copy."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore.backends.buckets import FROZEN, OWNED
from bagstore.backends.gate import GATED_FROM
from tests import servers
from tests.conftest import Topology


def _token(backend: Any) -> int:
    return int(backend.fetchall("SELECT token FROM bagstore_gate WHERE one = 1")[0][0])


def _one_shard(topo: Topology, **kwargs: Any) -> bagstore.Datastore:
    topo.urls = topo.urls[:1]
    return topo.open(kind="posts", freeze_wait=0.2, **kwargs)


def _spread(ds: bagstore.Datastore, n: int) -> list[dict[str, Any]]:
    """``n`` new entities, their buckets many."""
    return [{"id": bagstore.new_id(), "n": k} for k in range(n)]


def _bucket(ds: bagstore.Datastore, entity: dict[str, Any]) -> int:
    return int(ds.placer.entity_bucket(entity, entity["id"]))


def test_every_change_of_ownership_gives_the_gate_a_new_token(topo: Topology) -> None:
    ds = _one_shard(topo, buckets=64)
    backend = ds.router.backends[0]
    assert backend.gated
    seen = {_token(backend)}
    changes = [
        lambda: backend.set_bucket_state(3, FROZEN),
        lambda: backend.set_bucket_state(3, OWNED),
        lambda: backend.release_bucket(5),
        lambda: backend.claim_buckets([5]),
        # behind bagstore's back (an operator, or a process of an older version)
        lambda: backend.execute(f"UPDATE bagstore_owned SET state = {FROZEN} WHERE bucket = 7"),
        lambda: backend.execute("DELETE FROM bagstore_owned WHERE bucket = 7"),
        lambda: backend.execute(f"INSERT INTO bagstore_owned (bucket, state) VALUES (7, {OWNED})"),
    ]
    for change in changes:
        change()
        token = _token(backend)
        assert token not in seen
        seen.add(token)
    backend.claim_buckets([5, 7])  # held already: nothing changes
    assert _token(backend) in seen


@pytest.mark.parametrize("how", ["bagstore", "sql"])
def test_a_gated_write_sees_ownership_changed_since_it_last_read_it(
    topo: Topology, how: str
) -> None:
    ds = _one_shard(topo, buckets=64)
    backend = ds.router.backends[0]
    ds.put_many(_spread(ds, 200))  # the states read under the gate's token, kept
    assert backend._gate_seen is not None and len(backend._gate_seen[1]) >= GATED_FROM
    batch = _spread(ds, 200)
    b = _bucket(ds, batch[0])
    assert len({_bucket(ds, e) for e in batch}) >= GATED_FROM

    def set_state(state: int | None) -> None:
        if how == "bagstore":
            backend.release_bucket(b) if state is None else backend.set_bucket_state(b, state)
        elif state is None:
            backend.execute(f"DELETE FROM bagstore_owned WHERE bucket = {b}")
        else:
            backend.execute(f"UPDATE bagstore_owned SET state = {state} WHERE bucket = {b}")

    set_state(FROZEN)
    with pytest.raises(bagstore.KeyMigrating):
        ds.put_many(batch)
    set_state(None)
    with pytest.raises(bagstore.StalePlacement):
        ds.put_many(batch)
    assert all(ds.get(e["id"]) is None for e in batch)  # nothing of either
    backend.claim_buckets([b])
    ds.put_many(batch)
    assert all(ds.get(e["id"]) == e for e in batch)


def test_many_buckets_not_read_yet_are_read_in_parts(topo: Topology) -> None:
    ds = _one_shard(topo, buckets=4096)
    backend = ds.router.backends[0]
    batch = _spread(ds, 3000)
    assert len({_bucket(ds, e) for e in batch}) > 1000
    ds.put_many(batch)
    assert backend._gate_seen is not None and len(backend._gate_seen[1]) > 1000
    frozen = _bucket(ds, batch[-1])
    backend.set_bucket_state(frozen, FROZEN)
    again = [{**e, "n": -1} for e in batch]
    with pytest.raises(bagstore.KeyMigrating):
        ds.put_many(again)
    assert ds.get(batch[0]["id"]) == batch[0]


def test_a_change_of_ownership_waits_for_a_gated_write(topo: Topology) -> None:
    """While a write of many buckets holds the gate, no move may freeze or
    release a bucket (on SQLite one writer at a time holds the file)."""
    if not topo.is_mysql:
        pytest.skip("SQLite's one writer at a time: a change waits for the write anyway")
    ds = _one_shard(topo, buckets=64)
    backend = ds.router.backends[0]
    inside, leave = threading.Event(), threading.Event()

    def hold(cur: Any, old: Any) -> None:
        inside.set()
        assert leave.wait(10)

    batch = _spread(ds, 100)
    ds.put_many(batch)  # their buckets' states read: the next write reads the gate alone
    batch = [{**e, "n": -1} for e in batch]
    target = _bucket(ds, batch[0])
    other = next(b for b in range(64) if b not in {_bucket(ds, e) for e in batch})
    writer = threading.Thread(target=_put_holding, args=(ds, batch, hold))
    writer.start()
    assert inside.wait(10)
    done: list[float] = []
    mover = threading.Thread(
        target=lambda: (backend.set_bucket_state(other, FROZEN), done.append(time.monotonic()))
    )
    mover.start()
    time.sleep(0.5)
    assert not done  # the freeze of a bucket the write does not even touch waits
    released = time.monotonic()
    leave.set()
    writer.join(10)
    mover.join(10)
    assert done and done[0] >= released
    assert all(ds.get(e["id"]) == e for e in batch)
    assert backend.bucket_states([other, target]) == {other: FROZEN, target: OWNED}


def _put_holding(ds: bagstore.Datastore, batch: list[dict[str, Any]], hold: Any) -> None:
    """put_many of ``batch`` on a one-shard store, ``hold`` run inside its
    transaction after its first statement."""
    from bagstore import codec
    from bagstore.backends.entityrows import entity_rows

    backend = ds.router.backends[0]
    rows = entity_rows([e["id"] for e in batch], [_bucket(ds, e) for e in batch],
                       time.time_ns() // 1000, [codec.encode(e) for e in batch])  # fmt: skip
    backend.put_entities("posts", rows, read_old=False, within=hold)


# -- a login that may not create triggers ---------------------------------------------


@pytest.fixture
def trigger_less(mysql_main: servers.MySQLAddress) -> Iterator[tuple[str, str]]:
    m = mysql_main
    name = servers.unique_name("gate")
    user = f"g{name[-6:]}"
    conn = servers._connect(m.host, m.port, m.user, m.password)
    cur = conn.cursor()
    cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    cur.execute(f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw'")
    cur.execute(f"GRANT ALL PRIVILEGES ON `{name}`.* TO '{user}'@'127.0.0.1'")
    cur.execute(f"REVOKE TRIGGER ON `{name}`.* FROM '{user}'@'127.0.0.1'")
    try:
        yield f"mysql://{user}:pw@{m.host}:{m.port}/{name}", name
    finally:
        cur.execute(f"DROP USER '{user}'@'127.0.0.1'")
        cur.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.close()


def test_a_login_that_may_not_create_triggers_checks_each_bucket(
    trigger_less: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = trigger_less
    with caplog.at_level(logging.WARNING, "bagstore.backends.gate"):
        ds = bagstore.Datastore([url], kind="posts", buckets=64, freeze_wait=0.2)
    try:
        backend = ds.router.backends[0]
        assert not backend.gated
        assert any("no ownership gate" in r.message for r in caplog.records)
        batch = _spread(ds, 100)
        ds.put_many(batch)
        assert backend._gate_seen is None
        b = _bucket(ds, batch[0])
        backend.set_bucket_state(b, FROZEN)  # no trigger: the token stays as it was
        with pytest.raises(bagstore.KeyMigrating):
            ds.put_many([{**e, "n": -1} for e in batch])
        assert ds.get(batch[0]["id"]) == batch[0]
        assert [s["ownership_gate"] for s in ds.status()["shards"]] == [False]
    finally:
        ds.close()


def test_status_names_a_shard_without_the_gate(
    trigger_less: tuple[str, str], tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from bagstore.cli import cli

    url, _ = trigger_less
    config = tmp_path / "bagstore.toml"
    config.write_text(f'[bagstore]\nshards = ["{url}"]\nbuckets = 64\n')
    runner = CliRunner()
    assert runner.invoke(cli, ["--config", str(config), "init"]).exit_code == 0
    shown = runner.invoke(cli, ["--config", str(config), "status"])
    assert shown.exit_code == 0, shown.output
    assert "shard 0 has no ownership gate" in shown.output
    as_json = runner.invoke(cli, ["--config", str(config), "status", "--json"])
    assert '"ownership_gate": false' in as_json.stdout
