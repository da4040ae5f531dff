"""Ids whose index rows live away from their entity (helpers for the tests).

An entity's index rows that live on its own shard are written in its
transaction (``bagstore.colocated``); a test of what happens between an
entity's commit and its index writes (a crash at a failpoint, a writer
held back) needs rows on other shards, whatever id ``new_id`` would draw.
"""

from __future__ import annotations

from typing import Any

import bagstore


def apart(ds: bagstore.Datastore, *bodies: dict[str, Any]) -> bytes:
    """A new id such that, for each of ``bodies`` stored under it, no row of an
    index ``ds`` maintains lives on the entity's shard."""
    topology = ds.router.topology
    shard_of = topology.shard_of_bucket
    indexes = ds.registry().maintained()
    for _ in range(100_000):
        entity_id = bagstore.new_id()
        home = shard_of[ds.placer.entity_bucket(bodies[0], entity_id)]
        if all(
            shard_of[r.bucket] != home
            for body in bodies
            for index in indexes
            for r in index.rows_for(body, entity_id, topology.buckets)
        ):
            return entity_id
    raise AssertionError("no id keeps these rows off the entity's shard (one shard?)")
