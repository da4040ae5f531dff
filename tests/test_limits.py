"""One largest entity body on every backend (``max_body_bytes``), and the SQLite
library warning of ``bagstore status``."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import bagstore
import bagstore.cli
from bagstore import codec
from bagstore.backends.sqlite import has_wal_reset_bug, wal_reset_advice
from bagstore.cli import cli
from tests.conftest import Topology


def _entity_of_size(size: int) -> dict[str, Any]:
    """An entity whose encoded body is exactly ``size`` bytes (random bytes do
    not compress, so the body is stored raw)."""
    entity: dict[str, Any] = {"id": bagstore.new_id(), "blob": b""}
    noise = os.urandom(size)
    n = size - 64
    for _ in range(5):  # msgpack's length header grows with the blob
        entity["blob"] = noise[:n]
        n += size - len(codec.encode(entity))
    assert len(codec.encode(entity)) == size
    return entity


def _ids(ds: bagstore.Datastore) -> set[bytes]:
    return {bytes(r[0]) for b in ds.router.backends for r in b.fetchall("SELECT id FROM entities")}


def test_the_limit_is_one_documented_constant() -> None:
    assert bagstore.MAX_BODY_BYTES == 8 * 1024 * 1024 - 64 * 1024
    # a body travels to MariaDB as a hex literal: twice its size, and the
    # statement around it, fit the default 16 MiB max_allowed_packet
    assert 2 * bagstore.MAX_BODY_BYTES + 64 * 1024 <= 16 * 1024 * 1024


def test_a_body_at_the_limit_round_trips_and_one_byte_more_is_refused(topo: Topology) -> None:
    ds = topo.open()
    assert ds.max_body_bytes == bagstore.MAX_BODY_BYTES  # on SQLite and MariaDB alike
    at_limit = _entity_of_size(bagstore.MAX_BODY_BYTES)
    ds.put(at_limit)
    assert ds.get(at_limit["id"]) == at_limit
    over = _entity_of_size(bagstore.MAX_BODY_BYTES + 1)
    with pytest.raises(bagstore.InvalidEntity) as exc:
        ds.put(over)
    assert str(exc.value) == (
        f"entity {over['id'].hex()} is {bagstore.MAX_BODY_BYTES + 1} bytes encoded, over the "
        f"store's limit of {bagstore.MAX_BODY_BYTES} bytes (max_body_bytes)"
    )
    assert ds.get(over["id"]) is None and _ids(ds) == {at_limit["id"]}


def test_put_many_checks_the_whole_batch_before_writing(topo: Topology) -> None:
    ds = topo.open(max_body_bytes=4096)
    small = [{"n": i} for i in range(20)]
    batch = [*small, _entity_of_size(4097), {"n": 99}]
    with pytest.raises(bagstore.InvalidEntity, match=r"4097 bytes encoded, .* limit of 4096"):
        ds.put_many(batch)
    assert _ids(ds) == set()  # nothing of the batch, not even the entities before it
    assert all("id" not in e for e in small)
    ds.put_many([*small, _entity_of_size(4096)])
    assert len(_ids(ds)) == 21


def test_max_body_bytes_is_the_stores_own(topo: Topology, tmp_path: Path) -> None:
    ds = topo.open(max_body_bytes=1000)
    ds.put(_entity_of_size(1000))
    with pytest.raises(bagstore.InvalidEntity, match="limit of 1000 bytes"):
        ds.put(_entity_of_size(1001))
    # the same from a config file
    config = tmp_path / "bagstore.toml"
    urls = ", ".join(f'"{u}"' for u in topo.urls)
    config.write_text(f"[bagstore]\nshards = [{urls}]\nmax_body_bytes = 2000\n")
    from_file = bagstore.Datastore.from_config(config)
    try:
        assert from_file.max_body_bytes == 2000
        with pytest.raises(bagstore.InvalidEntity, match="limit of 2000 bytes"):
            from_file.put(_entity_of_size(2001))
    finally:
        from_file.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8M", True, (1 << 30) + 1])
def test_a_bad_max_body_bytes_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(bagstore.ConfigurationError, match="max_body_bytes must be"):
        bagstore.open(tmp_path / "s", max_body_bytes=bad)


def test_a_server_that_cannot_carry_the_limit_is_refused_at_open(topo: Topology) -> None:
    """16 MiB - 1 is what a MEDIUMBLOB holds, and more than a 16 MiB packet
    carries as hex: MariaDB refuses it at open, SQLite takes it."""
    big = 16 * 1024 * 1024 - 1
    if not topo.is_mysql:
        ds = topo.open(max_body_bytes=big)
        entity = _entity_of_size(big)
        ds.put(entity)
        assert ds.get(entity["id"]) == entity
        return
    with pytest.raises(bagstore.ConfigurationError) as exc:
        topo.open(max_body_bytes=big)
    message = str(exc.value)
    assert "max_allowed_packet" in message and f"under this store's max_body_bytes of {big}" in (
        message
    )


# -- the SQLite library warning of `bagstore status` -----------------------------------
@pytest.mark.parametrize(
    ("version", "affected"),
    [((3, 40, 1), True), ((3, 51, 2), True), ((3, 44, 6), False), ((3, 51, 3), False)],
)
def test_the_advice_names_the_fixed_versions_only_when_affected(
    version: tuple[int, int, int], affected: bool
) -> None:
    advice = wal_reset_advice(version)
    if not affected:
        assert advice is None
        return
    assert advice is not None
    assert ".".join(map(str, version)) in advice and "3.51.3 or later" in advice
    assert "3.44.6 or 3.50.7" in advice and "sqlite3.sqlite_version" in advice


def _status(args: list[str]) -> Any:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return result


def test_status_warns_once_when_this_sqlite_has_the_bug(tmp_path: Path) -> None:
    store = ["--store", str(tmp_path / "s")]
    _status([*store, "init", "--shards", "2"])
    result = _status([*store, "status"])
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    # this machine's library decides which side is shown; the other side is below
    assert len(warnings) == int(has_wal_reset_bug(sqlite3.sqlite_version))
    assert "WAL-reset" not in result.stdout
    if warnings:
        assert warnings == [f"warning: {wal_reset_advice()}"]
    assert "WAL-reset" not in _status(["-q", *store, "status"]).stderr


def test_status_is_quiet_with_a_fixed_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ["--store", str(tmp_path / "s")]
    _status([*store, "init", "--shards", "2"])
    monkeypatch.setattr(bagstore.cli, "wal_reset_advice", lambda: wal_reset_advice((3, 51, 3)))
    assert _status([*store, "status"]).stderr == ""
    monkeypatch.setattr(bagstore.cli, "wal_reset_advice", lambda: wal_reset_advice((3, 40, 1)))
    assert _status([*store, "status"]).stderr.count("warning:") == 1


def test_status_of_a_mariadb_store_never_warns(topo: Topology, tmp_path: Path) -> None:
    if not topo.is_mysql:
        pytest.skip("the MariaDB side; the SQLite side is tested above")
    topo.open().close()
    config = tmp_path / "bagstore.toml"
    urls = ", ".join(f'"{u}"' for u in topo.urls)
    config.write_text(f"[bagstore]\nshards = [{urls}]\n")
    # whatever this machine's SQLite library, a store without SQLite files is not affected
    assert "warning" not in _status(["--config", str(config), "status"]).stderr
