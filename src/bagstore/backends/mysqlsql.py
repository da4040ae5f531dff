"""MariaDB / MySQL statement text: :class:`MySQLDialect`.

Tables are InnoDB with ``utf8mb4_bin`` (text compares as bytes); bytes are
bound parameters (``%s``); a ``UNION ALL``'s parts are each in parentheses, so
that each may carry its own ``ORDER BY``, ``LIMIT`` or lock clause.  The
connections, their timeouts and the driver quirks are in ``mysql.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import ClassVar

from bagstore.backends.base import Dialect, check_identifier
from bagstore.backends.entitysql import NOT_OWNED
from bagstore.backends.seqsql import MySQLSequenceSQL, SequenceSQL

__all__ = ["PUT_PROCEDURE_VERSION", "MySQLDialect", "put_procedure_name"]

#: The ``added_id:updated:id`` text of ``Backend.stamps_text``, built by the server.
_STAMPS = (
    "GROUP_CONCAT(added_id, ':', updated, ':', LOWER(HEX(id)) ORDER BY added_id SEPARATOR ',')"
)

_ENGINE = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"


class MySQLDialect(Dialect):
    #: Statement builders for id sequences (backends/seqsql.py).
    sequences: ClassVar[SequenceSQL] = MySQLSequenceSQL()
    name: ClassVar[str] = "mysql"
    param: ClassVar[str] = "%s"
    quote_char: ClassVar[str] = "`"
    for_update: ClassVar[str] = " FOR UPDATE"
    share_lock: ClassVar[str] = " LOCK IN SHARE MODE"
    upsert_on_id: ClassVar[str] = "ON DUPLICATE KEY UPDATE"
    greatest: ClassVar[str] = "GREATEST"
    begin_write: ClassVar[str] = "BEGIN"
    count_when_short: ClassVar[bool] = True
    null_version: ClassVar[str] = "CAST(NULL AS UNSIGNED)"
    key_type: ClassVar[str] = "VARBINARY(255)"
    id_type: ClassVar[str] = "BINARY(16)"
    int_type: ClassVar[str] = "INT UNSIGNED"
    bigint_type: ClassVar[str] = "BIGINT"

    def create_catalog_sql(self) -> list[str]:
        return [
            "CREATE TABLE IF NOT EXISTS bagstore_meta "
            f"(name VARCHAR(64) NOT NULL PRIMARY KEY, value TEXT NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_shards "
            f"(shard_no INT NOT NULL PRIMARY KEY, name VARCHAR(512) NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_buckets "
            f"(bucket INT NOT NULL PRIMARY KEY, shard_no INT NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_indexes (name VARCHAR(64) NOT NULL PRIMARY KEY, "
            "kind VARCHAR(64) NOT NULL, definition TEXT NOT NULL, state VARCHAR(16) NOT NULL, "
            f"changed BIGINT NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_checkpoints "
            f"(name VARCHAR(191) NOT NULL PRIMARY KEY, value BIGINT NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_kinds (kind VARCHAR(64) PRIMARY KEY, "
            f"shard_key VARCHAR(64) NOT NULL, shard_map VARCHAR(16) NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_moves (bucket INT NOT NULL PRIMARY KEY, "
            f"source INT NOT NULL, target INT NOT NULL, phase VARCHAR(16) NOT NULL) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_directory (kind VARCHAR(64) NOT NULL, "
            "skey VARBINARY(255) NOT NULL, bucket INT NOT NULL, state INT NOT NULL, "
            f"PRIMARY KEY (kind, skey)) {_ENGINE}",
            "CREATE TABLE IF NOT EXISTS bagstore_bucket_keys (kind VARCHAR(64) NOT NULL, "
            f"bucket INT NOT NULL, n BIGINT NOT NULL, PRIMARY KEY (kind, bucket)) {_ENGINE}",
        ]

    def insert_ignore_sql(self, table: str, columns: Sequence[str], rows: int = 1) -> str:
        # ON DUPLICATE KEY UPDATE a no-op rather than INSERT IGNORE, which would
        # also turn truncation and other real errors into warnings.
        cols = ", ".join(self.q(c) for c in columns)
        values = ", ".join([f"({self.params(len(columns))})"] * rows)
        first = self.q(columns[0])
        return (
            f"INSERT INTO {self.q(table)} ({cols}) VALUES {values} "
            f"ON DUPLICATE KEY UPDATE {first} = {first}"
        )

    def union_all_sql(self, parts: Sequence[str]) -> str:
        # Each part in parentheses: it may have its own ORDER BY, LIMIT or lock clause.
        return " UNION ALL ".join(f"({p})" for p in parts)

    # Each part with its own ORDER BY and LIMIT, in parentheses (cheaper than
    # derived tables, which MariaDB materialises before the union): MariaDB
    # reads a UNION's parts whole before the ORDER BY of the whole.
    limit_union_parts = True

    def create_secondary_sql(self, table: str, name: str, columns: Sequence[str]) -> list[str]:
        cols = ", ".join(self.q(c) for c in columns)
        # MariaDB knows IF NOT EXISTS for indexes; MySQL 8 does not (it would fail
        # on a second run), so bagstore's MySQL tables declare keys inline instead.
        return [f"CREATE INDEX IF NOT EXISTS {self.q(name)} ON {self.q(table)} ({cols})"]

    def upsert_sql(self, table: str, key: Sequence[str], values: Sequence[str]) -> str:
        cols = [*key, *values]
        sets = ", ".join(f"{self.q(c)} = VALUES({self.q(c)})" for c in values)
        return (
            f"INSERT INTO {self.q(table)} ({', '.join(self.q(c) for c in cols)}) "
            f"VALUES ({self.params(len(cols))}) ON DUPLICATE KEY UPDATE {sets}"
        )

    def scan_bodies_sql(self, kind: str, limit: int) -> str:
        """``(id, body)`` of the next ``limit`` rows, and one more row ``(NULL,
        their stamps)`` (see ``Backend.scan_bodies``), in one statement."""
        t = self.q(kind)
        nxt = f"FROM {t} WHERE added_id > %s ORDER BY added_id LIMIT {int(limit)}"
        return (
            f"(SELECT id, body {nxt}) UNION ALL "
            f"(SELECT NULL, {_STAMPS} FROM (SELECT added_id, updated, id {nxt}) AS s)"
        )

    def stamps_text_sql(self, kind: str) -> str:
        return f"SELECT {_STAMPS} FROM {self.q(kind)} WHERE added_id > %s AND added_id <= %s"

    def create_entities_sql(self, kind: str) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {self.q(kind)} ("
            " added_id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,"
            " id BINARY(16) NOT NULL,"
            " bucket INT UNSIGNED NOT NULL,"
            " updated BIGINT NOT NULL,"
            " version BIGINT UNSIGNED NOT NULL DEFAULT 1,"
            " body MEDIUMBLOB NOT NULL,"
            " PRIMARY KEY (added_id),"
            " UNIQUE KEY id (id),"
            " KEY bucket (bucket, added_id),"
            f" KEY updated (updated)) {_ENGINE}"
        ]

    def create_index_table_sql(self, table: str, columns: Sequence[str], unique: bool) -> list[str]:
        defs, key = self._index_table_parts(columns, unique)
        return [
            f"CREATE TABLE IF NOT EXISTS {self.q(table)} ({defs}, {key}, "
            "KEY bagstore_bucket (bagstore_bucket), "
            f"KEY entity_id (entity_id)) {_ENGINE}"
        ]

    def fenced_insert_sql(
        self, table: str, columns: Sequence[str], rows: int, *, ignore: bool
    ) -> str:
        t = self.q(table)
        cols = ", ".join(self.q(c) for c in columns)
        sql = f"INSERT INTO {t} ({cols}) {self._fenced_select(columns, rows)}"
        if ignore:
            first = f"{t}.{self.q(columns[0])}"
            sql += f" ON DUPLICATE KEY UPDATE {first} = {first}"
        return sql

    def excluded(self, column: str) -> str:
        return f"VALUES({column})"

    def widen_version_sql(self, kind: str) -> list[str]:
        return [f"ALTER TABLE {self.q(kind)} MODIFY version BIGINT UNSIGNED NOT NULL DEFAULT 1"]

    def put_one_sql(self, kind: str, returning: bool = True) -> str | None:
        # MariaDB's compound statement: the ownership check, the row lock, the
        # clock read under it (the server's: SYSDATE is the time it is
        # evaluated, unlike NOW, the statement's start; the session's time
        # zone is UTC, see INIT_COMMAND) and the upsert, in one round trip.
        # The version comes back only if asked for (a result set costs the
        # driver more than the rest of the statement's answer), and a bucket
        # not owned here is signalled (NOT_OWNED).  The same work as a stored
        # procedure costs the server less: see put_procedure_sql.
        names = ("%(id)s", "%(bucket)s", "%(updated)s", "%(body)s")
        select = "SELECT v; " if returning else ""
        return f"BEGIN NOT ATOMIC {self._put_one_body(kind, names, select)}"

    def _put_one_body(self, kind: str, names: Sequence[str], select: str) -> str:
        """The statements of :meth:`put_one_sql` (after its ``BEGIN``), the
        values spelled ``names`` (id, bucket, updated, body); ``select``: what
        returns the version ``v`` after the commit ('': nothing)."""
        t = self.q(kind)
        i, b, u, body = names
        return (
            "DECLARE v BIGINT DEFAULT NULL; DECLARE st INT DEFAULT NULL; "
            "START TRANSACTION; "
            f"SELECT state INTO st FROM bagstore_owned WHERE bucket = {b}{self.share_lock}; "
            f"IF st = 0 THEN SELECT version INTO v FROM {t} WHERE id = {i}{self.for_update}; "
            "SET v = GREATEST(IFNULL(v + 1, 0), "
            "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)); "
            f"INSERT INTO {t} (id, bucket, updated, version, body) "
            f"VALUES ({i}, {b}, {u}, v, {body}) "
            "ON DUPLICATE KEY UPDATE bucket = VALUES(bucket), updated = VALUES(updated), "
            f"version = VALUES(version), body = VALUES(body); COMMIT; {select}"
            f"ELSE ROLLBACK; SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{NOT_OWNED}'; "
            "END IF; END"
        )

    def put_procedure_sql(self, kind: str) -> str:
        """``CREATE PROCEDURE`` of :meth:`put_one_sql`'s work as a stored
        procedure of the kind (backends/mysqlproc.py): ``(id, bucket, updated,
        body, returning)``, the version selected if ``returning``.  The server
        parses and plans its statements once per connection, not at every
        put.  ``SQL SECURITY INVOKER``: the caller's privileges, whoever
        created it (no definer to outlive)."""
        names = ("p_id", "p_bucket", "p_updated", "p_body")
        check_identifier(kind, "kind")  # (named in the comment, a string literal)
        return (
            f"CREATE PROCEDURE IF NOT EXISTS {self.q(put_procedure_name(kind))} "
            "(IN p_id BINARY(16), IN p_bucket INT, IN p_updated BIGINT, IN p_body LONGBLOB, "
            "IN p_returning BOOLEAN) MODIFIES SQL DATA SQL SECURITY INVOKER "
            f"COMMENT 'bagstore: the put of one entity of kind {kind} (made again if dropped)' "
            f"BEGIN {self._put_one_body(kind, names, 'IF p_returning THEN SELECT v; END IF; ')}"
        )

    def put_call_sql(self, kind: str, returning: bool) -> str:
        """The ``CALL`` of the kind's procedure (:meth:`put_procedure_sql`);
        parameters: id, bucket, updated, body."""
        return f"CALL {self.q(put_procedure_name(kind))}(%s, %s, %s, %s, {int(returning)})"


#: The version of the put procedure's text: a change to it takes a new name,
#: so that a store opened by a newer bagstore creates its own beside the old.
PUT_PROCEDURE_VERSION = 1


def put_procedure_name(kind: str) -> str:
    """The name of ``kind``'s put procedure: a digest of the kind, as the
    change feed's triggers are named (a kind may be 64 characters long).

    >>> put_procedure_name("posts")
    'bagstore_put_11ac81f3726ea4c7_1'
    """
    digest = hashlib.blake2b(kind.encode(), digest_size=8).hexdigest()
    return f"bagstore_put_{digest}_{PUT_PROCEDURE_VERSION}"
