"""Every kind of write and the change feed: typed tables' writes recorded as
the dict API's are, and a write that fails inside its transaction (after its
entity's statement and its change's) leaving neither (issue #26)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import bagstore
from tests.conftest import Topology
from tests.test_changes import drain


@contextmanager
def fuse(
    ds: bagstore.Datastore, table: str, entity_id: bytes, recorded: int, mysql: bool
) -> Iterator[None]:
    """While in the block, writing or deleting ``entity_id``'s rows of index
    ``table`` fails once the entity has more than ``recorded`` changes: a
    statement of its write's transaction after its entity's and its change's."""
    (backend,) = ds.router.backends
    x = f"X'{entity_id.hex()}'"
    recorded_more = f"(SELECT COUNT(*) FROM bagstore_changes WHERE id = {x}) > {recorded}"
    for when, row in (("INSERT", "NEW"), ("DELETE", "OLD")):
        name, hit = f"test_fuse_{when[0]}", f"{row}.entity_id = {x} AND {recorded_more}"
        if mysql:
            backend.execute(f"CREATE TRIGGER {name} BEFORE {when} ON {table} FOR EACH ROW "
                            f"BEGIN IF {hit} THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = "
                            "'fuse'; END IF; END")  # fmt: skip
        else:
            backend.execute(f"CREATE TRIGGER {name} BEFORE {when} ON {table} WHEN {hit} "
                            "BEGIN SELECT RAISE(ABORT, 'fuse'); END")  # fmt: skip
    try:
        yield
    finally:
        for when in ("I", "D"):
            backend.execute(f"DROP TRIGGER test_fuse_{when}")


@pytest.mark.parametrize("op", ["put", "put_many", "update", "delete", "delete_many"])
def test_a_write_failing_inside_its_transaction_has_no_change(topo: Topology, op: str) -> None:
    """Each kind of write made to fail at a statement after its entity's (an
    index row, in the entity's transaction on a one-shard store): the store
    and the feed agree after it, and the write done again has one change."""
    idx = bagstore.Index(table="index_tag", properties=["tag"])
    ds = bagstore.Datastore(topo.urls[:1], indexes=[idx])
    try:
        ds.feed.enable()
        others = ds.put_many([{"tag": "a", "n": i} for i in range(8)])
        target = others[3] if op in ("update", "delete", "delete_many") else bagstore.new_id()
        batch = [{"id": i, "tag": "b"} for i in others[:5]] + [{"id": target, "tag": "b"}]
        write = {
            "put": lambda: ds.put({"id": target, "tag": "b"}),
            "put_many": lambda: ds.put_many(batch),
            "update": lambda: ds.update(target, lambda e: {**e, "tag": "b"}),
            "delete": lambda: ds.delete(target),
            "delete_many": lambda: ds.delete_many(others[:5]),
        }[op]
        before, cursor = drain(ds)
        recorded = sum(1 for c in before if c.id == target)
        fused = fuse(ds, "index_tag", target, recorded, topo.is_mysql)
        with fused, pytest.raises(bagstore.BagstoreError, match="fuse"):
            write()
        failed, cursor = drain(ds, cursor)
        assert failed == []  # nothing committed, nothing recorded
        stored = {i: v for i in (*others, target) if (v := ds.get_with_version(i))}
        assert {i: v for i, (_, v) in stored.items()} == {
            c.id: c.version for c in before if c.id in stored
        }
        assert (target in stored) == (op != "put" and op != "put_many")
        write()  # again, with nothing in its way
        again, _ = drain(ds, cursor)
        assert [c.id for c in again if c.id == target] == [target]
        for c in again:  # each change is the state the store now holds
            now = ds.get_with_version(c.id)
            assert (c.op, c.version) == (("put", now[1]) if now else ("delete", c.version))
    finally:
        ds.close()


class Note(bagstore.Model, kind="notes", shard_key="user_id", indexes=[("user_id", "tag")]):
    note_id: int = bagstore.auto_id()
    user_id: int
    tag: str = ""
    text: str = ""


def test_typed_table_writes_are_recorded(topo: Topology) -> None:
    """A table's insert, update (its changed fields on the stored entity) and
    delete each record one change, with the version and the body stored."""
    notes = Note.open(topo.urls)
    try:
        notes.ds.feed.enable(bodies=True)
        row = notes.insert(Note(user_id=7, tag="a", text="first"))
        notes.ds.update(notes.ds.query(user_id=7)[0]["id"], lambda e: {**e, "extra": 1})
        loaded = notes.load(7, row.note_id)
        assert loaded is not None
        row = loaded
        row.text = "second"
        assert notes.update(row) is True
        assert notes.update(row) is False  # nothing changed: nothing written, nothing recorded
        other = notes.insert(Note(user_id=8))
        assert notes.delete(row) is True
        changes, _ = drain(notes.ds)
        of_row = [(c.op, c.version, c.entity) for c in changes if c.entity is None or
                  c.entity["note_id"] == row.note_id]  # fmt: skip
        ops = [op for op, _, _ in of_row]
        assert ops == ["put", "put", "put", "delete"]
        versions = [v for _, v, _ in of_row]
        assert versions[0] < versions[1] < versions[2] == versions[3]
        bodies = [e for _, _, e in of_row]
        assert bodies[0] is not None and bodies[0]["text"] == "first"
        assert bodies[2] is not None and (bodies[2]["text"], bodies[2]["extra"]) == ("second", 1)
        assert bodies[3] is None
        assert [c.entity["note_id"] for c in changes if c.entity and c.entity["user_id"] == 8] == [
            other.note_id
        ]
    finally:
        notes.close()
