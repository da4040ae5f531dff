"""Replica reads and planned switchover on a real MariaDB replication group
(one primary and two replicas started for this module: tests/replication.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore.errors import ConfigurationError, InvalidQuery
from tests import servers
from tests.replication import (
    APP_PASSWORD,
    APP_USER,
    REPL_PASSWORD,
    REPL_USER,
    ReplicationGroup,
    connect_as_app,
    paused,
    started_group,
)


@pytest.fixture(scope="module")
def group() -> Iterator[ReplicationGroup]:
    with started_group(3) as g:
        yield g


@pytest.fixture
def db(group: ReplicationGroup) -> Iterator[str]:
    name = servers.unique_name("repl")
    yield name
    group.sync()
    primary = next(s for s in group.servers if s.running and not s.one("SELECT @@read_only"))
    primary.sql(f"DROP DATABASE IF EXISTS {servers.quote_ident(name)}")


def _open(group: ReplicationGroup, db: str, **kwargs: Any) -> bagstore.Datastore:
    return bagstore.Datastore([group.url(db)], **kwargs)


def test_replica_read_sees_the_write_just_made(group: ReplicationGroup, db: str) -> None:
    with _open(group, db, read_from="replica") as ds:
        for n in range(20):
            entity_id = ds.put({"n": n})
            assert ds.get(entity_id) == {"n": n, "id": entity_id}
            assert ds.get_many([entity_id])[0]["n"] == n
        stats = ds.stats()
        replicas = {r.addr for r in group.replicas}
        assert set(stats["reads"]) == replicas  # both replicas took reads, the primary none
        assert sum(stats["reads"].values()) == 40
        assert min(stats["reads"].values()) >= 10  # spread, not all on one
        assert stats["replicas"]["fallbacks"] == 0
        assert stats["replicas"]["waits"] >= 20  # each new write waited for
        # per call: the primary, counted nowhere (not routed by read_from)
        assert ds.get(entity_id, read_from="primary")["n"] == 19
        assert sum(ds.stats()["reads"].values()) == 40


def test_stopped_sql_thread_falls_back_to_the_primary(group: ReplicationGroup, db: str) -> None:
    with _open(group, db, read_from="replica") as ds:
        ds.router.replication.wait_timeout = 0.2
        ds.put({"warm": 1})
        group.sync()
        for r in group.replicas:
            r.sql("STOP SLAVE SQL_THREAD")
        try:
            entity_id = ds.put({"n": 1})
            assert ds.get(entity_id)["n"] == 1  # read your write: from the primary
            stats = ds.stats()
            assert stats["replicas"]["fallbacks"] == 1
            assert stats["reads"] == {group.primary.addr: 1}
        finally:
            for r in group.replicas:
                r.sql("START SLAVE SQL_THREAD")


def test_max_lag_skips_a_replica_that_is_behind(group: ReplicationGroup, db: str) -> None:
    with _open(group, db) as writer, _open(group, db, read_from="replica", max_lag=5) as reader:
        entity_id = writer.put({"n": 1})
        group.sync()
        lagging = group.replicas[0]
        lagging.sql("STOP SLAVE SQL_THREAD")  # its lag is unknown: too far behind
        try:
            for _ in range(6):
                assert reader.get(entity_id)["n"] == 1  # (another process's write)
            stats = reader.stats()
            assert set(stats["reads"]) == {group.replicas[1].addr}
            assert stats["replicas"]["skipped"] >= 3
            # one wait at most: for what opening the store wrote, never per read
            assert stats["replicas"]["waits"] <= 1
        finally:
            lagging.sql("START SLAVE SQL_THREAD")


def test_a_dead_replica_is_skipped_never_an_error(group: ReplicationGroup, db: str) -> None:
    with _open(group, db, read_from="replica", connect_timeout=0.5, read_timeout=0.5) as ds:
        ids = [ds.put({"n": n}) for n in range(4)]
        group.sync()
        with paused(group.replicas[0]):
            for entity_id in ids * 2:
                assert ds.get(entity_id) is not None
            assert [e["n"] for e in ds.get_many(ids) if e] == [0, 1, 2, 3]
        stats = ds.stats()
        assert stats["replicas"]["skipped"] >= 1
        assert stats["reads"].get(group.replicas[1].addr, 0) >= 9


def test_queries_read_replicas_and_cache_fills_read_the_primary(
    group: ReplicationGroup, db: str
) -> None:
    index = bagstore.Index("index_user", ["user_id"], shard_on="user_id")
    with _open(group, db, indexes=[index], read_from="replica") as ds:
        ids = [ds.put({"user_id": b"u1", "n": n}) for n in range(5)]
        got = index.get_all(ds, user_id=b"u1")
        assert sorted(e["n"] for e in got) == [0, 1, 2, 3, 4]
        assert len(ds.query(user_id=b"u1", read_from="primary")) == 5
        replica_reads = sum(ds.stats()["reads"].get(r.addr, 0) for r in group.replicas)
        assert replica_reads >= 1
        assert ds.get(ids[0])["n"] == 0
    with _open(group, db, read_from="replica", cache="memory") as cached:
        assert cached.get(ids[1])["n"] == 1
        assert cached.stats()["reads"] == {}  # a cache fill: from the primary, not routed


def test_a_query_whose_replica_stops_answering_is_answered_by_the_primary(
    group: ReplicationGroup, db: str
) -> None:
    index = bagstore.Index("index_user", ["user_id"], shard_on="user_id")
    with _open(group, db, indexes=[index]) as writer:
        for n in range(5):
            writer.put({"user_id": b"u2", "n": n})
    group.sync()
    with _open(
        group, db, indexes=[index], read_from="replica", connect_timeout=0.5, read_timeout=0.5
    ) as ds:
        for _ in range(2):  # each replica has reached this process's position
            assert len(ds.query(user_id=b"u2")) == 5
        # so a replica is chosen for a scan without a statement, and stops
        # answering then
        with paused(group.replicas[0]), paused(group.replicas[1]):
            got = ds.query(user_id=b"u2")
            assert sorted(e["n"] for e in got) == [0, 1, 2, 3, 4]
            assert sorted(e["n"] for e in index.get_all(ds, user_id=b"u2")) == [0, 1, 2, 3, 4]
        assert ds.stats()["replicas"]["fallbacks"] >= 1


def test_bad_read_options_are_refused(group: ReplicationGroup, db: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="read_from"):
        _open(group, db, read_from="nearest")
    with pytest.raises(ConfigurationError, match="max_lag"):
        _open(group, db, max_lag=-1)
    with pytest.raises(ConfigurationError, match="not host:port"):
        bagstore.Datastore([group.url(db) + "&replica=nohost"])
    with pytest.raises(ConfigurationError, match="cannot have replicas"):
        bagstore.Datastore([f"sqlite:///{tmp_path}/a.db?replica=127.0.0.1:3307"])
    with _open(group, db) as ds:
        entity_id = ds.put({"n": 1})
        with pytest.raises(ConfigurationError, match="read_from"):
            ds.get(entity_id, read_from="secondary")
        with pytest.raises(InvalidQuery):
            ds.get(b"short", read_from="replica")
        with pytest.raises(ConfigurationError, match="no shard"):
            ds.failover(7, to=group.replicas[0].addr)
        with pytest.raises(ConfigurationError, match="not a replica"):
            ds.failover(0, to="127.0.0.1:1")
        from bagstore.sharding.failover import find_shard

        # a shard by its URL as configured, or its name in `bagstore shard list`
        assert find_shard(ds.router, group.url(db))[0] == "0"
        assert find_shard(ds.router, ds.shards[0])[0] == "0"
        assert ds.get(entity_id)["n"] == 1  # nothing changed


def _writers(
    ds_list: list[bagstore.Datastore], stop: threading.Event
) -> tuple[list[threading.Thread], list[bytes], list[BaseException], list[float]]:
    acked: list[bytes] = []
    errors: list[BaseException] = []
    pauses: list[float] = []

    def write(ds: bagstore.Datastore, n: int) -> None:
        i = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                acked.append(ds.put({"w": n, "i": i}))
            except Exception as exc:  # counted, the test fails on any
                errors.append(exc)
            pauses.append(time.monotonic() - started)
            i += 1

    threads = [
        threading.Thread(target=write, args=(ds, n), daemon=True)
        for n, ds in enumerate(ds_list * 2)
    ]
    for t in threads:
        t.start()
    return threads, acked, errors, pauses


@pytest.mark.parametrize("login", ["root", "app"])
def test_planned_switchover_under_writers(group: ReplicationGroup, db: str, login: str) -> None:
    """Two datastores (the second never told of the switchover) write while
    the primary moves to a replica and back: no error, nothing lost."""
    user, password = (APP_USER, APP_PASSWORD) if login == "app" else ("root", "")
    with _open(group, db):  # creates the database and tables as root
        pass
    group.sync()
    url = group.url(db, user=user, password=password)
    first = bagstore.Datastore([url])
    stale = bagstore.Datastore([url])
    try:
        stop = threading.Event()
        threads, acked, errors, pauses = _writers([first, stale], stop)
        while len(acked) < 50:
            time.sleep(0.01)
        old, target = group.primary.addr, group.replicas[0].addr
        done = first.failover(
            0, to=target, user="root", password="",
            replication_user=REPL_USER, replication_password=REPL_PASSWORD,
        )  # fmt: skip
        assert done["primary"] == target and done["planned"] and done["old_primary"] == old
        assert first.feed.epoch() == 0  # a switchover loses nothing: the feed's cursors hold
        count = len(acked)
        while len(acked) < count + 50:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join()
        assert errors == []
        assert max(pauses) < 10  # bounded by writable_wait (5 s) and the switch
        # the new primary has every acknowledged write, and so does the old one
        new_primary = group.servers[1]
        assert not new_primary.one("SELECT @@read_only")
        assert group.primary.one("SELECT @@read_only")
        table = f"{servers.quote_ident(db)}.entities"
        assert new_primary.one(f"SELECT COUNT(*) FROM {table}") == len(acked)
        got = first.get_many(acked)
        assert all(e is not None for e in got)
        # a new process, configured as before (the old primary first), finds the new one
        with bagstore.Datastore([url]) as fresh:
            written = fresh.put({"fresh": 1})
            assert fresh.router.backends[0].server == target
        group.primary.wait_for(new_primary.gtid())
        assert (
            group.primary.one(f"SELECT COUNT(*) FROM {table} WHERE id = %s", (written,)) == 1
        )  # the old primary replicates from the new one
    finally:
        try:
            first.failover(
                0,
                to=old,
                user="root",
                password="",
                replication_user=REPL_USER,
                replication_password=REPL_PASSWORD,
            )  # fmt: skip  (back as before, for the next test)
        finally:
            first.close()
            stale.close()
    assert not group.primary.one("SELECT @@read_only")
    group.sync()


def test_toml_names_replicas_as_a_table_or_in_the_url(
    group: ReplicationGroup, db: str, tmp_path: Path
) -> None:
    from bagstore.config import load_config

    replicas = ", ".join(f'"{r.addr}"' for r in group.replicas)
    config = tmp_path / "app.toml"
    config.write_text(
        "[bagstore]\n"
        f'shards = [{{ url = "mysql://root@{group.primary.addr}/{db}", '
        f"replicas = [{replicas}] }}]\n"
        'read_from = "replica"\nmax_lag = 30\n'
    )
    with load_config(config) as ds:
        entity_id = ds.put({"n": 1})
        assert ds.get(entity_id)["n"] == 1
        assert set(ds.stats()["reads"]) <= {r.addr for r in group.replicas}
        assert ds.stats()["reads"]
    config.write_text(f'[bagstore]\nshards = ["{group.url(db)}"]\n')
    with load_config(config) as ds:
        assert ds.get(entity_id, read_from="replica")["n"] == 1
    for bad in ('{ url = "sqlite:///x.db", replicas = ["h:1"] }', '{ url = "x", copies = 2 }', "3"):
        config.write_text(f"[bagstore]\nshards = [{bad}]\n")
        with pytest.raises(ConfigurationError):
            load_config(config)


def test_cli_failover_and_status(group: ReplicationGroup, db: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from bagstore.cli import cli

    config = tmp_path / "app.toml"
    config.write_text(f'[bagstore]\nshards = ["{group.url(db)}"]\n')
    env = {"BAGSTORE_REPLICATION_PASSWORD": REPL_PASSWORD}

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, ["--config", str(config), *args], env=env)

    assert run("put", '{"n": 1}').exit_code == 0
    result = run("status", "--json")
    assert result.exit_code == 0, result.output
    import json

    roles = {s["server"]: s["role"] for s in json.loads(result.stdout)["replication"]}
    status_keys = {
        f"replication[].{k}" for s in json.loads(result.stdout)["replication"] for k in s
    }
    assert roles == {group.primary.addr: "primary", **{r.addr: "replica" for r in group.replicas}}
    bad = run("shard", "failover", "0", "--to", "nohost")
    assert bad.exit_code == 2 and "error:" in bad.output and "host:port" in bad.output
    target = group.replicas[1].addr
    args = ("--replication-user", REPL_USER, "--json")
    result = run("shard", "failover", "0", "--to", target, *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["primary"] == target
    from tests.test_cli_json import DOCUMENTED, ELSEWHERE

    assert "shard failover" in ELSEWHERE  # its keys are checked here, as docs/cli.md has them
    assert set(json.loads(result.stdout)) == set(DOCUMENTED["shard failover"])
    assert status_keys <= set(DOCUMENTED["status"])
    try:
        roles = {
            s["server"]: s["role"]
            for s in json.loads(run("status", "--json").stdout)["replication"]
        }
        assert roles[target] == "primary" and roles[group.primary.addr] == "replica"
        assert "Replication" in run("status").output
    finally:
        back = run("shard", "failover", "0", "--to", group.primary.addr, *args)
        assert back.exit_code == 0, back.output
    group.sync()


def test_the_catalog_fails_over_by_the_command(group: ReplicationGroup, db: str) -> None:
    """The catalog on the replicated servers, the shard elsewhere (the main
    MariaDB): ``failover("catalog")`` moves it; processes follow."""
    from tests.conftest import MYSQL

    shard_db = servers.unique_name("repl_shard")
    shard = f"mysql://root@{MYSQL.host}:{MYSQL.port}/{shard_db}"
    options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
    ds = bagstore.Datastore([shard], catalog=group.url(db))
    other = bagstore.Datastore([shard], catalog=group.url(db))
    try:
        entity_id = ds.put({"n": 1})
        target = group.replicas[0].addr
        done = ds.failover("catalog", to=target, **options)
        assert done["shard"] == "catalog" and done["primary"] == target
        assert ds.catalog.backend.server == target
        assert other.refresh_placement(force=True).version >= done["epoch"]
        assert other.catalog.backend.server == target  # its connection was closed: it looked
        with bagstore.Datastore([shard], catalog=group.url(db)) as fresh:
            assert fresh.get(entity_id)["n"] == 1
            assert fresh.catalog.backend.server == target
        ds.failover("catalog", to=group.primary.addr, **options)
    finally:
        ds.close()
        other.close()
        servers.drop_databases(MYSQL.host, MYSQL.port, [shard_db])


def test_the_examples_in_docs_replication_md_run(group: ReplicationGroup, db: str) -> None:
    """The page's Python blocks as written, on this module's servers (db1,
    db1r, db1s), as the application's non-privileged user, with root as the
    administrative login; the primary switched back afterwards."""
    import re

    page = Path(__file__).resolve().parent.parent / "docs" / "replication.md"
    code = "\n".join(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
    primary, r1, r2 = (s.addr for s in group.servers)
    for written, real in [
        ("db1r:3306", r1), ("db1s:3306", r2), ("db1:3306", primary),
        ("mysql://app@", f"mysql://{APP_USER}:{APP_PASSWORD}@"), ("app_0", db),
        ('user="admin"', 'user="root"'), ('"admin-secret"', '""'),
        ('"repl-secret"', repr(REPL_PASSWORD)),
        ('replication_user="repl"', f"replication_user={REPL_USER!r}"),
    ]:  # fmt: skip
        assert written in code
        code = code.replace(written, real)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(page), "exec"), namespace)
    ds = namespace["ds"]
    try:
        assert namespace["done"]["primary"] == r1
        assert set(namespace["reads"]) <= {r1, r2}
        options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
        ds.failover(0, to=primary, user="root", password="", **options)
    finally:
        ds.close()


def test_the_replicas_toml_of_docs_configuration_md_reads(tmp_path: Path) -> None:
    """docs/configuration.md's TOML with replicas names them alike both ways."""
    import re

    from bagstore.config import read_config, shard_url

    page = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    (block,) = [
        b for b in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S) if "replica" in b
    ]
    path = tmp_path / "app.toml"
    path.write_text(block)
    section = read_config(path)
    urls = [shard_url(s) for s in section["shards"]]
    assert urls[0] == "mysql://app@db1:3306/app_0?replica=db1r:3306&replica=db1s:3306"
    assert urls[1].endswith("?replica=db2r:3306&replica=db2s:3306")
    assert (section["read_from"], section["max_lag"]) == ("replica", 5)


def test_doctests_of_the_replication_modules() -> None:
    import doctest

    from bagstore.backends import gtid, replication
    from bagstore.sharding import failover, replicas, watch

    attempted = 0
    for module in (gtid, replication, replicas, failover, watch):
        failed, tried = doctest.testmod(module)
        assert failed == 0, module.__name__
        attempted += tried
    assert attempted >= 6


def test_bad_watcher_options_are_refused(tmp_path: Path) -> None:
    from bagstore.sharding.watch import Watcher

    with bagstore.open(tmp_path, shards=1) as ds:
        for bad in ({"interval": 0}, {"failures": 0}, {"lease": -1}, {"failures": 1.5}):
            with pytest.raises(ConfigurationError, match="watch needs"):
                Watcher(ds.router, **bad)
        assert Watcher(ds.router).shards() == []  # nothing replicated to watch
        with pytest.raises(ConfigurationError, match="has no replicas"):
            ds.failover(0, to="127.0.0.1:1")


def test_a_switchover_to_a_replica_that_lags_is_abandoned(group: ReplicationGroup, db: str) -> None:
    options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
    with _open(group, db) as ds, _open(group, db) as other:
        ds.put({"n": 1})
        group.sync()
        target = group.replicas[0]
        target.sql("STOP SLAVE SQL_THREAD")
        try:
            ds.put({"n": 2})  # the target cannot apply it
            with pytest.raises(ConfigurationError, match="abandoned"):
                ds.failover(0, to=target.addr, timeout=0.3, **options)
        finally:
            target.sql("START SLAVE SQL_THREAD")
        assert not group.primary.one("SELECT @@read_only")
        entity_id = other.put({"n": 3})  # its connection was closed; it looks, stays
        assert ds.put({"n": 4}) and other.get(entity_id)["n"] == 3
        assert other.router.backends[0].server == group.primary.addr
        assert ds.router.backends[0].server == group.primary.addr


def test_a_write_in_the_way_of_read_only_is_closed_not_waited_for(
    group: ReplicationGroup, db: str
) -> None:
    """``read_only=ON`` waits for every write statement under way; one that
    takes long (here a sleeping INSERT of the application's login, standing
    for a write stuck in its commit) has its connection closed after
    READ_ONLY_WAIT, and the switchover goes on."""
    from bagstore.backends import replication

    with _open(group, db) as ds:
        ds.put({"n": 1})
    group.sync()
    blocker = connect_as_app(group.primary, db)
    outcome: list[BaseException | None] = []

    def stuck_write() -> None:
        try:
            with blocker.cursor() as cur:
                cur.execute("CREATE TABLE IF NOT EXISTS slow (n INT) ENGINE=InnoDB")
                cur.execute("INSERT INTO slow SELECT SLEEP(60)")
            outcome.append(None)
        except Exception as exc:  # the connection is closed under it
            outcome.append(exc)

    thread = threading.Thread(target=stuck_write, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not group.primary.one(
        "SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE 'INSERT INTO slow%%'"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    old, target = group.primary.addr, group.replicas[0].addr
    options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
    with _open(group, db) as ds:
        started = time.monotonic()
        try:
            done = ds.failover(0, to=target, **options)
            took = time.monotonic() - started
            assert done["primary"] == target
            # waited READ_ONLY_WAIT once, not the statement's 60 s
            assert replication.READ_ONLY_WAIT <= took < 30
            thread.join(10)
            assert outcome and outcome[0] is not None  # its connection was closed
            assert group.primary.one("SELECT @@read_only")
        finally:
            ds.failover(0, to=old, **options)
    blocker.close()
    assert not group.primary.one("SELECT @@read_only")


def test_replication_commands_refuse_bad_input(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from bagstore.cli import cli

    store = str(tmp_path / "s")
    runner = CliRunner()
    assert runner.invoke(cli, ["--store", store, "init", "--shards", "1"]).exit_code == 0
    for args, says in [
        (["shard", "watch"], "no replicated shard"),
        (["shard", "failover", "0", "--to", "127.0.0.1:1"], "has no replicas"),
        (["shard", "failover", "9"], "no shard"),
        (["shard", "add-replica", "0", "nohost"], "has no replicas"),
        (["shard", "watch", "--failures", "0"], "--failures"),
    ]:
        result = runner.invoke(cli, ["--store", store, *args])
        assert result.exit_code == 2, (args, result.output)
        assert says in result.output and "Traceback" not in result.output
