"""Shared pieces of the benchmarks: timing rounds, medians, tables, temp databases.

Every benchmark compares bagstore with the raw DB-API baseline doing the same
work in the same process, round by round (interleaved, the order alternating),
so that the *ratio* holds on a noisy machine even when the absolute figures
drift.  A round runs a fixed number of operations over inputs prepared outside
the timed loop; the figure quoted is the median over rounds.

    >>> median_rate([100.0, 300.0, 200.0])
    200.0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sqlite3
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bagstore.backends.mysql import INIT_COMMAND
from bagstore.ids import new_id

MYSQL_HOST = os.environ.get("BAGSTORE_BENCH_MYSQL_HOST", "127.0.0.1")
MYSQL_PORT = int(os.environ.get("BAGSTORE_BENCH_MYSQL_PORT", "3306"))
MYSQL_USER = os.environ.get("BAGSTORE_BENCH_MYSQL_USER", "root")
MYSQL_PASSWORD = os.environ.get("BAGSTORE_BENCH_MYSQL_PASSWORD", "")

_TITLE = "How FriendFeed uses MySQL to store schema-less data, and why that still works today"


def friendfeed_entity(user_id: bytes | None = None, published: int | None = None) -> dict[str, Any]:
    """A ~300-byte FriendFeed-style entity (16-byte id, user_id bytes, title,
    a unique link, published as an int, a list of tags)."""
    entity_id = new_id()
    return {
        "id": entity_id,
        "user_id": user_id if user_id is not None else os.urandom(16),
        "title": _TITLE,
        "link": "https://backchannel.org/blog/friendfeed-schemaless-mysql?e=" + entity_id.hex(),
        "published": published if published is not None else time.time_ns() // 1000,
        "tags": ["mysql", "python", "schemaless", "sharding", "friendfeed", "indexes"],
    }


# -- timing ------------------------------------------------------------------------


@dataclass
class Work:
    """One unit of work measured on both sides.

    ``bag`` and ``raw`` each take one prepared input; ``inputs(n, side)`` makes
    ``n`` inputs for one round of that side (``"bag"`` or ``"raw"``), outside the
    timed loop; ``units`` is how many entities one call handles (500 for a
    ``put_many`` of 500), so that rates are entities per second.
    """

    name: str
    bag: Callable[[Any], object]
    raw: Callable[[Any], object]
    inputs: Callable[[int, str], Sequence[Any]]
    units: int = 1


@dataclass
class Sample:
    rate: float  # units per second over the round
    p50: float  # median latency of one call, seconds


@dataclass
class Result:
    """Medians over rounds for one work on one backend."""

    work: str
    backend: str
    bag: list[Sample]
    raw: list[Sample]
    target: str = ""
    met: bool | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bag_rate(self) -> float:
        return median_rate([s.rate for s in self.bag])

    @property
    def raw_rate(self) -> float:
        return median_rate([s.rate for s in self.raw])

    @property
    def bag_p50(self) -> float:
        return statistics.median(s.p50 for s in self.bag)

    @property
    def raw_p50(self) -> float:
        return statistics.median(s.p50 for s in self.raw)

    @property
    def ratio(self) -> float:
        """Median of the per-round ratios (each bagstore round against the raw
        round next to it): steadier than the ratio of the medians."""
        return statistics.median(b.rate / r.rate for b, r in zip(self.bag, self.raw, strict=True))


def median_rate(rates: Sequence[float]) -> float:
    return float(statistics.median(rates))


def _run_round(fn: Callable[[Any], object], inputs: Sequence[Any], units: int) -> Sample:
    latencies = []
    clock = time.perf_counter
    start = clock()
    for item in inputs:
        t0 = clock()
        fn(item)
        latencies.append(clock() - t0)
    elapsed = clock() - start
    return Sample(len(inputs) * units / elapsed, statistics.median(latencies))


def _calibrate(work: Work, seconds: float, min_ops: int, max_ops: int) -> int:
    """How many calls make a round of about ``seconds`` on the slower side."""
    slowest = float("inf")
    for side, fn in (("bag", work.bag), ("raw", work.raw)):
        n, spent = 4, 0.0
        while spent < seconds / 4 and n <= max_ops:
            inputs = work.inputs(n, side)
            t0 = time.perf_counter()
            for item in inputs:
                fn(item)
            spent = time.perf_counter() - t0
            n *= 4
        slowest = min(slowest, (n // 4) / max(spent, 1e-9))
    return max(min_ops, min(max_ops, int(slowest * seconds)))


def compare(
    work: Work,
    backend: str,
    *,
    rounds: int,
    seconds: float,
    min_ops: int = 20,
    max_ops: int = 200_000,
) -> Result:
    """Time ``work`` on both sides: a warm-up, then ``rounds`` interleaved
    rounds of the same number of calls, bagstore first in even rounds, raw
    first in odd ones."""
    t0 = time.perf_counter()
    min_ops = max(3, min_ops * 50 // max(50, work.units))  # a call of 500 entities: 3 calls
    n = _calibrate(work, seconds, min_ops, max_ops)
    bag: list[Sample] = []
    raw: list[Sample] = []
    for i in range(rounds):
        order = [("bag", work.bag, bag), ("raw", work.raw, raw)]
        if i % 2:
            order.reverse()
        for side, fn, out in order:
            inputs = work.inputs(n, side)
            out.append(_run_round(fn, inputs, work.units))
    r = Result(work.name, backend, bag, raw)
    log(
        f"  {backend:18} {work.name:34} bagstore {r.bag_rate:>10,.0f}/s  raw {r.raw_rate:>10,.0f}/s"
        f"  ratio {r.ratio:.2f}  ({time.perf_counter() - t0:.1f}s)"
    )
    return r


# -- printing: one table per bench, one row per metric -----------------------------------


HEADERS = ["metric", "bagstore", "raw", "ratio", "goal", "met?"]


@dataclass
class Row:
    """One metric of a bench: bagstore's figure beside the raw baseline's, their
    ratio (``bag / raw`` unless given), the goal and whether it was met."""

    metric: str
    bag: float | None
    raw: float | None
    ratio: float | None = None
    goal: str = ""
    met: bool | None = None
    unit: str = "/s"  # how the two figures read: "/s", " ms", "x", ""

    def __post_init__(self) -> None:
        if self.ratio is None and self.bag is not None and self.raw:
            self.ratio = self.bag / self.raw


#: Every row printed in this process, by bench title (``python -m bench all --json``).
RECORDED: list[tuple[str, Row]] = []


def fmt_value(x: float | None, unit: str = "/s") -> str:
    if x is None or x != x:
        return "—"
    if unit == " ms":
        text = f"{x:,.1f}" if x < 100 else f"{x:,.0f}"
    elif unit == "x":
        text = f"{x:.2f}"
    else:
        text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.2f}"
    return text + unit


def _met(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "NO")


def result_row(r: Result) -> Row:
    """A :class:`Result` (rates in ``r.work``'s units per second) as a table row."""
    return Row(f"{r.backend}: {r.work}", r.bag_rate, r.raw_rate, r.ratio, r.target, r.met)


def print_rows(title: str, rows: Sequence[Row], *, fmt: str = "rich") -> None:
    """The bench's table (metric, bagstore, raw, ratio, goal, met?) as a rich
    table, a plain one, or Markdown (``fmt``)."""
    RECORDED.extend((title, r) for r in rows)
    body = [
        [
            r.metric,
            fmt_value(r.bag, r.unit),
            fmt_value(r.raw, r.unit),
            "—" if r.ratio is None or r.ratio != r.ratio else f"{r.ratio:.2f}",
            r.goal,
            _met(r.met),
        ]
        for r in rows
    ]
    headers = HEADERS
    if fmt == "rich":
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            fmt = "plain"
        else:
            table = Table(title=title)
            for i, h in enumerate(headers):
                table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i > 0)
            for row in body:
                table.add_row(*row)
            console = Console()
            if not console.is_terminal:  # piped: do not wrap at 80 columns
                console = Console(width=200)
            console.print(table)
            return
    if fmt == "markdown":
        print(f"\n**{title}**\n")
        print("| " + " | ".join(headers) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
        for row in body:
            print("| " + " | ".join(row) + " |")
        print()
        return
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in body:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print()


def add_common_args(
    p: argparse.ArgumentParser, backends: Sequence[str] = ("sqlite", "mysql")
) -> None:
    p.add_argument("--backend", choices=[*backends, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="a small size: a smoke run")
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="rich")


def plan(backend: str) -> list[str] | None:
    """The backends to run for ``--backend``: MariaDB is left out, with a line
    saying so, when it does not answer (None when it was asked for alone)."""
    out = ["sqlite"] if backend in ("sqlite", "all") else []
    if backend in ("mysql", "all"):
        if mysql_available():
            out.append("mysql")
        elif backend == "mysql":
            print(f"MariaDB is not reachable on {MYSQL_HOST}:{MYSQL_PORT}", file=sys.stderr)
            return None
        else:
            print(f"skipped: MariaDB on {MYSQL_HOST}:{MYSQL_PORT} does not answer", file=sys.stderr)
    return out


# -- MariaDB -------------------------------------------------------------------------


def mysql_connect(
    database: str | None = None,
    *,
    driver: str = "pymysql",
    host: str | None = None,
    port: int | None = None,
    **extra: Any,
) -> Any:
    """A raw DB-API connection with the session settings bagstore uses
    (autocommit, utf8mb4, UTC, strict sql_mode, ``_binary`` prefix); to the
    bench's MariaDB server unless ``host``/``port`` name another."""
    args: dict[str, Any] = {
        "host": MYSQL_HOST if host is None else host,
        "port": MYSQL_PORT if port is None else port,
        "user": MYSQL_USER,
        "password": MYSQL_PASSWORD,
        "charset": "utf8mb4",
        "autocommit": True,
        "init_command": INIT_COMMAND,
        "binary_prefix": True,
        **extra,
    }
    if database is not None:
        args["database"] = database
    if driver == "mysqlclient":
        import MySQLdb

        return MySQLdb.connect(**args)
    import pymysql

    return pymysql.connect(**args)


def rows_of(conn: Any, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """Every row of one statement on a raw DB-API connection (its own cursor).
    Without ``params`` the text is sent as it is (PyMySQL would read a ``%``
    in it as a parameter mark even for empty parameters)."""
    cur = conn.cursor()
    try:
        if params is None:
            cur.execute(sql)
        else:
            cur.execute(sql, params)
        return list(cur.fetchall())
    finally:
        cur.close()


def mysql_url(database: str, *, driver: str = "pymysql") -> str:
    auth = MYSQL_USER + (f":{MYSQL_PASSWORD}" if MYSQL_PASSWORD else "")
    return f"mysql://{auth}@{MYSQL_HOST}:{MYSQL_PORT}/{database}?driver={driver}"


def mysql_available() -> bool:
    try:
        mysql_connect().close()
    except Exception:
        return False
    return True


@contextlib.contextmanager
def temp_databases(n: int, prefix: str = "bagbench") -> Iterator[list[str]]:
    """``n`` freshly created, uniquely named databases, dropped afterwards."""
    tag = uuid.uuid4().hex[:10]
    names = [f"{prefix}_{tag}_{i}" for i in range(n)]
    conn = mysql_connect()
    try:
        cur = conn.cursor()
        for name in names:
            cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        yield names
    finally:
        with contextlib.suppress(Exception):
            conn.ping(True)
        cur = conn.cursor()
        for name in names:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        conn.close()


def machine_info() -> dict[str, str]:
    info = {
        "cpus": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "sqlite": sqlite3.sqlite_version,
        "load average": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    }
    try:
        conn = mysql_connect()
        cur = conn.cursor()
        cur.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
        version, flush = cur.fetchone()
        conn.close()
        info["mariadb"] = f"{version} (innodb_flush_log_at_trx_commit={flush})"
    except Exception as exc:
        info["mariadb"] = f"unavailable ({exc})"
    return info


def print_machine(fmt: str) -> None:
    info = machine_info()
    line = ", ".join(f"{k} {v}" for k, v in info.items())
    print(f"machine: {line}" if fmt != "markdown" else f"_machine: {line}_")


# -- environments: bagstore over N shards beside one raw database ------------------------


@dataclass
class Env:
    """A bagstore datastore and a raw DB-API connection to one database holding
    the same tables (``raw_ddl``), on one backend."""

    label: str  # e.g. "sqlite", "mariadb/pymysql"
    dialect: Any  # bagstore's Dialect for this backend
    ds: Any  # bagstore.Datastore
    raw: Any  # DB-API connection (autocommit)
    extra: dict[str, Any] = field(default_factory=dict)

    def cursor(self) -> Any:
        return self.raw.cursor()


@contextlib.contextmanager
def open_env(
    backend: str,
    *,
    shards: int = 4,
    indexes: Sequence[Any] = (),
    raw_ddl: Callable[[Any], list[str]] | None = None,
    driver: str = "pymysql",
    extra_stores: Mapping[str, tuple[int, Sequence[Any], dict[str, Any]]] | None = None,
) -> Iterator[Env]:
    """Open bagstore over ``shards`` fresh databases (SQLite files in a temp
    directory, or MariaDB databases) and one raw database with the tables
    ``raw_ddl(dialect)`` lists; everything is removed afterwards.

    ``extra_stores`` (``{name: (shards, indexes, keywords)}``) opens more
    datastores in ``env.extra[name]``, each on its own fresh databases.
    """
    import bagstore
    from bagstore.backends.mysql import MySQLDialect
    from bagstore.backends.sqlite import SQLiteDialect

    if backend not in ("sqlite", "mysql"):
        raise ValueError(f"unknown backend {backend!r}")
    extra_stores = extra_stores or {}
    total = shards + sum(spec[0] for spec in extra_stores.values()) + 1
    with contextlib.ExitStack() as stack:
        fresh = stack.enter_context(fresh_shards(backend, total))
        mysql = backend == "mysql"
        dialect: Any = MySQLDialect() if mysql else SQLiteDialect()
        urls = [mysql_url(t, driver=driver) for t in fresh.targets] if mysql else fresh.urls
        free = iter(urls[1:])

        def make_store(n: int, idx: Sequence[Any], **kw: Any) -> Any:
            ds = bagstore.Datastore([next(free) for _ in range(n)], indexes=idx, **kw)
            stack.callback(ds.close)
            return ds

        raw = connect_target(fresh.targets[0], driver)
        stack.callback(raw.close)
        for sql in raw_ddl(dialect) if raw_ddl else []:
            rows_of(raw, sql)
        env = Env(
            f"mariadb/{driver}" if mysql else "sqlite", dialect, make_store(shards, indexes), raw
        )
        for name, (n, idx, kw) in extra_stores.items():
            env.extra[name] = make_store(n, idx, **kw)
        yield env


# -- raw connections, fresh shards, interleaved rounds, the suites' main -----------------


def sqlite_connect(path: str) -> sqlite3.Connection:
    """A raw SQLite connection with bagstore's settings (WAL, synchronous=NORMAL),
    autocommit, usable from any thread, waiting up to 120 s for a lock."""
    conn = sqlite3.connect(path, timeout=120, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def connect_target(target: str, driver: str = "pymysql", **extra: Any) -> Any:
    """A raw autocommit connection to a SQLite file (a path) or a database of the
    bench's MariaDB server (a name)."""
    if os.sep in target:
        return sqlite_connect(target)
    return mysql_connect(target, driver=driver, **extra)


@dataclass
class Shards:
    """Fresh, empty shards: bagstore URLs and, for raw connections, their targets
    (SQLite file paths or MariaDB database names)."""

    urls: list[str]
    targets: list[str]

    def connect(self, i: int, **extra: Any) -> Any:
        return connect_target(self.targets[i], **extra)


@contextlib.contextmanager
def fresh_shards(backend: str, n: int, prefix: str = "bagbench") -> Iterator[Shards]:
    """``n`` fresh shards (SQLite files in a temp directory, or databases on the
    MariaDB server), removed afterwards."""
    import tempfile

    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix=prefix + "_") as root:
            paths = [os.path.join(root, f"s{i}.db") for i in range(n)]
            yield Shards([f"sqlite:///{p}" for p in paths], paths)
    else:
        with temp_databases(n, prefix) as names:
            yield Shards([mysql_url(x) for x in names], names)


def alternate(sides: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run each side's round (returning its rate) ``rounds`` times, the order
    reversed every other round; the rates by side."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(rounds):
        for name in order if i % 2 == 0 else reversed(order):
            rates[name].append(sides[name]())
    return rates


def paired(
    metric: str, bag: Sequence[float], raw: Sequence[float], goal: float | str = "", **kw: Any
) -> Row:
    """A row of medians of interleaved rates, the ratio the median of the
    per-round ratios; ``goal`` a least ratio (``>= 0.9x``) or a word."""
    ratio = statistics.median(b / r for b, r in zip(bag, raw, strict=True))
    met = None if isinstance(goal, str) else ratio >= goal
    text = goal if isinstance(goal, str) else f">= {goal}x"
    return Row(metric, statistics.median(bag), statistics.median(raw), ratio, text, met, **kw)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def label_of(backend: str) -> str:
    return "mariadb" if backend == "mysql" else backend


#: an option of a suite: (type or list of choices, default, --quick default, help)
Option = tuple[Any, Any, Any, str]


def suite_args(
    argv: list[str] | None,
    description: str,
    options: Mapping[str, Option],
    backends: Sequence[str] = ("sqlite", "mysql"),
) -> argparse.Namespace:
    """The common options (``--backend``, ``--quick``, ``--format``) and the
    suite's own, whose defaults ``--quick`` replaces."""
    p = argparse.ArgumentParser(description=description)
    add_common_args(p, backends)
    for name, (kind, full, _, help_) in options.items():
        how = {"choices": kind} if isinstance(kind, list) else {"type": kind}
        p.add_argument("--" + name, **how, default=None, help=f"{help_} (default {full})")
    args = p.parse_args(argv)
    for name, (_, full, quick, _) in options.items():
        key = name.replace("-", "_")
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
        value = getattr(args, key)
        if isinstance(value, int | float) and value < (1 if name == "rounds" else 0):
            p.error(f"--{name} must be at least {1 if name == 'rounds' else 0}")
    return args


def run_suite(
    args: argparse.Namespace,
    title: str,
    run_backend: Callable[[str, argparse.Namespace], Sequence[Row]],
) -> int:
    """Run ``run_backend`` for each backend asked for (MariaDB left out with a
    line when it does not answer), then print the table; a backend that fails
    is reported and the others still run (exit code 1)."""
    backends = plan(args.backend)
    if backends is None:
        return 2
    print_machine(args.format)
    started = time.perf_counter()
    rows: list[Row] = []
    failed: list[str] = []
    for backend in backends:
        try:
            rows += run_backend(backend, args)
        except Exception as exc:  # report it, run the others
            failed.append(f"{backend}: {type(exc).__name__}: {exc}")
            log(f"FAILED {failed[-1]}")
    print_rows(title, rows, fmt=args.format)
    for line in failed:
        print(f"FAILED {line}")
    log(f"total {time.perf_counter() - started:.0f}s")
    return 1 if failed else 0


# -- counting the statements a bagstore backend sends ----------------------------------------


class Counter:
    def __init__(self) -> None:
        self.db = 0
        self.cache = 0


class _Cursor:
    def __init__(self, cur: Any, counter: Counter) -> None:
        self._cur, self._counter = cur, counter

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.db += 1
        return self._cur.execute(*args, **kwargs)

    def executemany(self, *args: Any, **kwargs: Any) -> Any:
        self._counter.db += 1
        return self._cur.executemany(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Conn:
    def __init__(self, conn: Any, counter: Counter, commits: bool) -> None:
        self._conn, self._counter, self._commits = conn, counter, commits

    def cursor(self, *args: Any) -> _Cursor:
        return _Cursor(self._conn.cursor(*args), self._counter)

    def commit(self) -> Any:
        self._counter.db += self._commits
        return self._conn.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def count_statements(backend: Any, counter: Counter, *, commits: bool = True) -> None:
    """Count in ``counter.db`` every statement ``backend`` sends through its
    ``run`` (and each ``commit``, unless ``commits`` is false)."""
    original = backend.run

    def run(work: Any, *args: Any, **kw: Any) -> Any:
        return original(lambda conn: work(_Conn(conn, counter, commits), *args), **kw)

    backend.run = run


def raw_connector(env: Env) -> Callable[[], Any]:
    """A function opening another raw connection to ``env``'s raw database."""
    if env.dialect.name == "sqlite":
        target = env.raw.execute("PRAGMA database_list").fetchone()[2]
    else:
        (target,) = rows_of(env.raw, "SELECT DATABASE()")[0]
    driver = "mysqlclient" if "mysqlclient" in env.label else "pymysql"
    return lambda: connect_target(target, driver)


def in_threads(n: int, body: Callable[[int], object]) -> float:
    """``body(k)`` for k in 0..n-1, each in a thread of its own, all at once;
    the seconds until the last one ended."""
    import threading

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0
