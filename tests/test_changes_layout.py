"""SQLite keeps a shard's change rows in commit order (bagstore.backends.changeseq):
a store made with the layout before (rows keyed by kind, bucket and position)
is converted when opened, its changes and cursors kept; rows a bucket move
copies are numbered after the destination's own, in position order."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore.backends import changeseq
from bagstore.sharding.hashing import bucket_of

_OLD_TABLE = (
    "CREATE TABLE bagstore_changes (kind VARCHAR(64) NOT NULL, bucket INTEGER NOT NULL, "
    "pos BIGINT NOT NULL, id BLOB NOT NULL, op INTEGER NOT NULL, version BIGINT NOT NULL, "
    "updated BIGINT NOT NULL, body BLOB NULL, PRIMARY KEY (kind, bucket, pos)) WITHOUT ROWID"
)


def _as_before(path: Path) -> None:
    """Rewrite one shard file to the layout before: the change table keyed by
    (kind, bucket, pos), no counters, triggers that insert no number."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    triggers = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name LIKE 'bagstore_chg_%'"
    ).fetchall()
    for name, _ in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("ALTER TABLE bagstore_changes RENAME TO numbered")
    conn.execute(_OLD_TABLE)
    conn.execute(
        "INSERT INTO bagstore_changes SELECT kind, bucket, pos, id, op, version, updated, body "
        "FROM numbered"
    )
    conn.execute("DROP TABLE numbered")
    conn.execute(f"DROP TABLE {changeseq.FLOOR}")
    for _, text in triggers:
        old = text.replace("kind, seq, bucket", "kind, bucket")
        old = re.sub(r"MAX\(COALESCE\(\(SELECT MAX\(seq\).*?\) \+ 1, ", "", old)
        assert "seq" not in old, old
        conn.execute(old)
    conn.execute("COMMIT")
    conn.close()


def _columns(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [str(r[1]) for r in conn.execute("PRAGMA table_info(bagstore_changes)")]
    finally:
        conn.close()


def _seen(changes: list[bagstore.Change]) -> list[tuple[Any, ...]]:
    return [(c.bucket, c.position, c.id, c.op, c.version, c.entity) for c in changes]


def test_a_store_made_before_is_converted_when_opened(tmp_path: Path) -> None:
    paths = [tmp_path / f"s{i}.db" for i in range(2)]
    urls = [f"sqlite:///{p}" for p in paths]
    ds = bagstore.Datastore(urls, buckets=16)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": i} for i in range(60)])
    for i in ids[:20]:
        ds.put({"id": i, "n": -1})
    for i in ids[-10:]:
        assert ds.delete(i)
    every = ds.changes(limit=1000)
    part = ds.changes(limit=35)
    ds.close()
    for path in paths:
        _as_before(path)
        assert "seq" not in _columns(path)

    ds = bagstore.Datastore(urls, buckets=16)
    assert all("seq" in _columns(path) for path in paths)
    again = ds.changes(limit=1000)
    assert sorted(_seen(again)) == sorted(_seen(every)) and len(again) == 90
    rest = ds.changes(since=part.cursor, limit=1000)
    assert sorted(_seen(part) + _seen(rest)) == sorted(_seen(every))
    # the triggers were made again: new writes are numbered after the rows kept
    late = ds.put({"n": 100})
    newer = ds.changes(since=again.cursor)
    assert [(c.id, c.op) for c in newer] == [(late, "put")]
    assert [c.entity for c in newer] == [{"id": late, "n": 100}]
    for backend in ds.router.backends:
        top = changeseq.tops(backend, ds.kind)
        assert top == backend.fetchall("SELECT MAX(seq) FROM bagstore_changes")[0][0]
    ds.close()
    # opened again: nothing more to convert
    ds = bagstore.Datastore(urls, buckets=16)
    assert len(ds.changes(limit=1000)) == 91
    ds.close()


def test_a_bucket_moved_is_numbered_after_the_destination_s_rows(tmp_path: Path) -> None:
    """A bucket's rows copied by a move take numbers after every row of the
    destination, in position order: a reader of the destination that had
    read past its own rows reads the moved bucket's next changes in order."""
    ds = bagstore.Datastore([f"sqlite:///{tmp_path}/s{i}.db" for i in range(2)], buckets=8)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": i} for i in range(80)])
    page = ds.changes(limit=1000)
    bucket = page[0].bucket
    source = ds.placement.shard_of_bucket[bucket]
    target = ds.router.backends[1 - source]
    before = changeseq.tops(target, ds.kind)
    for i in ids[:40]:
        ds.put({"id": i, "n": -1})
    bagstore.Mover(ds, grace=0).move([bucket], to=1 - source)
    rows = target.fetchall(
        "SELECT pos, seq FROM bagstore_changes WHERE kind = ? AND bucket = ? ORDER BY pos",
        [ds.kind, bucket],
    )
    assert rows and all(seq > before for _, seq in rows)
    assert [seq for _, seq in rows] == sorted(seq for _, seq in rows)
    later = ds.changes(since=page.cursor, limit=1000)
    moved = [c.position for c in later if c.bucket == bucket]
    first = max(c.position for c in page if c.bucket == bucket)
    assert moved == list(range(first + 1, first + 1 + len(moved)))
    assert len(later) == 40
    ds.close()


@pytest.mark.parametrize("limit", [1, 7, 1000])
def test_pages_read_from_any_cursor_go_on_where_it_stood(tmp_path: Path, limit: int) -> None:
    """Reading from a cursor that is not the last page's end (a fresh start:
    each shard read from the first row after any of its buckets' positions,
    rows before skipped by position) gives each change once, in its
    bucket's order, whatever cursor."""
    urls = [f"sqlite:///{tmp_path}/s{i}.db" for i in range(2)]
    ds = bagstore.Datastore(urls, buckets=8)
    ds.feed.enable()
    ids = ds.put_many([{"n": i} for i in range(50)])
    for i in ids[::3]:
        ds.put({"id": i, "n": -1})
    cursors = [None]
    every: list[bagstore.Change] = []
    since = None
    while page := ds.changes(since=since, limit=7):
        every += page
        since = page.cursor
        cursors.append(since)
    for n, cursor in enumerate(cursors):
        other = bagstore.Datastore(urls, buckets=8)  # no session of its own
        got: list[bagstore.Change] = []
        since = cursor
        while page := other.changes(since=since, limit=limit):
            got += page
            since = page.cursor
        assert sorted(_seen(got)) == sorted(_seen(every[n * 7 :]))
        for b in range(8):
            positions = [c.position for c in got if c.bucket == b]
            assert positions == sorted(positions)
        other.close()
    ds.close()


@pytest.mark.parametrize("how", ["prune", "move away"])
@pytest.mark.parametrize("floor", [True, False])
def test_a_number_is_never_given_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, floor: bool
) -> None:
    """A change's number is one past the highest row's: when the rows with
    the highest numbers are deleted (retention, a bucket moved away), the
    kind's floor, raised first, keeps the next change past them (a reader
    that read them would otherwise skip it).  Without the floor (``floor``
    False, the check disabled) a number is given twice: the test can fail."""
    from bagstore.backends import changesql

    if not floor:
        monkeypatch.setattr(changeseq, "raise_floor", lambda backend, kind: None)
    ds = bagstore.Datastore([f"sqlite:///{tmp_path}/s0.db"], buckets=4)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(10)])
    backend = ds.router.backends[0]
    newest = ds.changes(limit=1000)[-1]
    top = changeseq.tops(backend, ds.kind)
    if how == "prune":
        changesql.prune(backend, ds.kind, newest.bucket, newest.position, None, 100)
    else:
        changesql.clear_bucket_changes(backend, newest.bucket)
    left = changeseq.tops(backend, ds.kind)
    assert left == top if floor else left < top
    other = next(b for b in range(4) if b != newest.bucket)
    ds.put({"n": 10, "id": _id_in_bucket(ds, other)})
    (seq,) = backend.fetchall("SELECT MAX(seq) FROM bagstore_changes WHERE kind = ?", [ds.kind])[0]
    assert (seq > top) is floor
    ds.close()


def _id_in_bucket(ds: bagstore.Datastore, bucket: int) -> bytes:
    while True:
        entity_id = bagstore.new_id()
        if bucket_of(entity_id, ds.placement.buckets) == bucket:
            return entity_id
