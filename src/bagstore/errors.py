"""The whole bagstore exception tree.

Every error bagstore raises derives from :class:`BagstoreError`::

    BagstoreError
      ConfigurationError              bad URL or config file, shards that do not match the catalog
      Conflict                        a conditional write found another version: nothing written
      InvalidEntity                   bad entity: not a dict, bad id, unencodable value, too big
      InvalidQuery                    unknown lookup, bad filter value, bad cursor
        ChangesPruned                 a change feed position older than the changes kept
          ChangesLost                 a change feed position from before a failover
      BagstoreIndexError
        IndexNotReady                 the index that would answer is still building (or retired)
        NoIndexForQuery               no declared index can answer; names the one that would
      BackendError                    wraps the driver's error (``raise ... from exc``)
        ShardUnavailable              the shard's server cannot be reached
        ShardTimeout                  the shard did not answer in time (lock wait, timeout):
                                      a write may or may not have been applied
        DuplicateValue                a unique index already holds the value
      Retryable                       the operation may succeed if simply tried again
        KeyMigrating                  the key's bucket is being moved or migrated
        StalePlacement                this process's placement was out of date

Bad input (``InvalidEntity``, ``InvalidQuery``) is always raised before anything is
written: nothing stored changes.  Driver exceptions are translated in one place,
:func:`bagstore.backends.base.translate_errors`.

    >>> import bagstore
    >>> try:
    ...     bagstore.open(":memory:").put("not a dict")  # doctest: +SKIP
    ... except bagstore.InvalidEntity as exc:
    ...     print(exc)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BackendError",
    "BagstoreError",
    "BagstoreIndexError",
    "ChangesLost",
    "ChangesPruned",
    "ConfigurationError",
    "Conflict",
    "DuplicateValue",
    "IndexNotReady",
    "InvalidEntity",
    "InvalidQuery",
    "KeyMigrating",
    "NoIndexForQuery",
    "Retryable",
    "ShardTimeout",
    "ShardUnavailable",
    "StalePlacement",
]


class BagstoreError(Exception):
    """Root of every exception bagstore raises."""


class ConfigurationError(BagstoreError):
    """The datastore was configured wrongly (URL, config file, shard list, names)."""


class Conflict(BagstoreError):
    """A conditional write (``expect_version``) found another version stored.

    ``id`` is a refused entity's id and ``found`` the version it has (0: no
    entity); ``refused`` maps every refused id to its version found, and
    ``written`` lists the ids of the call that were written (a ``put_many``
    writes the shards where every condition held).  A refused entity is left
    exactly as it was."""

    def __init__(
        self,
        message: str,
        *,
        id: bytes,
        found: int,
        refused: dict[bytes, int] | None = None,
        written: list[bytes] | None = None,
    ) -> None:
        super().__init__(message)
        self.id = id
        self.found = found
        self.refused = refused if refused is not None else {id: found}
        self.written = written or []


class InvalidEntity(BagstoreError, ValueError):
    """An entity that cannot be stored. Nothing was written."""


class InvalidQuery(BagstoreError, ValueError):
    """A query that cannot be run as asked: unknown lookup, bad value, bad cursor."""


class ChangesPruned(InvalidQuery):
    """A change feed cursor or consumer is behind the changes kept: retention
    deleted changes it had not read (reset the consumer, or read from the start).
    ``bucket``: the bucket found so, when one was."""

    def __init__(self, message: str, *, bucket: int | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket


class ChangesLost(ChangesPruned):
    """A change feed cursor or consumer position from before a failover that
    may have lost committed writes (the feed's epoch moved on): changes it had
    not read may be gone and their positions reused (reset the consumer)."""


class BagstoreIndexError(BagstoreError):
    """A query cannot be served by an index in its current state."""


class IndexNotReady(BagstoreIndexError):
    """The index that would answer is still ``building`` (or ``retired``).

    ``index.get_all(..., allow_partial=True)`` reads a building index anyway.
    """

    def __init__(self, message: str, *, index: str = "", state: str = "") -> None:
        super().__init__(message)
        self.index = index
        self.state = state


class NoIndexForQuery(BagstoreIndexError):
    """No index can answer the query; ``suggestion`` describes one that would
    (``Index(...)``), ``index`` is that :class:`~bagstore.Index` (None when not
    known) and ``command`` the ``bagstore index add ...`` line that registers it."""

    def __init__(
        self, message: str, *, suggestion: str = "", index: Any = None, command: str = ""
    ) -> None:
        super().__init__(message)
        self.suggestion = suggestion
        self.index = index
        self.command = command


class BackendError(BagstoreError):
    """A storage backend failed; ``__cause__`` holds the driver's exception."""

    def __init__(self, message: str, *, shard: str = "") -> None:
        super().__init__(message)
        self.shard = shard


class ShardUnavailable(BackendError):
    """The shard's server cannot be reached (refused, gone away, lost connection)."""


class ShardTimeout(BackendError):
    """The shard did not answer in time: a lock wait timeout, a locked SQLite
    file, no free connection, or a server that did not answer within the
    timeouts (docs/configuration.md).

    When a statement's answer did not come, its connection is closed and the
    outcome is unknown: **a write may or may not have been applied** (its
    commit may have reached the server).  bagstore never retries such a write
    by itself; read the entity back before writing it again.  A new connection
    that timed out sent nothing.  A conditional write (``expect_version``,
    ``update``) whose connection was lost raises it too, for the same doubt
    (docs/consistency.md).
    """


class DuplicateValue(BackendError):
    """A unique index already holds this value for another entity. Nothing was written."""


class Retryable(BagstoreError):
    """The operation did not happen, and may succeed if tried again shortly."""


class KeyMigrating(Retryable):
    """The key (or its bucket) is being moved; writes to it are refused for now."""


class StalePlacement(Retryable):
    """This process routed by an out-of-date placement; it refreshes and retries.

    ``buckets``: the buckets the shard refused (empty when not known)."""

    def __init__(self, message: str = "", *, buckets: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.buckets = buckets
