"""The cache, beside the uncached path in the same run: hits, misses, round trips saved.

Run from the repository root::

    python -m bench.cache [--backend sqlite|mysql|all] [--cache memcached|redis|all]
                          [--memcached HOST:PORT] [--redis URL] [--rounds N]
                          [--quick] [--format rich|plain|markdown]

One store of 4 shards (SQLite files in a temp directory, or fresh databases on the
MariaDB at 127.0.0.1:3306), 5,000 FriendFeed-style entities of 250 users (20
each) and the index ``(user_id, published)`` sharded on ``user_id``.  Three
Datastores open it: one without a cache (the baseline, "uncached" below), one on
memcached, one on Redis.  Each work runs both, round by round (interleaved):

- ``get`` hit / miss: one entity by id; a miss is an entity whose key was removed
  from the cache before the round (the read goes to the database and fills).
- ``get_many x50`` (hit).
- index query hit / miss: ``user_pub.get_all(ds, user_id=u)`` (20 entities); a miss
  is a query whose page is not cached (its revision bumped before the round, the
  entities still cached: the usual case after a write).
- L1: ``ds.get`` of an entity already read inside ``with ds.request():``.

Then a read-heavy mix (90% reads: 70% ``get``, 20% index queries; 10% ``put``;
ids and users Zipf-distributed, s=1.1) runs on each datastore, counting the
database statements actually sent (every ``cursor.execute`` and ``commit``) and
the cache calls.  Goals: an index query served from the cache >= 3x the uncached
one; L1 hits >= 200,000/s.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import bagstore
from bagstore.query import parse_filters, plan_query
from bench.common import (
    Counter,
    Result,
    Row,
    Work,
    compare,
    count_statements,
    fresh_shards,
    friendfeed_entity,
    label_of,
    log,
    result_row,
    run_suite,
    suite_args,
)

SHARDS = 4
USERS = 250
PER_USER = 20
MANY = 50
MIX_READS = 0.9
ZIPF_S = 1.1

user_pub = bagstore.Index(
    table="index_user_published", properties=["user_id", "published"], shard_on="user_id"
)


# -- stores ------------------------------------------------------------------------------
def prefill(ds: bagstore.Datastore) -> tuple[list[bytes], list[bytes]]:
    """5,000 entities; returns (ids, users)."""
    users = [os.urandom(16) for _ in range(USERS)]
    entities = [friendfeed_entity(user_id=u, published=p) for p in range(PER_USER) for u in users]
    for start in range(0, len(entities), 500):
        ds.put_many(entities[start : start + 500])
    return [e["id"] for e in entities], users


def cache_available(url: str) -> str | None:
    """None if the cache answers, else why not."""
    from bagstore.cache import open_cache

    try:
        client, _ = open_cache(url)
    except bagstore.ConfigurationError as exc:
        return str(exc)
    try:
        client.set_many({"bagbench:probe": b"1"}, 10)
        if "bagbench:probe" not in client.get_many(["bagbench:probe"]):
            return f"{url} does not keep what is stored"
    except client.errors as exc:
        return f"{url}: {exc}"
    finally:
        client.close()
    return None


def count_round_trips(ds: bagstore.Datastore) -> Counter:
    """Count every statement ds sends to its shards, and every cache call."""
    counter = Counter()
    for backend in ds.router.backends:
        count_statements(backend, counter)
        # SQLite's point read skips run(): count it as the one statement it is.
        if "get_body" in type(backend).__dict__:
            original_get = backend.get_body

            def get_body(kind: str, entity_id: bytes, _original: Any = original_get) -> Any:
                counter.db += 1
                return _original(kind, entity_id)

            backend.get_body = get_body  # type: ignore[method-assign]
    cache = ds.cache_layer.cache
    if cache is not None:
        for name in ("get_many", "add_many", "set_many", "cas", "bump"):
            method = getattr(cache, name)

            def call(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                counter.cache += 1
                return _method(*args, **kwargs)

            setattr(cache, name, call)
    return counter


# -- works ----------------------------------------------------------------------------------
def zipf_picker(items: Sequence[Any], rng: random.Random) -> Callable[[], Any]:
    weights = list(itertools.accumulate(1.0 / (k**ZIPF_S) for k in range(1, len(items) + 1)))
    shuffled = list(items)
    rng.shuffle(shuffled)
    total = weights[-1]
    return lambda: shuffled[bisect.bisect_left(weights, rng.random() * total)]


def works(
    plain: bagstore.Datastore, cached: bagstore.Datastore, ids: list[bytes], users: list[bytes]
) -> list[tuple[Work, int]]:
    """(work, most calls per round) pairs: bagstore side cached, raw side uncached."""
    rng = random.Random(11)
    layer = cached.cache_layer
    assert layer.cache is not None
    cache = layer.cache
    cached.get_many(ids)  # warm: replace the writers' markers
    cached.get_many(ids)
    for _ in range(3):  # revisions started, page stored, then read from the cache
        for u in users:
            user_pub.get_all(cached, user_id=u)
    # each user's query's scope revisions (without the index epoch): a write to
    # the user bumps these
    scope = {
        u: layer.scope_keys(plan_query(user_pub, parse_filters({"user_id": u}), None))[:-1]
        for u in users
    }

    def some_ids(n: int, side: str) -> list[bytes]:
        return [rng.choice(ids) for _ in range(n)]

    def missing_ids(n: int, side: str) -> list[bytes]:
        chosen = rng.sample(ids, min(n, len(ids)))
        if side == "bag":
            cache.delete_many([layer.entity_key(i) for i in chosen])
        return chosen

    def id_lists(n: int, side: str) -> list[list[bytes]]:
        return [rng.sample(ids, MANY) for _ in range(n)]

    def some_users(n: int, side: str) -> list[bytes]:
        return [rng.choice(users) for _ in range(n)]

    def stale_users(n: int, side: str) -> list[bytes]:
        chosen = rng.sample(users, min(n, len(users)))
        if side == "bag":  # as a write to each user would: the page is gone
            cache.bump([k for u in chosen for k in scope[u]], time.time_ns() // 1000, 3600)
        return chosen

    def query(ds: bagstore.Datastore) -> Callable[[bytes], object]:
        return lambda u: user_pub.get_all(ds, user_id=u)

    return [
        (Work("get (hit)", cached.get, plain.get, some_ids), 200_000),
        (Work("get (miss)", cached.get, plain.get, missing_ids), len(ids)),
        (
            Work(f"get_many x{MANY} (hit)", cached.get_many, plain.get_many, id_lists, MANY),
            200_000,
        ),
        (Work("index query (hit)", query(cached), query(plain), some_users), 200_000),
        (Work("index query (miss)", query(cached), query(plain), stale_users), len(users)),
    ]


def level_one(
    plain: bagstore.Datastore, cached: bagstore.Datastore, ids: list[bytes], quick: bool
) -> Result:
    """``ds.get`` inside a request, the entity already read there, beside plain get."""
    from bench.common import Sample

    chosen = ids[:100]
    bag, raw = [], []
    for _ in range(5):
        with cached.request():
            cached.get_many(chosen)
            n = 50_000
            t0 = time.perf_counter()
            for i in range(n):
                cached.get(chosen[i % 100])
            bag.append(Sample(n / (time.perf_counter() - t0), 0.0))
        n = 400 if quick else 2_000
        t0 = time.perf_counter()
        for i in range(n):
            plain.get(chosen[i % 100])
        raw.append(Sample(n / (time.perf_counter() - t0), 0.0))
    result = Result("get in request (L1 hit)", "", bag, raw)
    result.target, result.met = ">= 200,000/s", result.bag_rate >= 200_000
    return result


def mix(
    ds: bagstore.Datastore, ids: list[bytes], users: list[bytes], ops: int, seed: int
) -> dict[str, float]:
    """The read-heavy mix; returns ops/s and round trips per operation."""
    rng = random.Random(seed)
    pick_id, pick_user = zipf_picker(ids, rng), zipf_picker(users, rng)
    counter = count_round_trips(ds)
    t0 = time.perf_counter()
    for n in range(ops):
        r = rng.random()
        if r < MIX_READS * 7 / 9:
            ds.get(pick_id())
        elif r < MIX_READS:
            user_pub.get_all(ds, user_id=pick_user())
        else:
            entity_id = pick_id()
            entity = ds.get(entity_id) or {}
            entity["title"] = f"edited {n}"
            entity["id"] = entity_id
            ds.put(entity)
    elapsed = time.perf_counter() - t0
    return {"ops/s": ops / elapsed, "db": counter.db / ops, "cache": counter.cache / ops}


# -- the run ---------------------------------------------------------------------------------
def judge(r: Result) -> Result:
    if r.work == "index query (hit)":
        r.target, r.met = ">= 3x uncached", r.ratio >= 3.0
    return r


def run_backend(backend: str, args: argparse.Namespace) -> list[Row]:
    results: list[Result] = []
    mixes: list[Row] = []
    label, caches = label_of(backend), args.caches
    with fresh_shards(backend, SHARDS, "bagbench_cache") as shards:
        urls = shards.urls
        plain = bagstore.Datastore(urls, indexes=[user_pub])
        stores = {
            name: bagstore.Datastore(urls, indexes=[user_pub], cache=url)
            for name, url in caches.items()
        }
        try:
            ids, users = prefill(plain)
            for name, ds in stores.items():
                for work, most in works(plain, ds, ids, users):
                    where = f"{label} + {name}"
                    r = compare(work, where, rounds=args.rounds, seconds=args.seconds,
                                min_ops=10, max_ops=most)  # fmt: skip
                    results.append(judge(r))
            first = next(iter(stores.values()), None)
            if first is not None:
                r = level_one(plain, first, ids, args.quick)
                r.backend = label
                results.append(r)
                log(f"  {label:20} L1 get {r.bag_rate:,.0f}/s (plain get {r.raw_rate:,.0f}/s)")
            # the mix: a fresh datastore each (fresh counters), same seed
            base: dict[str, float] | None = None
            for name, url in [("uncached", None), *caches.items()]:
                ds = bagstore.Datastore(urls, indexes=[user_pub], cache=url)
                try:
                    if url is not None:  # warm it as a running service would be
                        mix(ds, ids, users, args.mix_ops // 2, seed=1)
                    got = mix(ds, ids, users, args.mix_ops, seed=2)
                finally:
                    ds.close()
                if base is None:
                    base = got
                    continue
                mixes += [
                    Row(f"{label}: read-heavy mix, {name}", got["ops/s"], base["ops/s"]),
                    Row(f"{label}: read-heavy mix, {name}: DB statements/op", got["db"],
                        base["db"], unit=""),
                ]  # fmt: skip
                log(f"  {label:20} mix {name:10} {got} (uncached {base})")
        finally:
            plain.close()
            for ds in stores.values():
                ds.close()
    return [result_row(r) for r in results] + mixes


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.cache``."""
    options = {
        "cache": (["memcached", "redis", "all"], "all", "all", "the caches to run"),
        "memcached": (str, "127.0.0.1:11211", "127.0.0.1:11211", "host:port[,host:port...]"),
        "redis": (str, "redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", "its URL"),
        "rounds": (int, 5, 3, "interleaved rounds"),
        "seconds": (float, 0.4, 0.03, "length of one round"),
        "mix-ops": (int, 4000, 400, "operations of the mix"),
    }
    args = suite_args(argv, "bagstore's cache beside the uncached path", options)
    args.caches = {}
    for name, url in (("memcached", f"memcached://{args.memcached}"), ("redis", args.redis)):
        if args.cache in (name, "all"):
            why = cache_available(url)
            if why is None:
                args.caches[name] = url
            else:
                log(f"{name} skipped: {why}")
    if not args.caches:
        log("skipped: bench.cache (no cache server answers)")
        return 0
    title = (
        f"bench.cache: bagstore with a cache (bagstore column) vs the same store uncached "
        f"(raw column), ops/s, medians of {args.rounds} rounds; the mix: {MIX_READS:.0%} "
        f"reads, Zipf s={ZIPF_S}"
    )
    return run_suite(args, title, run_backend)


if __name__ == "__main__":
    sys.exit(main())
