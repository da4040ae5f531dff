"""Typed tables (bagstore.tables): fields, keys, load on one shard, updates of
the changed fields, bad input, schema evolution, ids across processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, date, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bagstore
from bagstore.backends import Backend
from bagstore.errors import ConfigurationError, InvalidEntity, InvalidQuery
from bagstore.tables import ID_PREFIX, id_of_pk, pk_of_id
from tests import servers
from tests.conftest import Topology


class Photo(
    bagstore.Model, kind="photos", shard_key="user_id", indexes=[("user_id", "posted_date")]
):
    photo_id: int = bagstore.auto_id()
    user_id: int
    title: str = ""
    posted_date: date | None = None
    tags: list[str] = []
    meta: dict[str, Any] = {}
    score: float = 0.0
    public: bool = True
    taken: datetime | None = None
    thumb: bytes | None = None


@pytest.fixture
def photos(topo: Topology) -> Iterator[bagstore.Table[Photo]]:
    ds = topo.open(kind="photos", shard_key="user_id")
    yield bagstore.Table(Photo, ds)


@pytest.fixture(scope="module")
def shared_photos(shared_topo: Topology) -> bagstore.Table[Photo]:
    """A table the tests of refused input share (each checks nothing is stored)."""
    return bagstore.Table(Photo, shared_topo.open(kind="photos", shard_key="user_id"))


def test_every_field_type_round_trips(photos: bagstore.Table[Photo]) -> None:
    row = Photo(
        user_id=7,
        title="sea",
        posted_date=date(2010, 6, 2),
        tags=["a", "b"],
        meta={"k": [1, {"x": None}]},
        score=3,  # an int is taken for a float, stored as a float
        public=False,
        taken=datetime(2010, 6, 2, 10, 30, tzinfo=UTC),
        thumb=b"\x00\xff",
    )
    photos.insert(row)
    assert isinstance(row.photo_id, int) and row.photo_id >= 1
    back = photos.load(7, row.photo_id)
    assert back is not None
    assert back.as_dict() == {**row.as_dict(), "score": 3.0}
    assert type(back.score) is float and type(back.posted_date) is date
    assert photos.ds.get(id_of_pk(row.photo_id))["posted_date"] == date(2010, 6, 2)


def test_a_rows_key_cannot_change(photos: bagstore.Table[Photo]) -> None:
    """Found by hypothesis: a loaded row whose key was set to another row's
    was written over that row when both were written together (one version):
    update and delete were conditional on the old row's version only."""
    ds = photos.ds
    ds.put_many(
        [{"id": id_of_pk(pk), "photo_id": pk, "user_id": 1, "title": f"t{pk}"} for pk in (100, 101)]
    )
    assert ds.get_with_version(id_of_pk(100))[1] == ds.get_with_version(id_of_pk(101))[1]  # type: ignore[index]
    for write in (photos.update, photos.delete):
        row = photos.load(1, 100)
        assert row is not None
        row.photo_id = 101
        with pytest.raises(InvalidEntity, match="key photo_id cannot change"):
            write(row)
    rows = [photos.load(1, pk) for pk in (100, 101)]
    assert [(p.photo_id, p.title) for p in rows if p] == [(100, "t100"), (101, "t101")]


def test_insert_load_update_delete_fetch(photos: bagstore.Table[Photo]) -> None:
    a = photos.insert(photos.new(user_id=1, title="Workforme", posted_date=date(2010, 7, 1)))
    b = photos.insert(Photo(user_id=1, title="old", posted_date=date(2010, 5, 1)))
    c = photos.insert(Photo(user_id=2, title="other", posted_date=date(2010, 8, 1)))
    assert a.pk is not None and b.pk is not None and c.pk is not None
    assert a.pk < b.pk < c.pk  # one process: increasing
    loaded = photos.load(1, a.pk)
    assert loaded == a
    loaded.title = "Database Sharding"
    assert photos.update(loaded) is True
    assert photos.update(loaded) is False  # nothing changed since
    assert photos.load(1, a.pk).title == "Database Sharding"  # type: ignore[union-attr]
    found = photos.fetch(user_id=1, posted_date__gt=date(2010, 6, 1))
    assert [p.pk for p in found] == [a.pk] and found.cursor is None
    ordered = photos.fetch(user_id=1, order="-posted_date")
    assert [p.pk for p in ordered] == [a.pk, b.pk]
    assert photos.delete(loaded) is True
    assert photos.load(1, a.pk) is None
    assert photos.delete(loaded) is False
    assert [p.pk for p in photos.fetch(user_id=1, posted_date__gt=date(2010, 1, 1))] == [b.pk]


def test_load_with_another_users_key_finds_nothing(photos: bagstore.Table[Photo]) -> None:
    row = photos.insert(Photo(user_id=1, title="mine"))
    assert row.pk is not None
    assert photos.load(2, row.pk) is None
    assert photos.load(1, row.pk + 1000) is None


def _spy(backends: tuple[Backend, ...], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every read a backend is asked for (which shard, which method)."""
    calls: list[str] = []
    for backend in backends:
        for method in ("read_bodies", "get_body", "entity_rows", "lookup_ids"):
            real = getattr(backend, method)

            def spy(
                *args: Any, _real: Any = real, _m: str = method, _b: Backend = backend, **kw: Any
            ) -> Any:
                calls.append(f"{_b.name} {_m}")
                return _real(*args, **kw)

            monkeypatch.setattr(backend, method, spy)
    return calls


def test_load_reads_one_shard_found_or_not(
    photos: bagstore.Table[Photo], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [photos.insert(Photo(user_id=u, title=f"t{u}")) for u in range(8)]
    calls = _spy(photos.ds.router.backends, monkeypatch)
    for row in rows:
        assert row.pk is not None
        calls.clear()
        assert photos.load(row.user_id, row.pk) == row
        assert len(calls) == 1, calls  # one statement, on the key's shard
        calls.clear()
        assert photos.load(row.user_id, row.pk + 10_000) is None
        assert len(calls) == 1, calls  # a miss looks nowhere else
    shards = {c.split()[0] for c in calls}
    assert len(shards) == 1


def test_ids_are_the_keys_behind_a_zero_prefix() -> None:
    assert id_of_pk(1) == ID_PREFIX + (1).to_bytes(8, "big")
    assert pk_of_id(id_of_pk(2**64 - 1)) == 2**64 - 1
    assert pk_of_id(bagstore.new_id()) is None
    for bad in (0, -1, 2**64, True, 1.0, "1"):
        with pytest.raises(InvalidQuery, match="primary key"):
            id_of_pk(bad)  # type: ignore[arg-type]


# -- bad input: a clear error naming the field, nothing stored ------------------------


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"user_id": "1"}, "Photo.user_id: expected int, got str '1'"),
        ({"user_id": True}, "Photo.user_id: expected int, got bool"),
        ({"user_id": 1, "title": 5}, "Photo.title: expected str, got int 5"),
        ({"user_id": 1, "posted_date": datetime(2010, 1, 1)}, "Photo.posted_date: expected date"),
        ({"user_id": 1, "tags": ["a", 2]}, "Photo.tags: expected list[str]"),
        ({"user_id": 1, "tags": ("a",)}, "Photo.tags: expected list[str], got tuple"),
        ({"user_id": 1, "meta": {1: 2}}, "Photo.meta: expected dict[str, Any]"),
        ({"user_id": 1, "score": "high"}, "Photo.score: expected float"),
        ({"user_id": 1, "public": 1}, "Photo.public: expected bool, got int"),
        ({"user_id": 1, "thumb": bytearray(b"x")}, "Photo.thumb: expected bytes | None"),
        ({"user_id": None}, "Photo.user_id: expected int, got NoneType"),
    ],
)
def test_a_wrong_type_is_refused_and_nothing_stored(
    shared_photos: bagstore.Table[Photo], values: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(InvalidEntity) as info:
        shared_photos.insert(Photo(**values))
    assert fragment in str(info.value)
    assert shared_photos.ds.count() == 0


def test_unknown_and_missing_fields_are_refused_and_nothing_stored(
    photos: bagstore.Table[Photo],
) -> None:
    with pytest.raises(InvalidEntity, match="Photo: unknown field 'titel'"):
        Photo(user_id=1, titel="typo")
    with pytest.raises(InvalidEntity, match=r"Photo\.user_id: required field missing"):
        Photo(title="no user")
    row = Photo(user_id=1)
    row.titel = "typo"  # type: ignore[attr-defined]
    with pytest.raises(InvalidEntity, match="unknown field 'titel'"):
        photos.insert(row)
    row = Photo(user_id=1)
    del row.user_id
    with pytest.raises(InvalidEntity, match=r"Photo\.user_id: required field missing"):
        photos.insert(row)
    assert photos.ds.count() == 0
    with pytest.raises(InvalidEntity, match="Photo rows"):
        photos.insert({"user_id": 1})  # type: ignore[arg-type]


def test_a_bad_update_changes_nothing(photos: bagstore.Table[Photo]) -> None:
    row = photos.insert(Photo(user_id=1, title="kept"))
    assert row.pk is not None
    row.title = 42  # type: ignore[assignment]
    with pytest.raises(InvalidEntity, match=r"Photo\.title: expected str"):
        photos.update(row)
    assert photos.load(1, row.pk).title == "kept"  # type: ignore[union-attr]


def test_bad_queries_and_loads(photos: bagstore.Table[Photo]) -> None:
    with pytest.raises(InvalidQuery, match="unknown field 'colour'"):
        photos.fetch(colour="red")
    with pytest.raises(InvalidQuery, match="takes the user_id and the photo_id"):
        photos.load(1)
    with pytest.raises(InvalidQuery, match="shard key 'user_id'"):
        photos.load([1], 5)


def test_bad_declarations_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="auto_id"):

        class NoKey(bagstore.Model, kind="nokey"):
            name: str

    with pytest.raises(ConfigurationError, match="not one a table field may have"):

        class BadType(bagstore.Model, kind="badtype"):
            key: int = bagstore.auto_id()
            when: complex

    with pytest.raises(ConfigurationError, match="shard_key 'nope'"):

        class BadKey(bagstore.Model, kind="badkey", shard_key="nope"):
            key: int = bagstore.auto_id()

    with pytest.raises(ConfigurationError, match="global table has no shard_key"):

        class Both(bagstore.Model, kind="both", shard_key="a", global_kind=True):
            key: int = bagstore.auto_id()
            a: int

    with pytest.raises(ConfigurationError, match="not a field"):

        class BadIndex(bagstore.Model, kind="badindex", indexes=[("nope",)]):
            key: int = bagstore.auto_id()

    with pytest.raises(ConfigurationError, match=r"unknown table option\(s\) \['shardkey'\]"):

        class Typo(bagstore.Model, kind="typo", shardkey="a"):  # type: ignore[call-arg]
            key: int = bagstore.auto_id()


def test_a_table_refuses_a_datastore_of_another_kind_or_placement(topo: Topology) -> None:
    with pytest.raises(ConfigurationError, match="kind 'photos'"):
        bagstore.Table(Photo, topo.open())
    with pytest.raises(ConfigurationError, match="placed by 'user_id'"):
        bagstore.Table(Photo, topo.open(kind="photos"))


# -- updates: only the changed fields ------------------------------------------------


def test_update_writes_only_the_changed_fields_over_what_is_stored(
    photos: bagstore.Table[Photo],
) -> None:
    row = photos.insert(Photo(user_id=1, title="a", tags=["x"], posted_date=date(2010, 1, 1)))
    assert row.pk is not None
    entity_id = id_of_pk(row.pk)
    # another writer, untyped, changes a field and adds a property no field declares
    body = photos.ds.get(entity_id)
    assert body is not None
    photos.ds.put({**body, "score": 9.5, "legacy": "kept"})
    fetched = photos.fetch(user_id=1)[0]  # a row whose version is not known
    fetched.tags.append("y")  # a change inside a list is seen
    photos.ds.put({**photos.ds.get(entity_id), "title": "b"})  # type: ignore[dict-item]
    assert photos.update(fetched) is True
    stored = photos.ds.get(entity_id)
    assert stored is not None
    assert stored["tags"] == ["x", "y"]
    assert stored["title"] == "b" and stored["score"] == 9.5 and stored["legacy"] == "kept"


def test_update_of_a_deleted_row_says_so(photos: bagstore.Table[Photo]) -> None:
    row = photos.insert(Photo(user_id=1, title="a", posted_date=date(2010, 1, 1)))
    fetched = photos.fetch(user_id=1)[0]
    assert photos.delete(row)
    fetched.title = "b"
    with pytest.raises(bagstore.RowMissing, match="not stored"):
        photos.update(fetched)


# -- schema evolution ------------------------------------------------------------------


def test_old_entities_read_a_new_field_with_its_default(tmp_path: Any) -> None:
    class V1(bagstore.Model, kind="notes"):
        note_id: int = bagstore.auto_id()
        text: str

    class V2(bagstore.Model, kind="notes"):
        note_id: int = bagstore.auto_id()
        text: str
        stars: int = 0
        labels: list[str] = []

    class V3(bagstore.Model, kind="notes"):
        note_id: int = bagstore.auto_id()
        text: str
        owner: int  # required, no default: old entities cannot be read as V3

    with V1.open(tmp_path) as v1:
        old = v1.insert(V1(text="hello"))
    assert old.pk is not None
    with V2.open(tmp_path) as v2:
        row = v2.load(old.pk)
        assert row is not None and (row.stars, row.labels) == (0, [])
        row.labels.append("new")
        assert v2.update(row)
        assert v2.load(old.pk).labels == ["new"]  # type: ignore[union-attr]
    with V3.open(tmp_path) as v3, pytest.raises(InvalidEntity, match="'owner', a required"):
        v3.load(old.pk)


# -- ids across processes -------------------------------------------------------------


def test_keys_are_unique_across_processes_and_increasing_in_each(topo: Topology) -> None:
    ds = topo.open(kind="photos", shard_key="user_id")
    bagstore.Table(Photo, ds)  # registers the kind and its index
    code = f"""
        import json, sys
        import bagstore
        from tests.test_tables import Photo
        ds = bagstore.Datastore({topo.urls!r}, kind="photos", shard_key="user_id")
        photos = bagstore.Table(Photo, ds)
        keys = [photos.insert(Photo(user_id=i % 5, title="t")).photo_id for i in range(300)]
        print(json.dumps(keys))
        """
    procs = [servers.spawn_python(code) for _ in range(2)]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        runs.append(json.loads(out))
    for keys in runs:
        assert keys == sorted(keys) and len(set(keys)) == 300
    assert not set(runs[0]) & set(runs[1])
    assert ds.count() == 600


def test_changing_the_shard_key_moves_the_row(photos: bagstore.Table[Photo]) -> None:
    row = photos.insert(Photo(user_id=1, title="mine", posted_date=date(2010, 1, 1)))
    assert row.pk is not None
    row.user_id = 2
    assert photos.update(row)
    assert photos.load(1, row.pk) is None
    moved = photos.load(2, row.pk)
    assert moved is not None and moved.title == "mine"
    assert [p.pk for p in photos.fetch(user_id=2)] == [row.pk] and not photos.fetch(user_id=1)
    assert photos.ds.bucket_of_id(id_of_pk(row.pk)) == photos._bucket(2)
    moved.title = "again"  # a loaded row: conditional on its version, read on user 2's shard
    assert photos.update(moved) and photos.load(2, row.pk).title == "again"  # type: ignore[union-attr]


class Post(bagstore.Model, kind="dposts", shard_key="author", indexes=[("author", "n")]):
    post_id: int = bagstore.auto_id(sequence="posts_seq", block=10, start=500)
    author: str
    n: int = 0


def test_a_table_over_the_directory_shard_map(topo: Topology) -> None:
    posts = bagstore.Table(
        Post, topo.open(kind="dposts", shard_key="author", shard_map="directory")
    )
    rows = [posts.insert(Post(author=a, n=i)) for i, a in enumerate(["ann", "bob", "ann"])]
    assert [r.post_id for r in rows] == [500, 501, 502]  # the sequence's start
    assert posts.load("ann", 502) == rows[2]
    assert posts.load("zed", 502) is None  # a key the directory does not know: no shard is read
    assert [p.n for p in posts.fetch(author="ann")] == [0, 2]
    moved = posts.ds.migrate_key(
        "ann",
        (posts.ds.placer.bucket_of_key(bagstore.keys.encode_value("ann"), for_write=False) or 0)
        + 1,
        wait=0,
    )
    assert moved == 2
    assert posts.load("ann", 500) == rows[0]  # found in the key's new bucket


def test_the_modules_doctests_pass() -> None:
    import doctest

    from bagstore import fields, models, tables
    from bagstore.sharding import home

    for module in (tables, models, fields, home):
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and (attempted > 0 or module is home)


class Sample(bagstore.Model, kind="samples"):
    key: int = bagstore.auto_id()
    n: int
    s: str
    b: bytes
    f: float
    flag: bool
    day: date | None
    at: datetime
    items: list[int]
    extra: dict[str, Any]


samples = st.builds(
    lambda **kw: Sample(**kw),
    n=st.integers(min_value=-(2**70), max_value=2**70),
    s=st.text(max_size=20),
    b=st.binary(max_size=20),
    f=st.floats(allow_nan=False),
    flag=st.booleans(),
    day=st.none() | st.dates(),
    at=st.datetimes() | st.datetimes(timezones=st.just(UTC)),
    items=st.lists(st.integers(), max_size=5),
    extra=st.dictionaries(st.text(max_size=5), st.none() | st.integers() | st.dates(), max_size=3),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=st.lists(samples, min_size=1, max_size=4))
def test_generated_rows_round_trip_with_their_types(
    tmp_path_factory: Any, rows: list[Sample]
) -> None:
    with Sample.open(tmp_path_factory.mktemp("samples"), shards=2) as table:
        for row in rows:
            table.insert(row)
            back = table.load(row.pk)
            assert back is not None and back.as_dict() == row.as_dict()
            for name, value in row.as_dict().items():
                assert type(getattr(back, name)) is type(value), name


def test_update_and_delete_are_conditional_on_the_version_loaded(
    photos: bagstore.Table[Photo],
) -> None:
    row = photos.insert(Photo(user_id=1, title="a", posted_date=date(2010, 1, 1)))
    assert row.pk is not None
    mine, theirs = photos.load(1, row.pk), photos.load(1, row.pk)
    assert mine is not None and theirs is not None
    theirs.title = "theirs"
    assert photos.update(theirs) is True
    mine.title = "mine"
    with pytest.raises(bagstore.Conflict) as refused:
        photos.update(mine)
    assert refused.value.id == id_of_pk(row.pk) and refused.value.found > 0
    stored = photos.load(1, row.pk)
    assert stored is not None and stored.title == "theirs"
    # a delete of the stale row is refused too, and leaves the row
    with pytest.raises(bagstore.Conflict):
        photos.delete(mine)
    assert photos.load(1, row.pk) is not None
    # inserting a key that is stored already is refused (expect_version=0)
    with pytest.raises(bagstore.Conflict):
        photos.insert(Photo(photo_id=row.pk, user_id=1, title="again"))
    again = photos.load(1, row.pk)
    assert again is not None and again.title == "theirs"
