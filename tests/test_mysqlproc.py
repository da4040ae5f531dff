"""MariaDB's put of one entity through the kind's stored procedure
(backends/mysqlproc.py): made where it is missing, the compound statement
where it cannot be made or run, and everything the compound statement
guaranteed (ownership, versions, the change feed, read-your-writes GTIDs,
a read-only server's refusal)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

import pytest

import bagstore
from bagstore.backends import EntityRow
from bagstore.backends.mysql import MySQLBackend
from bagstore.backends.mysqlsql import put_procedure_name
from bagstore.errors import BackendError, KeyMigrating, StalePlacement
from bagstore.versions import clock
from tests import servers
from tests.conftest import started

DRIVERS = [
    "pymysql",
    pytest.param(
        "mysqlclient",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("MySQLdb") is None, reason="mysqlclient is optional"
        ),
    ),
]
PROC = put_procedure_name("posts")


def _procedures(backend: Any) -> set[str]:
    rows = backend.fetchall("SELECT name FROM mysql.proc WHERE db = DATABASE()")
    return {r[0].decode() if isinstance(r[0], bytes) else str(r[0]) for r in rows}


def _owned_id(backend: Any, buckets: int) -> tuple[bytes, int]:
    """An id whose bucket ``backend`` owns, and that bucket."""
    from bagstore.sharding.hashing import bucket_of

    mine = {b for b, s in backend.bucket_states().items() if s == 0}
    for k in range(1, 10_000):
        entity_id = k.to_bytes(16, "big")
        bucket = bucket_of(entity_id, buckets)
        if bucket in mine:
            return entity_id, bucket
    raise AssertionError("no bucket owned")


@pytest.fixture(params=DRIVERS)
def store(request: pytest.FixtureRequest, mysql_main: servers.MySQLAddress) -> Iterator[Any]:
    """Two databases on the main MariaDB, on each driver."""
    m = mysql_main
    names = [servers.unique_name("proc") for _ in range(2)]
    auth = f"{m.user}:{m.password}" if m.password else m.user
    urls = [f"mysql://{auth}@{m.host}:{m.port}/{n}?driver={request.param}" for n in names]
    ds = bagstore.Datastore(urls, kind="posts", buckets=64)
    try:
        yield ds
    finally:
        ds.close()
        servers.drop_databases(m.host, m.port, names, m.user, m.password)


def test_puts_call_the_kinds_procedure_made_where_missing(store: Any) -> None:
    ids = [store.put({"n": n}) for n in range(20)]
    assert [e["n"] for e in store.get_many(ids)] == list(range(20))
    for backend in store.router.backends:
        assert _procedures(backend) == {PROC}  # each shard put to made its own
        assert backend._compound_kinds == set()
    # an operator drops them: the next puts make them again and succeed
    for backend in store.router.backends:
        backend.execute(f"DROP PROCEDURE {PROC}")
    before = store.get_with_version(ids[0])
    store.put({"id": ids[0], "n": 100})
    more = [store.put({"n": n}) for n in range(20)]
    after = store.get_with_version(ids[0])
    assert before is not None and after is not None and after[1] > before[1]
    assert after[0] == {"id": ids[0], "n": 100} and len(store.get_many(more)) == 20
    assert all(_procedures(b) == {PROC} for b in store.router.backends)
    assert store.check()["missing"] == 0


def test_the_versions_a_call_returns_never_go_back(store: Any) -> None:
    backend = store.router.backends[0]
    entity_id, bucket = _owned_id(backend, 64)
    body = bagstore.codec.encode({"id": entity_id})
    versions: dict[bytes, int] = {}
    start = clock()
    backend.put_entities("posts", [EntityRow(entity_id, bucket, 1, body)], read_old=False,
                         versions=versions)  # fmt: skip
    first = versions[entity_id]
    assert first >= start and backend.versions("posts", [entity_id])[entity_id][0] == first
    # a version above the clock (a clock set back since): the next is one more
    backend.execute("UPDATE posts SET version = %s WHERE id = %s", [first + 10**12, entity_id])
    backend.put_entities("posts", [EntityRow(entity_id, bucket, 2, body)], read_old=False,
                         versions=versions)  # fmt: skip
    assert versions[entity_id] == first + 10**12 + 1
    assert backend.versions("posts", [entity_id])[entity_id] == (first + 10**12 + 1, 2)
    backend.put_entities("posts", [EntityRow(entity_id, bucket, 3, body)], read_old=False)
    assert backend.versions("posts", [entity_id])[entity_id] == (first + 10**12 + 2, 3)
    assert _procedures(backend) == {PROC}


@pytest.mark.parametrize("state", ["frozen", "gone"])
def test_a_call_refuses_a_bucket_not_owned(store: Any, state: str) -> None:
    backend = store.router.backends[0]
    entity_id, bucket = _owned_id(backend, 64)
    old = EntityRow(entity_id, bucket, 1, bagstore.codec.encode({"id": entity_id}))
    backend.put_entities("posts", [old], read_old=False)  # (the procedure is made)
    if state == "frozen":
        backend.set_bucket_state(bucket, 1)
    else:
        backend.release_bucket(bucket)
    new = EntityRow(entity_id, bucket, 2, bagstore.codec.encode({"id": entity_id, "n": 2}))
    with pytest.raises(KeyMigrating if state == "frozen" else StalePlacement):
        backend.put_entities("posts", [new], read_old=False)
    assert backend.get_bodies("posts", [entity_id])[entity_id].body == old.body
    assert backend._compound_kinds == set() and _procedures(backend) == {PROC}


def test_the_feed_records_a_called_put(store: Any) -> None:
    store.feed.enable(bodies=True)
    a = store.put({"n": 1})
    store.put({"id": a, "n": 2})
    b = store.put({"n": 3})
    got = sorted((c.id, c.version, c.op, c.entity) for c in store.changes())
    va, vb = (store.get_with_version(i)[1] for i in (a, b))
    of_a = [g for g in got if g[0] == a]
    assert [(g[2], g[3]) for g in of_a] == [("put", {"id": a, "n": 1}), ("put", {"id": a, "n": 2})]
    assert of_a[0][1] < of_a[1][1] == va
    assert [g[1:] for g in got if g[0] == b] == [(vb, "put", {"id": b, "n": 3})]
    assert sum(bool(_procedures(be)) for be in store.router.backends) >= 1


# -- a private server with binary logs (GTIDs) and logins of its own ------------------


@pytest.fixture(scope="module")
def server() -> Iterator[servers.MariaDBServer]:
    options = ("--server-id=1", "--log-bin=mysql-bin", "--binlog-format=ROW", "--sync-binlog=0")
    with started(servers.MariaDBServer(extra_options=options)) as s:
        yield s


def _root(server: servers.MariaDBServer, *statements: str) -> Any:
    conn = server.connect()
    try:
        cur = conn.cursor()
        for sql in statements:
            cur.execute(sql)
        return cur.fetchall()
    finally:
        conn.close()


@pytest.fixture
def db(server: servers.MariaDBServer) -> Iterator[str]:
    name = servers.unique_name("proc")
    _root(server, f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    yield name
    _root(server, f"DROP DATABASE IF EXISTS {name}")


def _login(server: servers.MariaDBServer, db: str, revoke: str) -> str:
    """A login with every privilege on ``db`` but ``revoke``; its name."""
    user = f"u{db[-6:]}"
    _root(
        server,
        f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw'",
        f"GRANT ALL PRIVILEGES ON `{db}`.* TO '{user}'@'127.0.0.1'",
        *([f"REVOKE {revoke} ON `{db}`.* FROM '{user}'@'127.0.0.1'"] if revoke else []),
    )
    return user


def _open(
    server: servers.MariaDBServer, db: str, user: str = "root", driver: str = "pymysql"
) -> Any:
    auth = "root" if user == "root" else f"{user}:pw"
    url = f"mysql://{auth}@{server.host}:{server.port}/{db}?driver={driver}"
    return bagstore.Datastore([url], kind="posts", buckets=16)


@pytest.mark.parametrize("returning", [False, True])
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_called_put_reports_its_gtid(
    server: servers.MariaDBServer, db: str, driver: str, returning: bool
) -> None:
    """Read-your-writes: the GTID of the CALL's commit is the one noted
    (PyMySQL: from the CALL's last OK packet; mysqlclient: asked after)."""
    _open(server, db).close()  # the shard's tables
    backend = MySQLBackend(host=server.host, port=server.port, user="root", password="",
                           database=db, driver=driver, replicas=["127.0.0.1:1"])  # fmt: skip
    try:
        entity_id, bucket = _owned_id(backend, 16)
        row = EntityRow(entity_id, bucket, 1, b'{"n": 1}')
        for _ in range(3):
            backend.put_entities("posts", [row], read_old=False,
                                 versions={} if returning else None)  # fmt: skip
            assert backend.position() == _root(server, "SELECT @@gtid_binlog_pos")[0][0]
        assert _procedures(backend) == {PROC}
    finally:
        backend.close()


@pytest.mark.parametrize("revoke", ["CREATE ROUTINE", "CREATE ROUTINE, EXECUTE"])
def test_a_login_that_may_not_make_or_run_it_puts_as_before(
    server: servers.MariaDBServer, db: str, revoke: str, caplog: pytest.LogCaptureFixture
) -> None:
    if "EXECUTE" in revoke:  # made by another login: this one may not run it
        root = _open(server, db)
        root.put({"n": 0})
        root.close()
    user = _login(server, db, revoke)
    try:
        ds = _open(server, db, user)
        with caplog.at_level(logging.WARNING, "bagstore.backends.mysqlproc"):
            a = ds.put({"n": 1})
            ds.put({"id": a, "n": 2})
            b = ds.put({"n": 3})
        backend = ds.router.backends[0]
        assert backend._compound_kinds == {"posts"}
        assert len([r for r in caplog.records if "without its stored procedure" in r.message]) == 1
        assert ds.get(a) == {"id": a, "n": 2} and ds.get(b) == {"id": b, "n": 3}
        ds.close()
        root = _open(server, db)
        assert _procedures(root.router.backends[0]) == (
            set() if revoke == "CREATE ROUTINE" else {PROC}
        )
        root.close()
    finally:
        _root(server, f"DROP USER '{user}'@'127.0.0.1'")


def test_a_read_only_server_refuses_a_called_put(server: servers.MariaDBServer, db: str) -> None:
    """The old primary of a switchover is fenced by read_only: a login
    without READ ONLY ADMIN (the application's) can write nothing there,
    through the procedure or by making it."""
    user = _login(server, db, "")
    ds = _open(server, db, user)
    try:
        a = ds.put({"n": 1})
        _root(server, "SET GLOBAL read_only = ON")
        try:
            with pytest.raises(BackendError, match="read-only"):
                ds.put({"id": a, "n": 2})
            _root(server, f"DROP PROCEDURE `{db}`.{PROC}")
            with pytest.raises(BackendError, match="read-only"):
                ds.put({"id": a, "n": 3})  # nor may it make the procedure again
        finally:
            _root(server, "SET GLOBAL read_only = OFF")
        assert ds.get(a) == {"id": a, "n": 1}
        ds.put({"id": a, "n": 4})
        assert ds.get(a) == {"id": a, "n": 4} and ds.router.backends[0]._compound_kinds == set()
    finally:
        ds.close()
        _root(server, f"DROP USER '{user}'@'127.0.0.1'")


def test_procedure_names_fit_whatever_the_kind() -> None:
    import doctest

    from bagstore.backends import mysqlsql

    assert doctest.testmod(mysqlsql).failed == 0
    long_kind = "k" * 64
    assert len(put_procedure_name(long_kind)) <= 64
    assert put_procedure_name(long_kind) != put_procedure_name("k" * 63)
    with pytest.raises(bagstore.ConfigurationError):
        mysqlsql.MySQLDialect().put_procedure_sql("x' OR '1")


def test_a_login_without_super_uses_the_ownership_gate_another_made(
    server: servers.MariaDBServer, db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Binary logging: a login without SUPER may not create triggers (1419).
    It writes through the gate where another login made it (backends/gate.py),
    and checks each bucket's row, with a warning, where none did."""
    _open(server, db).close()  # root makes the shard's tables and the gate's triggers
    alone = servers.unique_name("proc")
    _root(server, f"CREATE DATABASE {alone} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    user = _login(server, db, "")
    _root(server, f"GRANT ALL PRIVILEGES ON `{alone}`.* TO '{user}'@'127.0.0.1'")
    try:
        for name, gated in ((db, True), (alone, False)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, "bagstore.backends.gate"):
                ds = _open(server, name, user)
            try:
                backend = ds.router.backends[0]
                assert backend.gated is gated
                warned = [r for r in caplog.records if "no ownership gate" in r.message]
                assert len(warned) == (0 if gated else 1)
                batch = [{"id": bagstore.new_id(), "n": k} for k in range(50)]
                ds.put_many(batch)
                assert (backend._gate_seen is not None) is gated
                assert [ds.get(e["id"]) for e in batch] == batch
            finally:
                ds.close()
    finally:
        _root(server, f"DROP USER '{user}'@'127.0.0.1'", f"DROP DATABASE IF EXISTS {alone}")
