"""On MariaDB the one-statement put (a compound statement) is prepared once
per connection and then EXECUTEd: the server parses the block once.  A
statement gone from the session is prepared again; a server that holds no
more prepared statements gets the statement's text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

import bagstore
from tests import servers
from tests.conftest import DRIVER


@pytest.fixture
def store(mysql_main: servers.MySQLAddress) -> Iterator[bagstore.Datastore]:
    name = servers.unique_name("prep")
    ds = bagstore.Datastore([f"mysql://root@{mysql_main.host}:{mysql_main.port}/{name}{DRIVER}"])
    yield ds
    ds.close()
    servers.drop_databases(mysql_main.host, mysql_main.port, [name], "root", "")


def _executes(ds: bagstore.Datastore) -> int:
    """EXECUTE statements run by the connection bagstore's next write takes."""
    with ds.router.backends[0].connection() as conn:
        cur = conn.cursor()
        cur.execute("SHOW SESSION STATUS LIKE 'Com_execute_sql'")
        return int(cur.fetchone()[1])


def test_a_put_executes_a_statement_prepared_once(store: bagstore.Datastore) -> None:
    first = store.put({"n": 0})
    before = _executes(store)
    for n in range(1, 6):
        store.put({"id": first, "n": n})
    assert _executes(store) - before == 5
    entity, version = store.get_with_version(first)  # type: ignore[misc]
    assert entity == {"id": first, "n": 5} and version > 0


def test_a_statement_gone_from_the_session_is_prepared_again(store: bagstore.Datastore) -> None:
    entity_id = store.put({"n": 1})
    with store.router.backends[0].connection() as conn:
        names: dict[str, Any] = conn.bagstore_prepared
        assert list(names.values()) == [True]
        cur = conn.cursor()
        for name in names:
            cur.execute(f"DEALLOCATE PREPARE {name}")  # as a session reset would
    store.put({"id": entity_id, "n": 2})
    assert store.get(entity_id) == {"id": entity_id, "n": 2}


def test_a_server_full_of_prepared_statements_gets_the_text(
    mysql_main: servers.MySQLAddress,
) -> None:
    admin = pymysql.connect(host=mysql_main.host, port=mysql_main.port, user="root")
    cur = admin.cursor()
    cur.execute("SELECT @@GLOBAL.max_prepared_stmt_count")
    limit = int(cur.fetchone()[0])
    name = servers.unique_name("prep")
    url = f"mysql://root@{mysql_main.host}:{mysql_main.port}/{name}{DRIVER}"
    ds = bagstore.Datastore([url])
    try:
        cur.execute("SET GLOBAL max_prepared_stmt_count = 0")
        ids = [ds.put({"n": n}) for n in range(3)]
        with ds.router.backends[0].connection() as conn:
            assert list(conn.bagstore_prepared.values()) == [False]  # asked once, not again
        assert [e["n"] for e in ds.get_many(ids)] == [0, 1, 2]  # type: ignore[index]
    finally:
        cur.execute(f"SET GLOBAL max_prepared_stmt_count = {limit}")
        ds.close()
        admin.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, [name], "root", "")
