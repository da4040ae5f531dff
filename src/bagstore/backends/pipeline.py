"""Write transactions in fewer round trips: statements whose results nobody
reads travel with the next statement that is read, and with the COMMIT.

A put of one entity and its index row on MariaDB is five statements (BEGIN,
the locked read, the upsert, the index row, COMMIT); sent one by one over
the network each waits for its answer.  Only the locked read's answer is
needed before the next statement can be written, so :class:`Pipeline` holds
BEGIN back and sends it with the locked read, and holds the writes back and
sends them with the COMMIT: two round trips.  (The server runs the
statements of one packet in order and stops at the first that fails, whose
error the driver raises; the transaction is then rolled back as before.)

It needs the connection's ``CLIENT_MULTI_STATEMENTS`` capability; values
stay bound parameters, quoted exactly as the driver quotes them for a single
statement (``cursor.mogrify``).  Where the driver spells bytes as a hex
literal and an int as its digits (PyMySQL 1.1 does), :class:`Pipeline`
spells those two itself, in one pass over the parameters: a put_many's
statements carry thousands of them, and the driver's escaping dispatches
through a few calls per value.  Any other value goes to the driver.

A backend without it (SQLite, which has no round trips to save) uses a plain
cursor, on which :func:`later` runs the statement at once.

    >>> import sqlite3
    >>> cur = sqlite3.connect(":memory:").cursor()
    >>> later(cur, "CREATE TABLE t (x)")
    >>> later(cur, "INSERT INTO t VALUES (?)", (1,))
    >>> cur.execute("SELECT x FROM t").fetchall()
    [(1,)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["MULTI_STATEMENTS", "Pipeline", "later", "transact"]

T = TypeVar("T")

#: The client capability flag of several statements in one query packet.
MULTI_STATEMENTS = 1 << 16


def later(cur: Any, sql: str, params: Sequence[Any] = ()) -> None:
    """Run ``sql`` in ``cur``'s transaction, sent whenever the transaction
    next needs an answer (at once on a plain cursor).  Only for statements
    whose row count and rows nobody reads."""
    if type(cur) is Pipeline:  # (not getattr: a plain cursor has no ``defer`` to miss)
        cur._held.append((sql, params))
    else:
        cur.execute(sql, params)


def transact(backend: Any, conn: Any, work: Callable[..., T], args: tuple[Any, ...]) -> T:
    """``work(cursor, *args)`` in a write transaction of ``backend`` on
    ``conn``, as ``Backend.transaction`` runs it, without its context
    manager (whose calls cost a put on MariaDB ~6% of bagstore's own
    instructions, the driver's apart)."""
    cur = backend._write_cursor(conn)
    try:
        backend._begin(cur)
        result = work(cur, *args)
        if isinstance(cur, Pipeline):
            cur.commit()
        else:
            conn.commit()
    except BaseException:
        backend._rollback_quietly(conn)
        raise
    finally:
        cur.close()
    return result


_SPELLS_PLAINLY: dict[type, bool] = {}


def spells_plainly(conn: Any) -> bool:
    """Whether the driver's connection quotes bytes as ``X'<hex>'`` and ints
    as their digits (so that :meth:`Pipeline.text` may spell them itself);
    asked once per connection class (bagstore connects with the driver's
    own converters)."""
    known = _SPELLS_PLAINLY.get(type(conn))
    if known is None:
        escape = getattr(conn, "escape", None)
        try:
            known = escape is not None and (
                escape(b"\x00'\\") == "X'00275c'" and escape(-12) == "-12" and escape(7) == "7"
            )
        except Exception:
            known = False
        _SPELLS_PLAINLY[type(conn)] = known
    return known


class Pipeline:
    """A DB-API cursor of a write transaction that holds back deferred
    statements (:meth:`defer`) until the next :meth:`execute` or
    :meth:`commit`, then sends them all in one packet."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur
        self._held: list[tuple[str, Sequence[Any]]] = []
        conn = getattr(cur, "connection", None)
        self._escape = conn.escape if conn is not None and spells_plainly(conn) else None

    def text(self, sql: str, params: Sequence[Any] = ()) -> str:
        """``sql`` with ``params`` bound, as ``cursor.mogrify`` spells it."""
        return self.joined([(sql, params)])

    def joined(self, parts: Sequence[tuple[str, Sequence[Any]]]) -> str:
        """The statements ``(sql, params)`` bound (as :meth:`text`) and joined
        by ``"; "``, the text made in one go where each ``%`` of a statement
        is a parameter's (no held statement's text copied again into the
        packet's: a put_many's is ~1 KB an entity)."""
        escape = self._escape
        if escape is None:
            return "; ".join([sql if not p else str(self.cur.mogrify(sql, p)) for sql, p in parts])
        if len(parts) == 1 and not parts[0][1]:
            return parts[0][0]
        templates: list[str] = []
        values: list[Any] = []
        for sql, params in parts:
            if not params:
                templates.append(sql.replace("%", "%%"))
            elif sql.count("%") == len(params):  # (each a %s, bound with the others)
                templates.append(sql)
                values += params
            else:  # a literal %, or a wrong count: the driver's, on its own
                templates.append(str(self.cur.mogrify(sql, params)).replace("%", "%%"))
        try:
            return "; ".join(templates) % tuple(
                [
                    f"X'{v.hex()}'" if type(v) is bytes else str(v) if type(v) is int else escape(v)
                    for v in values
                ]
            )
        except TypeError:  # (a mark other than %s): the driver's, statement by statement
            return "; ".join([sql if not p else str(self.cur.mogrify(sql, p)) for sql, p in parts])

    def defer(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._held.append((sql, params))

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Send the held statements and ``sql``; the cursor then holds ``sql``'s
        result (rows, row count)."""
        if not self._held:
            return int(self.cur.execute(self.text(sql, params)))
        held = len(self._held)
        text = self.joined([*self._held, (sql, params)])
        self._held = []
        self.cur.execute(text)
        for _ in range(held):
            self.cur.nextset()
        return int(self.cur.rowcount)

    def commit(self) -> None:
        """Send the held statements and COMMIT in one packet."""
        text = self.joined([*self._held, ("COMMIT", ())])
        self._held = []
        self.cur.execute(text)
        while self.cur.nextset():
            pass

    @property
    def rowcount(self) -> int:
        return int(self.cur.rowcount)

    def fetchone(self) -> Any:
        return self.cur.fetchone()

    def fetchall(self) -> Any:
        return self.cur.fetchall()

    def close(self) -> None:
        self._held = []  # never sent: a transaction rolled back drops them
        self.cur.close()
