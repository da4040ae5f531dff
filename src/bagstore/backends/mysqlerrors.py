"""How the MySQL drivers' errors read (:mod:`bagstore.backends.mysql`): the
server's and the client's error codes, shared by PyMySQL and mysqlclient, and
PyMySQL's client-side timeouts."""

from __future__ import annotations

__all__ = [
    "DEADLOCK",
    "DUPLICATE",
    "LOCK_WAIT_TIMEOUT",
    "LOST",
    "NO_SUCH_TABLE",
    "READ_ONLY",
    "TIMEOUT",
    "UNAVAILABLE",
    "UNKNOWN_DATABASE",
    "UNKNOWN_VARIABLE",
    "timed_out",
    "timeout_of",
]

UNAVAILABLE = {
    1040,  # too many connections
    1053,  # server shutdown in progress
    1927,  # connection was killed
    2002,  # can't connect through socket
    2003,  # can't connect to server
    2005,  # unknown host
    2006,  # server has gone away
    2013,  # lost connection during query
    2055,  # lost connection at reading initial packet
    4031,  # disconnected by the server because of inactivity
}
LOST = {1927, 2006, 2013, 2055, 4031}
LOCK_WAIT_TIMEOUT = 1205
TIMEOUT = {LOCK_WAIT_TIMEOUT, 3024, 1969}  # and max_execution_time, statement_timeout
DEADLOCK = {1213}
DUPLICATE = {1062}
UNKNOWN_DATABASE = 1049
NO_SUCH_TABLE = 1146
UNKNOWN_VARIABLE = 1193
READ_ONLY = 1290  # the server runs with --read-only (a replica, or a fenced primary)


def timed_out(exc: BaseException) -> bool:
    """Whether a driver error means a client-side timeout expired."""
    return timeout_of(exc) is not None


def timeout_of(exc: BaseException) -> BaseException | None:
    """The driver error that reported a client-side timeout, if ``exc`` is one
    or was raised while handling one (a rollback on the connection the timeout
    closed): PyMySQL raises its "lost connection" / "gone away" / "can't
    connect" errors from the socket's ``TimeoutError``.  (mysqlclient's read
    timeout is a plain error 2013, which looks like a lost connection:
    ShardUnavailable.)"""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        cause = seen.__context__ or getattr(seen, "original_exception", None)
        if isinstance(cause, TimeoutError):
            return seen
        seen = cause
    return None
