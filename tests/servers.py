"""Real servers for the tests: addresses, reachability checks, throw-away databases,
and extra MariaDB / memcached processes that the tests start and kill themselves.

This is a plain module (no pytest in it); ``conftest.py`` turns its answers into
skips (outside CI) or failures (in CI, see :func:`in_ci`).

The extra servers are started so that they cannot outlive the test process: they
are stopped by an :mod:`atexit` hook, and on Linux the kernel sends them SIGKILL
when the thread that started them dies (``PR_SET_PDEATHSIG``), even if the test
process itself is killed with SIGKILL.  Start them from the main thread: the
parent-death signal fires when the *thread* that forked the server exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, NamedTuple, Self
from urllib.parse import unquote, urlsplit

import pymysql

MYSQL_URL: Final[str] = os.environ.get("BAGSTORE_TEST_MYSQL", "mysql://root@127.0.0.1:3306")
REDIS_URL: Final[str] = os.environ.get("BAGSTORE_TEST_REDIS", "redis://127.0.0.1:6379/0")
MEMCACHED_ADDR: Final[str] = os.environ.get("BAGSTORE_TEST_MEMCACHED", "127.0.0.1:11211")

#: Every database made by :func:`unique_name` starts with this.
TEST_DB_PREFIX: Final[str] = "bst_"

CONNECT_TIMEOUT_S: Final[float] = 2.0

_IDENT_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# bst_<tag>_<unix time>_<pid>_<counter>_<6 hex>; parsed from the right, so the tag
# may itself contain underscores and digits.
_UNIQUE_RE: Final = re.compile(
    r"bst_(?P<tag>[a-z0-9_]*?)_(?P<ts>[0-9]{10})_(?P<pid>[0-9]+)_(?P<n>[0-9]+)_[0-9a-f]{6}"
)
_counter = itertools.count(1)
_counter_lock = threading.Lock()

_SEARCH_DIRS: Final[tuple[str, ...]] = (
    "/usr/sbin",
    "/usr/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
)


class ServerUnavailable(RuntimeError):
    """A server binary is missing or a server could not be started."""


# ---------------------------------------------------------------------------
# Addresses


class MySQLAddress(NamedTuple):
    host: str
    port: int
    user: str
    password: str


def parse_mysql_url(url: str = MYSQL_URL) -> MySQLAddress:
    """``mysql://user:password@host:port`` -> its parts (defaults root, '', 3306)."""
    parts = urlsplit(url)
    if parts.scheme not in ("mysql", "mariadb", "mysql+pymysql"):
        raise ValueError(f"not a mysql:// URL: {url!r}")
    return MySQLAddress(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 3306,
        user=unquote(parts.username) if parts.username else "root",
        password=unquote(parts.password) if parts.password else "",
    )


def parse_hostport(addr: str, default_port: int) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``) -> ``(host, port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, default_port
    return host.strip("[]") or "127.0.0.1", int(port)


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to a true-ish value."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


# ---------------------------------------------------------------------------
# Reachability: None when the server answers, else a reason fit for a skip message.


def mysql_reachable(host: str, port: int, user: str = "root", password: str = "") -> str | None:
    """None if a MariaDB/MySQL server accepts ``user``/``password`` at host:port."""
    try:
        conn = pymysql.connect(
            host=host,
            port=port,
            user=user,
            password=password,
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=10,
            write_timeout=10,
        )
    except Exception as exc:  # any failure is a reason
        return f"MariaDB at {user}@{host}:{port} is not reachable: {exc}"
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            cur.fetchall()
    except Exception as exc:
        return f"MariaDB at {user}@{host}:{port} does not answer queries: {exc}"
    finally:
        conn.close()
    return None


def redis_reachable(url: str = REDIS_URL) -> str | None:
    """None if the Redis server at ``url`` answers PING."""
    try:
        import redis
    except ImportError:
        return "the redis package is not installed (pip install -e '.[test]')"
    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S
    )
    try:
        client.ping()
    except Exception as exc:
        return f"Redis at {url} is not reachable: {exc}"
    finally:
        client.close()
    return None


def memcached_reachable(addr: str = MEMCACHED_ADDR) -> str | None:
    """None if a memcached at ``host:port`` answers ``version``."""
    host, port = parse_hostport(addr, 11211)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.sendall(b"version\r\n")
            reply = b""
            while not reply.endswith(b"\r\n") and len(reply) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        return f"memcached at {addr} is not reachable: {exc}"
    if not reply.startswith(b"VERSION "):
        return f"memcached at {addr} answered {reply[:60]!r} to 'version'"
    return None


# ---------------------------------------------------------------------------
# Throw-away databases


def unique_name(prefix: str) -> str:
    """A fresh SQL identifier ``bst_<prefix>_<unix time>_<pid>_<counter>_<hex>``.

    ``prefix`` is lower-cased and may hold letters, digits and underscores; it is
    cut short so that the name stays within 64 characters.  The embedded time and
    pid let :func:`drop_stale_test_databases` recognise leftovers of killed runs.
    """
    tag = prefix.lower().strip("_")
    if not re.fullmatch(r"[a-z0-9_]*", tag):
        raise ValueError(f"prefix may only hold letters, digits and '_': {prefix!r}")
    with _counter_lock:
        n = next(_counter)
    tail = f"_{int(time.time()):010d}_{os.getpid()}_{n}_{secrets.token_hex(3)}"
    room = 64 - len(TEST_DB_PREFIX) - len(tail)
    name = f"{TEST_DB_PREFIX}{tag[:room].rstrip('_')}{tail}"
    assert _IDENT_RE.fullmatch(name) and _UNIQUE_RE.fullmatch(name), name
    return name


def quote_ident(name: str) -> str:
    """Backquote ``name`` after checking it is a plain identifier (no quoting tricks)."""
    if not _IDENT_RE.fullmatch(name):
        raise ValueError(f"not a safe SQL identifier: {name!r}")
    return f"`{name}`"


def _connect(host: str, port: int, user: str, password: str) -> pymysql.Connection:
    return pymysql.connect(
        host=host,
        port=port,
        user=user,
        password=password,
        connect_timeout=CONNECT_TIMEOUT_S,
        autocommit=True,
    )


def _execute_all(host: str, port: int, user: str, password: str, sqls: Iterable[str]) -> None:
    conn = _connect(host, port, user, password)
    try:
        with conn.cursor() as cur:
            for sql in sqls:
                cur.execute(sql)
    finally:
        conn.close()


def create_databases(
    host: str, port: int, names: Iterable[str], user: str = "root", password: str = ""
) -> None:
    """``CREATE DATABASE`` each of ``names`` (server's default character set)."""
    sqls = [f"CREATE DATABASE {quote_ident(name)}" for name in names]
    _execute_all(host, port, user, password, sqls)


def drop_databases(
    host: str, port: int, names: Iterable[str], user: str = "root", password: str = ""
) -> None:
    """``DROP DATABASE IF EXISTS`` each of ``names``.

    MariaDB has been seen to leave a trigger file's backup (``*.TRG-``) in a
    test database's directory under concurrent DDL; the drop then fails with
    "Directory not empty" (1010), and does so again however often it is
    tried.  On a server of this machine (its data directory readable here),
    such leftovers of a database being dropped are removed and the drop is
    tried once more."""
    conn = _connect(host, port, user, password)
    try:
        with conn.cursor() as cur:
            for name in names:
                sql = f"DROP DATABASE IF EXISTS {quote_ident(name)}"
                try:
                    cur.execute(sql)
                except pymysql.err.OperationalError as e:
                    if e.args[0] != _DROP_RMDIR_FAILED or not _remove_leftovers(cur, name):
                        raise
                    cur.execute(sql)
    finally:
        conn.close()


_DROP_RMDIR_FAILED = 1010  # ER_DB_DROP_RMDIR
#: what the server writes beside a trigger's files while it changes them
_LEFTOVER_SUFFIXES = (".TRG-", ".TRN-", ".TRG~", ".TRN~")


def _remove_leftovers(cur: Any, name: str) -> bool:
    """Remove the trigger files' backups left in database ``name``'s
    directory, when the server's data directory is on this machine and the
    directory holds nothing else; True if the directory was cleared."""
    cur.execute("SELECT @@datadir")
    directory = Path(str(cur.fetchone()[0])) / name
    if not directory.is_dir():
        return False
    files = list(directory.iterdir())
    if not files or not all(f.name.endswith(_LEFTOVER_SUFFIXES) for f in files):
        return False
    for f in files:
        f.unlink()
    return True


def _running_as_root() -> bool:
    return os.geteuid() == 0


def _current_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_stale_test_databases(
    host: str,
    port: int,
    prefix: str = TEST_DB_PREFIX,
    older_than_s: float = 3600,
    user: str = "root",
    password: str = "",
) -> list[str]:
    """Drop databases left behind by killed test runs; returns the names dropped.

    Only names in the exact :func:`unique_name` format that start with ``prefix``
    are considered, and one is dropped only when its embedded time is more than
    ``older_than_s`` old *and* the process that made it is not running on this
    machine (a pid that may belong to a live run keeps its database).
    """
    cutoff = time.time() - older_than_s
    conn = _connect(host, port, user, password)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW DATABASES LIKE %s", ("bst\\_%",))
            names = [str(row[0]) for row in cur.fetchall()]
            stale: list[str] = []
            for name in names:
                m = _UNIQUE_RE.fullmatch(name)
                if m is None or not name.startswith(prefix):
                    continue
                if int(m["ts"]) >= cutoff or _pid_alive(int(m["pid"])):
                    continue
                cur.execute(f"DROP DATABASE IF EXISTS {quote_ident(name)}")
                stale.append(name)
    finally:
        conn.close()
    return stale


# ---------------------------------------------------------------------------
# Processes


def find_binary(name: str) -> str | None:
    """``name`` on PATH, else in the usual sbin/bin directories, else None."""
    found = shutil.which(name)
    if found:
        return found
    for directory in _SEARCH_DIRS:
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


_PR_SET_PDEATHSIG: Final = 1
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        _libc = None


def _child_setup(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child get SIGKILL when its parent thread dies."""
    libc = _libc
    if libc is None:
        return None

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


#: Other directories servers may keep their working directories in (see ``tmp_root``).
_WORKDIR_ROOTS: Final[tuple[str, ...]] = ("/dev/shm",)
_WORKDIR_RE: Final = re.compile(r"bst-[a-z-]+-(?P<pid>[0-9]+)-[A-Za-z0-9_]+")
_stale_workdirs_removed = False


def _remove_stale_workdirs() -> None:
    """Remove the temp directories of servers whose test process died (once per process)."""
    global _stale_workdirs_removed
    if _stale_workdirs_removed:
        return
    _stale_workdirs_removed = True
    roots = {tempfile.gettempdir(), *(r for r in _WORKDIR_ROOTS if os.path.isdir(r))}
    for path in (p for root in roots for p in Path(root).glob("bst-*")):
        m = _WORKDIR_RE.fullmatch(path.name)
        if m is None or not path.is_dir() or path.stat().st_uid != os.geteuid():
            continue
        if int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)


_live: set[_ManagedServer] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        with contextlib.suppress(Exception):  # best effort at exit
            server.stop()


class _ManagedServer:
    """One server process run by the tests: start, kill, restart, stop."""

    name = "server"
    host: str = "127.0.0.1"
    _stop_signal: signal.Signals = signal.SIGTERM
    startup_timeout_s: float = 30.0
    #: Where the working directory is made (None: the system's temp directory).
    tmp_root: str | None = None

    def __init__(self, port: int | None = None, startup_timeout_s: float | None = None) -> None:
        self._port = port
        self._fixed_port = port is not None
        if startup_timeout_s is not None:
            self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    # -- to be provided by subclasses
    def _prepare(self, workdir: Path) -> None:
        """One-time setup in ``workdir`` before the first start."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _diagnostics(self) -> str:
        return _tail(self.workdir / "stderr.log")

    def _bind_failed(self) -> bool:
        return False

    # -- public API
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self._port

    @property
    def workdir(self) -> Path:
        if self._dir is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self._dir

    @property
    def pid(self) -> int | None:
        """The server's pid while its process is running, else None."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> Self:
        """Create the working directory (first time only) and start the server."""
        if self.running:
            return self
        with _live_lock:
            _live.add(self)
        if self._dir is None:
            _remove_stale_workdirs()
            self._dir = Path(
                tempfile.mkdtemp(prefix=f"bst-{self.name}-{os.getpid()}-", dir=self.tmp_root)
            )
            try:
                self._prepare(self._dir)
            except BaseException:
                self.stop()
                raise
        attempts = 1 if self._fixed_port or self._port is not None else 3
        for attempt in range(attempts):
            if self._port is None:
                self._port = free_port(self.host)
            try:
                self._spawn_and_wait()
                return self
            except ServerUnavailable:
                # Another process may have grabbed the free port between our check
                # and the server's bind: try another one.
                if attempt + 1 < attempts and self._bind_failed():
                    self._port = None
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def restart(self) -> Self:
        """Start again on the same port and working directory (shutting down first if up)."""
        if self._dir is None:
            raise RuntimeError(f"{self.name} was never started")
        if self.running:
            self.terminate()
        self._fixed_port = True
        return self.start()

    def kill(self) -> None:
        """SIGKILL the server (a crash) and wait for it; its files are kept."""
        self._signal_and_wait(signal.SIGKILL, timeout_s=30)

    def terminate(self) -> None:
        """Shut the server down cleanly (SIGTERM, then SIGKILL after 60 s); files are kept."""
        self._signal_and_wait(self._stop_signal, timeout_s=60)

    def stop(self) -> None:
        """Shut down cleanly and remove the working directory.  Safe to call twice."""
        try:
            self.terminate()
        finally:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            with _live_lock:
                _live.discard(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "not running"
        return f"<{type(self).__name__} {self.host}:{self._port} {state}>"

    # -- internals
    def _signal_and_wait(self, sig: signal.Signals, timeout_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def _spawn_and_wait(self) -> None:
        workdir = self.workdir
        with open(workdir / "stderr.log", "ab") as stderr:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                cwd=workdir,
                start_new_session=True,  # no terminal signals (Ctrl-C) go to it directly
                preexec_fn=_child_setup(os.getpid()),  # PDEATHSIG
            )
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.01
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise ServerUnavailable(
                    f"{self.name} exited with code {code} while starting on port "
                    f"{self._port}:\n{self._diagnostics()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerUnavailable(
                    f"{self.name} did not accept connections on {self.host}:{self._port} "
                    f"within {self.startup_timeout_s:g} s:\n{self._diagnostics()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


_templates: dict[tuple[str, str, tuple[str, ...]], Path] = {}
_templates_lock = threading.Lock()


@atexit.register
def _remove_templates() -> None:
    with _templates_lock:
        for path in _templates.values():
            shutil.rmtree(path.parent, ignore_errors=True)
        _templates.clear()


def _mariadb_template(install_db: str, os_user: str, options: tuple[str, ...]) -> Path:
    """A datadir made by ``mariadb-install-db`` once per process, to be copied."""
    key = (install_db, os_user, options)
    with _templates_lock:
        if key in _templates:
            return _templates[key]
        parent = Path(tempfile.mkdtemp(prefix=f"bst-mariadb-template-{os.getpid()}-"))
        datadir = parent / "data"
        (parent / "tmp").mkdir()
        cmd = [
            install_db,
            "--no-defaults",  # must come first; ignores /etc/mysql/my.cnf (user=mysql, ...)
            f"--user={os_user}",
            f"--datadir={datadir}",
            "--auth-root-authentication-method=normal",  # root@localhost, 127.0.0.1: no password
            "--skip-test-db",
            "--skip-name-resolve",
            # Its own temporary tables: another bootstrap's or server's in /tmp
            # once made one fail ("Could not remove temporary table").
            f"--tmpdir={parent / 'tmp'}",
            *options,
        ]
        result = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=parent,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            shutil.rmtree(parent, ignore_errors=True)
            out = result.stdout.decode(errors="replace")
            raise ServerUnavailable(
                f"mariadb-install-db failed (exit {result.returncode}):\n{out[-3000:]}"
            )
        _templates[key] = datadir
        return datadir


class MariaDBServer(_ManagedServer):
    """A private ``mariadbd`` on 127.0.0.1:<free port> with a datadir in a temp directory.

    root has an empty password.  Settings are chosen for fast, light test servers
    (see :attr:`SERVER_OPTIONS`); ``innodb_flush_log_at_trx_commit=2`` still loses no
    committed transaction on :meth:`kill` (only an OS crash could), so crash tests
    stay meaningful.  ``extra_options`` are appended to the ``mariadbd`` command line.
    """

    name = "mariadb"

    #: Options for both ``mariadb-install-db`` (bootstrap) and ``mariadbd``.
    INNODB_OPTIONS: Final[tuple[str, ...]] = (
        "--innodb-buffer-pool-size=64M",
        "--innodb-log-file-size=32M",
    )
    SERVER_OPTIONS: Final[tuple[str, ...]] = (
        "--skip-name-resolve",
        "--innodb-flush-log-at-trx-commit=2",
        "--innodb-buffer-pool-load-at-startup=OFF",
        "--innodb-buffer-pool-dump-at-shutdown=OFF",
        "--performance-schema=OFF",
        "--skip-log-bin",
        # the same defaults as the shared server on 3306 (Debian's my.cnf)
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_general_ci",
    )

    def __init__(
        self,
        port: int | None = None,
        extra_options: Sequence[str] = (),
        startup_timeout_s: float | None = None,
    ) -> None:
        super().__init__(port, startup_timeout_s)
        self.extra_options = tuple(extra_options)
        mariadbd = find_binary("mariadbd") or find_binary("mysqld")
        install_db = find_binary("mariadb-install-db") or find_binary("mysql_install_db")
        if mariadbd is None or install_db is None:
            raise ServerUnavailable(
                "mariadbd / mariadb-install-db not found (apt-get install mariadb-server)"
            )
        self.mariadbd: str = mariadbd
        self.install_db: str = install_db

    @property
    def user(self) -> str:
        return "root"

    @property
    def password(self) -> str:
        return ""

    @property
    def url(self) -> str:
        return f"mysql://root@{self.host}:{self.port}"

    @property
    def datadir(self) -> Path:
        return self.workdir / "data"

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"

    @property
    def socket_path(self) -> Path:
        return self.workdir / "mysqld.sock"

    def reachable(self) -> str | None:
        return mysql_reachable(self.host, self.port)

    def connect(self, database: str | None = None) -> pymysql.Connection:
        """A new autocommit PyMySQL connection as root (caller closes it)."""
        return pymysql.connect(
            host=self.host,
            port=self.port,
            user="root",
            password="",
            database=database,
            connect_timeout=CONNECT_TIMEOUT_S,
            autocommit=True,
        )

    def _os_user(self) -> str:
        # mariadbd refuses to run as root without --user=root; as anyone else,
        # --user must name the current user.
        return "root" if _running_as_root() else _current_user()

    def _prepare(self, workdir: Path) -> None:
        # mariadb-install-db takes 0.5-1.6 s here; copying its result takes ~50 ms,
        # so it runs once per process and every server starts from a copy.
        template = _mariadb_template(self.install_db, self._os_user(), self.INNODB_OPTIONS)
        shutil.copytree(template, workdir / "data", symlinks=True)
        (workdir / "tmp").mkdir()

    def _command(self) -> list[str]:
        workdir = self.workdir
        return [
            self.mariadbd,
            "--no-defaults",
            f"--user={self._os_user()}",
            f"--datadir={workdir / 'data'}",
            f"--socket={workdir / 'mysqld.sock'}",
            f"--port={self.port}",
            f"--bind-address={self.host}",
            f"--pid-file={workdir / 'mariadbd.pid'}",
            f"--log-error={workdir / 'error.log'}",
            # Its own temporary files: never beside the machine's server's in /tmp.
            f"--tmpdir={workdir / 'tmp'}",
            *self.INNODB_OPTIONS,
            *self.SERVER_OPTIONS,
            *self.extra_options,
        ]

    def _ready(self) -> bool:
        # Cheap TCP probe first; then a real login, so "ready" means usable.
        return _port_open(self.host, self.port) and self.reachable() is None

    def _diagnostics(self) -> str:
        parts = [_tail(self.error_log), _tail(self.workdir / "stderr.log", 10)]
        return "\n".join(p for p in parts if p)

    def _bind_failed(self) -> bool:
        log = _tail(self.error_log, 50)
        return "Address already in use" in log or "Can't start server: Bind" in log


class Memcached(_ManagedServer):
    """A private ``memcached`` on 127.0.0.1:<free port>, in the foreground (not -d).

    Run as root it uses ``-u root``: letting it switch to the ``memcache`` user would
    clear the parent-death signal (the kernel resets it on a change of credentials),
    and it could then outlive a killed test process.
    """

    name = "memcached"
    # memcached keeps nothing worth a clean shutdown, and SIGTERM takes 0.7-1 s here.
    _stop_signal = signal.SIGKILL

    def __init__(
        self,
        port: int | None = None,
        memory_mb: int = 64,
        extra_options: Sequence[str] = (),
        startup_timeout_s: float | None = None,
    ) -> None:
        super().__init__(port, startup_timeout_s)
        binary = find_binary("memcached")
        if binary is None:
            raise ServerUnavailable("memcached not found (apt-get install memcached)")
        self.binary: str = binary
        self.memory_mb = memory_mb
        self.extra_options = tuple(extra_options)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def reachable(self) -> str | None:
        return memcached_reachable(self.addr)

    def _command(self) -> list[str]:
        user = ["-u", "root"] if _running_as_root() else []
        return [
            self.binary,
            *user,
            "-l",
            self.host,
            "-p",
            str(self.port),
            "-U",
            "0",  # no UDP
            "-m",
            str(self.memory_mb),
            *self.extra_options,
        ]

    def _ready(self) -> bool:
        return self.reachable() is None

    def _bind_failed(self) -> bool:
        return "Address already in use" in _tail(self.workdir / "stderr.log")


def sigint_default() -> None:
    """A ``preexec_fn`` for a child that a test interrupts with SIGINT: its
    default disposition back, since a shell starting the tests in the
    background (``cmd &``) leaves SIGINT ignored, and Python then raises no
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -c CODE`` (dedented) in a child process that imports this
    checkout's ``tests`` package; stdout and stderr piped as text."""
    env = {**os.environ, **(env_extra or {})}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
