"""GTIDs this process committed on a MariaDB primary, read from the commits'
OK packets (docs/replication.md, "Read-your-writes").

MariaDB reports a session's ``last_gtid`` in the OK packet of each commit once
the session asks (``session_track_system_variables = 'last_gtid'``, with the
client's ``CLIENT_SESSION_TRACK`` capability).  PyMySQL receives that packet
but exposes none of it: :func:`tracking_connection` makes its connection class
keep the value (``tracked_gtid``), at no extra round trip; mysqlclient asks
``SELECT @@last_gtid`` instead (see ``MySQLBackend._collect_gtid``).
:class:`Gtids` keeps the highest per replication domain: the position a
replica must reach (``MASTER_GTID_WAIT``) before it may answer this process.

    >>> g = Gtids()
    >>> g.note("0-1-5"); g.note("0-2-9"); g.note("0-1-7"); g.note("1-3-2")
    >>> g.position()
    '0-2-9,1-3-2'
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["SESSION_STATE_CHANGED", "Gtids", "last_gtid", "tracking_connection"]

#: The OK packet's status flag: session state changes follow.
SESSION_STATE_CHANGED = 0x4000


class Gtids:
    """The highest GTID per replication domain that this process committed."""

    def __init__(self) -> None:
        self._by_domain: dict[str, tuple[int, str]] = {}  # domain -> (seq_no, GTID)
        self._lock = threading.Lock()

    def note(self, gtid: str) -> None:
        domain, _, rest = gtid.partition("-")
        seq = int(rest.rpartition("-")[2] or 0)
        with self._lock:
            known = self._by_domain.get(domain)
            if known is None or seq > known[0]:
                self._by_domain[domain] = (seq, gtid)

    def position(self) -> str:
        """A GTID position (``"0-1-5,1-2-9"``); '' before any commit."""
        if not self._by_domain:
            return ""
        with self._lock:
            return ",".join(g for _, g in self._by_domain.values())


def tracking_connection(driver: Any) -> Any:
    """PyMySQL's connection class, remembering the ``last_gtid`` that MariaDB
    reports in the OK packets of committed transactions (``tracked_gtid``)."""

    class Tracking(driver.connections.Connection):  # type: ignore[misc]
        tracked_gtid = ""

        def _read_ok_packet(self) -> Any:  # COMMIT
            ok = super()._read_ok_packet()
            if ok.server_status & SESSION_STATE_CHANGED:
                self._track(ok.message)
            return ok

        def _read_query_result(self, unbuffered: bool = False) -> Any:
            n = super()._read_query_result(unbuffered)
            result = self._result
            if result is not None and result.message and result.server_status & 0x4000:
                self._track(result.message)
            return n

        def _track(self, data: bytes) -> None:
            gtid = last_gtid(data)
            if gtid:
                self.tracked_gtid = gtid

    return Tracking


def _lenenc(data: bytes, at: int) -> tuple[bytes, int]:
    n = data[at]
    if n < 0xFB:
        return data[at + 1 : at + 1 + n], at + 1 + n
    size = {0xFC: 2, 0xFD: 3, 0xFE: 8}[n]
    n = int.from_bytes(data[at + 1 : at + 1 + size], "little")
    start = at + 1 + size
    return data[start : start + n], start + n


def last_gtid(data: bytes) -> str:
    """``last_gtid`` from an OK packet's tail (info, then session state
    changes: type 0 = a system variable, name and value); '' if absent.

    >>> last_gtid(b"\\x00\\x15\\x00\\x13\\tlast_gtid\\x080-1-4006")
    '0-1-4006'
    >>> last_gtid(b""), last_gtid(b"\\x00\\x05\\x00\\x03\\x01a\\x00")
    ('', '')
    """
    try:
        _, at = _lenenc(data, 0)
        state, _ = _lenenc(data, at)
        at = 0
        while at < len(state):
            kind = state[at]
            item, at = _lenenc(state, at + 1)
            if kind == 0:
                name, rest = _lenenc(item, 0)
                if name == b"last_gtid":
                    return _lenenc(item, rest)[0].decode()
    except (IndexError, KeyError, UnicodeDecodeError):
        return ""
    return ""
