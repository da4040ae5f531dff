"""Conditional writes (expect_version), get_with_version and update(fn): no
lost updates, and a refused write changes nothing (body, index rows, unique
claims, cache)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import pytest

import bagstore
from bagstore import codec, testing
from bagstore.backends.buckets import FROZEN, OWNED
from bagstore.cache.base import decode_value
from bagstore.errors import ShardTimeout
from bagstore.sharding.hashing import bucket_of
from tests import servers
from tests.conftest import DRIVER, Topology, sqlite_write_lock_held
from tests.test_cache import cache_url, memcached_server, redis_url  # noqa: F401

BY_LINK = bagstore.Index(table="index_link", properties=["link"])
BY_EMAIL = bagstore.Index(table="index_email", properties=["email"], unique=True)


def _stored(ds: bagstore.Datastore, entity_id: bytes) -> tuple[bytes, int] | None:
    """Body and version as the shards hold them."""
    for backend in ds.router.backends:
        found = backend.get_bodies(ds.kind, [entity_id])
        if entity_id in found:
            return found[entity_id].body, found[entity_id].version
    return None


def _index_rows(ds: bagstore.Datastore, entity_id: bytes) -> set[Any]:
    rows: set[Any] = set()
    for backend in ds.router.backends:
        for index in (BY_LINK, BY_EMAIL):
            rows |= {
                (index.table, r)
                for r in backend.rows_of_entities(index.table, index.properties, [entity_id])
            }
    return rows


@pytest.fixture
def store(topo: Topology) -> Iterator[bagstore.Datastore]:
    yield topo.open(indexes=[BY_LINK, BY_EMAIL])


@pytest.fixture(scope="module")
def shared_store(shared_topo: Topology) -> bagstore.Datastore:
    """A store the tests of refused input share (each checks it changed nothing)."""
    return shared_topo.open(indexes=[BY_LINK, BY_EMAIL])


def test_get_with_version_reads_the_shard(store: bagstore.Datastore) -> None:
    assert store.get_with_version(bagstore.new_id()) is None
    entity_id = store.put({"link": "a"})
    entity, version = store.get_with_version(entity_id)  # type: ignore[misc]
    assert entity == {"id": entity_id, "link": "a"}
    assert version == _stored(store, entity_id)[1]  # type: ignore[index]


def test_conditional_put_and_delete(store: bagstore.Datastore) -> None:
    entity_id = store.put({"link": "a"}, expect_version=0)  # only if absent: a new id
    _, v1 = store.get_with_version(entity_id)  # type: ignore[misc]
    with pytest.raises(bagstore.Conflict) as caught:
        store.put({"id": entity_id, "link": "b"}, expect_version=0)
    assert (caught.value.id, caught.value.found, caught.value.written) == (entity_id, v1, [])
    store.put({"id": entity_id, "link": "b"}, expect_version=v1)
    _, v2 = store.get_with_version(entity_id)  # type: ignore[misc]
    assert v2 > v1
    with pytest.raises(bagstore.Conflict) as caught:
        store.put({"id": entity_id, "link": "c"}, expect_version=v1)
    assert caught.value.found == v2
    with pytest.raises(bagstore.Conflict):
        store.delete(entity_id, expect_version=v1)
    assert store.get(entity_id) == {"id": entity_id, "link": "b"}
    assert store.delete(entity_id, expect_version=v2)
    assert store.get(entity_id) is None
    assert store.delete(entity_id, expect_version=0) is False  # absent, as expected
    with pytest.raises(bagstore.Conflict) as caught:
        store.delete(entity_id, expect_version=v2)  # gone
    assert caught.value.found == 0
    with pytest.raises(bagstore.Conflict) as caught:
        store.put({"id": entity_id, "link": "d"}, expect_version=v2)  # gone
    assert caught.value.found == 0 and store.get(entity_id) is None
    store.put({"id": entity_id, "link": "e"}, expect_version=0)  # re-created
    assert store.get_with_version(entity_id)[1] > v2  # type: ignore[index]
    assert store.check()["missing"] == store.check()["stale"] == 0


def test_a_refused_put_changes_nothing(topo: Topology, cache_url: str) -> None:  # noqa: F811
    ds = topo.open(indexes=[BY_LINK, BY_EMAIL], cache=cache_url)
    other = topo.open(indexes=[BY_LINK, BY_EMAIL], cache=cache_url)
    entity_id = ds.put({"link": "old", "email": "old@x"})
    assert ds.get(entity_id) is not None  # the cache holds the entity now
    layer = ds.cache_layer
    assert layer.cache is not None
    key = layer.entity_key(entity_id)
    cached = layer.cache.get_many([key])[key][0]
    assert decode_value(entity_id, cached) is not None
    before = (_stored(ds, entity_id), _index_rows(ds, entity_id))
    _, version = ds.get_with_version(entity_id)  # type: ignore[misc]
    ds.put({"id": entity_id, "link": "mid", "email": "old@x"})  # another writer's put
    between = (_stored(ds, entity_id), _index_rows(ds, entity_id))
    assert ds.get(entity_id)["link"] == "mid"  # type: ignore[index]
    cached = layer.cache.get_many([key])[key][0]
    with pytest.raises(bagstore.Conflict):
        ds.put({"id": entity_id, "link": "new", "email": "new@x"}, expect_version=version)
    assert (_stored(ds, entity_id), _index_rows(ds, entity_id)) == between != before
    assert layer.cache.get_many([key])[key][0] == cached  # the cache entry as it was
    report = ds.check()
    assert (report["missing"], report["stale"]) == (0, 0), report
    # The unique value it claimed is free again: another entity takes it at once.
    other.put({"link": "x", "email": "new@x"})
    assert other.get(entity_id)["email"] == "old@x"  # type: ignore[index]
    with pytest.raises(bagstore.DuplicateValue):
        other.put({"email": "old@x"})  # and the entity's own value stays guarded


def test_put_many_is_atomic_per_shard(topo: Topology) -> None:
    ds = topo.open(indexes=[BY_LINK], buckets=16)
    shard_of = ds.placement.shard_of_bucket
    by_shard: dict[int, list[bytes]] = {}
    while min((len(v) for v in by_shard.values()), default=0) < 2 or len(by_shard) < 2:
        entity_id = ds.put({"link": "a"})
        by_shard.setdefault(shard_of[bucket_of(entity_id, 16)], []).append(entity_id)
    (a, b, *_), (c, *_) = list(by_shard.values())[:2]
    versions = {i: ds.get_with_version(i)[1] for i in (a, b, c)}  # type: ignore[index]
    with pytest.raises(bagstore.Conflict) as caught:
        ds.put_many(
            [{"id": a, "link": "n"}, {"id": b, "link": "n"}, {"id": c, "link": "n"}],
            expect_versions={a: versions[a] + 1, b: versions[b], c: versions[c]},
        )
    assert caught.value.refused == {a: versions[a]}
    assert caught.value.written == [c]
    assert [ds.get(i)["link"] for i in (a, b, c)] == ["a", "a", "n"]  # type: ignore[index]
    assert {i: ds.get_with_version(i)[1] for i in (a, b)} == {a: versions[a], b: versions[b]}  # type: ignore[index]
    assert ds.check()["missing"] == ds.check()["stale"] == 0


def test_a_conditional_put_that_moves_the_entity_checks_the_old_copy(topo: Topology) -> None:
    ds = topo.open(kind="posts", shard_key="user_id", buckets=16)
    shard_of = ds.placement.shard_of_bucket
    entity_id = ds.put({"user_id": "ann", "n": 1})
    home = shard_of[ds.bucket_of_id(entity_id)]  # type: ignore[index]
    other = next(
        u
        for u in (f"u{k}" for k in range(1000))
        if shard_of[ds.placer.entity_bucket({"user_id": u}, entity_id)] != home
    )
    _, version = ds.get_with_version(entity_id)  # type: ignore[misc]
    with pytest.raises(bagstore.Conflict) as caught:
        ds.put({"id": entity_id, "user_id": other, "n": 2}, expect_version=version - 1)
    assert caught.value.found == version
    assert shard_of[ds.bucket_of_id(entity_id)] == home  # type: ignore[index]
    fresh = topo.open(kind="posts", shard_key="user_id")  # reads the lookup row again
    assert fresh.get_with_version(entity_id) == (
        {"id": entity_id, "user_id": "ann", "n": 1},
        version,
    )
    ds.put({"id": entity_id, "user_id": other, "n": 2}, expect_version=version)
    entity, moved = ds.get_with_version(entity_id)  # type: ignore[misc]
    assert entity["user_id"] == other and moved > version
    assert ds.count() == 1


def test_update_applies_fn_and_retries(store: bagstore.Datastore) -> None:
    entity_id = store.put({"n": 0})
    assert store.update(entity_id, lambda e: {**e, "n": e["n"] + 1}) == {"id": entity_id, "n": 1}
    assert store.update(entity_id, lambda e: None) == {"id": entity_id, "n": 1}  # no write
    fresh = bagstore.new_id()
    made = store.update(fresh, lambda e: {"n": 10} if e is None else {**e, "n": e["n"] + 1})
    assert made == {"id": fresh, "n": 10} and store.get(fresh) == made
    calls = [0]

    def racing(e: dict[str, Any] | None) -> dict[str, Any]:
        """Another writer gets in between the read and the put, twice."""
        assert e is not None
        calls[0] += 1
        if calls[0] <= 2:
            store.put({**e, "n": e["n"] + 100})
        return {**e, "n": e["n"] + 1}

    assert store.update(entity_id, racing)["n"] == 201 + 1  # type: ignore[index]
    assert calls[0] == 3

    def always(e: dict[str, Any] | None) -> dict[str, Any]:
        assert e is not None
        store.put({**e, "n": e["n"] + 1})
        return {**e, "n": -1}

    with pytest.raises(bagstore.Conflict, match="3 tries"):
        store.update(entity_id, always, retries=2)
    assert store.get(entity_id)["n"] == 202 + 3  # type: ignore[index]


def _timing_out(
    ds: bagstore.Datastore, monkeypatch: pytest.MonkeyPatch, after: bool, meddle: Any = None
) -> None:
    """The next put times out: after its commit (``after``: its answer lost),
    or before it reached the server."""
    writes = ds._writes
    real = writes.put
    state = {"done": False}

    def put(entities: list[dict[str, Any]], expect: Any = None) -> list[bytes]:
        if state["done"]:
            return real(entities, expect)
        state["done"] = True
        if after:
            real(entities, expect)
            if meddle is not None:
                meddle()
        raise ShardTimeout("simulated: no answer", shard="test")

    monkeypatch.setattr(writes, "put", put)


@pytest.mark.parametrize("after", [True, False])
def test_update_after_a_timeout_reads_before_it_retries(
    store: bagstore.Datastore, monkeypatch: pytest.MonkeyPatch, after: bool
) -> None:
    entity_id = store.put({"n": 0})
    _timing_out(store, monkeypatch, after)
    assert store.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 1  # type: ignore[index]
    assert store.get(entity_id)["n"] == 1  # applied once, whether the timeout came before or after  # type: ignore[index]


def test_update_after_a_timeout_and_another_write_does_not_guess(
    store: bagstore.Datastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    entity_id = store.put({"n": 0})
    _timing_out(store, monkeypatch, True, lambda: store.put({"id": entity_id, "n": 50}))
    with pytest.raises(ShardTimeout, match="cannot be told"):
        store.update(entity_id, lambda e: {**e, "n": e["n"] + 1})
    assert store.get(entity_id)["n"] == 50  # type: ignore[index]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ds, i: ds.put({"id": i, "n": 9}, expect_version=-1), "0 or more"),
        (lambda ds, i: ds.put({"id": i, "n": 9}, expect_version="1"), "must be an int"),
        (lambda ds, i: ds.put({"id": i, "n": 9}, expect_version=True), "must be an int"),
        (lambda ds, i: ds.put({"id": i, "n": 9}, expect_version=1.0), "must be an int"),
        (lambda ds, i: ds.put({"n": 9}, expect_version=3), "without an id is new"),
        (lambda ds, i: ds.put_many([{"id": i, "n": 9}], expect_versions=[1]), "must be a dict"),
        (
            lambda ds, i: ds.put_many([{"id": i, "n": 9}], expect_versions={b"x" * 16: 1}),
            "not among",
        ),
        (
            lambda ds, i: ds.put_many([{"id": i, "n": 9}], expect_versions={i.hex(): 1}),
            "must be bytes",
        ),
        (lambda ds, i: ds.put_many([{"id": i, "n": 9}], expect_versions={i: -2}), "0 or more"),
        (lambda ds, i: ds.delete(i, expect_version=-1), "0 or more"),
        (lambda ds, i: ds.delete(i, expect_version="v"), "must be an int"),
        (lambda ds, i: ds.get_with_version(i.hex()), "must be bytes"),
        (lambda ds, i: ds.update(i, "not a function"), "needs a function"),
        (lambda ds, i: ds.update(i, lambda e: e, retries=-1), "retries"),
        (lambda ds, i: ds.update(i, lambda e: e, retries=1.5), "retries"),
        (lambda ds, i: ds.update(i, lambda e: [e]), "must return a dict"),
        (
            lambda ds, i: ds.update(i, lambda e: {**e, "id": bagstore.new_id(), "n": 9}),
            "another id",
        ),
    ],
)
def test_bad_conditional_input_is_refused_and_changes_nothing(
    shared_store: bagstore.Datastore, call: Any, message: str
) -> None:
    store = shared_store
    entity_id = store.put({"n": 1})
    before, count = _stored(store, entity_id), store.count()
    with pytest.raises(bagstore.BagstoreError, match=message):
        call(store, entity_id)
    assert _stored(store, entity_id) == before
    assert store.count() == count


def _counter(urls: list[str], entity_id: bytes, n: int, start: float) -> Any:
    code = f"""
        import json
        import time
        import bagstore
        ds = bagstore.Datastore({urls!r})
        ds.get({entity_id!r})
        time.sleep(max(0.0, {start!r} - time.time()))  # both at once (500 updates take ~20 ms)
        calls = 0
        def bump(e):
            global calls
            calls += 1
            return {{**e, "n": e["n"] + 1}}
        stored = [ds.update({entity_id!r}, bump, retries=1000)["n"] for _ in range({n})]
        ds.close()
        print(json.dumps({{"retried": calls - {n}, "stored": stored}}))
    """
    return servers.spawn_python(code)


def test_two_processes_update_one_counter(topo: Topology) -> None:
    ds = topo.open()
    entity_id = ds.put({"n": 0})
    start = time.time() + 2  # after both processes have started
    children = [_counter(topo.urls, entity_id, 500, start) for _ in range(2)]
    conflicts, stored = 0, []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        report = json.loads(out)
        conflicts += report["retried"]
        stored += report["stored"]
    assert ds.get(entity_id)["n"] == 1000  # type: ignore[index]
    # every update stored a count of its own: none was written over another
    assert sorted(stored) == list(range(1, 1001))
    print(f"{topo.name}: 1000 updates by 2 processes, {conflicts} conflicts retried")


@pytest.mark.parametrize("left", [False, True], ids=["moved", "copy left"])
def test_a_conditional_put_from_a_stale_placement_is_fenced(topo: Topology, left: bool) -> None:
    """The one-statement conditional write of an entity without index rows
    checks the bucket's ownership too: a process that missed a bucket move
    is refused by the old shard and writes where the bucket is now.  A move
    that stopped after the switch leaves the old shard's copy, still at the
    version expected: it never passes for a conflict."""
    stale = topo.open(buckets=16, refresh_interval=3600)
    admin = topo.open()
    entity_id = stale.put({"n": 1})
    bucket = bucket_of(entity_id, 16)
    source = stale.placement.shard_of_bucket[bucket]
    _, version = stale.get_with_version(entity_id)  # type: ignore[misc]
    if left:
        with testing.failpoint("move.after_switch"), pytest.raises(testing.SimulatedCrash):
            admin.move_buckets([bucket], to=(source + 1) % 4, grace=0)
        assert admin.router.backends[source].get_bodies("entities", [entity_id])
    else:
        admin.move_buckets([bucket], to=(source + 1) % 4, grace=0)
    stale.put({"id": entity_id, "n": 2}, expect_version=version)
    assert stale.placement.shard_of_bucket[bucket] == (source + 1) % 4
    assert admin.get(entity_id) == {"id": entity_id, "n": 2}
    if not left:
        assert admin.router.backends[source].get_bodies("entities", [entity_id]) == {}
    with pytest.raises(bagstore.Conflict) as refused:
        stale.put({"id": entity_id, "n": 3}, expect_version=version)
    assert refused.value.found > version


def test_sqlite_update_waits_for_a_lock_another_connection_holds(tmp_path: Any) -> None:
    """update's one-statement write runs on the thread's idle connection; a
    file locked by another connection makes it wait and try again (nothing
    was written by the refused statement), and a statement that fails for
    another reason is a bagstore error that leaves the connection usable."""
    ds = bagstore.open(tmp_path, shards=1)
    try:
        entity_id = ds.put({"n": 0})
        ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})  # the connection is made
        backend = ds.router.backends[0]
        with sqlite_write_lock_held(backend.path) as events:
            # (raw SQL only to reach the backend's execute path)
            stamp = 'UPDATE "entities" SET updated = updated + 1 WHERE id = ?'
            assert backend.execute(stamp, [entity_id]) == 1  # the thread's idle connection
            assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 2
            events.append("updated")
        assert events == ["released", "updated"]
        with pytest.raises(bagstore.BackendError):
            backend.execute("UPDATE no_such_table SET n = 1")
        assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 3
        assert ds.get_with_version(entity_id)[0]["n"] == 3  # type: ignore[index]
    finally:
        ds.close()


def test_sqlite_update_alone_binds_blobs_and_tells_the_request_level(tmp_path: Any) -> None:
    """update's one-statement path (no index, no shared cache level): the id
    and the body go to SQLite as bytearrays (SQLiteBackend.blob) and are
    stored as the same BLOBs a put stores; inside a request its level 1
    learns the entity written."""
    ds = bagstore.open(tmp_path, shards=1)
    try:
        entity_id = ds.put({"n": 0})
        with ds.request():
            assert ds.get(entity_id) == {"id": entity_id, "n": 0}  # level 1 holds it
            assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 1  # type: ignore[index]
            assert ds.get(entity_id) == {"id": entity_id, "n": 1}
        path = ds.router.backends[0].path  # type: ignore[attr-defined]
        with closing(sqlite3.connect(path)) as conn:
            kinds, body, version = conn.execute(
                'SELECT typeof(id) || typeof(body), body, version FROM "entities" WHERE id = ?',
                [entity_id],
            ).fetchone()
        assert kinds == "blobblob" and type(body) is bytes
        assert codec.decode(body) == {"id": entity_id, "n": 1}
        assert ds.get_with_version(entity_id) == ({"id": entity_id, "n": 1}, version)
    finally:
        ds.close()


@pytest.mark.parametrize("shards", [1, 4])
def test_update_alone_is_fenced_by_the_rows_own_bucket(topo: Topology, shards: int) -> None:
    """update's one-statement write of an entity without index rows checks
    that the shard owns the entity's bucket (on SQLite the row's own bucket
    column, no bucket bound: on a shard holding every bucket none is hashed
    from the id): a frozen bucket holds the write back, nothing written, and
    it goes once the bucket is owned again."""
    ds = bagstore.Datastore(topo.urls[:shards])
    try:
        entity_id = ds.put({"n": 0})
        bucket = bucket_of(entity_id, ds.router.topology.buckets)
        backend = ds.router.topology.backend_of(bucket)
        assert backend.dialect.fences_by_row is not topo.is_mysql
        bound = bucket if topo.is_mysql else None
        _, version = ds.get_with_version(entity_id)  # type: ignore[misc]
        body = codec.encode({"id": entity_id, "n": 5})
        own = "UPDATE bagstore_owned SET state = {} WHERE bucket = {}"
        backend.execute(own.format(FROZEN, bucket))
        write = backend.update_row_if
        assert write("entities", entity_id, bound, 1, body, version, moves=False) == 0
        with pytest.raises(bagstore.KeyMigrating):
            ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1}, retries=0)
        assert ds.get_with_version(entity_id) == ({"id": entity_id, "n": 0}, version)
        backend.execute(own.format(OWNED, bucket))
        assert write("entities", entity_id, bound, 1, body, version, moves=False) > version
        assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 6  # type: ignore[index]
    finally:
        ds.close()


def test_update_alone_follows_the_registry(tmp_path: Any) -> None:
    """update's one-statement route is worked out once for each registry and
    topology: once the kind has an index, update writes its rows too."""
    ds = bagstore.open(tmp_path, shards=1)
    try:
        entity_id = ds.put({"n": 0})
        assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 1  # type: ignore[index]
        assert ds._writes.alone_route() == (ds.router.backends[0], ())
        by_n = bagstore.Index(table="by_n", properties=["n"])
        ds.add_index(by_n)
        bagstore.Cleaner(ds).backfill("by_n")
        assert ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})["n"] == 2  # type: ignore[index]
        assert ds._writes.alone_route() == (None, ())
        assert [e["id"] for e in by_n.get_all(ds, n=2)] == [entity_id]
        assert by_n.get_all(ds, n=1) == []
    finally:
        ds.close()


@contextmanager
def _answer_lost(marker: str) -> Iterator[list[str]]:
    """The next statement (on PyMySQL) whose text holds ``marker`` runs on the
    server, its transaction committed, and then its connection is lost before
    the answer is read: the outcome is unknown to the client (a dropped
    network, a failover's KILL at that moment).  Yields the statements hit."""
    import pymysql

    real = pymysql.connections.Connection.query
    hit: list[str] = []

    def query(self: Any, sql: Any, unbuffered: bool = False) -> int:
        result: int = real(self, sql, unbuffered)
        text = sql.decode(errors="replace") if isinstance(sql, bytes) else sql
        if not hit and marker in text:
            hit.append(text)
            self._force_close()
            raise pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")
        return result

    pymysql.connections.Connection.query = query  # type: ignore[method-assign]
    try:
        yield hit
    finally:
        pymysql.connections.Connection.query = real  # type: ignore[method-assign]


@pytest.mark.parametrize("indexed", [False, True], ids=["row alone", "with index rows"])
def test_a_conditional_write_whose_answer_was_lost_is_not_run_again(
    topo: Topology, indexed: bool
) -> None:
    """A connection lost after the conditional write committed: running it
    again would find its own new version and call that a conflict (update(fn)
    would then apply fn twice).  It is not run again: update reads the row
    back and finds its write there; a conditional put says its outcome is
    unknown (ShardTimeout), never a false Conflict."""
    if not topo.is_mysql or DRIVER:
        pytest.skip("a lost answer is injected into PyMySQL (SQLite has no connection to lose)")
    ds = topo.open(indexes=[BY_LINK] if indexed else [])
    entity_id = ds.put({"n": 0, "link": "a"})
    # the row alone: one UPDATE ... WHERE version = ?; with index rows: the transaction's COMMIT
    marker = "COMMIT" if indexed else "UPDATE"
    with _answer_lost(marker) as hit:
        stored = ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1, "link": f"l{e['n'] + 1}"})
    assert hit  # the answer was lost once
    assert stored is not None and stored["n"] == 1
    assert ds.get(entity_id)["n"] == 1  # type: ignore[index]  (applied once, not twice)
    found = ds.get_with_version(entity_id)
    assert found is not None
    with _answer_lost(marker) as hit, pytest.raises(ShardTimeout, match="may or may not"):
        ds.put({"id": entity_id, "n": 5, "link": "b"}, expect_version=found[1])
    assert hit
    assert ds.get(entity_id)["n"] == 5  # type: ignore[index]  (it had been applied)
    # index rows on another shard, not written after the lost answer, are the
    # Cleaner's to repair, as after a timeout (docs/consistency.md)
    bagstore.Cleaner(ds).repair()
    assert ds.check()["missing"] == ds.check()["stale"] == 0


def test_a_conditional_delete_whose_answer_was_lost_says_the_outcome_is_unknown(
    topo: Topology,
) -> None:
    """The same for ``delete(id, expect_version=v)``: run again after its
    commit, it would find no row and call that a conflict."""
    if not topo.is_mysql or DRIVER:
        pytest.skip("a lost answer is injected into PyMySQL (SQLite has no connection to lose)")
    ds = topo.open()
    entity_id = ds.put({"n": 0})
    found = ds.get_with_version(entity_id)
    assert found is not None
    with _answer_lost("COMMIT") as hit, pytest.raises(ShardTimeout, match="may or may not"):
        ds.delete(entity_id, expect_version=found[1])
    assert hit
    assert ds.get(entity_id) is None  # it had been applied
