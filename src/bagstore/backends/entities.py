"""Entities tables: their SQL and the statements bagstore sends to them.

:class:`EntitySQL` (in :mod:`bagstore.backends.entitysql`, mixed into
:class:`bagstore.backends.base.Dialect`) builds the text of the statements on
an entities table; :class:`EntityOps` (mixed into
:class:`bagstore.backends.base.Backend`) runs them: creating a kind's table,
reading bodies, the locked reads and writes of puts and deletes (versions,
conditional writes, work ``within`` the write's transaction), and the scans of
backfills and ``recent`` reads.  The row types are in :mod:`bagstore.backends.entityrows`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from operator import itemgetter
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from bagstore.backends.changesql import skip_sql
from bagstore.backends.chunks import by_size
from bagstore.backends.entityrows import EntityRow, Stored, entity_row, entity_rows
from bagstore.backends.entitysql import NOT_OWNED, EntitySQL
from bagstore.backends.pipeline import later
from bagstore.errors import ConfigurationError
from bagstore.versions import clock, next_version

if TYPE_CHECKING:
    from bagstore.backends.base import Dialect

__all__ = [
    "ENTITY_COLUMNS",
    "NOT_OWNED",
    "EntityOps",
    "EntityRow",
    "EntitySQL",
    "Stored",
    "Within",
    "entity_row",
    "entity_rows",
]

#: The columns every entities table has (see ``Dialect.create_entities_sql``).
ENTITY_COLUMNS = frozenset({"added_id", "id", "bucket", "updated", "version", "body"})

T = TypeVar("T")

#: ``within(cursor, {id: old body or None})``: work run inside an entity
#: write's transaction (see :meth:`Backend.put_entities`: read it with ``get``).
Within = Callable[[Any, "Mapping[bytes, bytes | None]"], None]


class EntityOps:
    """Entity-table operations; mixed into :class:`bagstore.backends.base.Backend`
    (behind ``GatedReads``, whose ``_locked_read`` it declares, see backends/gate.py)."""

    # Provided by Backend:
    dialect: Dialect
    name: str
    driver_errors: tuple[type[BaseException], ...]
    max_statement_bytes: int
    max_statement_rows: int
    _schema_lock: threading.Lock
    _ready_kinds: set[str]
    _point_sql: dict[str, str]
    _versioned_sql: dict[str, str]
    _sql_memo: dict[tuple[Any, ...], str]

    #: How ids and bodies are given to the driver in the statements that write
    #: entities: as they are here; SQLite's backend gives bytearrays (see there).
    blob: ClassVar[type[bytes] | type[bytearray]] = bytes

    # Provided by Backend and BucketOps; declared for the type checker only (a
    # stub defined here would hide BucketOps's at run time).
    if TYPE_CHECKING:

        def sql(self, builder: str, *args: Any, **kwargs: Any) -> str: ...

        def run(
            self, work: Callable[..., T], *args: Any, attempts: int = 3, replay: bool = True
        ) -> T: ...

        def transaction(self, conn: Any) -> AbstractContextManager[Any]: ...

        def write(self, work: Callable[..., T], *args: Any, replay: bool = True) -> T: ...

        def execute(self, sql: str, params: Sequence[Any] = (), *, replay: bool = True) -> int: ...

        def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

        def _executescript(self, statements: Sequence[str]) -> None: ...

        def table_columns(self, table: str) -> frozenset[str]: ...

        def check_owned(self, buckets: Sequence[int]) -> None: ...

        def bucket_states(self, buckets: Sequence[int] | None = None) -> dict[int, int]: ...

        def _locked_read(
            self,
            cur: Any,
            kind: str,
            buckets: Sequence[int],
            ids: Sequence[bytes],
            bodies: bool = True,
        ) -> list[tuple[Any, ...]]: ...

    def ensure_kind(self, kind: str) -> None:
        """Create the entities table of ``kind`` when missing (once per process).

        Raises ``ConfigurationError`` if a table of that name exists that is not
        an entities table (an index's, bagstore's own or another program's): the
        kind would write into it."""
        if kind in self._ready_kinds:
            return
        with self._schema_lock:
            if kind not in self._ready_kinds:
                self._check_entities_table(kind)
                self._executescript(self.dialect.create_entities_sql(kind))
                self._check_entities_table(kind)
                self._widen_version(kind)
                self._ready_kinds.add(kind)

    def _widen_version(self, kind: str) -> None:
        """Give a table made by an older bagstore a ``version`` column wide
        enough for :mod:`bagstore.versions` (MySQL's INT to BIGINT); nothing to
        do where every integer column is wide (SQLite)."""

    def _check_entities_table(self, kind: str) -> None:
        columns = self.table_columns(kind)
        if columns and not columns >= ENTITY_COLUMNS:
            raise ConfigurationError(
                f"kind {kind!r}: shard {self.name} holds a table {kind!r} that is not an "
                f"entities table (columns {sorted(columns)}): a kind cannot share its name with "
                "an index table or any other table (see 'Names' in docs/cleaner.md)"
            )

    def get_body(self, kind: str, entity_id: bytes) -> bytes | None:
        """One entity's encoded body on this shard, or None: one statement."""
        row = self.run(_fetchone, self.point_read_sql(kind), (entity_id,))
        return None if row is None else bytes(row[1])

    def point_read_sql(self, kind: str) -> str:
        """``select_bodies_sql(kind, 1, stamps=False)``, found by kind with one
        lookup (a point read's path is a few microseconds on SQLite)."""
        sql = self._point_sql.get(kind)
        if sql is None:
            sql = self._point_sql[kind] = self.dialect.select_bodies_sql(kind, 1, stamps=False)
        return sql

    def get_versioned(self, kind: str, entity_id: bytes) -> tuple[bytes, int] | None:
        """``(body, version)`` of one entity on this shard as it is now, or
        None: one statement (a read-modify-write's read: the body to change
        and the version its write expects)."""
        sql = self._versioned_sql.get(kind) or self.versioned_read_sql(kind)
        row = self.run(_fetchone, sql, (entity_id,))
        return None if row is None else (row[0], row[1])

    def versioned_read_sql(self, kind: str) -> str:
        """``SELECT body, version`` of one id, built once per kind."""
        sql = self._versioned_sql.get(kind)
        if sql is None:
            d = self.dialect
            sql = f"SELECT body, version FROM {d.q(kind)} WHERE id = {d.param}"
            self._versioned_sql[kind] = sql
        return sql

    def get_bodies(self, kind: str, ids: Sequence[bytes]) -> dict[bytes, Stored]:
        """``{id: Stored(body, version, updated)}`` of the ids present on this shard."""
        return {r[0]: Stored(r[1], r[2], r[3]) for r in self.read_bodies(kind, ids, stamps=True)}

    def read_bodies(
        self, kind: str, ids: Sequence[bytes], *, stamps: bool, bodies: bool = True
    ) -> list[tuple[Any, ...]]:
        """Rows ``(id, body, version, updated)`` (``(id, body)`` without
        ``stamps``, no body without ``bodies``) of the ids present on this
        shard, as the driver returns them: bytes and ints."""
        if not ids:
            return []
        sql = self.sql("select_bodies_sql", kind, len(ids), False, None, stamps, bodies)
        return self.fetchall(sql, ids)

    def _chunks(self, rows: Sequence[EntityRow]) -> Iterator[Sequence[EntityRow]]:
        """Split rows so that one statement stays under ``max_statement_bytes``."""
        if len(rows) <= self.max_statement_rows and (
            sum(map(len, map(_BODY, rows))) + 64 * len(rows) <= self.max_statement_bytes
        ):
            yield rows  # (by_size would make this one chunk)
            return
        sizes = [len(r.body) + 64 for r in rows]
        yield from by_size(rows, sizes, self.max_statement_bytes, self.max_statement_rows)

    def put_entities(
        self,
        kind: str,
        rows: Sequence[EntityRow],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
        expect: Mapping[bytes, int] | None = None,
        carried: Mapping[bytes, int] | None = None,
        refused: dict[bytes, int] | None = None,
        within: Within | None = None,
        fence: Collection[int] = (),
    ) -> dict[bytes, bytes]:
        """Upsert rows in one transaction; with ``read_old`` return the bodies
        they replaced (read in the same transaction, rows locked).
        ``versions`` (if given) is filled with each row's new version
        (:func:`bagstore.versions.next_version` of the one read under the
        row's lock), and ``stamps`` (if given) with the ``updated`` of each
        row replaced.

        Conditional writes: ``expect`` maps ids to the version each must have
        (0: no row); ``carried`` the version of an entity's copy in another
        bucket (a put that moves it there), taken as found when this shard has
        no row of the id.  If any row's condition fails, nothing is written:
        ``refused`` (required with ``expect``) gets ``{id: version found}`` of
        the rows that failed and ``{}`` is returned.  ``within(cursor, old)``,
        if given, runs in the transaction after the upsert (``old``: ``{id:
        replaced body}`` with ``read_old``, else empty; an id whose row was
        not there is not in it: read it with ``get``);
        ``fence``: more buckets whose ownership the transaction checks and
        share-locks with its rows' (those of the rows ``within`` writes
        without a fence of their own)."""

        if len(rows) == 1 and not (read_old or carried or within):
            one = rows[0]
            if not expect:
                if self._put_one(kind, one, versions):
                    return {}
            elif expect.get(one.id, 0) > 0 and self.update_if(kind, one, expect[one.id], versions):
                return {}  # one statement did it (else: the transaction finds out why not)
        old, new = self.write(
            self._write_rows, kind, rows, read_old, stamps, expect, carried, refused, within, fence,
            replay=not expect,  # (a conditional write is never run twice: Backend.run)
        )  # fmt: skip
        if versions is not None and new is not None:
            versions.update(new)
        return old

    def _write_rows(
        self,
        cur: Any,
        kind: str,
        rows: Sequence[EntityRow],
        read_old: bool,
        stamps: dict[bytes, int] | None,
        expect: Mapping[bytes, int] | None,
        carried: Mapping[bytes, int] | None,
        refused: dict[bytes, int] | None,
        within: Within | None,
        fence: Collection[int],
    ) -> tuple[dict[bytes, bytes], dict[bytes, int] | None]:
        """:meth:`put_entities`' transaction: the bodies replaced and the
        rows' new versions (None: a condition failed, nothing written).  A
        put's one row is worked on as itself (each call that builds a list
        of one costs a one-entity put on SQLite ~1-2k instructions)."""
        old: dict[bytes, bytes] = {}
        found: dict[bytes, int] = {}
        if len(rows) == 1:
            ids: Sequence[bytes] = (rows[0][0],)
            buckets = [rows[0][1], *fence]
        else:
            ids = list(map(_ID, rows))
            buckets = [*map(_BUCKET, rows), *fence]
        for r in self._locked_read(cur, kind, buckets, ids, read_old):
            found[r[0]] = r[2]
            if read_old:
                old[r[0]] = r[1]
            if stamps is not None:
                stamps[r[0]] = r[3]
        if carried:
            found = {**{i: v for i, v in carried.items() if i in ids}, **found}
        if expect:
            failed = {i: found.get(i, 0) for i, v in expect.items() if found.get(i, 0) != v}
            if failed:
                assert refused is not None, "expect needs refused"
                refused.update(failed)
                return {}, None
        # The clock is read with the rows locked (bagstore.versions):
        # once for them all, each row's version next_version's.
        now = clock()
        if found:
            new = {r.id: next_version(found.get(r.id), now) for r in rows}
        elif len(ids) == 1:  # (no row yet: next_version(None, now), the clock)
            new = {ids[0]: now}
        else:
            new = dict.fromkeys(ids, now)
        blob, memo = self.blob, self._sql_memo
        for chunk in (rows,) if len(rows) == 1 else self._chunks(rows):
            key = ("write_entities_sql", kind, len(chunk))  # (self.sql's memo, without its call)
            later(cur, memo.get(key) or self.sql(*key), _flatten(chunk, new, blob))
        if within is not None:
            within(cur, old)
        return old, new

    def _put_one(self, kind: str, row: EntityRow, versions: dict[bytes, int] | None) -> bool:
        """One entity in one statement, where the dialect has one; False if it
        has none (or the bucket came back to this shard meanwhile)."""
        sql = self.sql("put_one_sql", kind, versions is not None)
        if sql is None:
            return False
        blob = self.blob
        params = {"id": blob(row.id), "bucket": row.bucket, "updated": row.updated,
                  "body": blob(row.body)}  # fmt: skip
        return self._put_answered(row, self.run(self._send_put, sql, params), versions)

    def _send_put(
        self,
        conn: Any,
        sql: str,
        params: Any,
        refusal: Callable[[BaseException], Any] | None = None,
    ) -> Any:
        """One statement putting one entity: the version's row (``()`` if
        none is selected), None if the bucket is not owned here; the driver's
        other errors raised, or answered by ``refusal(error)`` if given."""
        cur = conn.cursor()
        try:
            try:
                cur.execute(sql, params)
            except self.driver_errors as exc:
                if NOT_OWNED in str(exc):
                    return None
                if refusal is None:
                    raise
                return refusal(exc)
            return () if cur.description is None else cur.fetchone()
        finally:
            cur.close()

    def _put_answered(self, row: EntityRow, found: Any, versions: dict[bytes, int] | None) -> bool:
        """What :meth:`_send_put`'s answer ``found`` says: True (the row's new
        version noted in ``versions``), or False if the bucket is not owned
        here (``check_owned`` raises if it is frozen or elsewhere)."""
        if found is None:
            self.check_owned([row.bucket])
            return False
        if versions is not None:
            versions[row.id] = int(found[0])
        return True

    def update_if(
        self,
        kind: str,
        row: EntityRow,
        expected: int,
        versions: dict[bytes, int] | None,
        *,
        moves: bool = True,
    ) -> bool:
        """A conditional write of one existing row that needs nothing else in
        its transaction: one ``UPDATE ... WHERE version = expected`` (its new
        version above the one it replaces, whatever the clock says).  False if
        it changed nothing (another version, no row, or a bucket not owned).
        ``moves=False``: the row's bucket is the one it has (placed by its id)."""
        new = self.update_row_if(
            kind, row.id, row.bucket, row.updated, row.body, expected, moves=moves
        )
        if not new:
            return False
        if versions is not None:
            versions[row.id] = new
        return True

    def update_row_if(
        self,
        kind: str,
        entity_id: bytes,
        bucket: int | None,
        updated: int,
        body: bytes,
        expected: int,
        *,
        moves: bool = True,
    ) -> int:
        """:meth:`update_if` of a row given by its fields (a read-modify-write
        makes no :class:`EntityRow`): the row's new version, 0 if the
        statement changed nothing.  ``moves=False``: the row keeps its bucket,
        whose ownership is checked (``bucket`` may be None where the dialect
        :attr:`~EntitySQL.fences_by_row`: the row's own is checked)."""
        new = clock()
        if new <= expected:  # (max(expected + 1, clock()) without the call)
            new = expected + 1
        blob = self.blob
        if moves:
            params = [bucket, updated, new, blob(body), blob(entity_id), expected, bucket]
        elif self.dialect.fences_by_row:
            params = [updated, new, blob(body), blob(entity_id), expected]
        else:
            params = [updated, new, blob(body), blob(entity_id), expected, bucket]
        # (the memo of ``self.sql``, looked up without its call)
        key = ("conditional_update_sql", kind, moves)
        sql = self._sql_memo.get(key) or self.sql(*key)
        return new if self.execute(sql, params, replay=False) == 1 else 0

    def delete_entities(
        self,
        kind: str,
        ids: Sequence[bytes],
        buckets: Sequence[int],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
        record: bool = True,
        expect: Mapping[bytes, int] | None = None,
        refused: dict[bytes, int] | None = None,
        within: Within | None = None,
    ) -> dict[bytes, bytes | None]:
        """Delete ids (of ``buckets``, which this shard must own); return ``{id:
        old body}`` of those that existed (the body is ``None`` unless ``read_old``).
        ``versions`` (if given) is filled with the deleted rows' versions, and
        ``stamps`` (if given) with their ``updated``.  ``expect``, ``refused``
        and ``within`` as for :meth:`put_entities` (a failed condition deletes
        nothing on this shard).  Without ``record``, the deletes leave no
        change in the kind's change feed (an entity moved to another bucket:
        its put is the change; see backends/changesql.py)."""

        def work(conn: Any) -> dict[bytes, bytes | None]:
            with self.transaction(conn) as cur:
                found: dict[bytes, bytes | None] = {}
                seen: dict[bytes, tuple[int, int]] = {}
                for r in self._locked_read(cur, kind, buckets, ids, read_old):
                    found[r[0]] = r[1] if read_old else None
                    seen[r[0]] = (r[2], r[3])
                if expect:
                    failed = {
                        i: seen[i][0] if i in seen else 0
                        for i, v in expect.items()
                        if (seen[i][0] if i in seen else 0) != v
                    }
                    if failed:
                        assert refused is not None, "expect needs refused"
                        refused.update(failed)
                        return {}
                present = list(found)
                for start in range(0, len(present), 1000):
                    part = present[start : start + 1000]
                    if not record:  # (change feed) marked unrecorded, see changesql
                        later(cur, skip_sql(self.dialect, len(part), insert=True),
                              [v for i in part for v in (kind, i)])  # fmt: skip
                    later(cur, self.sql("delete_entities_sql", kind, len(part)), part)
                    if not record:
                        later(cur, skip_sql(self.dialect, len(part), insert=False), [kind, *part])
                if within is not None:
                    within(cur, found)
            if versions is not None:
                versions.update({i: v for i, (v, _) in seen.items()})
            if stamps is not None:
                stamps.update({i: u for i, (_, u) in seen.items()})
            return found

        if not ids:
            return {}
        return self.run(work, replay=not expect)

    def read_locked(
        self, kind: str, ids: Sequence[bytes], buckets: Sequence[int]
    ) -> dict[bytes, Stored]:
        """``{id: Stored}`` of the ids present, read in a write transaction with
        their rows locked (of ``buckets``, which this shard must own): a write
        still committing is waited for, never missed."""

        if not ids:
            return {}
        rows = self.write(self._locked_read, kind, buckets, ids)
        return {r[0]: Stored(bytes(r[1]), r[2], r[3]) for r in rows}

    def scan_entities(
        self, kind: str, after_added_id: int, limit: int
    ) -> list[tuple[int, bytes, bytes, int]]:
        """``(added_id, id, body, updated)`` of the next rows after ``after_added_id``."""
        d = self.dialect
        sql = (
            f"SELECT added_id, id, body, updated FROM {d.q(kind)} WHERE added_id > {d.param} "
            f"ORDER BY added_id LIMIT {int(limit)}"
        )
        return [
            (int(r[0]), bytes(r[1]), bytes(r[2]), int(r[3]))
            for r in self.fetchall(sql, [after_added_id])
        ]

    def scan_recent(
        self, kind: str, before: tuple[int, int] | None, since: int | None, limit: int
    ) -> list[tuple[int, bytes, bytes, int]]:
        """``(added_id, id, body, updated)``, most recently updated first, strictly
        before the ``(updated, added_id)`` position, not older than ``since``."""
        d, p = self.dialect, self.dialect.param
        where, params = [], []
        if before is not None:
            where.append(f"(updated < {p} OR (updated = {p} AND added_id < {p}))")
            params += [before[0], before[0], before[1]]
        if since is not None:
            where.append(f"updated >= {p}")
            params.append(since)
        sql = (
            f"SELECT added_id, id, body, updated FROM {d.q(kind)}"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + f" ORDER BY updated DESC, added_id DESC LIMIT {int(limit)}"
        )
        return [
            (int(r[0]), bytes(r[1]), bytes(r[2]), int(r[3])) for r in self.fetchall(sql, params)
        ]

    def scan_bodies(
        self, kind: str, after_added_id: int, limit: int, *, packed: bool = False
    ) -> tuple[list[tuple[bytes, bytes]], str]:
        """A backfill's read: ``(id, body)`` of the next rows after
        ``after_added_id`` (in ``added_id`` order), and the same rows' stamps,
        read at the same moment, as :meth:`stamps_text` spells them.
        ``packed``: the server may work more to send less (a backend whose
        driver spends more per column than the server does: a flat-out
        backfill's choice, not a paced one's)."""
        rows = self.scan_entities(kind, after_added_id, limit)
        return [(r[1], r[2]) for r in rows], ",".join([f"{r[0]}:{r[3]}:{r[1].hex()}" for r in rows])

    def stamps_text(self, kind: str, after: int, last: int, *, packed: bool = False) -> str:
        """The rows with ``after < added_id <= last`` as one string,
        ``added_id:updated:id in hex`` joined by commas in ``added_id`` order:
        the same text as :meth:`scan_bodies` gave for them exactly when none of
        them changed, went or came since (``packed``: as for
        :meth:`scan_bodies`, the server may build it)."""
        d = self.dialect
        sql = (
            f"SELECT added_id, updated, id FROM {d.q(kind)} "
            f"WHERE added_id > {d.param} AND added_id <= {d.param} ORDER BY added_id"
        )
        rows = self.fetchall(sql, [after, last])
        return ",".join([f"{int(a)}:{int(u)}:{bytes(i).hex()}" for a, u, i in rows])

    def versions(self, kind: str, ids: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
        """``{id: (version, updated)}`` of the ids present."""
        if not ids:
            return {}
        d = self.dialect
        sql = f"SELECT id, version, updated FROM {d.q(kind)} WHERE id IN ({d.params(len(ids))})"
        return {bytes(r[0]): (int(r[1]), int(r[2])) for r in self.fetchall(sql, list(ids))}

    def max_added_id(self, kind: str) -> int:
        rows = self.fetchall(f"SELECT MAX(added_id) FROM {self.dialect.q(kind)}")
        return int(rows[0][0] or 0)


def _fetchone(conn: Any, sql: str, params: Sequence[Any]) -> Any:
    cur = conn.cursor()
    try:
        cur.execute(sql, params)
        return cur.fetchone()
    finally:
        cur.close()


_ID, _BUCKET, _BODY = itemgetter(0), itemgetter(1), itemgetter(3)  # EntityRow's fields


def _flatten(
    rows: Sequence[EntityRow], versions: Mapping[bytes, int], blob: Callable[[bytes], Any]
) -> list[Any]:
    out: list[Any] = []
    extend = out.extend
    for r in rows:
        extend((blob(r.id), r.bucket, r.updated, versions[r.id], blob(r.body)))
    return out
