"""A shard's ownership gate: one row whose token changes with any change of
``bagstore_owned``, so that a write of many buckets checks one row, not one
a bucket.

Every write transaction checks that its shard owns, and accepts writes in,
each bucket it writes (see :mod:`bagstore.backends.buckets`), share-locking
their ownership rows so that no move can freeze or release them before it
commits.  For a ``put_many`` of 500 entities that is some 400 rows looked
up and locked in its first statement, about a tenth of the batch's time on
MariaDB.

Each shard also keeps ``bagstore_gate``: one row holding a ``token``, and
triggers on ``bagstore_owned`` that give the token a new random value in the
same transaction as every insert, update and delete of an ownership row, by
whatever writes it (a bucket move, an operator's SQL, a process of an older
bagstore).  A write of :data:`GATED_FROM` buckets or more share-locks the
gate row instead of the buckets' rows.  While it holds that lock no
ownership row can change (the change's trigger waits for the gate row, and
the change cannot commit before its trigger has run), so if the token is the
one under which this backend last read those buckets' ownership rows, they
are still as read then.  The backend keeps, for the last token it saw, the
states it read under it; a bucket it has not read under the token it finds
is read (and share-locked) in the same transaction, as before the gate.

The token is random rather than a counter: after a failover to a replica
that had not received the last change, the next change would give a
counter's old value a new meaning, and a cache keyed by it would be wrong.

A change of ownership takes its bucket's row and then the gate's; a gated
writer that must read rows takes the gate's and then the buckets'.  The two
can deadlock (only while a writer reads rows it had not seen under a new
token); InnoDB rolls one back and both are run again, as every deadlock is.

A login that may not create triggers (MariaDB: no ``TRIGGER`` privilege, or
binary logging without SUPER) uses the gate if another login made it, and
otherwise gets none: its writes check each bucket's row as before, and a
warning says so when the store is opened.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from bagstore.backends.buckets import OWNED, ownership_error
from bagstore.backends.mysqlproc import DENIED
from bagstore.errors import BackendError, StalePlacement

if TYPE_CHECKING:
    from bagstore.backends.base import Backend, Dialect

__all__ = ["GATED_FROM", "TRIGGERS", "GatedReads", "ensure_gate", "gate_sql"]

log = logging.getLogger(__name__)

#: Writes of at least this many buckets check the gate; fewer check their
#: buckets' rows, which costs no more and holds no lock that every move of
#: the shard must wait for.
GATED_FROM = 3

#: The triggers that change the token, on insert, update and delete.
TRIGGERS = ("bagstore_gate_i", "bagstore_gate_u", "bagstore_gate_d")


def gate_sql(d: Dialect) -> tuple[str, list[str]]:
    """The gate's table; the triggers that change its token (an update only
    when it changes the row: MariaDB fires update triggers for an
    ``INSERT ... ON DUPLICATE KEY UPDATE`` of a row as it was)."""
    changed = "NEW.bucket <> OLD.bucket OR NEW.state <> OLD.state"
    if d.name == "mysql":
        bump = "UPDATE bagstore_gate SET token = FLOOR(RAND() * 9007199254740992) WHERE one = 1"
        bodies = [f"FOR EACH ROW {bump}",
                  f"FOR EACH ROW BEGIN IF {changed} THEN {bump}; END IF; END"]  # fmt: skip
    else:
        bump = "BEGIN UPDATE bagstore_gate SET token = random() WHERE one = 1; END"
        bodies = [bump, f"WHEN {changed} {bump}"]
    table = (
        "CREATE TABLE IF NOT EXISTS bagstore_gate "
        "(one INTEGER NOT NULL PRIMARY KEY, token BIGINT NOT NULL)"
    )
    return table, [
        f"CREATE TRIGGER IF NOT EXISTS {name} AFTER {event} ON bagstore_owned {body}"
        for name, event, body in zip(TRIGGERS, ("INSERT", "UPDATE", "DELETE"),
                                     (bodies[0], bodies[1], bodies[0]), strict=True)
    ]  # fmt: skip


def ensure_gate(backend: Backend) -> bool:
    """Create the shard's gate when missing; whether its writes may use it
    (False: this login may not create triggers)."""
    table, triggers = gate_sql(backend.dialect)
    backend._executescript([table])
    backend.insert_ignore("bagstore_gate", ("one", "token"), [(1, 0)])
    try:
        backend._executescript(triggers)
    except BackendError as exc:
        cause = exc.__cause__
        code = cause.args[0] if cause is not None and cause.args else None
        if type(exc) is not BackendError or code not in DENIED:
            raise
        # (a login that may not create triggers may find them made by another)
        made = backend.fetchall(
            "SELECT COUNT(*) FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE() "
            f"AND TRIGGER_NAME IN ({backend.dialect.params(len(TRIGGERS))})",
            TRIGGERS,
        )
        if int(made[0][0]) == len(TRIGGERS):
            return True
        log.warning(
            "shard %s: no ownership gate (%s): writes of many buckets check each bucket's "
            "ownership row; see backends/gate.py",
            backend.name,
            cause,
        )
        return False
    return True


class GatedReads:
    """``_locked_read``, through the gate where it has one (mixed into
    :class:`bagstore.backends.base.Backend`, ahead of ``EntityOps``)."""

    # Provided by Backend:
    name: str
    blob: ClassVar[type[bytes] | type[bytearray]]
    _sql_memo: dict[tuple[Any, ...], str]
    #: Whether this shard has its gate (set by ``Backend.stamp``).
    gated: bool = False
    #: The last token seen, and the ownership states read under it.
    _gate_seen: tuple[int, dict[int, int]] | None = None

    if TYPE_CHECKING:

        def sql(self, builder: str, *args: Any, **kwargs: Any) -> str: ...

        def bucket_states(self, buckets: Sequence[int] | None = None) -> dict[int, int]: ...

    def _locked_read(
        self,
        cur: Any,
        kind: str,
        buckets: Sequence[int],
        ids: Sequence[bytes],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        """Inside a write transaction: make sure that this shard owns the
        buckets and that they stay so until the transaction ends (raise
        unless it owns them all); lock the rows of ``ids`` and return them as
        ``(id, body, version, updated)`` (the body None unless ``bodies``).
        One statement for up to 1,000 buckets and 1,000 ids, or for the gate
        and up to 1,000 ids."""
        if len(buckets) == 2:  # (a put's: the entity's bucket and its index row's)
            a, b = buckets
            wanted = [a] if a == b else [a, b] if a < b else [b, a]
        else:
            wanted = sorted(set(buckets))
        gated = self.gated and len(wanted) >= GATED_FROM
        short, token = False, None
        found: list[tuple[Any, ...]] = []
        answers: Iterable[tuple[int, Sequence[tuple[Any, ...]]]]
        if len(ids) == 1 and len(wanted) < GATED_FROM:  # (a put's: one statement, no chunks)
            key = ("locked_read_sql", kind, len(wanted), 1, bodies)
            cur.execute(self._sql_memo.get(key) or self.sql(*key), [*wanted, self.blob(ids[0])])
            rows = cur.fetchall()
            if not rows:  # no row yet, and every bucket owned (no count row: not short)
                return found
            answers = ((len(wanted), rows),)
        else:
            answers = self._locked_reads(cur, kind, wanted, ids, bodies, gated)
        # int(): a UNION's integer column may come back as DECIMAL (see
        # ``EntitySQL.null_version``).  A count row may be left out when the
        # count is whole (``EntitySQL.count_when_short``).
        for counted, rows in answers:
            for r in rows:
                if r[0] is not None:
                    found.append((r[0], r[1], int(r[2]), int(r[3])))
                elif gated:
                    token = int(r[3])
                elif int(r[3]) != counted:
                    short = True
        if gated:
            self._check_gated(cur, wanted, token)
        elif short:  # not all held: which buckets, and why
            error = ownership_error(self.name, wanted, self.bucket_states(wanted))
            raise error or StalePlacement(  # one became owned since: not locked here
                f"shard {self.name}: a bucket's ownership changed during a write",
                buckets=tuple(wanted),
            )
        return found

    def _locked_reads(
        self,
        cur: Any,
        kind: str,
        wanted: list[int],
        ids: Sequence[bytes],
        bodies: bool,
        gated: bool,
    ) -> Iterator[tuple[int, Sequence[tuple[Any, ...]]]]:
        """The statements of :meth:`_locked_read`, 1,000 buckets and 1,000 ids
        at most each: for each, how many buckets it counts and its rows."""
        blob, memo = self.blob, self._sql_memo
        for start in range(0, max(1 if gated else len(wanted), len(ids)), 1000):
            if gated:
                some: Sequence[int] = ()
            else:
                some = wanted[start : start + 1000] if start or len(wanted) > 1000 else wanted
            part = ids[start : start + 1000] if start or len(ids) > 1000 else ids
            if gated and not start:
                key: tuple[Any, ...] = ("gated_read_sql", kind, len(part), bodies)
            else:  # (the memo of ``self.sql``, looked up without its call)
                key = ("locked_read_sql", kind, len(some), len(part), bodies)
            cur.execute(memo.get(key) or self.sql(*key), [*some, *map(blob, part)])
            yield len(some), cur.fetchall()

    def _check_gated(self, cur: Any, wanted: list[int], token: int | None) -> None:
        """With the gate row share-locked at ``token`` (None: the row is
        missing), raise unless every bucket of ``wanted`` is owned here."""
        seen = self._gate_seen
        if seen is None or seen[0] != token or token is None:
            seen = (token or 0, {})
        states = seen[1]
        unknown = [b for b in wanted if b not in states]
        if unknown:
            for start in range(0, len(unknown), 1000):
                part = unknown[start : start + 1000]
                cur.execute(self.sql("locked_states_sql", len(part)), part)
                states.update({int(b): int(s) for b, s in cur.fetchall()})
            if token is not None:
                self._gate_seen = seen
        if any(states.get(b) != OWNED for b in wanted):
            error = ownership_error(self.name, wanted, states)
            assert error is not None
            raise error
