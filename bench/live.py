"""A live writer in a process of its own, for the benches that run beside one
(bench.cleaner, bench.scaleout): single puts at a fixed rate, each write's
latency recorded, so that "writer p99 during / before" and the longest stall
can be read off a window of time.

bagstore's writer calls ``ds.put``; the raw writer sends one upsert of a row of
the baseline table (``id, bucket, updated, body, doc``: the body also as JSON,
for the database's own index build on a virtual column).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import bagstore
from bagstore import codec
from bagstore.sharding.hashing import bucket_of
from bench.common import Row, connect_target, friendfeed_entity

KIND = "entities"
RAW_COLUMNS = "id, bucket, updated, body, doc"


def json_doc(e: dict[str, Any]) -> str:
    """The entity as JSON (bytes as hex), the baseline's ``doc`` column."""
    return json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in e.items()})


def raw_row(e: dict[str, Any], buckets: int, now: int) -> tuple[Any, ...]:
    """``(id, bucket, updated, body, doc)`` of the baseline table."""
    return (e["id"], bucket_of(e["id"], buckets), now, codec.encode(e), json_doc(e))


def raw_upsert_sql(backend: str, rows: int) -> str:
    """An upsert of ``rows`` rows of the baseline table."""
    if backend == "mysql":
        values = ", ".join(["(%s, %s, %s, %s, %s)"] * rows)
        return (
            f"INSERT INTO {KIND} ({RAW_COLUMNS}) VALUES {values} ON DUPLICATE KEY UPDATE "
            "updated = VALUES(updated), version = version + 1, body = VALUES(body), "
            "doc = VALUES(doc)"
        )
    values = ", ".join(["(?, ?, ?, ?, ?)"] * rows)
    return (
        f"INSERT INTO {KIND} ({RAW_COLUMNS}) VALUES {values} ON CONFLICT(id) DO UPDATE SET "
        "updated = excluded.updated, version = version + 1, body = excluded.body, "
        "doc = excluded.doc"
    )


@dataclass
class WriterSpec:
    """What a writer process writes to (picklable: it crosses to a spawned process)."""

    mode: str  # "bag" or "raw"
    backend: str  # "mysql" or "sqlite"
    target: Any  # bag: shard URLs; raw: database name / file path
    rate: float
    update_ids: list[bytes] = field(default_factory=list)
    update_share: float = 0.1  # the share of puts that rewrite a loaded entity
    buckets: int = 1024


def _open(spec: WriterSpec) -> tuple[Callable[[dict[str, Any]], object], Callable[[], None]]:
    if spec.mode == "bag":
        ds = bagstore.Datastore(spec.target)
        return ds.put, ds.close
    sql = raw_upsert_sql(spec.backend, 1)
    conn = connect_target(spec.target)
    cur = conn.cursor()

    def put(e: dict[str, Any]) -> None:
        cur.execute(sql, raw_row(e, spec.buckets, time.time_ns() // 1000))

    return put, conn.close


def writer_main(spec: WriterSpec, pipe: Any, ready: Any, stop: Any) -> None:
    """Put one entity every ``1/rate`` seconds (open loop: a slow write delays the
    next ones, which then go back to back) until ``stop``; send back the start
    times and latencies (monotonic clock, shared by the processes of one
    machine), the errors, and how many new entities were written."""
    put, close = _open(spec)
    rng = random.Random(os.getpid())
    starts: list[float] = []
    latencies: list[float] = []
    errors: list[str] = []
    new_ok = 0
    interval = 1.0 / spec.rate
    clock = time.monotonic
    due = clock()
    try:
        while not stop.is_set():
            entity = friendfeed_entity()
            fresh = not (spec.update_ids and rng.random() < spec.update_share)
            if not fresh:
                entity["id"] = rng.choice(spec.update_ids)
            now = clock()
            if now < due:
                time.sleep(due - now)
            t0 = clock()
            try:
                put(entity)
                new_ok += fresh
            except Exception as exc:  # recorded and reported, the writer goes on
                errors.append(f"{type(exc).__name__}: {exc}")
            t1 = clock()
            starts.append(t0)
            latencies.append(t1 - t0)
            due = max(due + interval, t1 - 1.0)  # catch up at most one second
            if len(starts) == 50:
                ready.set()
    finally:
        ready.set()
        close()
        pipe.send((starts, latencies, errors[:20], len(errors), new_ok))
        pipe.close()


@dataclass
class Lat:
    """Latency figures of one window of writes (seconds)."""

    n: int
    p99: float
    max: float

    @classmethod
    def of(cls, lats: Sequence[float]) -> Lat:
        if not lats:
            return cls(0, float("nan"), float("nan"))
        ordered = sorted(lats)
        return cls(len(lats), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], ordered[-1])


@dataclass
class Writes:
    starts: list[float]
    latencies: list[float]
    errors: list[str]
    error_count: int
    new_ok: int

    def window(self, t_from: float, t_to: float) -> Lat:
        """The writes begun in ``[t_from, t_to)``."""
        return Lat.of(
            [lat for t, lat in zip(self.starts, self.latencies, strict=True) if t_from <= t < t_to]
        )


def timed_beside(
    spec: WriterSpec, before: float, work: Callable[[], object]
) -> tuple[float, Lat, Lat, Writes]:
    """Run ``work`` while a writer process runs: ``before`` seconds of writes
    first.  Returns ``(seconds, writer before, writer during, writes)``."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=writer_main, args=(spec, send, ready, stop), daemon=True)
    proc.start()
    send.close()
    try:
        if not ready.wait(120) or not proc.is_alive():
            raise RuntimeError("the writer process did not start")
        time.sleep(before)
        t0 = time.monotonic()
        work()
        t1 = time.monotonic()
        time.sleep(0.3)
        stop.set()
        if not recv.poll(120):
            raise RuntimeError("the writer process did not report")
        writes = Writes(*recv.recv())
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    return t1 - t0, writes.window(t0 - before, t0), writes.window(t0, t1), writes


def writer_rows(
    label: str,
    rate: float,
    work: str,
    pace: tuple[float, float, float | None],
    p99: tuple[float, float],
    longest: tuple[float, float],
    goals: tuple[float, float],
    errors: int,
) -> list[Row]:
    """The rows of ``work`` (``"backfill at the default pace vs own DDL|build|rows/s"``:
    what, the event, the unit) done beside a writer of ``rate`` puts/s: its
    ``pace`` (bagstore, raw, ratio), the writer's p99 during/before and its
    longest write in seconds (bagstore, raw); ``goals``: the p99 ratio, the stall."""
    what, event, unit = work.split("|")
    where = f"writer {rate:,.0f}/s"
    stall = (longest[0] * 1e3, longest[1] * 1e3)
    return [
        Row(f"{label}: {what}, {where} ({unit})", *pace),
        Row(f"{label}: writer p99 during/before the {event}, {where}", *p99,
            goal=f"bagstore <= {goals[0]:.0f}x", met=p99[0] <= goals[0] and not errors, unit="x"),
        Row(f"{label}: longest write during the {event}, {where}", *stall,
            goal=f"bagstore <= {goals[1] * 1e3:,.0f} ms", met=longest[0] <= goals[1], unit=" ms"),
    ]  # fmt: skip
