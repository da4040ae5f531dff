"""Issue #21 item 1: kinds, index tables and bagstore's own tables never share a name.

Each clash the issue names, on SQLite and MariaDB: refused when declared or
opened; a store that already holds one (made by older code: its catalog rows
written directly here) still opens, ``check()`` and ``bagstore check`` report
it, ``rename_index`` / ``bagstore index rename`` resolve it, and the kind's data
is intact at every step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import bagstore
from bagstore.cli import cli
from bagstore.errors import ConfigurationError
from bagstore.index import READY, RETIRED
from bagstore.names import MAX_NAME
from tests.conftest import Topology


def _register(ds: bagstore.Datastore, index: bagstore.Index, kind: str, state: str) -> None:
    """What older code left in the catalog (the API refuses it now)."""
    now = time.time_ns() // 1000
    ds.index_catalog.register(index.table, kind, index.to_json(), state, now)


def _photos(topo: Topology, n: int = 20) -> tuple[bagstore.Datastore, list[bytes]]:
    photos = topo.open(kind="photos")
    ids = photos.put_many([{"t": f"sunset {i}"} for i in range(n)])
    return photos, ids


def _intact(topo: Topology, ids: list[bytes]) -> None:
    """Every photo is there, on a freshly opened Datastore, and nothing else."""
    fresh = topo.open(kind="photos")
    assert [e["t"] if e else None for e in fresh.get_many(ids)] == [
        f"sunset {i}" for i in range(len(ids))
    ]
    assert fresh.count() == len(ids)


def test_index_named_after_a_kind_is_refused(topo: Topology) -> None:
    _, ids = _photos(topo)
    ents = topo.open()
    with pytest.raises(ConfigurationError, match=r"'photos'.*kind 'entities'.*kind 'photos'"):
        ents.add_index(bagstore.Index(table="photos", properties=["t"]))
    with pytest.raises(ConfigurationError, match="clashes with kind 'photos'"):
        ents.add_index(bagstore.Index(table="PHOTOS", properties=["t"]))  # one table on SQLite
    assert "photos" not in [n for n, *_ in ents.index_catalog.all_entries()]
    with pytest.raises(ConfigurationError, match="kind 'Photos' clashes with kind 'photos'"):
        topo.open(kind="Photos")
    with pytest.raises(ConfigurationError, match="no index 'photos'"):
        ents.retire_index("photos")
    with pytest.raises(ConfigurationError, match="no index 'photos'"):
        ents.drop_index("photos")
    _intact(topo, ids)


def test_index_named_like_its_own_kind_is_refused(topo: Topology) -> None:
    ents = topo.open()
    with pytest.raises(ConfigurationError, match=r"'entities'.*clashes with kind 'entities'"):
        ents.add_index(bagstore.Index(table="entities", properties=["t"]))
    with pytest.raises(ConfigurationError, match="clashes with kind 'entities'"):
        topo.open(indexes=[bagstore.Index(table="entities", properties=["t"])])
    entity_id = ents.put({"t": "x"})  # writes are unharmed
    assert ents.get(entity_id) == {"t": "x", "id": entity_id}
    assert ents.indexes() == {}


def test_kind_named_like_an_index_table_is_refused(topo: Topology) -> None:
    other = topo.open(kind="other")
    assert other.add_index(bagstore.Index(table="index_t", properties=["t"])) == READY
    other.put({"t": "a"})
    with pytest.raises(ConfigurationError, match=r"kind 'index_t'.*index table 'index_t'.*'other'"):
        topo.open(kind="index_t")
    with pytest.raises(
        ConfigurationError, match="kind 'INDEX_T' clashes with index table 'index_t'"
    ):
        topo.open(kind="INDEX_T")
    assert "index_t" not in other.catalog.kinds()
    assert [e["t"] for e in other.query(t="a")] == ["a"]


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("bagstore_shards", "prefix is reserved"),
        ("bagstore_meta", "prefix is reserved"),
        ("Bagstore_Kinds", "prefix is reserved"),
        ("k" * (MAX_NAME + 1), "at most 40"),
        ("photos__bucket", "'__' is reserved"),
    ],
)
def test_kind_names_that_are_not_free_are_refused(topo: Topology, kind: str, why: str) -> None:
    ents = topo.open()
    before = ents.catalog.read_placement()
    with pytest.raises(ConfigurationError, match=why):
        topo.open(kind=kind)
    assert kind not in ents.catalog.kinds()
    assert ents.catalog.read_placement() == before  # the catalog tables are untouched
    assert topo.open(kind="k" * MAX_NAME).put({"a": 1})  # 40 characters fit


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ("bagstore_shards", "prefix is reserved"),
        ("BAGSTORE_OWNED", "prefix is reserved"),
        ("i" * (MAX_NAME + 1), "at most 40"),
        ("entities__bucket", "'__' is reserved"),
    ],
)
def test_index_names_that_are_not_free_are_refused_when_declared(table: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=why):
        bagstore.Index(table=table, properties=["t"])


def test_definitions_stored_by_older_code_still_load() -> None:
    old = json.dumps({"table": "x__y", "properties": ["t"], "shard_on": "t", "unique": False})
    assert bagstore.Index.from_json(old).table == "x__y"
    with pytest.raises(ConfigurationError, match="prefix is reserved"):
        bagstore.Index.from_json(old.replace("x__y", "bagstore_ids"))


def test_a_table_that_is_not_the_index_s_is_never_written_or_dropped(topo: Topology) -> None:
    _, ids = _photos(topo)
    ents = topo.open()
    backend = ents.router.backends[0]
    assert backend.ensure_index_table("photos", ["t"], False) is False
    assert backend.drop_index_table("photos", ["t"], False) is False
    assert backend.ensure_index_table("index_t", ["t"], False) is True
    assert backend.drop_index_table("index_t", ["t", "u"], False) is False  # other columns
    assert backend.drop_index_table("index_t", ["t"], False) is True
    assert backend.table_columns("index_t") == frozenset()
    with pytest.raises(ConfigurationError, match="not an entities table"):
        backend.ensure_kind("bagstore_shards")
    _intact(topo, ids)


def test_old_clash_index_named_after_a_kind(topo: Topology, tmp_path: Path) -> None:
    """The issue's snippet, on a store whose catalog older code wrote."""
    _, ids = _photos(topo)
    ents = topo.open()
    mine = ents.put_many([{"t": f"e{i}"} for i in range(10)])
    _register(ents, bagstore.Index(table="photos", properties=["t"]), "entities", READY)

    ents = topo.open()  # the store still opens, and writes work
    assert ents.indexes() == {}  # the clashing index is neither written nor read
    mine.append(ents.put({"t": "e10"}))
    report = ents.check()
    assert (report["missing"], report["stale"]) == (0, 0)
    [clash] = report["clashes"]
    assert (clash["name"], clash["sort"], clash["kind"]) == ("photos", "index", "entities")
    assert "kind 'photos'" in clash["with"] and "index rename photos" in clash["remedy"]
    if not topo.is_mysql:  # the CLI on the same SQLite files
        result = _cli(topo, tmp_path, "check")
        assert result.exit_code == 1
        assert "name clash: index photos (kind entities)" in result.stdout
    _intact(topo, ids)

    state = ents.rename_index("photos", "index_photos_t", settle=0)
    assert state == READY
    assert [n for n, *_ in ents.index_catalog.all_entries()] == ["index_photos_t"]
    assert len(ents.query(t__gte="e")) == 11
    report = ents.check()
    assert (report["missing"], report["stale"], report["clashes"]) == (0, 0, [])
    assert [e["t"] for e in ents.get_many(mine)] == [f"e{i}" for i in range(11)]
    _intact(topo, ids)


def test_old_clash_drop_path_keeps_the_kind(topo: Topology) -> None:
    """retire + drop of an index named after a kind: only the registration goes."""
    _, ids = _photos(topo)
    ents = topo.open()
    _register(ents, bagstore.Index(table="photos", properties=["t"]), "entities", READY)
    ents = topo.open()
    ents.retire_index("photos")
    assert ents.index_catalog.entries("entities")[0][2] == RETIRED
    ents.drop_index("photos")
    assert ents.index_catalog.all_entries() == []
    assert ents.check()["clashes"] == []
    _intact(topo, ids)


def test_old_clash_index_named_entities(topo: Topology) -> None:
    ents = topo.open()
    mine = ents.put_many([{"t": f"e{i}"} for i in range(10)])
    _register(ents, bagstore.Index(table="entities", properties=["t"]), "entities", READY)
    ents = topo.open()
    mine.append(ents.put({"t": "e10"}))  # before: error 1054 / no such column
    assert [c["name"] for c in ents.check()["clashes"]] == ["entities"]
    assert ents.rename_index("entities", "index_t", settle=0) == READY
    report = ents.check()
    assert (report["missing"], report["stale"], report["clashes"]) == (0, 0, [])
    assert list(report["indexes"]) == ["index_t"]
    assert [e["t"] for e in ents.get_many(mine)] == [f"e{i}" for i in range(11)]
    assert ents.count() == 11
    assert [e["t"] for e in ents.query(t="e3")] == ["e3"]


def test_old_clash_kind_named_like_an_index(topo: Topology) -> None:
    other = topo.open(kind="other")
    other.add_index(bagstore.Index(table="index_t", properties=["t"]))
    other.put_many([{"t": f"o{i}"} for i in range(5)])
    other.catalog.register_kind("index_t", "", "hash")  # what older code recorded
    with pytest.raises(ConfigurationError, match="not an entities table"):
        topo.open(kind="index_t")
    [clash] = other.check()["clashes"]
    assert (clash["name"], clash["kind"]) == ("index_t", "other")
    assert "kind 'index_t'" in clash["with"]
    assert other.rename_index("index_t", "index_other_t", settle=0) == READY
    assert [e["t"] for e in other.query(t="o2")] == ["o2"]
    assert other.check()["clashes"] == []
    fixed = topo.open(kind="index_t")  # the index's own table was dropped: the kind opens
    assert fixed.get(fixed.put({"t": "k"}))["t"] == "k"


def test_rename_of_a_healthy_index_drops_the_old_table(topo: Topology) -> None:
    ents = topo.open(indexes=[bagstore.Index(table="index_a", properties=["t"], unique=True)])
    ents.put_many([{"t": f"e{i}"} for i in range(10)])
    with pytest.raises(ConfigurationError, match="clashes with kind 'entities'"):
        ents.rename_index("index_a", "entities", settle=0)
    assert ents.rename_index("index_a", "index_b", settle=0) == READY
    assert ents.router.backends[0].table_columns("index_a") == frozenset()
    with pytest.raises(bagstore.DuplicateValue):
        ents.put({"t": "e1"})
    assert ents.check()["missing"] == ents.check()["stale"] == 0


def _cli(topo: Topology, tmp_path: Path, *args: str) -> object:
    config = tmp_path / "clash.toml"
    config.write_text(f"[bagstore]\nshards = {json.dumps(topo.urls)}\n")
    return CliRunner().invoke(cli, ["--config", str(config), *args], catch_exceptions=False)


def test_cli_index_rename(topo: Topology, tmp_path: Path) -> None:
    _, ids = _photos(topo)
    ents = topo.open()
    ents.put({"t": "e"})
    _register(ents, bagstore.Index(table="photos", properties=["t"]), "entities", READY)
    result = _cli(topo, tmp_path, "index", "rename", "photos", "index_t", "--settle", "0")
    assert result.exit_code == 0, result.output
    assert "index index_t: ready (replaces photos)" in result.stdout
    result = _cli(topo, tmp_path, "check")
    assert result.exit_code == 0, result.output
    result = _cli(topo, tmp_path, "index", "rename", "index_t", "bagstore_x")
    assert result.exit_code == 2 and "prefix is reserved" in result.output
    _intact(topo, ids)
