"""Every kind of bad input: a clear bagstore exception, and nothing stored changes."""

from __future__ import annotations

import decimal
from pathlib import Path

import pytest

import bagstore
from tests.conftest import Topology


def _snapshot(ds: bagstore.Datastore) -> dict[bytes, dict[str, object] | None]:
    ids = []
    for backend in ds.router.backends:
        ids += [bytes(r[0]) for r in backend.fetchall("SELECT id FROM entities")]
    return dict(zip(ids, ds.get_many(ids), strict=True))


@pytest.fixture
def seeded(ds: bagstore.Datastore) -> bagstore.Datastore:
    ds.put_many([{"n": i, "title": f"t{i}"} for i in range(10)])
    return ds


@pytest.fixture(scope="module")
def shared_seeded(shared_topo: Topology) -> bagstore.Datastore:
    """``seeded``, one a module: the tests of refused input share it (each
    compares what is stored before and after)."""
    ds = shared_topo.open()
    ds.put_many([{"n": i, "title": f"t{i}"} for i in range(10)])
    return ds


@pytest.mark.parametrize(
    "bad, message",
    [
        ("a string", "must be a dict"),
        ([("n", 1)], "must be a dict"),
        (None, "must be a dict"),
        ({"id": "71f0c4d2291844cca2df6f486e96e37c"}, "bytes.fromhex"),
        ({"id": b"short"}, "16 bytes"),
        ({"id": bytearray(16)}, "must be bytes"),
        ({"v": (1, 2)}, "tuple"),
        ({"v": {1, 2}}, "set"),
        ({"v": decimal.Decimal("1.5")}, "Decimal"),
        ({"v": object()}, "object"),
        ({1: "non-string key"}, "must be str"),
        ({"nested": {"deep": [1, {2: "x"}]}}, "must be str"),
    ],
)
def test_bad_entity_is_refused_and_nothing_changes(
    shared_seeded: bagstore.Datastore, bad: object, message: str
) -> None:
    before = _snapshot(shared_seeded)
    with pytest.raises(bagstore.InvalidEntity, match=message):
        shared_seeded.put(bad)  # type: ignore[arg-type]
    with pytest.raises(bagstore.InvalidEntity):
        shared_seeded.put_many([{"fine": 1}, bad])  # type: ignore[list-item]
    assert _snapshot(shared_seeded) == before


def test_body_over_the_backend_limit_is_refused(seeded: bagstore.Datastore) -> None:
    import os

    before = _snapshot(seeded)
    limit = seeded.max_body_bytes
    with pytest.raises(bagstore.InvalidEntity, match="limit"):
        seeded.put({"blob": os.urandom(limit + 1)})  # random bytes do not compress
    assert _snapshot(seeded) == before


def test_body_just_under_the_limit_is_stored(topo: Topology) -> None:
    import os

    ds = topo.open()
    size = min(ds.max_body_bytes - 1024, 4 * 1024 * 1024)
    blob = os.urandom(size)
    entity_id = ds.put({"blob": blob})
    assert ds.get(entity_id) == {"blob": blob, "id": entity_id}


@pytest.mark.parametrize("bad", ["abc", b"short", 12, None, bytearray(16)])
def test_bad_ids_on_read_and_delete(shared_seeded: bagstore.Datastore, bad: object) -> None:
    before = _snapshot(shared_seeded)
    with pytest.raises(bagstore.InvalidQuery):
        shared_seeded.get(bad)  # type: ignore[arg-type]
    with pytest.raises(bagstore.InvalidQuery):
        shared_seeded.get_many([bagstore.new_id(), bad])  # type: ignore[list-item]
    with pytest.raises(bagstore.InvalidQuery):
        shared_seeded.delete(bad)  # type: ignore[arg-type]
    with pytest.raises(bagstore.InvalidQuery):
        shared_seeded.delete_many([next(iter(before)), bad])  # type: ignore[list-item]
    assert _snapshot(shared_seeded) == before


@pytest.mark.parametrize(
    "url, message",
    [
        ("postgresql://localhost/db", "unknown URL scheme"),
        ("redis://localhost:6379", "unknown URL scheme"),
        ("nonsense", "expected host:port"),
        ("sqlite:relative.db", "bad SQLite URL"),
        ("mysql://root@127.0.0.1:3306/bad-name", "not a plain identifier"),
        ("mysql://root@127.0.0.1:3306/db?colour=blue", "unknown option"),
        ("mysql://root@127.0.0.1:99999/db", "bad port"),
        ("mysql://root@127.0.0.1:0/db", "bad port 0"),
        ("mysql://:@:0/", "bad port 0"),
        ("mysql://:@/db", "no host"),
        ("mysql://root@:3306/db", "no host"),
        ("mysql://root@127.0.0.1:3306/db?driver=oracle", "unknown MySQL driver"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(bagstore.ConfigurationError, match=message):
        bagstore.Datastore([url])


@pytest.mark.parametrize(
    "index, message",
    [
        ("index = 5", "array of tables"),
        ("index = true", "array of tables"),
        ("index = 2010-07-01", "array of tables"),
        ('[bagstore.index]\ntable = "t"\nproperties = ["n"]', "array of tables"),
        ("index = [5]", "must be a table"),
    ],
)
def test_a_config_whose_indexes_are_not_tables(tmp_path: Path, index: str, message: str) -> None:
    """Found by hypothesis: TypeError (not iterable) before."""
    config = tmp_path / "bagstore.toml"
    config.write_text(f'[bagstore]\npath = "data"\n{index}\n')
    with pytest.raises(bagstore.ConfigurationError, match=message):
        bagstore.Datastore.from_config(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bagstore.toml"]  # nothing made


@pytest.mark.parametrize("value", ["5", "true", '""', "[1]"])
def test_a_config_path_that_is_not_a_directory_name(tmp_path: Path, value: str) -> None:
    config = tmp_path / "bagstore.toml"
    config.write_text(f"[bagstore]\npath = {value}\n")
    with pytest.raises(bagstore.ConfigurationError, match="must be a directory name"):
        bagstore.Datastore.from_config(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bagstore.toml"]  # nothing made


@pytest.mark.parametrize("shards", [0, 257, 2**62, True, 2.0, "4"])
def test_a_sqlite_store_of_too_many_or_no_files(tmp_path: Path, shards: object) -> None:
    """Found by hypothesis: shards=2**62 built a list of that many file names
    (the process ran out of memory)."""
    with pytest.raises(bagstore.ConfigurationError, match="from 1 to 256"):
        bagstore.open(tmp_path / "store", shards=shards)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_bad_shard_lists(tmp_path: Path) -> None:
    with pytest.raises(bagstore.ConfigurationError, match="at least one"):
        bagstore.Datastore([])
    with pytest.raises(bagstore.ConfigurationError, match="list of URLs"):
        bagstore.Datastore(f"sqlite:///{tmp_path}/a.db")  # type: ignore[arg-type]
    same = f"sqlite:///{tmp_path}/a.db"
    with pytest.raises(bagstore.ConfigurationError, match="twice"):
        bagstore.Datastore([same, same])
    with pytest.raises(bagstore.ConfigurationError, match="buckets"):
        bagstore.Datastore([f"sqlite:///{tmp_path}/b.db"], buckets=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"table": "bad-name", "properties": ["a"]}, "not a plain identifier"),
        ({"table": "t; DROP TABLE entities", "properties": ["a"]}, "not a plain identifier"),
        ({"table": "ok", "properties": ["a b"]}, "not a plain identifier"),
        ({"table": "ok", "properties": "user_id"}, "list of names"),
        ({"table": "ok", "properties": []}, "1 to 8"),
        ({"table": "ok", "properties": ["a", "a"]}, "twice"),
        ({"table": "ok", "properties": ["a"], "shard_on": "b"}, "must be one of"),
        ({"table": "ok", "properties": ["entity_id"]}, "reserved"),
        ({"table": "bagstore_x", "properties": ["a"]}, "reserved"),
        ({"table": "x" * 65, "properties": ["a"]}, "not a plain identifier"),
    ],
)
def test_bad_index_declarations(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(bagstore.ConfigurationError, match=message):
        bagstore.Index(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"buckets": True}, "buckets must be an integer"),
        ({"shard_map": "bogus"}, "shard_map must be one of"),
        ({"shard_map": None}, "shard_map must be one of"),
        ({"shard_map": 2**80}, "shard_map must be one of"),
        ({"shard_map": "directory"}, "needs a shard_key"),
        ({"refresh_interval": None}, "refresh_interval must be a number of seconds"),
        ({"refresh_interval": float("nan")}, "refresh_interval must be a number of seconds"),
        ({"refresh_interval": -1}, "refresh_interval must be a number of seconds"),
        ({"freeze_wait": float("inf")}, "freeze_wait must be a number of seconds"),
        ({"freeze_wait": "5"}, "freeze_wait must be a number of seconds"),
        ({"unique_lease": "2"}, "unique_lease must be a number of seconds"),
        ({"unique_lease": float("inf")}, "unique_lease must be a number of seconds"),
        ({"unique_lease": 0}, "unique_lease must be a number of seconds"),
        ({"sqlite_synchronous": 1}, "synchronous must be one of"),
        ({"sqlite_synchronous": None}, "synchronous must be one of"),
        ({"indexes": None}, "indexes must be a list"),
        ({"indexes": bagstore.Index("t", ["a"])}, "indexes must be a list"),
        ({"indexes": 5}, "indexes must be a list"),
    ],
)
def test_bad_store_options_are_refused_and_record_nothing(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    """Found by hypothesis: ``buckets=True`` was recorded as the store's bucket
    count (``"True"``: no later open of the store worked), and a kind's
    unknown ``shard_map`` (or ``"directory"`` without a shard key) was recorded
    as the kind's before it was refused (no later open of the kind worked);
    the others raised TypeError, ValueError, AttributeError or OverflowError."""
    url = f"sqlite:///{tmp_path}/a.db"
    with pytest.raises(bagstore.ConfigurationError, match=message):
        bagstore.Datastore([url], **kwargs)  # type: ignore[arg-type]
    with bagstore.Datastore([url]) as ds:  # the store and its kind open as if never tried
        ds.put({"n": 1})
        assert ds.placement.buckets == 1024 and ds.count() == 1


@pytest.mark.parametrize("bad", [None, 5, 2.5, True, "ab" * 16, b"x" * 16])
def test_id_lists_that_are_not_lists(shared_seeded: bagstore.Datastore, bad: object) -> None:
    """Found by hypothesis: TypeError (not iterable) rather than InvalidQuery."""
    before = _snapshot(shared_seeded)
    for method in (shared_seeded.get_many, shared_seeded.delete_many):
        with pytest.raises(bagstore.InvalidQuery, match="takes a list of ids"):
            method(bad)  # type: ignore[arg-type]
    assert _snapshot(shared_seeded) == before


@pytest.mark.parametrize("bad", [[b"x" * 16], {}, "ab", None])
def test_other_arguments_of_the_wrong_type(shared_seeded: bagstore.Datastore, bad: object) -> None:
    """Found by hypothesis: TypeError (unhashable) or AttributeError before."""
    before = _snapshot(shared_seeded)
    with pytest.raises(bagstore.InvalidQuery, match="an id must be"):
        shared_seeded.bucket_of_id(bad)  # type: ignore[arg-type]
    with pytest.raises(bagstore.InvalidQuery, match=r"takes a bagstore\.Index"):
        shared_seeded.query_index(bad, {"n": 1})  # type: ignore[arg-type]
    with pytest.raises(bagstore.ConfigurationError):
        shared_seeded.sequence("s", block=bad)  # type: ignore[arg-type]
    if not isinstance(bad, str):
        with pytest.raises(bagstore.ConfigurationError):
            shared_seeded.sequence(bad)  # type: ignore[arg-type]
    if bad is None:
        with pytest.raises(bagstore.ConfigurationError, match="list of bucket numbers"):
            shared_seeded.move_buckets(bad, to=0)  # type: ignore[arg-type]
    assert _snapshot(shared_seeded) == before


def test_buckets_to_move_given_as_a_generator_all_move(tmp_path: Path) -> None:
    """A generator of buckets was read up by the checks and nothing moved."""
    with bagstore.open(tmp_path, shards=2, buckets=8) as ds:
        ids = ds.put_many([{"n": n} for n in range(20)])
        on_0 = ds.placement.buckets_of_shard(0)[:2]
        with pytest.raises(bagstore.ConfigurationError, match="no bucket True"):
            ds.move_buckets([True], to=1)  # a bool is not a bucket number
        ds.move_buckets((b for b in on_0), to=1, grace=0)
        assert all(ds.placement.shard_of_bucket[b] == 1 for b in on_0)
        assert [e["n"] for e in ds.get_many(ids)] == list(range(20))  # type: ignore[index]


def test_bad_kind_name(tmp_path: Path) -> None:
    with pytest.raises(bagstore.ConfigurationError, match="kind"):
        bagstore.open(tmp_path, kind="entities; DROP TABLE x")


def test_unreachable_mysql_is_shard_unavailable() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(bagstore.ShardUnavailable):
        bagstore.Datastore([f"mysql://root@127.0.0.1:{port}/bst_nowhere?connect_timeout=2"])
