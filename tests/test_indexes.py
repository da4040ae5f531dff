"""Secondary indexes: the write path keeps them, queries never return a wrong entity.

Runs on SQLite, four databases on one MariaDB, and four databases over two
MariaDB servers (``topo3``).
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import pytest

import bagstore
from bagstore import codec, keys, testing
from bagstore.sharding.hashing import bucket_of
from tests.colocation import apart
from tests.conftest import Topology

user_idx = bagstore.Index(table="index_user_id", properties=["user_id"], shard_on="user_id")
user_pub = bagstore.Index(
    table="index_user_published", properties=["user_id", "published"], shard_on="user_id"
)
tags_idx = bagstore.Index(table="index_tags", properties=["tags"])
name_idx = bagstore.Index(table="index_name", properties=["name"])
pub_idx = bagstore.Index(table="index_published", properties=["published"])
email_idx = bagstore.Index(table="index_email", properties=["email"], unique=True)
ALL = [user_idx, user_pub, tags_idx, name_idx, pub_idx, email_idx]


@pytest.fixture
def ds(topo3: Topology) -> bagstore.Datastore:
    return topo3.open(indexes=ALL, unique_lease=0.2)


@pytest.fixture(scope="module")
def shared_ds(shared_topo3: Topology) -> bagstore.Datastore:
    """A store the tests of refused queries share (each changes nothing)."""
    ds = shared_topo3.open(indexes=ALL, unique_lease=0.2)
    ds.put_many([{"user_id": b"u", "published": i, "name": f"n{i}"} for i in range(3)])
    return ds


def ids_of(entities: list[dict[str, object]]) -> list[bytes]:
    return [e["id"] for e in entities]  # type: ignore[misc]


def all_pages(
    index: bagstore.Index, ds: bagstore.Datastore, limit: int, **query: Any
) -> list[dict[str, Any]]:
    """Every entity of a query, read page by page with the cursor (each page
    holding at most ``limit``)."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = index.get_all(ds, limit=limit, cursor=cursor, **query)
        assert len(page) <= limit
        out += page
        cursor = page.cursor
        if cursor is None:
            return out


def assert_consistent(ds: bagstore.Datastore) -> None:
    report = ds.check()
    assert (report["missing"], report["stale"]) == (0, 0), report


def test_new_indexes_on_empty_kind_are_ready(ds: bagstore.Datastore) -> None:
    assert {t: s for t, (_, s) in ds.indexes().items()} == {i.table: "ready" for i in ALL}


def test_update_moves_entity_between_values(ds: bagstore.Datastore) -> None:
    entity_id = ds.put({"user_id": b"alice", "name": "x"})
    assert ids_of(user_idx.get_all(ds, user_id=b"alice")) == [entity_id]
    ds.put({"id": entity_id, "user_id": b"bob", "name": "x"})
    assert user_idx.get_all(ds, user_id=b"alice") == []
    assert ids_of(user_idx.get_all(ds, user_id=b"bob")) == [entity_id]
    assert_consistent(ds)


def test_rewrite_without_index_change_touches_no_index_row(ds: bagstore.Datastore) -> None:
    entity_id = ds.put({"user_id": b"u", "title": "a"})
    rows_before = {b.name: b.count("index_user_id") for b in ds.router.backends}
    calls: list[object] = []
    original = ds.indexer.apply
    ds.indexer.apply = lambda changes, **kw: (calls.append(list(changes)), original(changes, **kw))  # type: ignore[method-assign]
    ds.put({"id": entity_id, "user_id": b"u", "title": "b"})
    assert calls == [[]]
    assert {b.name: b.count("index_user_id") for b in ds.router.backends} == rows_before


def test_delete_empties_every_index(ds: bagstore.Datastore) -> None:
    entity_id = ds.put(
        {"user_id": b"u", "published": 5, "tags": ["a", "b"], "name": "n", "email": "e@x"}
    )
    assert sum(b.count(i.table) for b in ds.router.backends for i in ALL) == 7
    assert ds.delete(entity_id)
    assert sum(b.count(i.table) for b in ds.router.backends for i in ALL) == 0
    assert_consistent(ds)


def test_entity_lacking_a_property_has_no_row(ds: bagstore.Datastore) -> None:
    ds.put({"user_id": b"u"})  # no published: not in the compound index
    ds.put({"user_id": b"u", "published": None})  # None is never indexed
    assert len(user_idx.get_all(ds, user_id=b"u")) == 2
    assert user_pub.get_all(ds, user_id=b"u") == []
    assert sum(b.count("index_user_published") for b in ds.router.backends) == 0


def test_compound_prefix_range_order_and_pages(ds: bagstore.Datastore) -> None:
    random.seed(7)
    pubs = random.sample(range(1000), 60)
    for p in pubs:
        ds.put({"user_id": b"u1", "published": p})
        ds.put({"user_id": b"u2", "published": p})
    got = user_pub.get_all(ds, user_id=b"u1", published__gte=100, published__lt=900)
    assert [e["published"] for e in got] == sorted(p for p in pubs if 100 <= p < 900)
    assert all(e["user_id"] == b"u1" for e in got)
    # pages: neither skip nor repeat, descending
    seen = all_pages(user_pub, ds, 7, user_id=b"u1", order="-published")
    assert [e["published"] for e in seen] == sorted(pubs, reverse=True)


def test_cursor_of_another_query_is_refused(ds: bagstore.Datastore) -> None:
    for p in range(5):
        ds.put({"user_id": b"u1", "published": p})
    page = user_pub.get_all(ds, user_id=b"u1", limit=2)
    assert page.cursor is not None
    with pytest.raises(bagstore.InvalidQuery, match="another query"):
        user_pub.get_all(ds, user_id=b"u2", limit=2, cursor=page.cursor)
    with pytest.raises(bagstore.InvalidQuery, match="malformed"):
        user_pub.get_all(ds, user_id=b"u1", limit=2, cursor="not-a-cursor")


def test_in_returns_each_entity_once(ds: bagstore.Datastore) -> None:
    both = ds.put({"tags": ["a", "b", "c"]})
    only_a = ds.put({"tags": ["a"]})
    ds.put({"tags": ["z"]})
    got = tags_idx.get_all(ds, tags__in=["a", "b", "c"])
    assert sorted(ids_of(got)) == sorted([both, only_a])
    paged = ids_of(all_pages(tags_idx, ds, 1, tags__in=["a", "b"]))
    assert sorted(paged) == sorted([both, only_a])


def test_multi_valued_property_indexes_each_element(ds: bagstore.Datastore) -> None:
    entity_id = ds.put({"tags": ["red", "green", "red"]})
    assert ids_of(tags_idx.get_all(ds, tags="red")) == [entity_id]
    assert ids_of(tags_idx.get_all(ds, tags="green")) == [entity_id]
    assert sum(b.count("index_tags") for b in ds.router.backends) == 2
    ds.put({"id": entity_id, "tags": ["green"]})
    assert tags_idx.get_all(ds, tags="red") == []
    assert_consistent(ds)


def test_equality_is_pythons(ds: bagstore.Datastore) -> None:
    names = ["Bob", "bob", "bob ", "bób", "BOB", "bo", "bob\x00"]
    ids = {n: ds.put({"name": n}) for n in names}
    for n in names:
        assert ids_of(name_idx.get_all(ds, name=n)) == [ids[n]], n
    assert [e["name"] for e in name_idx.get_all(ds)] == sorted(names)
    assert [e["name"] for e in name_idx.get_all(ds, name__gt="bo")] == sorted(
        n for n in names if n > "bo"
    )


def test_numbers_datetimes_bytes_order_like_python(ds: bagstore.Datastore) -> None:
    values = [3, 2.5, -1, 10**20, -(10**20), 0.0, 1e-9, 7]
    for v in values:
        ds.put({"published": v})
    got = [e["published"] for e in pub_idx.get_all(ds, published__gte=-(10**30))]
    assert got == sorted(values)
    assert [e["published"] for e in pub_idx.get_all(ds, published=3.0)] == [3]
    t = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    ds.put({"published": t})
    ds.put({"published": t.astimezone(dt.timezone(dt.timedelta(hours=9)))})
    assert len(pub_idx.get_all(ds, published=t)) == 2  # the same instant


def test_range_stays_within_its_type(ds: bagstore.Datastore) -> None:
    ds.put({"published": 5})
    ds.put({"published": "5"})
    ds.put({"published": True})
    assert [e["published"] for e in pub_idx.get_all(ds, published__gt=0)] == [5]
    assert [e["published"] for e in pub_idx.get_all(ds, published__lt="z")] == ["5"]


def test_long_values_are_prefixes_and_rechecked(ds: bagstore.Datastore) -> None:
    base = "x" * 400
    a = ds.put({"name": base + "a"})
    b = ds.put({"name": base + "b"})
    assert ids_of(name_idx.get_all(ds, name=base + "a")) == [a]
    assert ids_of(name_idx.get_all(ds, name=base + "b")) == [b]
    assert name_idx.get_all(ds, name=base) == []
    assert sorted(ids_of(name_idx.get_all(ds, name__gt=base))) == sorted([a, b])


def test_unique_index(ds: bagstore.Datastore) -> None:
    first = ds.put({"email": "a@x"})
    with pytest.raises(bagstore.DuplicateValue, match="index_email"):
        ds.put({"email": "a@x", "name": "second"})
    assert name_idx.get_all(ds, name="second") == []  # nothing of it stored
    assert ds.count() == 1
    # the owner may rewrite itself
    ds.put({"id": first, "email": "a@x", "name": "again"})
    # once the owner lets go, the value is free
    ds.put({"id": first, "email": "b@x"})
    second = ds.put({"email": "a@x"})
    assert ids_of(email_idx.get_all(ds, email="a@x")) == [second]
    assert email_idx.get(ds, email="b@x")["id"] == first  # type: ignore[index]
    with pytest.raises(bagstore.DuplicateValue):
        ds.put_many([{"email": "c@x"}, {"email": "c@x"}])
    assert email_idx.get_all(ds, email="c@x") == []
    assert_consistent(ds)


def test_unique_value_left_by_a_crash_can_be_taken_over(ds: bagstore.Datastore) -> None:
    import time

    owner = ds.put({"email": "a@x"})
    with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": owner, "email": "b@x"})  # the claim on a@x is left behind
    time.sleep(0.25)  # past the test store's unique_lease
    taker = ds.put({"email": "a@x"})
    assert ids_of(email_idx.get_all(ds, email="a@x")) == [taker]


def test_unique_value_too_long_is_refused(ds: bagstore.Datastore) -> None:
    with pytest.raises(bagstore.InvalidEntity, match="unique"):
        ds.put({"email": "e" * 300})
    assert ds.count() == 0


@pytest.mark.parametrize("point", ["put.after_entity", "put.after_index_delete"])
def test_crash_during_put_never_yields_a_wrong_entity(ds: bagstore.Datastore, point: str) -> None:
    old = {"user_id": b"old", "published": 1, "tags": ["t1"]}
    new = {"user_id": b"new", "published": 2, "tags": ["t2"]}
    entity_id = ds.put({"id": apart(ds, old, new), **old})  # rows on other shards
    with testing.failpoint(point), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": entity_id, "user_id": b"new", "published": 2, "tags": ["t2"]})
    assert ds.get(entity_id)["user_id"] == b"new"  # type: ignore[index]
    # stale rows (old values) are skipped; missing rows (new values) may hide it
    assert user_idx.get_all(ds, user_id=b"old") == []
    assert tags_idx.get_all(ds, tags="t1") == []
    assert user_pub.get_all(ds, user_id=b"old", published__gte=0) == []
    for got in (user_idx.get_all(ds, user_id=b"new"), tags_idx.get_all(ds, tags="t2")):
        assert ids_of(got) in ([], [entity_id])
    report = ds.check()
    assert report["missing"] > 0
    if point == "put.after_entity":
        assert report["stale"] > 0


def test_crash_after_delete_never_yields_a_wrong_entity(ds: bagstore.Datastore) -> None:
    body = {"user_id": b"u", "tags": ["t"]}
    entity_id = ds.put({"id": apart(ds, body), **body})  # rows on other shards
    with testing.failpoint("delete.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.delete(entity_id)
    assert ds.get(entity_id) is None
    assert user_idx.get_all(ds, user_id=b"u") == []
    assert tags_idx.get_all(ds, tags="t") == []
    report = ds.check()
    assert report["stale"] == 2 and report["missing"] == 0


def test_unknown_failpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown failpoint"), testing.failpoint("put.nowhere"):
        pass


def test_scatter_equals_single_shard_answer(topo3: Topology, tmp_path: object) -> None:
    four = topo3.open(indexes=[pub_idx, user_pub])
    one = bagstore.open(f"{tmp_path}/one", indexes=[pub_idx, user_pub], shards=1)
    try:
        random.seed(3)
        entities = [
            {"id": bagstore.new_id(), "published": random.randrange(200), "user_id": b"u"}
            for _ in range(150)
        ]
        four.put_many([dict(e) for e in entities])
        one.put_many([dict(e) for e in entities])
        for kwargs in (
            {"published__gte": 50},
            {"published__lt": 120, "order": "-published"},
            {"published__in": [3, 50, 199, 7]},
        ):
            a = pub_idx.get_all(four, **kwargs)  # type: ignore[arg-type]
            b = pub_idx.get_all(one, **kwargs)  # type: ignore[arg-type]
            assert ids_of(a) == ids_of(b), kwargs
            assert ids_of(all_pages(pub_idx, four, 9, **kwargs)) == ids_of(b), kwargs
    finally:
        one.close()


def test_one_shard_answers_as_four(topo: Topology, tmp_path: object) -> None:
    """A store of one shard (its reads route without hashing ids) answers as
    one of four, over scans read in several pages and entities with several
    rows in one scan."""
    four = topo.open(indexes=[user_pub, tags_idx])
    one = bagstore.open(f"{tmp_path}/one", indexes=[user_pub, tags_idx], shards=1)
    try:
        random.seed(5)
        entities = [
            {
                "id": bagstore.new_id(),
                "user_id": b"u%d" % (i % 2),
                "published": random.randrange(400),
                "tags": random.sample(["a", "b", "c"], random.randrange(1, 3)),
            }
            for i in range(1300)
        ]
        four.put_many([dict(e) for e in entities])
        one.put_many([dict(e) for e in entities])
        for index, kwargs in (
            (user_pub, {"user_id": b"u0"}),  # 650 rows: pages of 501 from one scan
            (user_pub, {"user_id": b"u1", "published__gte": 20, "order": "-published"}),
            (tags_idx, {"tags__in": ["a", "b"]}),  # some entities twice in the scan
            (tags_idx, {"tags": "c"}),
        ):
            want = ids_of(index.get_all(four, **kwargs))  # type: ignore[arg-type]
            assert ids_of(index.get_all(one, **kwargs)) == want, kwargs  # type: ignore[arg-type]
            assert len(want) == len(set(want)) > 300
            assert ids_of(all_pages(index, one, 120, **kwargs)) == want, kwargs
    finally:
        one.close()


def test_query_with_shard_on_reads_one_shard(ds: bagstore.Datastore) -> None:
    for i in range(40):
        ds.put({"user_id": b"u%d" % (i % 8), "published": i})
    for b in ds.router.backends:
        b.scans = 0
    user_pub.get_all(ds, user_id=b"u3", published__gte=0)
    assert sorted(b.scans for b in ds.router.backends) == [0, 0, 0, 1]
    for b in ds.router.backends:
        b.scans = 0
    pub_idx.get_all(ds, published__gte=0)  # no shard_on value: every shard
    assert [b.scans for b in ds.router.backends] == [1, 1, 1, 1]


def test_scatter_over_one_connection_is_one_merged_scan(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards that one connection reaches (SQLite files, databases of one
    MariaDB server) are scanned in one statement, merged and limited in SQL:
    a page crowded onto one shard needs no second read."""
    hot = bagstore.Index(table="index_hot", properties=["published", "user_id"], shard_on="user_id")
    ds = topo.open(indexes=[hot], refresh_interval=3600)
    crowded = ds.put_many([{"user_id": b"hot", "published": i} for i in range(40)])
    ds.put_many([{"user_id": b"cold%d" % i, "published": 100 + i} for i in range(6)])
    statements = _count_statements(ds, monkeypatch)
    for b in ds.router.backends:
        b.scans = 0
    page = hot.get_all(ds, published__gte=0, limit=25)
    assert ids_of(page) == crowded[:25] and page.cursor is not None
    assert [b.scans for b in ds.router.backends] == [1, 1, 1, 1]
    # One statement: the scans and the bodies (joined) together.
    assert len(statements) == 1 and statements[0].count("UNION ALL") == 3
    rest = hot.get_all(ds, published__gte=0, limit=25, cursor=page.cursor)
    assert [e["published"] for e in rest] == [*range(25, 40), *range(100, 106)]
    assert rest.cursor is None


def test_scatter_page_from_one_crowded_server(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over several servers, each server's shards are one merged scan that
    reads first twice its share of the page; when the page is crowded onto one
    server, that one alone is read again, and the pages neither skip nor
    repeat."""
    from tests.conftest import _mysql_topology

    main, second = request.getfixturevalue("mysql_main"), request.getfixturevalue("mysql_second")
    topo = _mysql_topology("t31", [(main, 3), (second, 1)])
    try:
        hot = bagstore.Index(
            table="index_hot", properties=["published", "user_id"], shard_on="user_id"
        )
        ds = topo.open(indexes=[hot], refresh_interval=3600)
        shard_of = ds.placement.shard_of_bucket
        # a user whose index rows live on the second server's one shard
        user = next(
            u
            for u in (b"hot%d" % n for n in range(1000))
            if shard_of[bucket_of(keys.encode_value(u), ds.placement.buckets)] == 3
        )
        crowded = ds.put_many([{"user_id": user, "published": i} for i in range(40)])
        ds.put_many([{"user_id": b"cold%d" % i, "published": 100 + i} for i in range(6)])
        for b in ds.router.backends:
            b.scans = 0
        page = hot.get_all(ds, published__gte=0, limit=25)
        assert ids_of(page) == crowded[:25] and page.cursor is not None
        # the lone shard's first read (14 rows: twice a quarter of the page)
        # fell short, so it alone was read again
        assert [b.scans for b in ds.router.backends] == [1, 1, 1, 2]
        rest = hot.get_all(ds, published__gte=0, limit=25, cursor=page.cursor)
        assert [e["published"] for e in rest] == [*range(25, 40), *range(100, 106)]
        assert rest.cursor is None
        assert len(ids_of(page) + ids_of(rest)) == len(set(ids_of(page) + ids_of(rest))) == 46
    finally:
        topo.close()


def test_ds_query_picks_the_best_index(ds: bagstore.Datastore) -> None:
    for i in range(10):
        ds.put({"user_id": b"u", "published": i, "name": f"n{i}"})
    got = ds.query(user_id=b"u", published__gte=5, order="-published", limit=3)
    assert [e["published"] for e in got] == [9, 8, 7]
    assert len(ds.query(name="n4")) == 1
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(title="x", published__gt=3)
    assert "properties=['title', 'published']" in exc.value.suggestion


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"published__like": 3}, "unknown lookup"),
        ({"published__gte__x": 3}, "unknown lookup"),
        ({"user_id__in": b"abc"}, "list of values"),
        ({"user_id": None}, "None is never indexed"),
        ({"user_id": {"a": 1}}, "cannot index"),
        ({"published": 3}, "cannot filter"),
        ({"user_id": b"u", "published__gt": 1, "published__gte": 2}, "one lower"),
        ({"user_id": b"u", "order": "title"}, "cannot order"),
        ({"user_id": b"u", "limit": 0}, "limit"),
        ({"user_id": b"u", "limit": "10"}, "limit"),
    ],
)
def test_bad_queries(
    shared_ds: bagstore.Datastore, kwargs: dict[str, object], message: str
) -> None:
    before = user_pub.get_all(shared_ds, user_id=b"u")
    with pytest.raises(bagstore.InvalidQuery, match=message):
        user_pub.get_all(shared_ds, **kwargs)  # type: ignore[arg-type]
    assert user_pub.get_all(shared_ds, user_id=b"u") == before


def test_query_on_undeclared_index_says_so(shared_ds: bagstore.Datastore) -> None:
    other = bagstore.Index(table="index_other", properties=["other"])
    with pytest.raises(bagstore.NoIndexForQuery, match="not registered"):
        other.get_all(shared_ds, other=1)


def test_index_definition_conflict_is_refused(topo3: Topology) -> None:
    topo3.open(indexes=[name_idx])
    changed = bagstore.Index(table="index_name", properties=["name", "published"])
    with pytest.raises(bagstore.ConfigurationError, match="registered as"):
        topo3.open(indexes=[changed])


def test_new_index_on_existing_data_is_building(topo3: Topology) -> None:
    ds = topo3.open()
    ds.put({"name": "old"})
    ds.add_index(name_idx)
    assert ds.indexes()["index_name"][1] == "building"
    with pytest.raises(bagstore.IndexNotReady, match="building"):
        name_idx.get_all(ds, name="old")
    with pytest.raises(bagstore.IndexNotReady):
        ds.query(name="old")
    new = ds.put({"name": "new"})  # writes maintain it at once
    assert ids_of(name_idx.get_all(ds, name="new", allow_partial=True)) == [new]
    assert name_idx.get_all(ds, name="old", allow_partial=True) == []
    report = ds.check()
    assert report["indexes"]["index_name"]["missing"] == 1


def test_writer_maintains_indexes_it_does_not_declare(topo3: Topology) -> None:
    declaring = topo3.open(indexes=[name_idx])
    other = topo3.open()  # knows nothing of index_name in code
    entity_id = other.put({"name": "z"})
    assert ids_of(name_idx.get_all(declaring, name="z")) == [entity_id]


def test_retire_and_drop(topo3: Topology) -> None:
    ds = topo3.open(indexes=[name_idx])
    ds.put({"name": "a"})
    with pytest.raises(bagstore.ConfigurationError, match="retire it"):
        ds.drop_index("index_name")
    ds.retire_index("index_name")
    with pytest.raises(bagstore.IndexNotReady, match="retired"):
        name_idx.get_all(ds, name="a")
    ds.put({"name": "b"})  # retired: no longer written
    assert sum(b.count("index_name") for b in ds.router.backends) == 1
    ds.drop_index("index_name")
    assert "index_name" not in ds.indexes()


def test_shards_sharing_a_server_are_read_in_one_statement(
    topo3: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No catalog re-read in the middle: it would add statements to the count.
    ds = topo3.open(indexes=[pub_idx], refresh_interval=3600)
    ids = ds.put_many([{"published": i} for i in range(60)])
    assert len({ds.placement.shard_of_bucket[ds.bucket_of_id(i) or 0] for i in ids}) == 4
    statements = _count_statements(ds, monkeypatch)
    # One statement per MariaDB server; SQLite files one by one (a UNION ALL
    # of them saves no round trip).
    groups = {"sqlite": 4, "t": 1, "t2": 2}[topo3.name]
    got = ds.get_many(list(reversed(ids)))
    assert [e["published"] for e in got if e is not None] == list(range(59, -1, -1))
    assert len(statements) == groups
    statements.clear()
    for b in ds.router.backends:
        b.scans = 0
    page = pub_idx.get_all(ds, published__gte=10, order="-published", limit=25)
    assert [e["published"] for e in page] == list(range(59, 34, -1))
    assert [b.scans for b in ds.router.backends] == [1, 1, 1, 1]  # every shard scanned once
    # The scans of one connection's shards are one statement, merged in SQL.
    # When that is every shard, it reads the bodies too (joined); over two
    # servers, each merged scan reads past its share of the page and half its
    # rows' entities live on the other server: the bodies follow, one
    # statement a server.
    if topo3.name == "t2":
        assert len(statements) == 4
        assert not any("JOIN" in sql for sql in statements)
    else:
        assert len(statements) == 1 and "LEFT JOIN" in statements[0]
    rest = pub_idx.get_all(ds, published__gte=10, order="-published", cursor=page.cursor)
    assert [e["published"] for e in rest] == list(range(34, 9, -1))


def _count_statements(ds: bagstore.Datastore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the reads sent to ``ds``'s shards: ``fetchall`` on a shard's own
    connection, and on SQLite ``read_together`` (MariaDB's calls fetchall)."""
    statements: list[str] = []
    for b in ds.router.backends:
        original = b.fetchall

        def counting(sql: str, params: Any = (), _original: Any = original) -> Any:
            statements.append(sql)
            return _original(sql, params)

        monkeypatch.setattr(b, "fetchall", counting)
        if b.dialect.name == "sqlite":
            together = b.read_together

            def counting_together(
                sql: str, params: Any, reach: Any, _original: Any = together
            ) -> Any:
                statements.append(sql)
                return _original(sql, params, reach)

            monkeypatch.setattr(b, "read_together", counting_together)
    return statements


def test_a_lookup_reads_bodies_with_the_index_rows(
    topo3: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's index rows live on one shard, the user's entities on all four.
    ds = topo3.open(indexes=[user_idx], refresh_interval=3600)
    user = b"u" * 16
    ids = ds.put_many([{"user_id": user, "n": i} for i in range(40)])
    shard_of = ds.placement.shard_of_bucket
    homes = {shard_of[ds.bucket_of_id(i) or 0] for i in ids}
    assert len(homes) == 4
    statements = _count_statements(ds, monkeypatch)
    got = user_idx.get_all(ds, user_id=user)
    assert sorted(e["n"] for e in got) == list(range(40))
    # One statement when the scan's connection reaches every shard (one MariaDB
    # server, SQLite files); else the bodies the scan could not join are read
    # afterwards: the other server's two databases in one statement.
    expected = {"sqlite": 1, "t": 1, "t2": 2}[topo3.name]
    assert len(statements) == expected, statements


def test_a_joined_body_is_taken_only_from_the_shard_the_placement_names(
    topo3: Topology,
) -> None:
    ds = topo3.open(indexes=[user_idx], refresh_interval=3600)
    user = b"v" * 16
    shard_of = ds.placement.shard_of_bucket
    index_shard = shard_of[bucket_of(keys.encode_value(user), ds.placement.buckets)]
    # An entity that lives on another shard than its user's index rows...
    while True:
        entity_id = ds.put({"user_id": user, "name": "real"})
        bucket = ds.bucket_of_id(entity_id)
        assert bucket is not None
        if shard_of[bucket] != index_shard:
            break
        ds.delete(entity_id)
    # ...and a stale copy of it on the index's shard (as a move leaves one
    # behind until its source copy is deleted), which the scan can join.
    b = ds.router.backends[index_shard]
    stale = codec.encode({"id": entity_id, "user_id": user, "name": "stale"})
    p = b.dialect.param
    b.execute(
        f"INSERT INTO entities (id, bucket, updated, version, body) VALUES ({p}, {p}, 1, 1, {p})",
        (entity_id, bucket, stale),
    )
    got = user_idx.get_all(ds, user_id=user)
    assert [e["name"] for e in got] == ["real"]
    assert ds.get(entity_id) == {"id": entity_id, "user_id": user, "name": "real"}


def test_a_merged_scan_never_returns_a_stale_copy(topo3: Topology) -> None:
    ds = topo3.open(indexes=[pub_idx], refresh_interval=3600)
    shard_of = ds.placement.shard_of_bucket
    while True:  # an entity that does not live on shard 0...
        entity_id = ds.put({"published": 7, "name": "real"})
        bucket = ds.bucket_of_id(entity_id)
        assert bucket is not None
        if shard_of[bucket] != 0:
            break
        ds.delete(entity_id)
    # ...and a stale copy of it on shard 0, the first entity table a scan
    # over every shard joins: the copy is found first, and not used.
    b = ds.router.backends[0]
    stale = codec.encode({"id": entity_id, "published": 7, "name": "stale"})
    p = b.dialect.param
    b.execute(
        f"INSERT INTO entities (id, bucket, updated, version, body) VALUES ({p}, {p}, 1, 1, {p})",
        (entity_id, bucket, stale),
    )
    assert [e["name"] for e in pub_idx.get_all(ds, published__gte=0)] == ["real"]
    newest_first = pub_idx.get_all(ds, published__lt=9, order="-published")
    assert [e["name"] for e in newest_first] == ["real"]


def test_a_kind_placed_by_the_shard_on_value_joins_only_its_own_table(
    topo3: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = topo3.open(indexes=[user_idx], shard_key="user_id", refresh_interval=3600)
    user = b"w" * 16
    ds.put_many([{"user_id": user, "n": i} for i in range(10)])
    statements = _count_statements(ds, monkeypatch)
    assert sorted(e["n"] for e in user_idx.get_all(ds, user_id=user)) == list(range(10))
    # The user's entities sit beside the user's index rows: one statement,
    # joined with that database's entity table alone.
    assert len(statements) == 1
    assert statements[0].count("LEFT JOIN") == 1


def test_a_scatter_over_a_kind_kept_beside_its_index_rows_joins_per_connection(
    topo3: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_user = bagstore.Index(
        table="index_by_user", properties=["user_id", "published"], shard_on="user_id"
    )
    ds = topo3.open(indexes=[by_user], shard_key="user_id", refresh_interval=3600)
    for u in range(12):
        ds.put_many([{"user_id": b"u%d" % u, "published": u * 100 + i} for i in range(5)])
    statements = _count_statements(ds, monkeypatch)
    users = [b"u%d" % u for u in range(12)]
    page = by_user.get_all(ds, user_id__in=users, limit=30)
    # Each connection's shards are one statement that reads the bodies too
    # (every entity sits beside its index rows): one statement per server.
    assert len(statements) == {"sqlite": 1, "t": 1, "t2": 2}[topo3.name], statements
    assert all("LEFT JOIN" in sql for sql in statements)
    everything = by_user.get_all(ds, user_id__in=users)
    # (__in on user_id: the rows come in the order of the next column)
    want = [u * 100 + i for u in range(12) for i in range(5)]
    assert [e["published"] for e in everything] == want
    assert ids_of(page) == ids_of(everything)[:30]


def test_sqlite_reads_more_files_than_one_connection_attaches(tmp_path: Any) -> None:
    # 12 files: one reading connection attaches at most 10, so a lookup's scan
    # joins 10 files' entity tables and reads the other bodies by id.
    urls = [f"sqlite:///{tmp_path}/shard_{i}.db" for i in range(12)]
    ds = bagstore.Datastore(urls, indexes=[user_idx, pub_idx])
    other = bagstore.Datastore(
        [f"sqlite:///{tmp_path}/other_{i}.db" for i in range(4)], indexes=[user_idx]
    )
    try:
        user = b"x" * 16
        ids = ds.put_many([{"user_id": user, "n": i, "published": i} for i in range(120)])
        # A scatter: the files in two merged scans (10 and 2), merged again.
        for b in ds.router.backends:
            b.scans = 0
        page = pub_idx.get_all(ds, published__gte=7, limit=30)
        assert [e["n"] for e in page] == list(range(7, 37))
        scans = [b.scans for b in ds.router.backends]  # every file (twice if crowded)
        assert min(scans) == 1 and max(scans) <= 2, scans
        assert [e["n"] for e in all_pages(pub_idx, ds, 25, published__lt=100)] == list(range(100))
        other_ids = other.put_many([{"user_id": user, "n": i} for i in range(8)])
        assert len({ds.placement.shard_of_bucket[ds.bucket_of_id(i) or 0] for i in ids}) == 12
        for _ in range(2):  # the same thread's connection, attaching and detaching
            got = ds.get_many(ids)
            assert [e["n"] for e in got if e is not None] == list(range(120))
            assert sorted(e["n"] for e in user_idx.get_all(ds, user_id=user)) == list(range(120))
            assert [e["n"] for e in other.get_many(other_ids) if e is not None] == list(range(8))
            assert len(user_idx.get_all(other, user_id=user)) == 8
    finally:
        ds.close()
        other.close()


def test_one_pass_answers_as_the_general_loop(tmp_path: Any) -> None:
    """A query whose one stream joins the bodies is answered in one pass over
    its first page (query._one_pass); every page (entities and cursor) equals
    what the general loop gives, with stale rows, rows repeated by lists,
    ``__in``, ranges, orders and limits.  SQLite: the path is the same on
    every backend."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from bagstore import query

    pair = bagstore.Index(table="index_a_b", properties=["a", "b"], shard_on="a")
    ds = bagstore.open(str(tmp_path / "store"), indexes=[pair], shards=2)
    rng = random.Random(5)
    values: list[object] = [0, 1, 2, 3, "x", "y", b"x"]
    ids = []
    for n in range(240):
        entity: dict[str, Any] = {"a": n % 3}
        if n % 7:
            b = rng.choice(values)
            entity["b"] = [b, rng.choice(values)] if n % 4 == 0 else b
        ids.append(ds.put(entity))
    for entity_id in ids[:30]:  # stale rows: the entity changed, its old rows stayed
        with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
            ds.put({"id": entity_id, "a": 1, "b": rng.choice(values)})
    taken: list[int] = []
    original = query._one_pass

    def counted(*args: Any, **kwargs: Any) -> Any:
        answer = original(*args, **kwargs)
        taken.append(answer is not None)
        return answer

    def pages(filters: dict[str, Any], order: str | None, limit: int | None) -> list[Any]:
        out, cursor = [], None
        for _ in range(300):
            page = pair.get_all(ds, order=order, limit=limit, cursor=cursor, **filters)
            out.append((ids_of(page), page.cursor))
            cursor = page.cursor
            if cursor is None:
                return out
        raise AssertionError("the cursor never ended")

    scalars = st.sampled_from(values)
    bounds = st.sampled_from(["b__gt", "b__gte", "b__lt", "b__lte"])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        a=st.one_of(st.sampled_from([0, 1, 2]), st.lists(st.sampled_from([0, 1, 2]), min_size=1)),
        b=st.one_of(
            st.none(),
            scalars,
            st.lists(scalars, min_size=1, max_size=3),
            st.dictionaries(bounds, st.sampled_from([1, 2, "x"]), min_size=1, max_size=1),
        ),
        desc=st.booleans(),
        limit=st.sampled_from([None, 1, 2, 5, 30]),
    )
    def check(a: Any, b: Any, desc: bool, limit: int | None) -> None:
        filters: dict[str, Any] = {"a__in": a} if isinstance(a, list) else {"a": a}
        order = None
        if isinstance(b, dict):
            filters.update(b)
        elif isinstance(b, list):
            filters["b__in"] = b
        elif b is not None:
            filters["b"] = b
        if "b__in" not in filters and "b" not in filters and not isinstance(a, list):
            order = "-b" if desc else "b"
        query._one_pass = counted  # type: ignore[assignment]
        try:
            fast = pages(filters, order, limit)
        finally:
            query._one_pass = original  # type: ignore[assignment]
        query._one_pass = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            slow = pages(filters, order, limit)
        finally:
            query._one_pass = original  # type: ignore[assignment]
        assert fast == slow, filters

    try:
        check()
    finally:
        ds.close()
    assert any(taken) and not all(taken)  # both ways were taken
