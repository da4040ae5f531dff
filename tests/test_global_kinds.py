"""Global kinds (shard_map='global'): one database, the router pinned to it,
never moved by bucket moves; typed and untyped APIs over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import bagstore
from bagstore.catalog import Catalog, Placement
from bagstore.errors import ConfigurationError, StalePlacement
from bagstore.sharding.home import GLOBAL_SHARD, default_home
from bagstore.sharding.router import Router
from bagstore.sharding.topology import ShardOpener
from tests import servers
from tests.conftest import Topology

names = bagstore.Index("users_by_name", ["name"])


def _drop_homes(topo: Topology) -> None:
    """Drop the default homes (``<catalog database>_global``) a MySQL test made."""
    if topo.is_mysql:
        parts = urlsplit(topo.urls[0])
        home = parts.path.lstrip("/").split("?")[0] + "_global"
        servers.drop_databases(parts.hostname or "127.0.0.1", parts.port or 3306, [home])


@pytest.fixture
def gtopo(topo: Topology) -> Iterator[Topology]:
    yield topo
    topo.close()
    _drop_homes(topo)


def test_a_global_kind_lives_in_one_database_beside_the_catalog(gtopo: Topology) -> None:
    users = gtopo.open(kind="users", shard_map="global", indexes=[names])
    home = users.router.backends
    assert len(home) == 1 and users.router.pinned
    assert home[0].name == users.router.opener.open(default_home(users.router.catalog_backend)).name
    assert home[0].stamp("ignored", 0)[1] == GLOBAL_SHARD
    ids = users.put_many([{"name": f"u{i}"} for i in range(40)])
    assert users.count() == 40 and users.get(ids[3]) == {"name": "u3", "id": ids[3]}
    assert [e["name"] for e in users.query(name__gte="u38", name__lt="u4")] == ["u38", "u39"]
    assert users.check()["missing"] == 0
    # the shards hold no table of it: nothing of a global kind is spread
    sharded = gtopo.open(indexes=[bagstore.Index("index_n", ["n"])])
    for backend in sharded.router.backends:
        assert "users" not in {t.lower() for t in _tables(backend)}
    assert users.delete(ids[0]) and users.count() == 39


def _tables(backend: bagstore.backends.Backend) -> set[str]:
    if backend.dialect.name == "sqlite":
        rows = backend.fetchall("SELECT name FROM sqlite_master WHERE type = 'table'")
    else:
        rows = backend.fetchall("SHOW TABLES")
    return {r[0].decode() if isinstance(r[0], bytes) else str(r[0]) for r in rows}


def test_bucket_moves_never_move_a_global_kinds_rows(gtopo: Topology, tmp_path: Path) -> None:
    sharded = gtopo.open(indexes=[bagstore.Index("index_n", ["n"])])
    users = gtopo.open(kind="users", shard_map="global", indexes=[names])
    ids = users.put_many([{"name": f"u{i}"} for i in range(60)])
    sharded.put_many([{"n": i} for i in range(60)])
    home = users.router.backends[0]
    before = home.bucket_states()
    if gtopo.is_mysql:
        url = gtopo.urls[0].rsplit("/", 1)[0] + "/" + servers.unique_name("tx")
        made = [url.rsplit("/", 1)[1]]
    else:
        url, made = f"sqlite:///{tmp_path}/extra.db", []
    try:
        sharded.add_shard(url)
        stats = sharded.rebalance(grace=0, duty=0)
        assert stats.buckets > 0
        # every row of the global kind stayed in its database, whole and found
        assert home.bucket_states() == before
        assert users.count() == 60 and sharded.count() == 60
        assert [u["name"] for u in users.get_many(ids)] == [f"u{i}" for i in range(60)]
        assert len(users.query(name__gte="u")) == 60 and users.check()["missing"] == 0
        # a datastore that opened before the move still reads and writes its home
        users.put({"id": ids[0], "name": "renamed"})
        assert users.get(ids[0])["name"] == "renamed"  # type: ignore[index]
    finally:
        if made:
            sharded.close()
            servers.drop_databases("127.0.0.1", int(urlsplit(url).port or 3306), made)
    with pytest.raises(ConfigurationError, match="global"):
        users.rebalance()
    with pytest.raises(ConfigurationError, match="global"):
        users.move_buckets([0], 0)


def test_the_home_is_recorded_and_checked(gtopo: Topology, tmp_path: Path) -> None:
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    users = gtopo.open(kind="users", shard_map="global", global_at=elsewhere)
    entity_id = users.put({"name": "ann"})
    # a later opener without global_at finds the home the catalog records
    again = gtopo.open(kind="users", shard_map="global")
    assert again.get(entity_id) == {"name": "ann", "id": entity_id}
    other = f"sqlite:///{tmp_path}/other.db"
    with pytest.raises(ConfigurationError, match="lives in"):
        gtopo.open(kind="users", shard_map="global", global_at=other)
    with pytest.raises(ConfigurationError, match="shard 1 of store"):
        gtopo.open(kind="posts", shard_map="global", global_at=gtopo.urls[1])


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"shard_map": "global", "shard_key": "user_id"}, "takes no shard_key"),
        ({"global_at": "sqlite:///x.db"}, "only for global kinds"),
        ({"shard_map": "global", "global_at": ""}, "global_at must be a database URL"),
    ],
)
def test_bad_global_options(gtopo: Topology, options: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        gtopo.open(kind="users", **options)


def test_a_kind_keeps_its_placement(gtopo: Topology) -> None:
    gtopo.open(kind="users", shard_map="global")
    with pytest.raises(ConfigurationError, match="global map"):
        gtopo.open(kind="users")
    gtopo.open(kind="photos")
    with pytest.raises(ConfigurationError, match="hash map"):
        gtopo.open(kind="photos", shard_map="global")


# -- the router, pinned ----------------------------------------------------------------


def test_a_pinned_router_routes_every_bucket_to_its_backend_and_ignores_moves(
    tmp_path: Path,
) -> None:
    opener = ShardOpener(bagstore.backends.MySQLDefaults())
    shards = [opener.open(f"sqlite:///{tmp_path}/s{i}.db") for i in range(2)]
    catalog = Catalog(shards[0])
    placement: Placement = catalog.open([b.name for b in shards], 8)
    router = Router(catalog, placement, shards, opener)
    home = opener.open(f"sqlite:///{tmp_path}/home.db")
    home.stamp(placement.store_id, GLOBAL_SHARD)  # (its ownership table, empty)
    unused = router.pin(home)
    assert unused == [shards[1]]  # the catalog's backend is kept
    assert router.route(range(8), write=True).shards == (0,)
    assert router.resolve(router.route_all()) == [home]
    assert router.topology.sole_shard == 0 and router.placement.buckets == 8
    catalog.set_bucket(3, 1)  # a move elsewhere in the store
    assert router.refresh(force=True).shard_of_bucket == (0,) * 8
    assert not router.learn({3: 1})
    with pytest.raises(StalePlacement, match="global kind's database"):
        router.by_bucket([1], lambda item: item, lambda b, part: b.check_owned(part))
    home.claim_buckets(range(8))
    assert router.by_bucket([1, 5], lambda item: item, lambda b, part: len(part)) == [2]
    router.close()
    shards[1].close()


# -- typed global tables ------------------------------------------------------------------


class User(bagstore.Model, kind="users", global_kind=True, indexes=[("username",)]):
    user_id: int = bagstore.auto_id()
    username: str


def test_a_typed_global_table(gtopo: Topology) -> None:
    users = bagstore.Table(User, gtopo.open(kind="users", shard_map="global"))
    ann = users.insert(User(username="ann"))
    assert ann.pk is not None
    assert users.load(ann.pk) == ann
    ann.username = "anne"
    assert users.update(ann)
    assert [u.username for u in users.fetch(username="anne")] == ["anne"]
    assert users.ds.get(bagstore.tables.id_of_pk(ann.pk)) == {
        "user_id": ann.pk,
        "username": "anne",
        "id": bagstore.tables.id_of_pk(ann.pk),
    }
    with pytest.raises(ConfigurationError, match="User is kind 'users'"):
        bagstore.Table(User, gtopo.open(kind="users2"))

    class Sharded(bagstore.Model, kind="users3"):
        key: int = bagstore.auto_id()

    with pytest.raises(ConfigurationError, match="placed by 'id'; kind 'users3' of this"):
        bagstore.Table(Sharded, gtopo.open(kind="users3", shard_map="global"))


def test_the_command_line_works_on_a_global_kind_by_its_config(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from bagstore.cli import cli

    config = tmp_path / "users.toml"
    config.write_text(
        '[bagstore]\npath = "store"\nshards = 2\nkind = "users"\nshard_map = "global"\n'
    )
    runner = CliRunner()
    put = runner.invoke(cli, ["--config", str(config), "put", '{"name": "ann"}'])
    assert put.exit_code == 0, put.output
    entity_id = put.stdout.strip()
    got = runner.invoke(cli, ["--config", str(config), "get", entity_id])
    assert got.exit_code == 0 and '"name": "ann"' in got.stdout
    status = runner.invoke(cli, ["--config", str(config), "status", "--json"])
    assert status.exit_code == 0 and '"entities": 1' in status.stdout
    assert (tmp_path / "store" / "global.db").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text('[bagstore]\npath = "store"\nkind = "users"\n')  # placed otherwise
    result = runner.invoke(cli, ["--config", str(bad), "get", entity_id])
    assert result.exit_code == 2 and "error:" in result.stderr and "global map" in result.stderr


def test_an_index_added_later_to_a_global_kind_is_backfilled_there(gtopo: Topology) -> None:
    users = gtopo.open(kind="users", shard_map="global")
    users.put_many([{"name": f"u{i}", "age": i} for i in range(30)])
    by_age = bagstore.Index("users_by_age", ["age"])
    assert users.add_index(by_age) == "building"
    stats = bagstore.Cleaner(users, settle=0).backfill("users_by_age")
    assert stats.written == 30 and users.indexes()["users_by_age"][1] == "ready"
    assert [e["name"] for e in users.query(age__gte=28)] == ["u28", "u29"]
    assert users.check()["missing"] == 0 and users.check()["stale"] == 0
