"""Replica reads and failovers, beside raw SQL on the primary alone (issue 23).

Run from the repository root::

    python -m bench replicas [--quick] [--rounds N] [--format rich|plain|markdown]

Three private MariaDB servers are started as the tests start them
(``tests/replication.py``: ``mariadbd --no-defaults``, data on /dev/shm, GTID
replication, one primary and two replicas), on this machine: the replicas
share its cores with the primary, so more servers add no CPU here; the ratios
say what routing and read-your-writes cost, not what separate machines gain.

Reads (a one-shard store of FriendFeed-style entities, point reads by id from
4 threads), each beside raw SQL doing the same reads on the primary alone
(``SELECT body ... WHERE id = %s`` through PyMySQL), interleaved rounds:

- ``get`` from the primary;
- ``get`` with ``read_from="replica"`` (spread over both replicas), nothing
  written by the reading process (no GTID to wait for);
- read-your-writes: a ``put`` then a replica ``get`` of it (a
  ``MASTER_GTID_WAIT`` each), beside a raw ``INSERT`` and ``SELECT`` on the
  primary.

Unavailability of writes (one writer thread putting continuously; seconds
from the primary's SIGKILL, or the switchover's start, to the first write
acknowledged after it), once each: a planned switchover (with the writer's
p99 during it against before), an unplanned failover by command issued at
once (no detection), and one by ``bagstore shard watch``'s watcher (probes
every 0.2 s, 3 failures).  No raw column: there is no raw equivalent.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import bagstore
from bench.common import (
    MYSQL_HOST,
    MYSQL_PORT,
    Row,
    Work,
    add_common_args,
    compare,
    friendfeed_entity,
    log,
    mysql_available,
    mysql_connect,
    mysql_url,
    print_machine,
    print_rows,
    temp_databases,
)

THREADS = 4


_POOL: ThreadPoolExecutor | None = None


#: calls that raised bagstore.errors.BackendError, by work: counted and shown
#: beside the metric (the goal then not met), the others go on
FAILED: dict[str, list[str]] = {}


def _each(fn: Callable[[Any], object], items: Sequence[Any], failed: list[str]) -> None:
    for x in items:
        try:
            fn(x)
        except bagstore.errors.BackendError as exc:
            failed.append(str(exc))


def _threaded(fn: Callable[[Any], object], name: str) -> Callable[[Sequence[Any]], None]:
    """``fn`` over a batch of inputs from THREADS threads (one call = one batch;
    the same threads every time, so that their connections stay open)."""
    failed = FAILED.setdefault(name, [])

    def run(batch: Sequence[Any]) -> None:
        global _POOL
        if _POOL is None:
            _POOL = ThreadPoolExecutor(THREADS)
        parts = [batch[k::THREADS] for k in range(THREADS)]
        for f in [_POOL.submit(_each, fn, p, failed) for p in parts]:
            f.result()

    return run


def read_rows(group: Any, db: str, quick: bool, rounds: int) -> list[Row]:
    url = group.url(db)
    writer = bagstore.Datastore([url])
    ids = [e["id"] for e in (friendfeed_entity() for _ in range(200 if quick else 2000))]
    writer.put_many([{**friendfeed_entity(), "id": i} for i in ids])
    group.sync()
    primary = bagstore.Datastore([url], max_workers=THREADS)
    replica = bagstore.Datastore([url], read_from="replica", max_workers=THREADS)
    # the cost of remembering each commit's GTID: the same put on the same
    # primary, named with and without replicas (beside a raw INSERT)
    plain = bagstore.Datastore([url.split("?", 1)[0]], max_workers=THREADS)
    local = threading.local()

    def cursor() -> Any:
        if getattr(local, "conn", None) is None:
            host, _, port = group.primary.addr.rpartition(":")
            local.conn = mysql_connect(db, host=host, port=int(port))
        return local.conn.cursor()

    def raw_get(entity_id: bytes) -> object:
        with cursor() as cur:
            cur.execute("SELECT body FROM entities WHERE id = %s", (entity_id,))
            return cur.fetchone()

    def raw_put(entity: dict[str, Any]) -> object:
        sql = "INSERT INTO entities (id, bucket, updated, version, body) VALUES (%s, 0, 0, 1, %s)"
        with cursor() as cur:
            cur.execute(sql, (entity["id"], bagstore.codec.encode(entity)))
        return None

    def raw_put_get(entity: dict[str, Any]) -> object:
        raw_put(entity)
        return raw_get(entity["id"])

    def ryw(entity: dict[str, Any]) -> object:
        return replica.get(replica.put(entity))

    batch = 64

    def id_batches(n: int, side: str) -> list[list[bytes]]:
        return [[ids[(k * batch + j) % len(ids)] for j in range(batch)] for k in range(n)]

    def entity_batches(n: int, side: str) -> list[list[dict[str, Any]]]:
        return [[friendfeed_entity() for _ in range(batch)] for _ in range(n)]

    table: list[tuple[str, Any, Any, Any]] = [
        ("get, primary alone", primary.get, raw_get, id_batches),
        ("get, 2 replicas", replica.get, raw_get, id_batches),
        ("put + replica get (read-your-writes)", ryw, raw_put_get, entity_batches),
        ("put, GTID tracked (replicas named)", primary.put, raw_put, entity_batches),
        ("put, no replicas named", plain.put, raw_put, entity_batches),
    ]
    works = [
        Work(n, _threaded(b, n), _threaded(r, f"raw: {n}"), inputs, batch)
        for n, b, r, inputs in table
    ]
    seconds = 0.2 if quick else 1.0
    results = [compare(w, "mariadb", rounds=rounds, seconds=seconds) for w in works]
    rows = []
    for k, r in enumerate(results):
        goal = "— (issue 23 sets none)" if k == 0 else "—"
        bag_failed, raw_failed = FAILED[r.work], FAILED[f"raw: {r.work}"]
        if bag_failed or raw_failed:
            goal += f"; failed calls: bagstore {len(bag_failed)}, raw {len(raw_failed)}"
            log(f"  {r.work}: first failure: {(bag_failed or raw_failed)[0]}")
        met = False if bag_failed or raw_failed else None
        kind = "puts" if r.work.startswith("put,") else "reads"
        rows.append(Row(f"{kind}: {r.work}", r.bag_rate, r.raw_rate, goal=goal, met=met))
    fallbacks = replica.stats()["replicas"]["fallbacks"]
    rows += [
        Row("reads: 2 replicas / primary alone (bagstore)", results[1].bag_rate,
            results[0].bag_rate, goal="> 1x (separate hosts)"),
        Row("reads: RYW fallbacks to the primary", float(fallbacks), None, unit=""),
        Row("puts: GTID tracked / not (both bagstore)", results[3].bag_rate,
            results[4].bag_rate, goal="~1x (no extra round trip)"),
    ]  # fmt: skip
    for ds in (writer, primary, replica, plain):
        ds.close()
    return rows


class _Writer:
    """One thread putting continuously; when each acknowledged put ended."""

    def __init__(self, ds: bagstore.Datastore) -> None:
        self.ds = ds
        self.acked: list[tuple[float, float]] = []  # (start, end)
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                self.ds.put({"n": 1})
            except bagstore.errors.BackendError:
                self.errors += 1
                time.sleep(0.005)
                continue
            self.acked.append((start, time.monotonic()))

    def first_after(self, moment: float, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [end for start, end in self.acked if start > moment]
            if later:
                return min(later) - moment
            time.sleep(0.01)
        raise RuntimeError("writes did not resume")

    def longest_gap(self, since: float, until: float) -> float:
        """The longest time with no write acknowledged, around [since, until]."""
        ends = sorted(e for _, e in self.acked)
        before = max((e for e in ends if e <= since), default=since)
        after = min((e for e in ends if e >= until), default=until)
        inside = [before, *(e for e in ends if since < e < until), after]
        return max(b - a for a, b in itertools.pairwise(inside))

    def p99(self, since: float, until: float) -> float:
        lat = sorted(e - s for s, e in self.acked if since <= s <= until)
        return lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def failover_rows(group: Any, db: str, catalog: str) -> list[Row]:
    from tests.replication import REPL_PASSWORD, REPL_USER

    from bagstore.sharding.watch import Watcher

    options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
    url = group.url(db)
    # the catalog elsewhere: a watcher never fails over its own lease's servers
    ds = bagstore.Datastore([url], catalog=catalog)
    writer = _Writer(bagstore.Datastore([url], catalog=catalog))
    rows = []
    time.sleep(1.0)
    before = time.monotonic()
    ds.failover(0, to=group.replicas[0].addr, **options)
    after = time.monotonic()
    writer.first_after(after)
    time.sleep(1.0)
    paused = writer.longest_gap(before, after)
    p99_before = writer.p99(before - 1.0, before)
    p99_during = writer.p99(before, after + 0.5)
    rows.append(Row("planned switchover: longest time with no write acknowledged", paused,
                    None, goal="< 5 s", unit=" s", met=paused < 5))  # fmt: skip
    rows.append(Row("planned switchover: writer p99 during / before", p99_during / p99_before,
                    None, unit="x"))  # fmt: skip
    # unplanned, by command at once: group.servers[1] is the primary now
    killed = time.monotonic()
    group.servers[1].kill()
    ds.failover(0, **options)
    down = writer.first_after(killed)
    rows.append(Row("unplanned failover (command): writes unavailable", down, None,
                    goal="measured", unit=" s"))  # fmt: skip
    # unplanned, by the watcher: the one left beside the new primary
    role = ds.router.replication.role_of(ds.router.backends[0])
    assert role is not None
    victim = next(s for s in group.servers if s.addr == role.primary)
    watcher = Watcher(ds.router, interval=0.2, failures=3, lease=5.0, **options)
    watcher.once()
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    killed = time.monotonic()
    victim.kill()
    try:
        down = writer.first_after(killed)
    finally:
        stop.set()
        thread.join()
    rows.append(Row("unplanned failover (watcher, 3 x 0.2 s probes): writes unavailable", down,
                    None, goal="measured", unit=" s"))  # fmt: skip
    writer.close()
    writer.ds.close()
    ds.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, backends=("mysql",))
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args(argv)
    from tests import servers
    from tests.replication import ReplicationGroup

    rounds = args.rounds or (2 if args.quick else 5)
    print_machine(args.format)
    group = ReplicationGroup(3)
    try:
        group.start()
    except servers.ServerUnavailable as exc:
        print(f"skipped: cannot start MariaDB servers: {exc}")
        return 0
    try:
        rows = read_rows(group, servers.unique_name("bench_reads"), args.quick, rounds)
        if mysql_available():  # the catalog of the failover runs
            with temp_databases(1, "bagbench_repl") as (catalog,):
                rows += failover_rows(group, servers.unique_name("bench_fo"), mysql_url(catalog))
        else:
            print(f"failovers skipped: no MariaDB on {MYSQL_HOST}:{MYSQL_PORT} for the catalog")
    finally:
        group.stop()
    print_rows("bench.replicas (1 primary + 2 replicas on one host)", rows, fmt=args.format)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
