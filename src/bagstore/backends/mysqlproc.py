"""MariaDB's put of one entity as a stored procedure: :class:`ProcedurePuts`.

A put that needs nothing else in its transaction is one round trip on
MariaDB: the ownership check, the row lock, the clock read under it and the
upsert (``MySQLDialect.put_one_sql``).  Sent as a compound statement
(``BEGIN NOT ATOMIC ...``), the server parses and plans its statements at
every put; as a stored procedure (``MySQLDialect.put_procedure_sql``, one per
kind, named by a digest of the kind and the procedure's version) it does so
once per connection, and a put costs the server about a third less CPU
(measured on a private server: see the commit that added this module).

The procedure is created where it is first needed: a ``CALL`` that finds
none (a new shard, a bucket move's target, a replica promoted before it was
replicated there, or one an operator dropped) creates it (``CREATE PROCEDURE
IF NOT EXISTS``: binary-logged, so replicas get it too) and calls again.  A
login that may not create it (no ``CREATE ROUTINE``) or not run it (no
``EXECUTE``) makes the backend put that kind with the compound statement
from then on, as before; so does a procedure that still cannot be found
after it was created.  Nothing else changes: the same statements run in the
same order (the change feed's triggers fire on its upsert), a bucket not
owned here is the same ``NOT_OWNED`` signal, and the ``CALL``'s final OK
packet carries the commit's GTID for read-your-writes as the compound
statement's does (see backends/gtid.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from bagstore.backends.entities import EntityOps, EntityRow

__all__ = ["DENIED", "ProcedurePuts"]

log = logging.getLogger(__name__)

#: No such procedure (ER_SP_DOES_NOT_EXIST); one made meanwhile by another
#: session (ER_SP_ALREADY_EXISTS, in spite of IF NOT EXISTS).
_NO_PROCEDURE, _PROCEDURE_EXISTS = 1305, 1304
#: What a login may not do, or a definer that no longer exists: the
#: procedure cannot be created or run by this backend.
DENIED = frozenset(
    {
        1044,  # access denied to the database (no CREATE ROUTINE)
        1142,  # command denied on a table
        1227,  # needs a privilege such as SUPER
        1370,  # no EXECUTE / ALTER ROUTINE on the routine
        1419,  # binary logging: creating routines needs SUPER
        1449,  # the definer does not exist
    }
)
#: ``work``'s answers besides a row: the procedure is missing, or denied.
_MISSING, _REFUSED = object(), object()


class ProcedurePuts(EntityOps):
    """``_put_one`` through the kind's stored procedure (mixed into
    :class:`bagstore.backends.mysql.MySQLBackend`, ahead of ``Backend``)."""

    #: Kinds this backend puts with the compound statement (no procedure).
    _compound_kinds: set[str]

    if TYPE_CHECKING:

        def _code(self, exc: BaseException | None) -> int | None: ...

    def _put_one(self, kind: str, row: EntityRow, versions: dict[bytes, int] | None) -> bool:
        if kind in self._compound_kinds:
            return super()._put_one(kind, row, versions)
        # (the memo of ``self.sql``, looked up without its call)
        key = ("put_call_sql", kind, versions is not None)
        sql = self._sql_memo.get(key) or self.sql(*key)
        params = (row.id, row.bucket, row.updated, row.body)
        found = self.run(self._send_put, sql, params, self._refusal)
        if found is _MISSING and self._create_put_procedure(kind):
            found = self.run(self._send_put, sql, params, self._refusal)
        if found is _MISSING or found is _REFUSED:
            log.warning(
                "shard %s: kind %s is put without its stored procedure (%s); "
                "see backends/mysqlproc.py",
                self.name,
                kind,
                "it cannot be run" if found is _REFUSED else "it cannot be created",
            )
            self._compound_kinds.add(kind)
            return super()._put_one(kind, row, versions)
        return self._put_answered(row, found, versions)

    def _refusal(self, exc: BaseException) -> Any:
        """A ``CALL``'s error other than ``NOT_OWNED`` (see ``_send_put``):
        ``_MISSING`` (no such procedure), ``_REFUSED`` (this login may not
        run it), else raised."""
        code = self._code(exc)
        if code == _NO_PROCEDURE:
            return _MISSING
        if code in DENIED:
            return _REFUSED
        raise exc

    def _create_put_procedure(self, kind: str) -> bool:
        """Create ``kind``'s put procedure here when missing; False if this
        login may not."""

        def work(conn: Any) -> bool:
            cur = conn.cursor()
            try:
                cur.execute(self.sql("put_procedure_sql", kind))
            except self.driver_errors as exc:
                code = self._code(exc)
                if code == _PROCEDURE_EXISTS:
                    return True
                if code in DENIED:
                    return False
                raise
            finally:
                cur.close()
            return True

        with self._schema_lock:
            return self.run(work)
