"""The cache: two levels, revision-scoped pages, never stale after a write.

Runs against the in-process ``memory`` cache, a private memcached started for
this module (``tests.servers.Memcached``) and the Redis at 127.0.0.1:6379, on
SQLite and on MariaDB (``topo``).  The read-fill race is forced through the
layer's ``before_fill`` hook (a reader is held between its database read and its
cache fill while a writer commits), never by sleeping.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import bagstore
from bagstore.backends.base import Stored
from bagstore.cache import CacheLayer, MemoryCache, open_layer
from bagstore.cache.base import Marker, decode_value, encode_list
from bagstore.cache.request import current
from bagstore.errors import ConfigurationError
from bagstore.query import parse_filters, plan_query
from tests import servers
from tests.colocation import apart
from tests.conftest import Topology, _need, started

user_pub = bagstore.Index(
    table="index_user_published", properties=["user_id", "published"], shard_on="user_id"
)
album_idx = bagstore.Index(
    table="index_album",
    properties=["user_id", "album", "published"],
    shard_on="user_id",
    isolate_key="album",
)
pub_idx = bagstore.Index(table="index_published", properties=["published"])
email_idx = bagstore.Index(table="index_email", properties=["email"], unique=True)
INDEXES = [user_pub, album_idx, pub_idx, email_idx]

_names = itertools.count(1)


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def memcached_server() -> Iterator[servers.Memcached]:
    """A private memcached for this module."""
    with started(servers.Memcached()) as server:
        yield server


@pytest.fixture(scope="module")
def redis_url() -> str:
    _need(servers.redis_reachable())
    return servers.REDIS_URL


def _url(request: pytest.FixtureRequest, kind: str) -> str:
    if kind == "memory":  # a fresh shared instance per test
        return f"memory://test{os.getpid()}x{next(_names)}"
    if kind == "memcached":
        server: servers.Memcached = request.getfixturevalue("memcached_server")
        return f"memcached://{server.addr}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture(params=["memory", "memcached", "redis"])
def cache_url(request: pytest.FixtureRequest) -> str:
    return _url(request, request.param)


@pytest.fixture
def pair(topo: Topology, cache_url: str) -> tuple[bagstore.Datastore, bagstore.Datastore]:
    """Two datastores on one store sharing one cache: a writer and a reader."""
    return topo.open(cache=cache_url, indexes=INDEXES), topo.open(cache=cache_url, indexes=INDEXES)


def ids(entities: list[dict[str, Any]]) -> list[bytes]:
    return [e["id"] for e in entities]


def raw(ds: bagstore.Datastore, entity_id: bytes) -> Stored | Marker | None:
    """What level 2 holds under an entity's key (decoded), or None."""
    layer: CacheLayer = ds.cache_layer
    assert layer.cache is not None
    key = layer.entity_key(entity_id)
    got = layer.cache.get_many([key]).get(key)
    return decode_value(entity_id, got[0]) if got is not None else None


def delta(ds: bagstore.Datastore, before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    now = ds.stats()
    return {lv: {k: now[lv][k] - before[lv][k] for k in now[lv]} for lv in now}


# -- never stale after a write returned -----------------------------------------------------
def test_other_datastore_never_reads_a_stale_entity_or_page(
    pair: tuple[bagstore.Datastore, bagstore.Datastore],
) -> None:
    w, r = pair
    a = w.put({"user_id": b"u1", "published": 1, "album": "x", "title": "one", "email": "a@x"})
    b = w.put({"user_id": b"u1", "published": 2, "album": "x", "title": "two"})
    # warm every cache entry
    for _ in range(2):
        assert r.get(a)["title"] == "one"
        assert [e["title"] for e in user_pub.get_all(r, user_id=b"u1")] == ["one", "two"]
        assert ids(r.query(published__gte=0)) == [a, b]
        assert r.get_many([a, b, a])[2]["title"] == "one"
        assert ids(email_idx.get_all(r, email="a@x")) == [a]
    assert r.stats()["l2"]["hits"] > 0

    # an update of a non-indexed property: the entity, inside cached pages too
    w.put({"id": a, "user_id": b"u1", "published": 1, "album": "x", "title": "ONE"})
    assert r.get(a)["title"] == "ONE"
    assert [e["title"] for e in user_pub.get_all(r, user_id=b"u1")] == ["ONE", "two"]

    # an index move between values: both scopes see it at once
    w.put({"id": a, "user_id": b"u2", "published": 3, "album": "x", "title": "moved"})
    assert ids(user_pub.get_all(r, user_id=b"u1")) == [b]
    assert ids(user_pub.get_all(r, user_id=b"u2")) == [a]
    assert ids(r.query(published__gte=0)) == [b, a]
    assert [e["published"] for e in r.get_many([a, b])] == [3, 2]
    assert ids(email_idx.get_all(r, email="a@x")) == []

    # a unique value taken by another entity
    c = w.put({"user_id": b"u3", "published": 4, "email": "a@x"})
    assert ids(email_idx.get_all(r, email="a@x")) == [c]

    # a delete
    assert w.delete(b)
    assert r.get(b) is None
    assert r.get_many([b, a])[0] is None
    assert ids(user_pub.get_all(r, user_id=b"u1")) == []
    assert ids(r.query(published__gte=0)) == [a, c]
    # and the reader's own writes, the other way round
    r.put({"id": a, "user_id": b"u1", "published": 5, "title": "back"})
    assert w.get(a)["title"] == "back"
    assert ids(user_pub.get_all(w, user_id=b"u1")) == [a]
    assert r.stats()["l2"]["errors"] == 0


def test_concurrent_writer_and_readers_never_go_back(topo: Topology, cache_url: str) -> None:
    """Readers in threads check each read against the last write that returned;
    a page read while no write was in flight must be exactly right."""
    w = topo.open(cache=cache_url, indexes=[user_pub])
    r = topo.open(cache=cache_url, indexes=[user_pub])
    entity_id = w.put({"user_id": b"u1", "published": 0, "n": 0})
    done = threading.Event()
    started = [0]
    returned = [(0, b"u1")]
    errors: list[str] = []
    exact = [0]

    def writer() -> None:
        try:
            for n in range(1, 61):
                user = b"u2" if n % 3 == 0 else b"u1"  # moves to u2 and back
                started[0] = n
                w.put({"id": entity_id, "user_id": user, "published": n, "n": n})
                returned[0] = (n, user)
                time.sleep(0.002)  # room for reads with no write in flight
        finally:
            done.set()

    def reader() -> None:
        while not done.is_set():
            floor = returned[0][0]
            got = r.get(entity_id)
            if got is None or got["n"] < floor:
                errors.append(f"get gave {got and got['n']} after write {floor} returned")
            for user in (b"u1", b"u2"):
                before, began = returned[0], started[0]
                page = user_pub.get_all(r, user_id=user)
                for e in page:
                    if e["n"] < before[0] or e["user_id"] != user:
                        errors.append(f"page {user!r} gave {e} after write {before} returned")
                if began == before[0] == started[0]:  # no write in flight all along
                    exact[0] += 1
                    want = [before[0]] if before[1] == user else []
                    if [e["n"] for e in page] != want:
                        errors.append(f"page {user!r} gave {page} at rest after {before}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    writer()
    for t in threads:
        t.join()
    assert errors == []
    assert exact[0] > 0
    assert r.get(entity_id)["n"] == 60
    assert r.stats()["l2"]["hits"] > 0


# -- the read-fill race, forced --------------------------------------------------------------
def _hold(layer: CacheLayer, what: str) -> tuple[threading.Event, threading.Event]:
    """Make the next fill of ``what`` wait between the database read and the fill."""
    reached, release = threading.Event(), threading.Event()

    def hook(kind: str, keys: list[Any]) -> None:
        if kind == what and not reached.is_set():
            reached.set()
            assert release.wait(10)

    layer.before_fill = hook
    return reached, release


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("start", ["evicted", "marker", "garbage"])
def test_read_fill_race_leaves_no_stale_entity(
    pair: tuple[bagstore.Datastore, bagstore.Datastore], start: str
) -> None:
    """python-ndb #651-#653: a reader stores what it read before a write committed,
    after the write invalidated the key.  The writer's marker defeats it."""
    w, r = pair
    entity_id = w.put({"user_id": b"u1", "published": 1, "n": 1})
    assert isinstance(raw(r, entity_id), Marker)  # the writer left a marker, not a delete
    layer: CacheLayer = r.cache_layer
    assert layer.cache is not None
    if start == "evicted":  # the key is absent: the reader fills with add
        layer.cache.delete_many([layer.entity_key(entity_id)])
    elif start == "garbage":  # junk there: the reader replaces it by compare-and-set
        layer.cache.set_many({layer.entity_key(entity_id): os.urandom(32)}, 60)
    reached, release = _hold(layer, "entities")
    t, out = _in_thread(lambda: r.get(entity_id))
    assert reached.wait(10)  # the reader has read n=1 from the database
    w.put({"id": entity_id, "user_id": b"u1", "published": 1, "n": 2})  # commits, returns
    release.set()
    t.join(10)
    assert "error" not in out
    assert out["value"]["n"] == 1  # its read started before the write: fine
    held = raw(r, entity_id)  # the late fill was refused: the writer's marker is there
    assert isinstance(held, Marker) and held.version >= 2 and not held.gone
    layer.before_fill = None
    assert r.get(entity_id)["n"] == 2
    assert r.get(entity_id)["n"] == 2
    held = raw(r, entity_id)
    assert isinstance(held, Stored) and held.version >= 2


def encode_entity_body(entity: dict[str, Any]) -> bytes:
    from bagstore import codec

    return codec.encode(entity)


def test_read_fill_race_after_a_delete(pair: tuple[bagstore.Datastore, bagstore.Datastore]) -> None:
    w, r = pair
    entity_id = w.put({"user_id": b"u1", "published": 1})
    layer: CacheLayer = r.cache_layer
    reached, release = _hold(layer, "entities")
    t, out = _in_thread(lambda: r.get(entity_id))
    assert reached.wait(10)
    assert w.delete(entity_id)
    release.set()
    t.join(10)
    assert out["value"] is not None  # read before the delete returned
    held = raw(r, entity_id)
    assert isinstance(held, Marker) and held.gone
    layer.before_fill = None
    assert r.get(entity_id) is None
    assert r.get_many([entity_id]) == [None]


def test_read_fill_race_leaves_no_stale_page(
    pair: tuple[bagstore.Datastore, bagstore.Datastore],
) -> None:
    w, r = pair
    a = w.put({"user_id": b"u1", "published": 1})
    b = w.put({"user_id": b"u1", "published": 2})
    layer: CacheLayer = r.cache_layer
    reached, release = _hold(layer, "list")
    t, out = _in_thread(lambda: ids(user_pub.get_all(r, user_id=b"u1")))
    assert reached.wait(10)  # the reader ran the query, about to store the page
    w.put({"id": a, "user_id": b"u9", "published": 1})  # moves a out of u1's page
    release.set()
    t.join(10)
    assert out["value"] == [a, b]
    layer.before_fill = None
    assert ids(user_pub.get_all(r, user_id=b"u1")) == [b]
    assert ids(user_pub.get_all(r, user_id=b"u9")) == [a]


def test_marker_is_replaced_only_by_its_version_or_newer(cache_url: str) -> None:
    layer = open_layer(cache_url, prefix=f"bs:unit{os.getpid()}x{next(_names)}:")
    try:
        entity_id = bagstore.new_id()
        body = encode_entity_body({"id": entity_id})
        layer.after_write({entity_id: Stored(body, 5, 0)}, {})

        def load(version: int) -> Callable[[list[bytes]], dict[bytes, Stored]]:
            return lambda wanted: {i: Stored(body, version, 0) for i in wanted}

        assert layer.read_entities([entity_id], load(4))[entity_id].version == 4
        assert layer.cache is not None
        key = layer.entity_key(entity_id)
        assert decode_value(entity_id, layer.cache.get_many([key])[key][0]) == Marker(5, False)
        assert layer.read_entities([entity_id], load(5))[entity_id].version == 5
        assert layer.read_entities([entity_id], load(9))[entity_id].version == 5  # a hit now
        # a delete leaves a "gone" marker: version floor = deleted + 1
        layer.after_write({}, {entity_id: 6})
        assert decode_value(entity_id, layer.cache.get_many([key])[key][0]) == Marker(6, True)
        assert layer.read_entities([entity_id], lambda wanted: {}) == {}
        assert layer.read_entities([entity_id], load(1))[entity_id].version == 1  # re-created
        assert isinstance(decode_value(entity_id, layer.cache.get_many([key])[key][0]), Marker)
    finally:
        layer.close()


# -- failures degrade to the database -------------------------------------------------------
def _exercise(ds: bagstore.Datastore) -> None:
    """Writes, reads and queries that must all be right whatever the cache does."""
    f1, f2 = os.urandom(8), os.urandom(8)
    a = ds.put({"user_id": f1, "published": 1, "n": 1})
    b = ds.put({"user_id": f1, "published": 2, "n": 1})
    for n in range(2, 4):
        ds.put({"id": a, "user_id": f1, "published": 1, "n": n})
        assert ds.get(a)["n"] == n
        assert [e["n"] for e in ds.get_many([a, b])] == [n, 1]
        assert [e["n"] for e in user_pub.get_all(ds, user_id=f1)] == [n, 1]
    ds.put({"id": b, "user_id": f2, "published": 2, "n": 9})
    assert ids(user_pub.get_all(ds, user_id=f1)) == [a]
    assert ids(user_pub.get_all(ds, user_id=f2)) == [b]
    assert ds.delete(a)
    assert ds.get(a) is None
    assert ids(user_pub.get_all(ds, user_id=f1)) == []


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_unreachable_cache_server_degrades_to_the_database(topo: Topology, kind: str) -> None:
    port = servers.free_port()
    url = f"memcached://127.0.0.1:{port}" if kind == "memcached" else f"redis://127.0.0.1:{port}/0"
    ds = topo.open(cache=url, indexes=[user_pub])
    _exercise(ds)
    first = ds.stats()["l2"]["errors"]
    assert first > 0
    _exercise(ds)
    assert ds.stats()["l2"]["errors"] > first
    assert ds.status()["cache"]["l2"]["errors"] >= first


def test_memcached_killed_mid_test_degrades_then_recovers(topo: Topology) -> None:
    try:
        server = servers.Memcached().start()
    except servers.ServerUnavailable as exc:
        _need(str(exc))
        raise
    try:
        url = f"memcached://{server.addr}"
        w = topo.open(cache=url, indexes=[user_pub])
        r = topo.open(cache=url, indexes=[user_pub])
        a = w.put({"user_id": b"k1", "published": 1, "n": 1})
        for _ in range(2):
            assert r.get(a)["n"] == 1
            assert ids(user_pub.get_all(r, user_id=b"k1")) == [a]
        assert r.stats()["l2"]["hits"] > 0 and r.stats()["l2"]["errors"] == 0
        server.kill()
        # writes and reads go on, right, while the cache is gone
        w.put({"id": a, "user_id": b"k2", "published": 1, "n": 2})
        assert r.get(a)["n"] == 2
        assert ids(user_pub.get_all(r, user_id=b"k1")) == []
        assert ids(user_pub.get_all(r, user_id=b"k2")) == [a]
        _exercise(w)
        assert w.stats()["l2"]["errors"] > 0
        assert w.status()["cache"]["pending_invalidations"] > 0
        errors = r.stats()["l2"]["errors"] + w.stats()["l2"]["errors"]
        _exercise(r)
        assert r.stats()["l2"]["errors"] + w.stats()["l2"]["errors"] > errors
        # back (empty): after the client's retry interval the cache is used again
        server.restart()
        w.put({"id": a, "user_id": b"k2", "published": 1, "n": 3})
        deadline = time.monotonic() + 10
        hits = r.stats()["l2"]["hits"]
        while r.stats()["l2"]["hits"] == hits and time.monotonic() < deadline:
            assert r.get(a)["n"] == 3
            assert ids(user_pub.get_all(r, user_id=b"k2")) == [a]
            time.sleep(0.05)
        assert r.stats()["l2"]["hits"] > hits
        deadline = time.monotonic() + 10
        while w.cache_layer.retry_pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.status()["cache"]["pending_invalidations"] == 0
    finally:
        server.stop()


def test_garbage_in_the_cache_reads_as_a_miss(topo: Topology, cache_url: str) -> None:
    ds = topo.open(cache=cache_url, indexes=[user_pub])
    a = ds.put({"user_id": b"g1", "published": 1, "n": 1})
    layer: CacheLayer = ds.cache_layer
    assert layer.cache is not None
    key = layer.entity_key(a)
    plan = plan_query(user_pub, parse_filters({"user_id": b"g1"}), None)
    for junk in (os.urandom(40), b"", b"\xb5\x01E" + os.urandom(30), os.urandom(2000)):
        layer.cache.set_many({key: junk or b"x"}, 60)
        assert ds.get(a)["n"] == 1
        assert ds.get_many([a])[0]["n"] == 1
        # the garbage was replaced by compare-and-set: now a hit
        before = ds.stats()
        assert ds.get(a)["n"] == 1
        assert delta(ds, before)["l2"]["hits"] == 1
        # garbage under the revisions and the page
        assert ids(user_pub.get_all(ds, user_id=b"g1")) == [a]
        layer.cache.set_many(dict.fromkeys(layer.scope_keys(plan), junk or b"x"), 60)
        assert ids(user_pub.get_all(ds, user_id=b"g1")) == [a]
        assert ids(user_pub.get_all(ds, user_id=b"g1")) == [a]
        base = f"{plan.fingerprint()}|None|None"
        revs = layer._memo[base].revs
        page_key = layer._hashed("l", base.encode(), *[str(v).encode() for v in revs])
        assert layer.cache.get_many([page_key])  # the page is there, under that key
        layer.cache.set_many({page_key: junk or b"x"}, 60)
        assert ids(user_pub.get_all(ds, user_id=b"g1")) == [a]
        ds.put({"id": a, "user_id": b"g1", "published": 1, "n": 1})
    assert ds.stats()["l2"]["errors"] == 0


def test_an_unchanged_page_is_read_in_one_cache_round_trip(
    topo: Topology, cache_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = topo.open(cache=cache_url, indexes=[user_pub])
    writer = topo.open(cache=cache_url, indexes=[user_pub])
    made = ds.put_many([{"user_id": b"r1", "published": n} for n in range(5)])
    assert ids(user_pub.get_all(ds, user_id=b"r1")) == made  # fills the page
    assert ids(user_pub.get_all(ds, user_id=b"r1")) == made  # learns its ids
    layer: CacheLayer = ds.cache_layer
    assert layer.cache is not None
    calls: list[int] = []
    original = layer.cache.get_many

    def counting(keys: list[str]) -> Any:
        calls.append(len(keys))
        return original(keys)

    monkeypatch.setattr(layer.cache, "get_many", counting)
    before = ds.stats()
    assert ids(user_pub.get_all(ds, user_id=b"r1")) == made
    assert len(calls) == 1 and calls[0] >= 5  # revisions, page and the 5 entities
    assert delta(ds, before)["l2"]["hits"] >= 1
    # An entity changed by another datastore is never served from the prefetch.
    writer.put({"id": made[2], "user_id": b"r1", "published": 2, "note": "changed"})
    again = user_pub.get_all(ds, user_id=b"r1")
    assert ids(again) == made and again[2]["note"] == "changed"
    writer.put({"id": made[4], "user_id": b"r1", "published": 2.5})  # moves in the index
    assert [e["published"] for e in user_pub.get_all(ds, user_id=b"r1")] == [0, 1, 2, 2.5, 3]


def test_a_page_whose_entity_no_longer_matches_is_a_miss(topo: Topology) -> None:
    """Defence in depth: a page is re-checked against the query when read back."""
    ds = topo.open(cache=f"memory://recheck{os.getpid()}x{next(_names)}", indexes=[user_pub])
    a = ds.put({"user_id": b"c1", "published": 1})
    other = ds.put({"user_id": b"c2", "published": 1})
    assert ids(user_pub.get_all(ds, user_id=b"c1")) == [a]
    assert ids(user_pub.get_all(ds, user_id=b"c1")) == [a]
    # a page naming an entity that does not match (as if a bump had been lost)
    layer: CacheLayer = ds.cache_layer
    assert layer.cache is not None
    plan = plan_query(user_pub, parse_filters({"user_id": b"c1"}), None)
    base = f"{plan.fingerprint()}|None|None"
    revs = layer._memo[base].revs
    key = layer._hashed("l", base.encode(), *[str(v).encode() for v in revs])
    layer.cache.set_many({key: encode_list(key, [other], None)}, 60)
    before = ds.stats()
    assert ids(user_pub.get_all(ds, user_id=b"c1")) == [a]
    assert delta(ds, before)["l2"]["fills"] >= 1  # re-run and stored again (set, not add)
    before = ds.stats()
    assert ids(user_pub.get_all(ds, user_id=b"c1")) == [a]
    assert delta(ds, before)["l2"]["misses"] == 0


# -- level 1 -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["none", "memory", "memcached", "redis"])
def test_level_one_inside_a_request(
    tmp_path: Any, request: pytest.FixtureRequest, kind: str
) -> None:
    url = None if kind == "none" else _url(request, kind)
    topo = Topology("sqlite", [f"sqlite:///{tmp_path}/shard_{i}.db" for i in range(2)])
    try:
        ds = topo.open(cache=url, indexes=[user_pub])
        a = ds.put({"user_id": b"r1", "published": 1, "tags": ["x"], "meta": {"k": [1]}})
        b = ds.put({"user_id": b"r1", "published": 2})
        missing = bagstore.new_id()
        assert current() is None
        with ds.request() as rc:
            before = ds.stats()
            first = ds.get(a)
            second = ds.get(a)
            assert first == second and first is not second
            first["tags"].append("mutated")
            first["meta"]["k"].append(2)
            assert ds.get(a)["tags"] == ["x"] and ds.get(a)["meta"] == {"k": [1]}
            assert ds.get(missing) is None and ds.get(missing) is None
            got = ds.get_many([a, b, a, missing])
            assert got[0] == got[2] and got[0] is not got[2] and got[3] is None
            page = user_pub.get_all(ds, user_id=b"r1")
            assert ids(user_pub.get_all(ds, user_id=b"r1")) == ids(page) == [a, b]
            d = delta(ds, before)
            assert d["l1"]["hits"] >= 8
            assert d["l2"]["hits"] + d["l2"]["misses"] <= 4  # a, missing, one page
            # writes inside the block update level 1
            ds.put({"id": a, "user_id": b"r2", "published": 1})
            assert ds.get(a)["user_id"] == b"r2"
            assert ids(user_pub.get_all(ds, user_id=b"r1")) == [b]
            assert ds.delete(b)
            assert ds.get(b) is None
            assert ids(user_pub.get_all(ds, user_id=b"r1")) == []
            with ds.request() as inner:  # nested: the same dictionary
                assert inner is rc
            assert current() is rc
        assert current() is None
        assert ds.get(a)["user_id"] == b"r2"
        if kind == "none":
            assert "cache" not in ds.status()
            assert ds.stats()["l2"] == dict.fromkeys(ds.stats()["l2"], 0)
    finally:
        topo.close()


def test_level_one_hits_are_fast(tmp_path: Any) -> None:
    ds = bagstore.open(tmp_path, cache=None)
    try:
        a = ds.put({"title": "x" * 100, "tags": ["a", "b"], "n": 1})
        with ds.request():
            ds.get(a)
            n = 20_000
            t0 = time.perf_counter()
            for _ in range(n):
                ds.get(a)
            rate = n / (time.perf_counter() - t0)
        assert rate > 20_000, rate  # bench/cache.py measures the real figure
    finally:
        ds.close()


# -- scopes and revisions --------------------------------------------------------------------
def test_stats_move_as_expected(tmp_path: Any, request: pytest.FixtureRequest) -> None:
    ds = bagstore.open(tmp_path, indexes=[user_pub], cache=_url(request, "memory"))
    try:
        s0 = ds.stats()
        a = ds.put({"user_id": b"s1", "published": 1})
        d = delta(ds, s0)
        assert d["l2"]["invalidations"] == 3  # the marker, u1's revision, the index's revision
        s1 = ds.stats()
        ds.get(a)  # the writer's marker: read the database, replace it
        assert delta(ds, s1)["l2"] == {
            "hits": 0,
            "misses": 1,
            "fills": 1,
            "invalidations": 0,
            "errors": 0,
        }
        s2 = ds.stats()
        ds.get(a)
        assert delta(ds, s2)["l2"]["hits"] == 1
        s3 = ds.stats()
        user_pub.get_all(ds, user_id=b"s1")  # page miss (entity hit), then filled
        user_pub.get_all(ds, user_id=b"s1")  # page hit, entity hit
        d = delta(ds, s3)["l2"]
        assert (d["hits"], d["misses"], d["fills"]) == (3, 1, 1)
        s4 = ds.stats()
        with ds.request():
            ds.get(a)
            ds.get(a)
        d = delta(ds, s4)
        assert d["l1"]["hits"] == 1 and d["l1"]["misses"] == 1 and d["l2"]["hits"] == 1
        assert set(ds.status()["cache"]) >= {"backend", "prefix", "l1", "l2"}
    finally:
        ds.close()


def test_isolate_key_narrows_the_scope(topo: Topology, cache_url: str) -> None:
    assert "isolate_key" not in user_pub.definition()  # older catalog definitions stay equal
    assert album_idx.definition()["isolate_key"] == "album"
    assert bagstore.Index.from_json(album_idx.to_json()) == album_idx
    assert "isolate_key='album'" in repr(album_idx)
    with pytest.raises(ConfigurationError, match="isolate_key"):
        bagstore.Index(table="t", properties=["a"], isolate_key="b")
    w = topo.open(cache=cache_url, indexes=[album_idx])
    r = topo.open(cache=cache_url, indexes=[album_idx])
    a = w.put({"user_id": b"i1", "album": "a1", "published": 1})
    assert ids(album_idx.get_all(r, user_id=b"i1", album="a1")) == [a]
    assert ids(album_idx.get_all(r, user_id=b"i1")) == [a]
    # a write to another album of the same user leaves album a1's page cached
    b = w.put({"user_id": b"i1", "album": "a2", "published": 2})
    before = r.stats()
    assert ids(album_idx.get_all(r, user_id=b"i1", album="a1")) == [a]
    assert delta(r, before)["l2"]["misses"] == 0
    # ... but not the user's whole page, nor album a2's
    assert ids(album_idx.get_all(r, user_id=b"i1")) == [a, b]
    assert ids(album_idx.get_all(r, user_id=b"i1", album="a2")) == [b]
    # a write into album a1 (and a move out of it) reaches its page
    c = w.put({"user_id": b"i1", "album": "a1", "published": 3})
    assert ids(album_idx.get_all(r, user_id=b"i1", album="a1")) == [a, c]
    w.put({"id": a, "user_id": b"i1", "album": "a2", "published": 1})
    assert ids(album_idx.get_all(r, user_id=b"i1", album="a1")) == [c]
    plain = topo.open(indexes=[album_idx])  # no cache: the reference
    for filters in ({"user_id": b"i1"}, {"user_id": b"i1", "album__in": ["a1", "a2"]}):
        assert ids(album_idx.get_all(r, **filters)) == ids(album_idx.get_all(plain, **filters))


def test_in_queries_and_queries_without_shard_value(topo: Topology, cache_url: str) -> None:
    w = topo.open(cache=cache_url, indexes=[user_pub, pub_idx])
    r = topo.open(cache=cache_url, indexes=[user_pub, pub_idx])
    a = w.put({"user_id": b"n1", "published": 1})
    b = w.put({"user_id": b"n2", "published": 2})
    for _ in range(2):
        assert ids(user_pub.get_all(r, user_id__in=[b"n1", b"n2"], order="published")) == [a, b]
        assert ids(pub_idx.get_all(r, published__gte=0)) == [a, b]
        assert ids(r.query(user_id=b"n2", published__lt=5)) == [b]
    before = r.stats()
    assert ids(pub_idx.get_all(r, published__gte=0)) == [a, b]
    assert delta(r, before)["l2"]["misses"] == 0
    c = w.put({"user_id": b"n2", "published": 3})
    assert ids(user_pub.get_all(r, user_id__in=[b"n1", b"n2"], order="published")) == [a, b, c]
    assert ids(pub_idx.get_all(r, published__gte=0)) == [a, b, c]
    assert ids(r.query(user_id=b"n2", published__lt=5)) == [b, c]
    # pages with cursors
    page1 = user_pub.get_all(r, user_id=b"n2", limit=1)
    assert ids(page1) == [b] and page1.cursor is not None
    assert ids(user_pub.get_all(r, user_id=b"n2", limit=1, cursor=page1.cursor)) == [c]
    w.delete(c)
    page2 = user_pub.get_all(r, user_id=b"n2", limit=1, cursor=page1.cursor)
    assert ids(page2) == [] and page2.cursor is None


def test_revisions_never_go_back_after_an_eviction(tmp_path: Any, cache_url: str) -> None:
    ds = bagstore.open(tmp_path, indexes=[user_pub], cache=cache_url)
    try:
        layer: CacheLayer = ds.cache_layer
        assert layer.cache is not None
        plan = plan_query(user_pub, parse_filters({"user_id": b"v1"}), None)
        key = layer.scope_keys(plan)[0]
        ds.put({"user_id": b"v1", "published": 1})
        first = int(layer.cache.get_many([key])[key][0])
        assert abs(first - time.time_ns() // 1000) < 600_000_000  # started at "now" (µs)
        ds.put({"user_id": b"v1", "published": 2})
        second = int(layer.cache.get_many([key])[key][0])
        assert second == first + 1
        layer.cache.delete_many([key])  # evicted
        ds.put({"user_id": b"v1", "published": 3})
        assert int(layer.cache.get_many([key])[key][0]) > second
    finally:
        ds.close()


def test_index_life_cycle_forgets_pages(tmp_path: Any, request: pytest.FixtureRequest) -> None:
    url = _url(request, "memory")
    ds = bagstore.open(tmp_path, indexes=[user_pub], cache=url)
    try:
        a = ds.put({"user_id": b"l1", "published": 1})
        assert ids(user_pub.get_all(ds, user_id=b"l1")) == [a]
        ds.retire_index(user_pub.table)
        b = ds.put({"user_id": b"l1", "published": 2})  # not indexed while retired
        ds.drop_index(user_pub.table)
        assert ds.add_index(user_pub) == "building"
        bagstore.Cleaner(ds).backfill(user_pub.table)
        assert ids(user_pub.get_all(ds, user_id=b"l1")) == [a, b]
    finally:
        ds.close()


def test_two_memcached_servers_share_the_keys(tmp_path: Any) -> None:
    try:
        one, two = servers.Memcached().start(), servers.Memcached().start()
    except servers.ServerUnavailable as exc:
        _need(str(exc))
        raise
    closing: list[bagstore.Datastore] = []
    try:
        from pymemcache.client.base import Client

        ds = bagstore.open(tmp_path, cache=f"memcached://{one.addr},{two.addr}")
        closing.append(ds)
        made = ds.put_many([{"n": i} for i in range(60)])
        assert [e["n"] for e in ds.get_many(made)] == list(range(60))
        assert [e["n"] for e in ds.get_many(made)] == list(range(60))
        assert ds.stats()["l2"]["hits"] == 60
        layer: CacheLayer = ds.cache_layer
        held = []
        for server in (one, two):
            client = Client((server.host, server.port))
            try:
                held.append({i for i in made if client.get(layer.entity_key(i)) is not None})
            finally:
                client.close()
        assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == set(made)
    finally:
        for ds in closing:
            ds.close()
        one.stop()
        two.stop()


def test_entity_body_agrees_with_decode_value() -> None:
    """The page hit's check of an entity entry accepts exactly what
    decode_value calls an entity: markers, garbage and damaged entries are None."""
    from bagstore.cache.base import encode_entity, encode_marker, entity_body

    eid = os.urandom(16)
    entry = encode_entity(eid, Stored(b"\x01body", 3, 12345))
    assert entity_body(eid, entry) == b"\x01body" == decode_value(eid, entry).body  # type: ignore[union-attr]
    damaged = [entry[:-1], entry[:10], entry[:-1] + bytes([entry[-1] ^ 1]), b"", os.urandom(40)]
    damaged += [entry[:5] + bytes([entry[5] ^ 1]) + entry[6:]]  # the version
    for bad in damaged:
        assert entity_body(eid, bad) is None
        assert not isinstance(decode_value(eid, bad), Stored)
    assert entity_body(os.urandom(16), entry) is None  # another entity's entry
    for marker in (encode_marker(3), encode_marker(4, gone=True)):
        assert entity_body(eid, marker) is None
        assert isinstance(decode_value(eid, marker), Marker)


# -- the multi-get reader ---------------------------------------------------------------------
def test_multi_get_reader_agrees_with_pymemcache(memcached_server: servers.Memcached) -> None:
    """bagstore parses multi-get replies itself: same answers as pymemcache's own
    client for awkward values, replies larger than one read, and absent keys."""
    from pymemcache.client.base import Client

    from bagstore.cache.memcached import MemcachedCache

    server = memcached_server
    ours = MemcachedCache([(server.host, server.port)])
    reference = Client((server.host, server.port))
    try:
        tag = f"mg{os.getpid()}x{next(_names)}:"
        values = {
            tag + "crlf": b"a\r\nEND\r\nVALUE x 0 1 1\r\nz\r\n",
            tag + "empty": b"",
            tag + "end": b"END",
            tag + "big": os.urandom(900_000),  # many reads for one value
            **{f"{tag}{i}": os.urandom(i * 37 % 3000) for i in range(300)},  # > 64 KB reply
        }
        assert reference.set_many(values, expire=60, noreply=False) == []
        keys = [*values, tag + "absent", tag + "absent2"]
        for asked in (keys, keys[::-1], [tag + "absent"], [tag + "crlf"], keys[3:5]):
            got = ours.get_many(asked)
            want = reference.gets_many(asked)
            assert got.keys() == want.keys() == {k for k in asked if k in values}
            for k, (value, token) in got.items():
                assert value == values[k] == want[k][0]
                assert token == want[k][1]
        # the connection is left clean: the next reply is read from its start
        token = reference.gets(tag + "end")[1]
        assert ours.get_many([tag + "end"]) == {tag + "end": (b"END", token)}
    finally:
        ours.close()
        reference.close()


@pytest.mark.parametrize(
    "bad", ["has space", "tab\tkey", "new\nline", "", "x" * 251, "nul\0", "caf\u00e9", "del\x7f"]
)
def test_multi_get_reader_refuses_keys_memcached_cannot_take(
    memcached_server: servers.Memcached, bad: str
) -> None:
    from pymemcache.exceptions import MemcacheIllegalInputError

    from bagstore.cache.memcached import MemcachedCache

    ours = MemcachedCache([(memcached_server.host, memcached_server.port)])
    try:
        with pytest.raises(MemcacheIllegalInputError, match="not a memcached key"):
            ours.get_many(["fine", bad])
        with pytest.raises(MemcacheIllegalInputError, match="not a memcached key"):
            ours.get_many([bad])
        assert ours.get_many(["fine" * 62]) == {}  # 248 bytes: taken
    finally:
        ours.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"SERVER_ERROR out of memory\r\n",
        b"HELLO\r\n",
        b"VALUE k 0 5 1\r\nabc",  # cut short, then closed
        b"VALUE k 0 3 1\r\nabcdef\r\nEND\r\n",  # longer than it said
        b"VALUE other 0 1 1\r\na\r\nEND\r\n",  # a key not asked for
    ],
)
def test_a_server_answering_garbage_degrades_to_the_database(tmp_path: Any, reply: bytes) -> None:
    """A process on the cache's port that does not speak memcached properly:
    reads are right (from the database), each bad reply counted as an error."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    if conn.recv(65536):  # "VALUE k": the key asked for
                        conn.sendall(reply.replace(b"VALUE k ", b"VALUE " + last_key[0] + b" "))
                except OSError:
                    pass

    last_key = [b"k"]
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ds = bagstore.open(tmp_path, cache=f"memcached://127.0.0.1:{port}")
    try:
        a = ds.put({"n": 1})
        last_key[0] = ds.cache_layer.entity_key(a).encode()
        for _ in range(3):
            assert ds.get(a) == {"id": a, "n": 1}
            assert ds.get_many([a]) == [{"id": a, "n": 1}]
        assert ds.stats()["l2"]["errors"] > 0
        assert ds.stats()["l2"]["hits"] == 0
    finally:
        ds.close()
        stop.set()
        thread.join()
        listener.close()


# -- configuration -----------------------------------------------------------------------------
def test_cache_configuration_errors(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (
        "bogus://x",
        "memcached://",
        "memcached://h:port",
        "memory://x?size=-1",
        "memory?x",
    ):
        with pytest.raises(ConfigurationError):
            bagstore.open(tmp_path, cache=bad)
    with pytest.raises(ConfigurationError, match="cache_prefix"):
        bagstore.open(tmp_path, cache="memory", cache_prefix="has space")
    with pytest.raises(ConfigurationError, match="cache must be"):
        bagstore.open(tmp_path, cache=42)
    monkeypatch.setitem(sys.modules, "pymemcache.client.hash", None)
    with pytest.raises(ConfigurationError, match=r"bagstore\[memcached\]"):
        bagstore.open(tmp_path, cache="memcached://127.0.0.1:11211")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ConfigurationError, match=r"bagstore\[redis\]"):
        bagstore.open(tmp_path, cache="redis://127.0.0.1:6379/0")


def test_prefixes_and_a_cache_object(tmp_path: Any) -> None:
    shared = MemoryCache(max_entries=1000)
    one = bagstore.open(tmp_path / "one", cache=shared)
    two = bagstore.open(tmp_path / "two", cache=shared)
    other_kind = bagstore.open(tmp_path / "one", cache=shared, kind="photos")
    custom = bagstore.open(tmp_path / "one", cache=shared, cache_prefix="app1:")
    try:
        prefixes = {ds.cache_layer.prefix for ds in (one, two, other_kind, custom)}
        assert len(prefixes) == 4
        assert one.cache_layer.prefix == f"bs:{one.placement.store_id}:entities:"
        assert custom.cache_layer.prefix == "app1:"
        a = one.put({"n": 1})
        assert one.get(a) == {"id": a, "n": 1}
        assert two.get(a) is None and other_kind.get(a) is None
        assert len(shared) > 0
    finally:
        for ds in (one, two, other_kind, custom):
            ds.close()
    assert len(shared) > 0  # a cache object passed in is not closed with the datastore


def test_memory_cache_is_bounded() -> None:
    cache = MemoryCache(max_entries=10, max_bytes=10_000)
    cache.set_many({f"k{i}": b"v" * 100 for i in range(50)}, 60)
    assert len(cache) == 10 and set(cache.get_many(["k49", "k0"])) == {"k49"}
    cache.set_many({"big": b"x" * 9_900}, 60)
    assert cache._bytes <= cache.max_bytes and "big" in cache.get_many(["big"])
    assert len(cache) < 10


def test_bagstore_imports_no_cache_client(tmp_path: Any) -> None:
    code = (
        "import sys, bagstore\n"
        "ds = bagstore.open(sys.argv[1], cache='memory')\n"
        "ds.get(ds.put({'a': 1})); ds.close()\n"
        "assert 'pymemcache' not in sys.modules and 'redis' not in sys.modules\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src")}
    store = str(tmp_path / "store")
    subprocess.run([sys.executable, "-c", code, store], check=True, env=env, timeout=60)


@pytest.mark.parametrize("point", ["put.after_entity", "put.after_index_delete"])
def test_a_writer_dying_after_its_commit_leaves_nothing_stale(
    pair: tuple[bagstore.Datastore, bagstore.Datastore], point: str
) -> None:
    """The writer leases the keys before it commits: if it dies before it
    invalidates, readers go to the database (until the lease's TTL)."""
    w, r = pair
    body = {"user_id": b"d1", "published": 1, "n": 1}
    # rows on other shards: those on the entity's are written with it
    a = w.put({"id": apart(w, body, {**body, "user_id": b"d2"}), **body})
    for _ in range(2):
        assert r.get(a)["n"] == 1
        assert ids(user_pub.get_all(r, user_id=b"d1")) == [a]
    with bagstore.testing.failpoint(point), pytest.raises(bagstore.testing.SimulatedCrash):
        w.put({"id": a, "user_id": b"d2", "published": 1, "n": 2})
    assert r.get(a)["n"] == 2
    assert r.get_many([a])[0]["n"] == 2
    assert ids(user_pub.get_all(r, user_id=b"d1")) == []  # the stale row fails the re-check
    for _ in range(2):  # the new row is missing until the Cleaner repairs it: cached so
        assert ids(user_pub.get_all(r, user_id=b"d2")) == []
    bagstore.Cleaner(r).repair()  # its row writes bump the scopes they touch
    assert ids(user_pub.get_all(r, user_id=b"d2")) == [a]
    assert ids(user_pub.get_all(r, user_id=b"d1")) == []


def test_the_example_in_docs_cache_md_runs(tmp_path: Any, monkeypatch: Any) -> None:
    import re
    import tempfile
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "cache.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (its store lands here)
    exec(compile(code, "docs/cache.md", "exec"), {})
