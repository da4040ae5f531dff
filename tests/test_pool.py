"""The connection pool: slots, reuse, timeouts, broken and idle connections.

Connections here are plain objects made by counting factories: the pool never
looks inside them, and what is tested is its bookkeeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from bagstore.backends.pool import Pool
from bagstore.errors import ShardTimeout


class Conn:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False


def _pool(size: int = 2, **kwargs: Any) -> tuple[Pool[Conn], list[Conn]]:
    made: list[Conn] = []

    def create() -> Conn:
        made.append(Conn(len(made)))
        return made[-1]

    def close(c: Conn) -> None:
        c.closed = True

    return Pool(create, close, size=size, name="test", **kwargs), made


def test_connections_are_made_on_demand_and_reused_last_in_first_out() -> None:
    pool, made = _pool(size=3)
    a, b = pool.acquire(), pool.acquire()
    assert len(made) == 2
    pool.release(a)
    pool.release(b)
    assert pool.acquire() is b  # the warmest first
    assert pool.acquire() is a
    assert len(made) == 2


def test_a_full_pool_waits_then_times_out() -> None:
    pool, _ = _pool(size=2, timeout=0.2)
    a, _b = pool.acquire(), pool.acquire()
    started = time.monotonic()
    with pytest.raises(ShardTimeout, match=r"test: no free connection after 0\.2s"):
        pool.acquire()
    assert time.monotonic() - started >= 0.19
    # a slot given back is taken by a waiting thread
    got: list[Conn] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    time.sleep(0.05)
    pool.release(a)
    waiter.join(5)
    assert got == [a]


def test_a_discarded_connection_frees_its_slot_and_is_closed() -> None:
    pool, made = _pool(size=1, timeout=0.1)
    a = pool.acquire()
    pool.discard(a)
    assert a.closed
    b = pool.acquire()  # the slot is free again; a new connection
    assert b is not a and len(made) == 2
    with pytest.raises(ShardTimeout):
        pool.acquire()


def test_an_idle_connection_is_checked_and_replaced_if_dead() -> None:
    alive = {0: False}
    pool, made = _pool(size=1, alive=lambda c: alive.get(c.n, True), idle_check=0.0)
    a = pool.acquire()
    pool.release(a)
    b = pool.acquire()
    assert b is not a and a.closed and len(made) == 2


def test_close_closes_idle_connections_and_those_given_back_later() -> None:
    pool, _ = _pool(size=2)
    a, b = pool.acquire(), pool.acquire()
    pool.release(a)
    pool.close()
    assert a.closed and not b.closed
    pool.release(b)
    assert b.closed


def test_slots_survive_many_threads() -> None:
    pool, made = _pool(size=3, timeout=10)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(300):
                pool.release(pool.acquire())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(made) <= 3
    conns = [pool.acquire() for _ in range(3)]  # all three slots are free again
    assert len({id(c) for c in conns}) == 3
