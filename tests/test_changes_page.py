"""A page of the change feed (bagstore.feedpage): a Change's body decoded when
``.entity`` is read, a damaged body's error, and the merge of the buckets by
time against the plain algorithm it shortcuts."""

from __future__ import annotations

import random
from typing import Any

import pytest

import bagstore
from bagstore.backends import changesql
from bagstore.feedpage import merge
from tests.conftest import Topology


def test_entity_is_what_was_written_and_decoded_when_read(topo: Topology) -> None:
    ds = topo.open(buckets=16)
    ds.feed.enable(bodies=True)
    bodies = [{"n": i, "tags": ["a", str(i)], "big": 2**70 + i} for i in range(30)]
    ids = ds.put_many(bodies)
    ds.delete(ids[0])
    page = ds.changes()
    assert len(page) == 31
    written = {i: {**b, "id": i} for i, b in zip(ids, bodies, strict=True)}
    puts = [c for c in page if c.op == "put"]
    assert {c.id: c.entity for c in puts} == written
    (gone,) = [c for c in page if c.op == "delete"]
    assert gone.id == ids[0] and gone.entity is None
    for c in page:
        assert type(c.id) is bytes and type(c.version) is int and type(c.updated) is int
        assert c.kind == ds.kind and type(c.bucket) is int and c.position >= 1
    first = puts[0]
    body = first.entity
    assert body is not None
    body["n"] = -1  # a fresh dict each read: the change itself is unchanged
    assert first.entity == written[first.id]
    assert hash(first) == hash(ds.changes()[page.index(first)])  # immutable, comparable
    text = repr(first)
    assert "op='put'" in text and "bytes>" in text and "tags" not in text


def test_a_damaged_body_raises_when_read_naming_the_change(topo: Topology) -> None:
    ds = topo.open(buckets=4)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": i} for i in range(5)])
    victim = ds.changes()[2]
    shard = ds.feed.holders([victim.bucket])[victim.bucket][2]
    backend = ds.feed.router.backends[shard]
    p = backend.dialect.param
    changed = backend.execute(
        f"UPDATE {changesql.CHANGES} SET body = {p} WHERE kind = {p} AND bucket = {p} "
        f"AND pos = {p}",
        [b"\x01garbage", ds.kind, victim.bucket, victim.position],
    )
    assert changed == 1
    page = ds.changes()  # reading the page decodes nothing
    assert len(page) == len(ids)
    (bad,) = [c for c in page if c.position == victim.position and c.bucket == victim.bucket]
    with pytest.raises(bagstore.InvalidEntity, match="cannot be decoded") as caught:
        _ = bad.entity
    message = str(caught.value)
    assert f"change {victim.position} of bucket {victim.bucket}" in message
    assert repr(ds.kind) in message and victim.id.hex() in message
    others = [c.entity for c in page if c is not bad]
    assert sorted(e["n"] for e in others if e) == sorted(n for n in range(5) if ids[n] != victim.id)


def _reference(
    streams: dict[int, list[tuple[Any, ...]]], truncated: set[int], limit: int
) -> list[tuple[Any, ...]]:
    """The plain merge: every row keyed by the running maximum of `updated`
    along its bucket, then bucket and position; stop before the first row
    after a truncated bucket's last."""
    keyed = []
    stop = None
    for b, rows in streams.items():
        high = 0
        for r in rows:
            high = max(high, r[5])
            keyed.append((high, b, r[1], r))
        if rows and b in truncated:
            end = (high, b, rows[-1][1] + 1)
            stop = end if stop is None or end < stop else stop
    keyed.sort()
    taken = [k[3] for k in keyed if stop is None or k[:3] < stop]
    return taken[:limit]


@pytest.mark.parametrize("monotone", [True, False])
def test_merge_is_the_plain_merge(monotone: bool) -> None:
    rng = random.Random(26)
    for _ in range(200):
        streams: dict[int, list[tuple[Any, ...]]] = {}
        for b in rng.sample(range(64), rng.randint(1, 12)):
            n = rng.randint(0, 15)
            times = [rng.randint(1, 50) for _ in range(n)]  # ties across buckets too
            if monotone:
                times.sort()
            first = rng.randint(1, 100)
            streams[b] = [(b, first + i, b"id", 0, 1, t, None) for i, t in enumerate(times)]
        truncated = {b for b in streams if rng.random() < 0.3}
        limit = rng.randint(1, 80)
        assert merge(streams, truncated, limit) == _reference(streams, truncated, limit)
