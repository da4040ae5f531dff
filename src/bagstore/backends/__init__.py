"""Storage backends and the URLs that name them.

Accepted shard URLs:

* ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db`` (SQLAlchemy's
  convention), or ``sqlite::memory:`` for a private in-memory database;
* ``mysql://user:password@host:port/database`` (``mariadb://`` is the same),
  with optional query parameters ``driver`` (``pymysql``, the default, or
  ``mysqlclient``), ``pool_size``, ``connect_timeout``, ``read_timeout``,
  ``write_timeout``, ``bulk_timeout`` (seconds; see :class:`MySQLDefaults`),
  and ``replica=host:port`` (repeatable: the servers replicating this one,
  see docs/replication.md);
* ``host:port`` (FriendFeed's form): a MySQL server; user, password and database
  come from the keywords given to :func:`open_backend`.

>>> open_backend("sqlite::memory:").dialect.name
'sqlite'
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from bagstore.backends.base import Backend, EntityRow, Stored, check_identifier
from bagstore.errors import ConfigurationError

__all__ = [
    "Backend",
    "EntityRow",
    "MySQLDefaults",
    "Stored",
    "check_identifier",
    "open_backend",
    "redact",
]


#: Seconds a MySQL shard may take to connect, to answer a statement, to take
#: one, and to answer a statement of bulk work (docs/configuration.md).
TIMEOUTS = {"connect_timeout": 5.0, "read_timeout": 30.0, "write_timeout": 30.0,
            "bulk_timeout": 600.0}  # fmt: skip


class MySQLDefaults:
    """User, password, database and timeouts for MySQL URLs that omit them.

    Keywords win, then ``BAGSTORE_MYSQL_USER`` / ``BAGSTORE_MYSQL_PASSWORD`` /
    ``BAGSTORE_MYSQL_DATABASE``, then ``root``, empty, ``bagstore``.
    ``timeouts`` (keys of :data:`TIMEOUTS`, positive seconds) replace those
    defaults; a URL's own options win over both.
    """

    def __init__(
        self,
        user: str | None = None,
        password: str | None = None,
        database: str | None = None,
        timeouts: dict[str, float | None] | None = None,
    ) -> None:
        env = os.environ
        self.user = user if user is not None else env.get("BAGSTORE_MYSQL_USER", "root")
        self.password = password if password is not None else env.get("BAGSTORE_MYSQL_PASSWORD", "")
        self.database = (
            database if database is not None else env.get("BAGSTORE_MYSQL_DATABASE", "bagstore")
        )
        self.timeouts = dict(TIMEOUTS)
        for key, value in (timeouts or {}).items():
            if key not in TIMEOUTS:
                raise ConfigurationError(f"unknown timeout {key!r} (known: {sorted(TIMEOUTS)})")
            if value is not None:
                self.timeouts[key] = _seconds(value, key, "")


def redact(url: str) -> str:
    """The URL without its password, for messages and the catalog."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _int(value: str, what: str, url: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"{what} must be an integer in {redact(url)!r}") from None


def _seconds(value: object, what: str, url: str) -> float:
    where = f" in {redact(url)!r}" if url else ""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what} must be a number of seconds{where}") from None
    if isinstance(value, bool) or not 0 < seconds <= 31_536_000:
        raise ConfigurationError(f"{what} must be over 0 and at most a year of seconds{where}")
    return seconds


def _replica(value: str, url: str) -> str:
    """A ``replica=host:port`` option, checked (``host:port``, port 1-65535)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"replica={value!r} in {redact(url)!r} is not host:port")
    return f"{host}:{int(port)}"


def open_backend(
    url: str, *, mysql: MySQLDefaults | None = None, sqlite_synchronous: str = "NORMAL"
) -> Backend:
    """Make the backend a shard URL names (no connection is opened yet)."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"a shard URL must be a non-empty string, not {url!r}")
    if url.startswith("sqlite:"):
        from bagstore.backends.sqlite import SQLiteBackend

        if "?" in url and "replica" in url.split("?", 1)[1]:
            raise ConfigurationError(
                f"SQLite shard {url.split('?', 1)[0]!r} cannot have replicas "
                "(replica= is for MariaDB shards: docs/replication.md)"
            )
        rest = url[len("sqlite:") :]
        if rest == ":memory:":
            return SQLiteBackend(":memory:", synchronous=sqlite_synchronous)
        if not rest.startswith("///") or len(rest) == 3:
            raise ConfigurationError(
                f"bad SQLite URL {url!r}: use sqlite:///relative/file.db or sqlite:////abs/file.db"
            )
        return SQLiteBackend(rest[3:], synchronous=sqlite_synchronous)
    defaults = mysql or MySQLDefaults()
    if "://" not in url:
        host, sep, port = url.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigurationError(
                f"unknown shard {url!r}: expected host:port, mysql://..., or sqlite:///..."
            )
        url = f"mysql://{host}:{port}"
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("mysql", "mariadb", "mysql+pymysql", "mysql+mysqldb", "mysql+mysqlclient"):
        raise ConfigurationError(
            f"unknown URL scheme {parts.scheme!r} in {redact(url)!r} "
            "(bagstore knows sqlite:, mysql:, mariadb:)"
        )
    from bagstore.backends.mysql import MySQLBackend

    pairs = parse_qsl(parts.query)
    replicas = tuple(_replica(v, url) for k, v in pairs if k == "replica")
    query = dict(pairs)
    query.pop("replica", None)
    known = {"driver", "pool_size", *TIMEOUTS}
    unknown = set(query) - known
    if unknown:
        raise ConfigurationError(f"unknown option(s) {sorted(unknown)} in {redact(url)!r}")
    driver = query.get("driver") or (scheme.split("+", 1)[1] if "+" in scheme else "pymysql")
    database = unquote(parts.path.lstrip("/")) or defaults.database
    try:
        port_no = 3306 if parts.port is None else parts.port
    except ValueError:
        raise ConfigurationError(f"bad port in {redact(url)!r}") from None
    if port_no == 0:
        raise ConfigurationError(f"bad port 0 in {redact(url)!r}")
    if parts.netloc and not parts.hostname:
        # "mysql://:@:0/" must not quietly mean root@127.0.0.1:3306
        raise ConfigurationError(f"no host in {redact(url)!r} (mysql://user@host:port/database)")
    kwargs: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": port_no,
        "user": unquote(parts.username) if parts.username else defaults.user,
        "password": unquote(parts.password) if parts.password is not None else defaults.password,
        "database": database,
        "driver": driver,
        "replicas": replicas,
        **defaults.timeouts,
    }
    if "pool_size" in query:
        kwargs["pool_size"] = _int(query["pool_size"], "pool_size", url)
    for key in TIMEOUTS:
        if key in query:
            kwargs[key] = _seconds(query[key], key, url)
    return MySQLBackend(**kwargs)
