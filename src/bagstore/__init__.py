"""bagstore: schema-less entities on MySQL/MariaDB and SQLite, sharded by bucket,
with secondary indexes that are added and dropped online.

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> entity_id = ds.put({"user_id": b"u1", "title": "first"})
    >>> ds.get(entity_id)["title"]
    'first'
    >>> ds.close()
"""

from __future__ import annotations

from bagstore import testing
from bagstore.cleaner import Cleaner, CleanStats
from bagstore.datastore import DataStore, Datastore, open
from bagstore.errors import (
    BackendError,
    BagstoreError,
    BagstoreIndexError,
    ConfigurationError,
    DuplicateValue,
    IndexNotReady,
    InvalidEntity,
    InvalidQuery,
    KeyMigrating,
    NoIndexForQuery,
    Retryable,
    ShardTimeout,
    ShardUnavailable,
    StalePlacement,
)
from bagstore.ids import new_id
from bagstore.index import Index
from bagstore.query import QueryResult
from bagstore.scaleout import Mover, MoveStats

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BagstoreError",
    "BagstoreIndexError",
    "CleanStats",
    "Cleaner",
    "ConfigurationError",
    "DataStore",
    "Datastore",
    "DuplicateValue",
    "Index",
    "IndexNotReady",
    "InvalidEntity",
    "InvalidQuery",
    "KeyMigrating",
    "MoveStats",
    "Mover",
    "NoIndexForQuery",
    "QueryResult",
    "Retryable",
    "ShardTimeout",
    "ShardUnavailable",
    "StalePlacement",
    "__version__",
    "new_id",
    "open",
    "testing",
]
