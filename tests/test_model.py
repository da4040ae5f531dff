"""The store against a model (hypothesis, stateful): random puts, ``put_many``,
deletes, ``update``, conditional writes right and wrong, bucket moves, key
migrations, the feed's read-ahead budget changed and a consumer's polls (its
handler failing at random) on one kind, written by one datastore.  After every
step, it and a second datastore sharing its cache give what a dict gives
(``get_many``), an index query lists exactly the model's matches, each id's
version grew with each write, and the change feed, read on from the last
step's cursor, ends each id on its last write with the versions of its puts
rising.  At the end, the consumer, drained, handled every change, each
bucket's in order, and applying them by docs/changes.md's rule ends where the
store is.

Kinds placed by the id, by a hash of a shard key and by the directory; SQLite
with the in-process cache, MariaDB with Redis; each run of the machine on a kind
of its own in one store.  A few runs here (fixed seed); ``BAGSTORE_MODEL_RUNS=N``
runs N of each (``-m soak`` runs 100)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import bagstore
from bagstore.errors import Conflict
from tests import servers
from tests.conftest import Topology, _need

BUCKETS = 8
VALUES = range(3)
pairs = st.tuples(st.sampled_from(VALUES), st.sampled_from("abc"))  # n, and u (a shard key)


class Store(RuleBasedStateMachine):
    """One kind of the store, the model beside it."""

    opened: tuple[bagstore.Datastore, bagstore.Datastore]  # set per run (below)
    #: how the kind is placed: by the id, by a hash of the shard key (an entity
    #: moves with it), or by the directory of shard keys (keys migrate too)
    placing = "id"
    key = "u"  # the shard key's property (one a run with the directory: it is store-wide)

    def __init__(self) -> None:
        super().__init__()
        self.w, self.r = self.opened
        self.model: dict[bytes, dict[str, Any]] = {}  # id -> body, of the entities there
        self.version: dict[bytes, int] = {}  # id -> its last version (a delete: the removed)
        self.gone: set[bytes] = set()
        self.cursor: str | None = None
        self.fed: dict[bytes, tuple[str, int]] = {}  # id -> its last change read
        self.every: list[bagstore.Change] = []  # every change read, in order
        self.handled: list[bagstore.Change] = []  # what the consumer's handler got
        self.failing = False
        self.consumer = self.w.subscribe(self.w.kind, self._handle, batch=3, lease=30.0)

    def _handle(self, changes: list[bagstore.Change]) -> None:
        if self.failing:
            raise RuntimeError("the handler fails (its batch comes again)")
        self.handled += changes

    ids = Bundle("ids")

    def _wrote(self, entity_id: bytes, body: dict[str, Any]) -> None:
        found = self.w.get_with_version(entity_id)
        assert found is not None
        stored, version = found
        assert stored == {**body, "id": entity_id}
        assert version > self.version.get(entity_id, 0)  # versions never go back (#12)
        self.model[entity_id] = stored
        self.version[entity_id] = version
        self.gone.discard(entity_id)

    def _body(self, nu: tuple[int, str]) -> dict[str, Any]:
        return {"n": nu[0]} if self.placing == "id" else {"n": nu[0], self.key: nu[1]}

    def _deleted(self, entity_id: bytes) -> None:
        del self.model[entity_id]
        self.gone.add(entity_id)

    @rule(target=ids, nu=pairs)
    def put_new(self, nu: tuple[int, str]) -> bytes:
        entity_id = self.w.put(self._body(nu))
        self._wrote(entity_id, self._body(nu))
        return entity_id

    @rule(entity_id=ids, nu=pairs)
    def put_again(self, entity_id: bytes, nu: tuple[int, str]) -> None:
        self.w.put({"id": entity_id, **self._body(nu)})  # (a deleted one comes back)
        self._wrote(entity_id, self._body(nu))

    @rule(chosen=st.lists(st.tuples(ids, pairs), min_size=1, max_size=4, unique_by=lambda t: t[0]))
    def put_many(self, chosen: list[tuple[bytes, tuple[int, str]]]) -> None:
        written = self.w.put_many([{"id": i, **self._body(nu)} for i, nu in chosen])
        assert written == [i for i, _ in chosen]
        for entity_id, nu in chosen:
            self._wrote(entity_id, self._body(nu))

    @rule(entity_id=ids)
    def delete(self, entity_id: bytes) -> None:
        assert self.w.delete(entity_id) is (entity_id in self.model)
        if entity_id in self.model:
            self._deleted(entity_id)

    @rule(chosen=st.lists(ids, min_size=1, max_size=4, unique=True))
    def delete_many(self, chosen: list[bytes]) -> None:
        there = [i for i in chosen if i in self.model]
        assert self.w.delete_many(chosen) == len(there)
        for entity_id in there:
            self._deleted(entity_id)

    @rule(entity_id=ids)
    def update(self, entity_id: bytes) -> None:
        def bump(e: dict[str, Any] | None) -> dict[str, Any] | None:
            return None if e is None else {**e, "n": (e["n"] + 1) % len(VALUES)}

        before = self.model.get(entity_id)
        got = self.w.update(entity_id, bump)
        if before is None:
            assert got is None
        else:
            body = {k: v for k, v in before.items() if k != "id"}
            self._wrote(entity_id, {**body, "n": (before["n"] + 1) % len(VALUES)})

    @rule(entity_id=ids, off=st.sampled_from([-1, 1]), delete=st.booleans())
    def conditional_wrong(self, entity_id: bytes, off: int, delete: bool) -> None:
        version = self.version[entity_id] if entity_id in self.model else 0
        with pytest.raises(Conflict):
            if delete:
                self.w.delete(entity_id, expect_version=max(1, version + off))
            else:
                body = {"id": entity_id, **self._body((0, "a"))}
                self.w.put(body, expect_version=max(0, version + off) or 1)

    @rule(entity_id=ids, nu=pairs, delete=st.booleans())
    def conditional_right(self, entity_id: bytes, nu: tuple[int, str], delete: bool) -> None:
        version = self.version[entity_id] if entity_id in self.model else 0
        if delete and version:
            assert self.w.delete(entity_id, expect_version=version) is True
            self._deleted(entity_id)
        else:
            self.w.put({"id": entity_id, **self._body(nu)}, expect_version=version)
            self._wrote(entity_id, self._body(nu))

    @precondition(lambda self: self.placing == "directory")
    @rule(value=st.sampled_from("abc"), bucket=st.integers(0, BUCKETS - 1))
    def migrate_key(self, value: str, bucket: int) -> None:
        mine = [i for i, e in self.model.items() if e[self.key] == value]
        there = {self.w.bucket_of_id(i) for i in mine}
        assert len(there) <= 1  # a key's entities share its bucket
        moved = self.w.migrate_key(value, bucket)
        assert moved == (0 if there == {bucket} else len(mine))
        assert {self.w.bucket_of_id(i) for i in mine} <= {bucket}

    @rule(bucket=st.integers(0, BUCKETS - 1))
    def move(self, bucket: int) -> None:
        shards = len(self.w.shards)
        here = self.w.placement.shard_of_bucket[bucket]
        self.w.move_buckets([bucket], to=(here + 1) % shards, grace=0)

    @rule(budget=st.sampled_from([0, 2_000, 32 * 2**20]))
    def read_ahead(self, budget: int) -> None:
        """The memory the feed's readers may hold read ahead (the pages and
        the consumer's batches must not depend on it)."""
        self.w.feed.read_ahead_bytes = budget

    @rule(fail=st.booleans())
    def consume(self, fail: bool) -> None:
        self.failing = fail
        try:
            self.consumer.poll()
        except RuntimeError:
            assert fail
        finally:
            self.failing = False

    @invariant()
    def reads_agree(self) -> None:
        asked = sorted(self.model) + sorted(self.gone)
        want = [self.model.get(i) for i in asked]
        for ds in (self.w, self.r):
            assert ds.get_many(asked) == want
            for n in VALUES:
                found = {e["id"] for e in ds.query(n=n)}
                assert found == {i for i, e in self.model.items() if e["n"] == n}

    @invariant()
    def feed_agrees(self) -> None:
        while True:
            page = self.w.changes(since=self.cursor, limit=50)
            self.cursor = page.cursor
            for c in page:
                last = self.fed.get(c.id)
                if c.op == "put":
                    # (a key's migration records each entity's put again in its
                    # new bucket, with the version it had: docs/changes.md)
                    migrated = self.placing == "directory" and last == ("put", c.version)
                    assert last is None or c.version > last[1] or migrated, (c, last)
                    assert c.entity == self.model.get(c.id) or c.version < self.version[c.id]
                else:
                    assert last is not None and last == ("put", c.version), (c, last)
                self.fed[c.id] = (c.op, c.version)
            self.every += page
            if not page:
                break
        for entity_id, version in self.version.items():
            op = "put" if entity_id in self.model else "delete"
            assert self.fed[entity_id] == (op, version)

    def teardown(self) -> None:
        """The consumer, drained, handled every change, each bucket's in the
        feed's order; applied as docs/changes.md says (a change only if its
        version is higher than the one held, a delete's at least as high),
        what it handled ends where the store is."""
        try:
            self.feed_agrees()
            while self.consumer.poll():
                pass
            assert set(self.every) <= set(self.handled)
            firsts = list(dict.fromkeys(self.handled))
            for b in range(BUCKETS):
                assert [c for c in firsts if c.bucket == b] == [
                    c for c in self.every if c.bucket == b
                ]
            held: dict[bytes, tuple[str, int]] = {}
            for c in self.handled:
                version = held.get(c.id, ("", 0))[1]
                if c.version > version or (c.op == "delete" and c.version == version):
                    held[c.id] = (c.op, c.version)
            assert held == self.fed
        finally:
            self.consumer.close()
            self.w.close()
            self.r.close()


_kinds = itertools.count()


@pytest.mark.parametrize("placing", ["id", "hash", "directory"])
def test_the_store_behaves_as_its_model(topo: Topology, placing: str) -> None:
    _check_model(topo, 3 if topo.is_mysql else 8, placing)


@pytest.mark.soak
def test_the_store_behaves_as_its_model_soak(
    topo: Topology, request: pytest.FixtureRequest
) -> None:
    if os.environ.get("BAGSTORE_SOAK") != "1" and "soak" not in (
        request.config.getoption("markexpr") or ""
    ):
        pytest.skip("soak test: run with -m soak or BAGSTORE_SOAK=1")
    for placing in ("id", "hash", "directory"):
        _check_model(topo, 100, placing)


def _check_model(topo: Topology, runs: int, placing: str) -> None:
    examples = int(os.environ.get("BAGSTORE_MODEL_RUNS", runs))
    if topo.is_mysql:
        _need(servers.redis_reachable())
        cache = servers.REDIS_URL
    else:
        cache = f"memory://model{next(_kinds)}"

    class Run(Store):
        def __init__(self) -> None:
            self.placing = placing
            kind = f"model{next(_kinds)}"
            options: dict[str, Any] = {
                "kind": kind,
                "buckets": BUCKETS,
                "indexes": [bagstore.Index(f"{kind}_by_n", ["n"])],  # (index names: the store's)
                "cache": cache,
            }
            if placing != "id":
                self.key = f"u_{kind}" if placing == "directory" else "u"
                options |= {"shard_key": self.key, "shard_map": placing}
            if placing == "directory":  # (no wait for directory caches to lapse)
                options["refresh_interval"] = 0
            writer = topo.open(**options)
            writer.feed.enable(bodies=True)
            self.opened = (writer, topo.open(**options))
            super().__init__()

    run_model(Run, examples, 20)


def run_model(machine: type[RuleBasedStateMachine], examples: int, steps: int) -> None:
    """Run a state machine of a test's store: ``examples`` runs of at most
    ``steps`` steps, from a fixed seed, nothing kept between test runs."""
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
