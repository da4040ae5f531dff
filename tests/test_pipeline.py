"""A write transaction sends the statements whose results it does not read
with the next one it reads, and with its COMMIT (bagstore.backends.pipeline):
a put of an entity and its index row on MariaDB is two round trips, and a
held statement that fails takes the whole transaction with it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import bagstore
from bagstore.backends.buckets import FROZEN
from tests.conftest import DRIVER, Topology

BY_USER = bagstore.Index(table="posts_by_user", properties=["user"])


@pytest.fixture
def one(topo: Topology) -> Iterator[bagstore.Datastore]:
    """A one-shard store (every index row beside its entity)."""
    ds = bagstore.Datastore(topo.urls[:1], kind="posts", indexes=[BY_USER], freeze_wait=0.3)
    yield ds
    ds.close()


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The query packets PyMySQL sends from now on (the real driver's, counted)."""
    import pymysql.connections

    sent: list[str] = []
    real = pymysql.connections.Connection.query

    def query(self: Any, sql: Any, unbuffered: bool = False) -> Any:
        sent.append(sql.decode() if isinstance(sql, bytes) else sql)
        return real(self, sql, unbuffered)

    monkeypatch.setattr(pymysql.connections.Connection, "query", query)
    return sent


def test_a_put_and_its_index_row_go_in_two_round_trips(
    topo: Topology, one: bagstore.Datastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not topo.is_mysql or DRIVER:
        pytest.skip("PyMySQL's write transactions are pipelined (SQLite has no round trips)")
    one.put({"user": "first"})  # tables made, connection open
    sent = _sent(monkeypatch)
    eid = one.put({"user": "ann"})
    monkeypatch.undo()
    assert len(sent) == 2, sent
    assert sent[0].startswith("BEGIN; ")  # with the locked read, whose rows are read
    assert sent[1].count("INSERT INTO") == 2 and sent[1].endswith("; COMMIT")
    assert [e["id"] for e in BY_USER.get_all(one, user="ann")] == [eid]
    # an update that moves its index row: the old row's delete is read (fenced)
    one.put({"id": eid, "user": "bob"})
    assert BY_USER.get_all(one, user="ann") == []
    assert [e["id"] for e in BY_USER.get_all(one, user="bob")] == [eid]
    assert one.check()["indexes"]["posts_by_user"]["missing"] == 0


def test_a_failing_held_statement_rolls_the_whole_put_back(one: bagstore.Datastore) -> None:
    kept = one.put({"user": "ann", "n": 1})
    # the index table goes behind bagstore's back: the index row's insert fails
    one.router.backends[0].execute("DROP TABLE posts_by_user")
    with pytest.raises(bagstore.BagstoreError):
        one.put({"id": kept, "user": "carl", "n": 2})
    fresh = bagstore.new_id()
    with pytest.raises(bagstore.BagstoreError):
        one.put({"id": fresh, "user": "bob"})
    assert one.get(kept) == {"id": kept, "user": "ann", "n": 1}  # nothing of either put
    assert one.get(fresh) is None
    # the table back (empty): the same connection serves the next write
    backend = one.router.backends[0]
    for sql in backend.dialect.create_index_table_sql("posts_by_user", ["user"], False):
        backend.execute(sql)
    one.put({"id": kept, "user": "carl", "n": 2})
    assert [e["n"] for e in BY_USER.get_all(one, user="carl")] == [2]


def test_an_index_row_in_a_frozen_bucket_holds_the_put_back(one: bagstore.Datastore) -> None:
    backend = one.router.backends[0]
    buckets = one.router.topology.buckets
    eid = bagstore.new_id()

    def row_bucket_of(user: str) -> int:
        (row,) = BY_USER.rows_for({"user": user}, eid, buckets)
        return row.bucket

    home = one.placer.entity_bucket({}, eid)
    user = next(u for u in (f"user{k}" for k in range(1000)) if row_bucket_of(u) != home)
    row_bucket = row_bucket_of(user)
    one.put({"user": "warm"})
    backend.execute(f"UPDATE bagstore_owned SET state = {FROZEN} WHERE bucket = {row_bucket}")
    with pytest.raises(bagstore.KeyMigrating):
        one.put({"id": eid, "user": user})
    assert one.get(eid) is None  # the entity waits with its index row
    backend.execute(f"UPDATE bagstore_owned SET state = 0 WHERE bucket = {row_bucket}")
    one.put({"id": eid, "user": user})
    assert [e["id"] for e in BY_USER.get_all(one, user=user)] == [eid]


def test_a_held_statement_is_spelled_as_the_driver_spells_it(mysql_main: Any) -> None:
    """Pipeline spells bytes and ints itself (one pass over a put_many's
    thousands of parameters): the text is cursor.mogrify's, byte for byte,
    for every kind of value; a driver that spells them otherwise is left to."""
    import pymysql

    from bagstore.backends.pipeline import Pipeline

    conn = pymysql.connect(host=mysql_main.host, port=mysql_main.port, user="root")
    try:
        cur = conn.cursor()
        pipe = Pipeline(cur)
        values = [
            b"\x00'\\\"%s\xff", b"", 0, -12, 2**63 + 5, True, None, "it's 100% \\", 1.5,
            bagstore.new_id(),
        ]  # fmt: skip
        sql = "SELECT " + ", ".join(["%s"] * len(values)) + " FROM DUAL WHERE 1 %% 2"
        assert pipe.text(sql, values) == cur.mogrify(sql, values)
        assert pipe.text("SELECT 5 %% 2") == cur.mogrify("SELECT 5 %% 2") == "SELECT 5 %% 2"
        # and the server reads back what was sent (into binary columns of a
        # database of the test's own: PyMySQL before 1.2 decodes a bare binary
        # literal's column as text)
        db = f"bst_spelled_{uuid.uuid4().hex[:12]}"
        cur.execute(f"CREATE DATABASE {db}")
        try:
            cur.execute(f"CREATE TABLE {db}.t (b VARBINARY(64), e VARBINARY(16), n DECIMAL(30))")
            insert = f"INSERT INTO {db}.t VALUES (%s, %s, %s)"
            cur.execute(pipe.text(insert, [values[0], b"", 2**63 + 5]))
            cur.execute(pipe.text(insert, [values[9], values[7], -12]))
            cur.execute(f"SELECT b, e, n FROM {db}.t ORDER BY n")
            assert cur.fetchall() == (
                (values[9], values[7].encode(), -12),
                (values[0], b"", 2**63 + 5),
            )
        finally:
            cur.execute(f"DROP DATABASE {db}")
        # held statements bound in one go: the text of each, bound alone, joined
        parts: list[tuple[str, Any]] = [
            ("BEGIN", ()),
            ("SELECT 5 %% 2", ()),
            (sql, values),
            ("SELECT %s, '%%s' FROM DUAL", ["50%", ]),  # a literal % beside a mark
            ("SELECT %s, %s", [3, b"\x01"]),
            ("COMMIT", ()),
        ]  # fmt: skip
        expected = "; ".join(str(cur.mogrify(q, p or None)) for q, p in parts)
        assert pipe.joined(parts) == expected
        # a wrong count: the driver's error (PyMySQL before 1.2 lets the TypeError out)
        with pytest.raises((pymysql.err.ProgrammingError, TypeError)):
            pipe.joined([("SELECT %s", [1, 2]), ("SELECT %s, %s", [3])])

        class Quoting(pymysql.connections.Connection):  # type: ignore[misc]
            def escape(self, obj: Any, mapping: Any = None) -> str:
                return "_binary'x'" if isinstance(obj, bytes) else str(super().escape(obj, mapping))

        odd = Quoting(host=mysql_main.host, port=mysql_main.port, user="root")
        try:
            other = odd.cursor()
            assert Pipeline(other).text("SELECT %s, %s", [b"ab", 3]) == "SELECT _binary'x', 3"
        finally:
            odd.close()
    finally:
        conn.close()


def test_a_put_s_locked_read_answers_its_rows_in_four_columns(
    topo: Topology, one: bagstore.Datastore
) -> None:
    """The locked read of a put whose buckets are all owned answers the
    entity's row and nothing else the driver must parse: four columns, no
    count row on MariaDB (sent only when short), the version an int (no
    DECIMAL made of the UNION's types)."""
    from bagstore.sharding.hashing import bucket_of

    eid = one.put({"user": "ann"})
    backend = one.router.backends[0]
    buckets = len(one.placement.shard_of_bucket)
    mine = bucket_of(eid, buckets)
    fence = [mine, (mine + 1) % buckets]  # (a one-shard store: both owned)

    def work(cur: Any) -> tuple[Any, int, int]:
        rows = backend._locked_read(cur, "posts", fence, [eid])
        raw = getattr(cur, "cur", cur)  # (a Pipeline's own cursor)
        return rows, len(raw.description), raw.rowcount

    rows, columns, count = backend.write(work)
    assert [(r[0], bagstore.codec.decode(r[1])) for r in rows] == [
        (eid, {"id": eid, "user": "ann"})
    ]
    assert columns == 4
    assert all(type(v) is int and v > 0 for v in rows[0][2:])
    if topo.is_mysql:
        assert count == 1  # the entity's row alone
