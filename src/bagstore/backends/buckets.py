"""Bucket ownership and bucket-wide operations (moving buckets between shards).

Every shard keeps ``bagstore_owned``: one row per bucket it holds, with a
state — ``OWNED`` (writes accepted), ``FROZEN`` (a move is copying its last
changes: writes wait), ``INCOMING`` (a move is filling this copy: writes go to
the source).  Every write checks ownership in the same statement or
transaction, so a process routing by an out-of-date placement can never write
to a shard that no longer owns the bucket: it gets ``StalePlacement`` (or
``KeyMigrating`` while the bucket is frozen), refreshes and retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bagstore.backends.chunks import by_size
from bagstore.backends.indexsql import BUCKET, CLAIMED, ENTITY_ID, IndexRow
from bagstore.errors import KeyMigrating, StalePlacement

if TYPE_CHECKING:
    from bagstore.backends.base import Dialect

__all__ = ["FROZEN", "INCOMING", "OWNED", "BucketOps", "ownership_error"]

OWNED, FROZEN, INCOMING = 0, 1, 2
STATE_NAMES = {OWNED: "owned", FROZEN: "frozen", INCOMING: "incoming"}


def ownership_error(
    shard: str, buckets: Sequence[int], states: dict[int, int]
) -> StalePlacement | KeyMigrating | None:
    """The error a write to ``buckets`` must raise given the shard's states."""
    refused = tuple(b for b in buckets if states.get(b) in (None, INCOMING))
    if refused:
        return StalePlacement(f"shard {shard} does not own bucket {refused[0]}", buckets=refused)
    for b in buckets:
        if states[b] == FROZEN:
            return KeyMigrating(f"bucket {b} is being moved; try again shortly")
    return None


class BucketOps:
    """Mixed into :class:`bagstore.backends.base.Backend`."""

    dialect: Dialect
    name: str
    max_statement_bytes: int

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        raise NotImplementedError

    def sql(self, builder: str, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def insert_ignore(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        raise NotImplementedError

    def upsert(self, table: str, key: dict[str, Any], values: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- ownership -----------------------------------------------------------------
    def claim_buckets(self, buckets: Sequence[int], state: int = OWNED) -> None:
        """Record buckets as held (unless a row for them exists)."""
        self.insert_ignore("bagstore_owned", ("bucket", "state"), [(b, state) for b in buckets])

    def set_bucket_state(self, bucket: int, state: int) -> None:
        self.upsert("bagstore_owned", {"bucket": bucket}, {"state": state})

    def release_bucket(self, bucket: int) -> None:
        d = self.dialect
        self.execute(f"DELETE FROM bagstore_owned WHERE bucket = {d.param}", [bucket])

    def bucket_states(self, buckets: Sequence[int] | None = None) -> dict[int, int]:
        d = self.dialect
        if buckets is None:
            rows = self.fetchall("SELECT bucket, state FROM bagstore_owned")
        else:
            where = f"WHERE bucket IN ({d.params(len(buckets))})"
            rows = self.fetchall(f"SELECT bucket, state FROM bagstore_owned {where}", list(buckets))
        return {int(b): int(s) for b, s in rows}

    def check_owned(self, buckets: Sequence[int]) -> None:
        """Raise StalePlacement / KeyMigrating unless every bucket is owned here."""
        wanted = sorted(set(buckets))
        error = ownership_error(self.name, wanted, self.bucket_states(wanted))
        if error is not None:
            raise error

    # -- id -> bucket lookup (kinds placed by a shard key) ---------------------------------
    def lookup_ids(self, kind: str, ids: Sequence[bytes]) -> dict[bytes, int]:
        """``{id: entity bucket}`` recorded on this shard."""
        d = self.dialect
        out: dict[bytes, int] = {}
        for start in range(0, len(ids), 500):
            part = list(ids[start : start + 500])
            rows = self.fetchall(
                "SELECT entity_id, entity_bucket FROM bagstore_ids WHERE kind = "
                f"{d.param} AND entity_id IN ({d.params(len(part))})",
                [kind, *part],
            )
            out.update({bytes(r[0]): int(r[1]) for r in rows})
        return out

    def record_ids(
        self, kind: str, rows: Sequence[tuple[bytes, int, int]], cur: Any = None
    ) -> None:
        """Record ``(id, bucket of the id, bucket of the entity)`` rows (in
        ``cur``'s transaction if given)."""
        if cur is not None:
            sql = self.sql(
                "upsert_sql",
                "bagstore_ids",
                ("kind", "entity_id"),
                ("bagstore_bucket", "entity_bucket"),
            )
            for entity_id, id_bucket, entity_bucket in rows:
                cur.execute(sql, [kind, entity_id, id_bucket, entity_bucket])
            return
        for entity_id, id_bucket, entity_bucket in rows:
            self.upsert(
                "bagstore_ids",
                {"kind": kind, "entity_id": entity_id},
                {"bagstore_bucket": id_bucket, "entity_bucket": entity_bucket},
            )

    def forget_ids(self, kind: str, ids: Sequence[bytes]) -> None:
        d = self.dialect
        for start in range(0, len(ids), 500):
            part = list(ids[start : start + 500])
            self.execute(
                f"DELETE FROM bagstore_ids WHERE kind = {d.param} "
                f"AND entity_id IN ({d.params(len(part))})",
                [kind, *part],
            )

    def bucket_id_rows(self, bucket: int) -> list[tuple[str, bytes, int]]:
        """``(kind, id, entity bucket)`` of the lookup rows in a bucket."""
        d = self.dialect
        rows = self.fetchall(
            "SELECT kind, entity_id, entity_bucket FROM bagstore_ids "
            f"WHERE bagstore_bucket = {d.param}",
            [bucket],
        )
        return [(str(r[0]), bytes(r[1]), int(r[2])) for r in rows]

    # -- bucket contents -------------------------------------------------------------
    def bucket_stamps(self, kind: str, bucket: int) -> dict[bytes, tuple[int, int]]:
        """``{id: (version, updated)}`` of every entity of ``kind`` in the bucket."""
        d = self.dialect
        rows = self.fetchall(
            f"SELECT id, version, updated FROM {d.q(kind)} WHERE bucket = {d.param}", [bucket]
        )
        return {bytes(r[0]): (int(r[1]), int(r[2])) for r in rows}

    def entity_rows(
        self, kind: str, ids: Sequence[bytes]
    ) -> list[tuple[bytes, int, int, int, bytes]]:
        """``(id, bucket, updated, version, body)`` of the ids present."""
        d = self.dialect
        out: list[tuple[bytes, int, int, int, bytes]] = []
        for start in range(0, len(ids), 500):
            part = list(ids[start : start + 500])
            out += [
                (bytes(r[0]), int(r[1]), int(r[2]), int(r[3]), bytes(r[4]))
                for r in self.fetchall(
                    f"SELECT id, bucket, updated, version, body FROM {d.q(kind)} "
                    f"WHERE id IN ({d.params(len(part))})",
                    part,
                )
            ]
        return out

    def copy_entity_rows(
        self, kind: str, rows: Sequence[tuple[bytes, int, int, int, bytes]]
    ) -> None:
        """Write rows exactly as read elsewhere (version and updated kept), 200
        a statement at most, within ``max_statement_bytes`` (large bodies: a
        MariaDB statement must fit in the server's ``max_allowed_packet``)."""
        d = self.dialect
        sizes = [len(r[4]) + 64 for r in rows]
        for chunk in by_size(rows, sizes, self.max_statement_bytes, 200):
            sql = d.copy_entities_sql(kind, len(chunk))
            self.execute(sql, [v for r in chunk for v in r])

    def delete_ids(self, kind: str, ids: Sequence[bytes]) -> int:
        d = self.dialect
        removed = 0
        for start in range(0, len(ids), 500):
            part = list(ids[start : start + 500])
            removed += self.execute(
                f"DELETE FROM {d.q(kind)} WHERE id IN ({d.params(len(part))})", part
            )
        return removed

    def bucket_index_rows(
        self, table: str, columns: Sequence[str], unique: bool, bucket: int
    ) -> dict[IndexRow, int | None]:
        """``{row: claimed}`` of every index row in the bucket (claimed for unique)."""
        d = self.dialect
        cols = (*columns, ENTITY_ID, BUCKET) + ((CLAIMED,) if unique else ())
        rows = self.fetchall(
            f"SELECT {', '.join(d.q(c) for c in cols)} FROM {d.q(table)} "
            f"WHERE {BUCKET} = {d.param}",
            [bucket],
        )
        n = len(columns)
        return {
            IndexRow(tuple(bytes(v) for v in r[:n]), bytes(r[n]), int(r[n + 1])): (
                int(r[n + 2]) if unique else None
            )
            for r in rows
        }
