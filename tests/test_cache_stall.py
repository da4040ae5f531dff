"""Never a stale read after a cache server stalls (issue 21, item 4).

A write whose invalidation a stalled server never confirmed must keep every
level-2 read of that entity and of its query pages from being trusted -- by the
other datastores of the process at once, and by other processes by the time the
write returns -- until level 2 is safe again (docs/cache.md, "When an
invalidation is not confirmed").

Two ways to stall a memcached the test started:

* :class:`StallProxy`, a real TCP proxy in front of it that, while stalled,
  swallows what clients send and answers nothing: the invalidations sent then
  never land, and the server comes back holding the old entries (the hard case),
  deterministically;
* ``SIGSTOP`` / ``SIGCONT`` of the memcached process itself.

Each case warms the old entity and page into level 2 first, writes during the
stall, and reads right after the write returned and on after the server is back,
counting stale answers (required: none), until level 2 serves hits again (so the
cache was in use, not merely bypassed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import bagstore
from bagstore.cache import shared as shared_mod
from bagstore.cache.shared import HOLD, OK, SUSPECT, WARMING, Shared, State, parse
from tests import servers
from tests.conftest import Topology, started

user_pub = bagstore.Index(
    table="index_user_published", properties=["user_id", "published"], shard_on="user_id"
)

#: How long a test waits for level 2 to be trusted again (a bound, not a measure).
RECOVERY = 30.0


@pytest.fixture
def memcached() -> Iterator[servers.Memcached]:
    """A private memcached, stopped by pid at the end."""
    with started(servers.Memcached()) as server:
        yield server


class StallProxy:
    """A TCP proxy to ``target``.  While :attr:`stalled` is set it reads what
    clients send and drops it, answering nothing; a connection that had bytes
    dropped stays silent for good (so no client ever gets a reply out of step)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.stalled = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            dead = threading.Event()
            for s in (client, upstream):
                s.settimeout(0.05)
                self._sockets.append(s)
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up, dead), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, up: bool, dead: threading.Event
    ) -> None:
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if up and self.stalled.is_set():
                dead.set()
            if dead.is_set():
                continue  # swallowed: a hung server
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5)
        for s in self._sockets:
            s.close()


@pytest.fixture
def proxy(memcached: servers.Memcached) -> Iterator[StallProxy]:
    p = StallProxy((memcached.host, memcached.port))
    try:
        yield p
    finally:
        p.close()


class Reads:
    """Reads of one entity and of its user's page through several datastores,
    counting every answer that is not the current one.  ``also``: the other
    entities the page holds now (after the entity, by ``published``)."""

    def __init__(self, readers: list[bagstore.Datastore], entity_id: bytes, user: bytes) -> None:
        self.readers, self.id, self.user = readers, entity_id, user
        self.also: list[bytes] = []
        self.stale: list[tuple[str, Any, Any]] = []
        self.reads = 0

    def check(self, expected: int) -> None:
        for ds in self.readers:
            got = ds.get(self.id)
            page = user_pub.get_all(ds, user_id=self.user)
            many = ds.get_many([self.id])
            self.reads += 3
            if got is None or got["n"] != expected:
                self.stale.append(("get", got and got["n"], expected))
            if [(e["id"], e["n"]) for e in page[:1]] != [(self.id, expected)]:
                self.stale.append(("page", [e["n"] for e in page], expected))
            if [e["id"] for e in page[1:]] != self.also:
                self.stale.append(("page ids", [e["id"] for e in page], self.also))
            if many[0] is None or many[0]["n"] != expected:
                self.stale.append(("get_many", many[0] and many[0]["n"], expected))

    def until_hits(self, expected: int) -> int:
        """Read on (checking every answer) until every reader was served from
        level 2 again; return how many rounds that took."""
        before = [ds.stats()["l2"]["hits"] for ds in self.readers]
        deadline = time.monotonic() + RECOVERY
        rounds = 0
        while True:
            self.check(expected)
            rounds += 1
            now = [ds.stats()["l2"]["hits"] for ds in self.readers]
            if all(n > b for n, b in zip(now, before, strict=True)):
                return rounds
            assert time.monotonic() < deadline, "level 2 never trusted again"
            time.sleep(0.02)


def _warm(w: bagstore.Datastore, readers: list[bagstore.Datastore], user: bytes) -> bytes:
    a = w.put({"user_id": user, "published": 1, "n": 1})
    reads = Reads(readers, a, user)
    reads.check(1)
    before = [ds.stats()["l2"]["hits"] for ds in readers]
    reads.check(1)  # now from level 2: the old entity and page are cached
    assert all(ds.stats()["l2"]["hits"] > b for ds, b in zip(readers, before, strict=True))
    assert not reads.stale
    return a


def _put_in_child(topo: Topology, cache: str, entity: dict[str, Any]) -> None:
    """Write ``entity`` from another process (this returns once it has)."""
    script = (
        "import json, sys, bagstore\n"
        "urls, cache, entity = json.loads(sys.argv[1])\n"
        "entity = {k: bytes.fromhex(v) if k in ('id', 'user_id') else v\n"
        "          for k, v in entity.items()}\n"
        "idx = bagstore.Index(table='index_user_published', properties=['user_id', 'published'],"
        " shard_on='user_id')\n"
        "ds = bagstore.Datastore(urls, cache=cache, indexes=[idx])\n"
        "ds.put(entity)\n"
        "print(json.dumps(ds.status()['cache']['shared_state']), flush=True)\n"
        "ds.close()\n"
    )
    arg = {k: v.hex() if isinstance(v, bytes) else v for k, v in entity.items()}
    with subprocess.Popen(
        [sys.executable, "-c", script, json.dumps([topo.urls, cache, arg])],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        line = child.stdout.readline()  # printed once the put returned
        assert child.wait(timeout=60) == 0
    assert json.loads(line) == SUSPECT  # the child could not confirm, and said so


# -- the state machine, on its own ------------------------------------------------------------
class _Cell:
    """An in-memory cell (the catalog row's stand-in for the state machine alone)."""

    def __init__(self) -> None:
        self.value: str | None = None

    def read(self) -> str | None:
        return self.value

    def swap(self, old: str | None, new: str) -> bool:
        if self.value != old:
            return False
        self.value = new
        return True


def test_shared_state_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """ok -> suspect (the writer is told to hold) -> warming under a new token
    once the cache answers -> ok; never two steps within a hold."""
    clock = [1000.0]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    monkeypatch.setattr(shared_mod, "time", FakeTime)
    cell, answers = _Cell(), [False]
    one, two = Shared(local=False), Shared(local=False)  # two processes

    def view(process: Shared) -> State:
        state = process.view(cell, lambda: answers[0])
        assert state is not None  # a fresh copy
        return state

    first = view(one)
    assert first.phase == OK and cell.value == first.raw
    assert view(two) == first
    # a write under the token could not be confirmed: suspect, and hold
    assert one.unconfirmed(cell, first.token) == pytest.approx(clock[0] + HOLD)
    assert parse(cell.value or "").phase == SUSPECT
    assert view(one).phase == SUSPECT  # this process knows at once
    # the other process goes by its copy until that is an interval old
    assert view(two) == first
    clock[0] += shared_mod.CHECK_INTERVAL
    assert view(two).phase == SUSPECT
    # a second unconfirmed write in the suspect phase waits for the rest of the hold only
    assert one.unconfirmed(cell, first.token) == pytest.approx(1000.0 + HOLD)
    # the cache does not answer yet: suspect stays
    clock[0] += HOLD + 0.01
    assert view(one).phase == SUSPECT
    answers[0] = True
    clock[0] += shared_mod.CHECK_INTERVAL
    warm = view(one)
    assert warm.phase == WARMING and warm.token != first.token
    # an unconfirmed write under the old token now: nothing to do (nobody trusts it)
    assert two.unconfirmed(cell, first.token) == 0.0
    clock[0] += HOLD + 0.01
    assert view(one) == parse(f"{OK}:{warm.token}") == parse(cell.value or "")


# -- the deterministic stall: a proxy that swallows everything ------------------------------
def test_stalled_server_never_gives_another_datastore_a_stale_read(
    topo: Topology, proxy: StallProxy
) -> None:
    url = f"memcached://127.0.0.1:{proxy.port}"
    w = topo.open(cache=url, indexes=[user_pub])
    r = topo.open(cache=url, indexes=[user_pub])
    a = _warm(w, [w, r], b"s1")
    reads = Reads([r, w], a, b"s1")  # the other datastore reads first
    proxy.stalled.set()
    try:
        w.put({"id": a, "user_id": b"s1", "published": 1, "n": 2})
        assert w.status()["cache"]["shared_state"] == SUSPECT
        assert r.status()["cache"]["shared_state"] == SUSPECT  # one state per process
        Reads([w], a, b"s1").check(2)  # (r's client stays unaware of the stall)
    finally:
        proxy.stalled.clear()
    # the server is back, still holding the old entity and page (the markers and
    # bumps sent during the stall were swallowed): no reader trusts them
    reads.check(2)
    reads.until_hits(2)
    assert r.status()["cache"]["shared_state"] == OK
    # and the cache works as before: a new write is seen at once, from level 2 after
    w.put({"id": a, "user_id": b"s1", "published": 1, "n": 3})
    reads.check(3)
    reads.until_hits(3)
    assert reads.stale == [], reads.stale


def test_stalled_server_never_gives_another_process_a_stale_read(
    topo: Topology, proxy: StallProxy
) -> None:
    url = f"memcached://127.0.0.1:{proxy.port}"
    r = topo.open(cache=url, indexes=[user_pub])
    a = _warm(r, [r], b"p1")
    reads = Reads([r], a, b"p1")
    proxy.stalled.set()
    try:
        _put_in_child(topo, url, {"id": a, "user_id": b"p1", "published": 1, "n": 2})
        reads.check(2)  # the first read after the other process's write returned
    finally:
        proxy.stalled.clear()
    reads.check(2)
    reads.until_hits(2)
    assert reads.stale == [], reads.stale


# -- a real memcached stopped with SIGSTOP ---------------------------------------------------
def test_sigstopped_memcached_gives_no_stale_reads(
    topo: Topology, memcached: servers.Memcached
) -> None:
    url = f"memcached://{memcached.addr}"
    w = topo.open(cache=url, indexes=[user_pub])
    r = topo.open(cache=url, indexes=[user_pub])
    a = _warm(w, [w, r], b"k1")
    reads = Reads([r, w], a, b"k1")  # the other datastore reads first
    pid = memcached.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        # the writer's read times out: its client leaves the server alone for a
        # second, so the writes' leases and markers are not even sent
        assert w.get(a) == {"id": a, "user_id": b"k1", "published": 1, "n": 1}
        w.put({"id": a, "user_id": b"k1", "published": 1, "n": 2})
        reads.also = [w.put({"user_id": b"k1", "published": 2, "n": 0})]  # joins the page
        w.put({"id": a, "user_id": b"k1", "published": 1, "n": 3})
        Reads([w], a, b"k1").check(3)
        assert w.stats()["l2"]["errors"] > 0
    finally:
        os.kill(pid, signal.SIGCONT)
    # memcached runs again, with whatever it took in before and during the stall
    rounds = reads.until_hits(3)
    assert rounds >= 1 and reads.reads > 0
    w.put({"id": a, "user_id": b"k1", "published": 1, "n": 4})
    reads.check(4)
    reads.until_hits(4)
    assert reads.stale == [], reads.stale
