"""Entities with large bodies through the paths that write many rows in one
statement: a bucket move and a key migration copy their rows (and the feed's
change rows, bodies and all) within ``max_statement_bytes``, so that a
MariaDB statement fits in the server's ``max_allowed_packet`` (16 MiB by
default: a body is escaped to twice its size on the wire)."""

from __future__ import annotations

import random
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bagstore
from bagstore.backends import changesql
from bagstore.backends.chunks import by_size, row_bytes
from tests.conftest import Topology

#: ~10 MB in one bucket: more than one statement of 8 MB takes
_BODY, _MANY = 2_000_000, 5


@given(
    sizes=st.lists(st.integers(0, 50), max_size=40),
    max_bytes=st.integers(1, 120),
    max_rows=st.integers(1, 8),
)
def test_chunks_keep_the_rows_in_order_within_both_bounds(
    sizes: list[int], max_bytes: int, max_rows: int
) -> None:
    rows = list(range(len(sizes)))
    chunks = [list(c) for c in by_size(rows, sizes, max_bytes, max_rows)]
    assert [r for c in chunks for r in c] == rows
    assert all(0 < len(c) <= max_rows for c in chunks)
    for c in chunks:
        assert len(c) == 1 or sum(sizes[r] for r in c) <= max_bytes
    for c, after in pairwise(chunks):  # each as long as the bounds allow
        more = c + after[:1]
        assert len(more) > max_rows or sum(sizes[r] for r in more) > max_bytes


def test_the_chunker_s_doctests_pass() -> None:
    import doctest

    from bagstore.backends import chunks

    failed, attempted = doctest.testmod(chunks)
    assert failed == 0 and attempted == 2


def test_a_rows_size_counts_its_bytes_and_strings() -> None:
    assert row_bytes((b"x" * 100, "yz", 7, None)) == 102 + 4 * 16


def _blobs(ds: bagstore.Datastore, n: int, **extra: object) -> dict[bytes, dict[str, object]]:
    rng = random.Random(26)
    out: dict[bytes, dict[str, object]] = {}
    for _ in range(n):
        entity = {"blob": rng.randbytes(_BODY), **extra}
        out[ds.put(entity)] = entity
    return out


def test_a_bucket_of_large_entities_moves_with_its_changes(topo: Topology) -> None:
    """Five entities of 2 MB in one bucket (one shard key), the feed recording
    bodies: the bucket's ~10 MB of entities and as much of change rows move
    in several statements; every entity and change reads back whole."""
    ds = topo.open(buckets=4, kind="docs", shard_key="user")
    ds.feed.enable(bodies=True)
    written = _blobs(ds, _MANY, user="ann")
    bucket = ds.bucket_of_id(next(iter(written)))
    assert bucket is not None and {ds.bucket_of_id(i) for i in written} == {bucket}
    here = ds.placement.shard_of_bucket[bucket]
    there = (here + 1) % len(topo.urls)
    stats = bagstore.Mover(ds, grace=0).move([bucket], to=there)
    assert stats.entities == _MANY
    ds.refresh_placement(force=True)
    assert ds.placement.shard_of_bucket[bucket] == there
    for entity_id, entity in written.items():
        assert ds.get(entity_id) == {**entity, "id": entity_id}
    changes = []
    since = None
    while page := ds.changes(since=since, limit=4):
        changes += [(c.id, c.entity) for c in page]
        since = page.cursor
    assert sorted(changes, key=lambda c: c[0]) == sorted(
        ((i, {**e, "id": i}) for i, e in written.items()), key=lambda c: c[0]
    )


def test_a_key_of_large_entities_migrates(topo: Topology) -> None:
    """One shard key's five entities of 2 MB migrate to a bucket of another
    shard in several statements, and read back whole."""
    ds = topo.open(
        kind="docs", buckets=8, shard_key="user", shard_map="directory", refresh_interval=0
    )
    written = _blobs(ds, _MANY, user="ann")
    here = ds.placement.shard_of_bucket[ds.bucket_of_id(next(iter(written))) or 0]
    to = next(b for b in range(8) if ds.placement.shard_of_bucket[b] != here)
    assert ds.migrate_key("ann", to_bucket=to, wait=0) == _MANY
    for entity_id, entity in written.items():
        assert ds.bucket_of_id(entity_id) == to
        assert ds.get(entity_id) == {**entity, "id": entity_id}


def test_a_move_reads_large_change_rows_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket's 24 change rows of 1 MB: the move reads them ten at first,
    then as many as fit in ~8 MiB, not a hundred at once."""
    urls = [f"sqlite:///{tmp_path}/s{i}.db" for i in range(2)]
    ds = bagstore.Datastore(urls, buckets=2, shard_key="user")
    ds.feed.enable(bodies=True)
    rng = random.Random(5)
    ids = [ds.put({"user": "ann", "blob": rng.randbytes(1_000_000)}) for _ in range(8)]
    for _ in range(2):
        for i in ids:
            ds.put({"id": i, "user": "ann", "blob": rng.randbytes(1_000_000)})
    bucket = ds.bucket_of_id(ids[0])
    assert bucket is not None and {ds.bucket_of_id(i) for i in ids} == {bucket}
    reads: list[tuple[int, int]] = []  # rows, bytes of bodies
    read = changesql.bucket_change_rows

    def spy(*args: Any) -> list[changesql.ChangeRow]:
        rows = read(*args)
        reads.append((len(rows), sum(len(r.body or b"") for r in rows)))
        return rows

    monkeypatch.setattr(changesql, "bucket_change_rows", spy)
    here = ds.placement.shard_of_bucket[bucket]
    bagstore.Mover(ds, grace=0).move([bucket], to=1 - here)
    # every change row copied, once: ten, then the eight of ~1 MB that fit in
    # 8 MiB, then the last six
    assert [n for n, _ in reads] == [10, 8, 6]
    assert all(size <= 8 * 2**20 for _, size in reads[1:]), reads
    since, got = None, 0
    while page := ds.changes(since=since, limit=5):
        got += len(page)
        since = page.cursor
    assert got == 24
    ds.close()


def test_the_batch_sizers_doctests_pass() -> None:
    import doctest

    from bagstore import rowsize

    failed, attempted = doctest.testmod(rowsize)
    assert failed == 0 and attempted >= 6


def _sized_reads(
    monkeypatch: pytest.MonkeyPatch, backend: Any, method: str, body_of: Any
) -> list[tuple[int, int, int]]:
    """(rows asked, rows read, bytes of their bodies) of each call of a
    backend's scan ``method`` from now on."""
    calls: list[tuple[int, int, int]] = []
    scan = getattr(backend, method)

    def spy(kind: str, *args: Any, **kw: Any) -> Any:
        got = scan(kind, *args, **kw)
        rows = got[0] if isinstance(got, tuple) else got
        calls.append((args[-1], len(rows), sum(len(body_of(r)) for r in rows)))
        return got

    monkeypatch.setattr(backend, method, spy)
    return calls


def test_a_backfill_and_a_repair_read_large_bodies_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 entities of 1 MB on one shard: a flat-out backfill (5,000 rows a
    batch) and a repair (1,000) read ten first, then what fits in ~32 MiB,
    rather than every body at once; the index is whole.  The repair's sweep
    of a non-unique index reads no body (which entities exist), so its
    pages are not cut to the bodies' size."""
    ds = bagstore.Datastore([f"sqlite:///{tmp_path}/one.db"])
    rng = random.Random(3)
    for n in range(60):
        ds.put({"n": n % 7, "blob": rng.randbytes(1_000_000)})
    backend = ds.router.backends[0]
    reads = _sized_reads(monkeypatch, backend, "scan_bodies", lambda r: r[1])
    by_n = bagstore.Index("by_n", ["n"])
    assert ds.add_index(by_n) == "building"
    stats = bagstore.Cleaner(ds, duty=0, settle=0).backfill("by_n")
    assert stats.written == 60
    assert [asked for asked, _, _ in reads] == [10, 33, 33], reads  # 32 MiB / ~1 MB
    assert max(size for _, _, size in reads) <= 32 * 2**20
    assert len(by_n.get_all(ds, n=3)) == len([n for n in range(60) if n % 7 == 3])
    recent = _sized_reads(monkeypatch, backend, "scan_recent", lambda r: r[2])
    fetched: list[int] = []
    fetch = ds.fetch_many

    def spy(ids: Any) -> Any:
        got = fetch(ids)
        fetched.append(len(got))
        return got

    monkeypatch.setattr(ds, "fetch_many", spy)
    exist = ds.existing
    asked: list[int] = []

    def exist_spy(ids: Any) -> Any:
        ids = list(ids)
        asked.append(len(ids))
        return exist(ids)

    monkeypatch.setattr(ds, "existing", exist_spy)
    bagstore.Cleaner(ds, settle=0).repair()  # with its sweep of rows left by deletes
    assert [asked for asked, _, _ in recent] == [10, 33, 33, 33], recent
    assert max(size for _, _, size in recent) <= 32 * 2**20
    assert fetched == []  # no body fetched by the sweep
    assert asked == [10, 50]  # its pages: ten first, then the rest at once
    ds.close()
