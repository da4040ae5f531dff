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

import logging

from bagstore import testing
from bagstore.changes import Change, ChangePage
from bagstore.cleaner import Cleaner, CleanStats
from bagstore.codec import MAX_BODY_BYTES
from bagstore.datastore import DataStore, Datastore, open
from bagstore.errors import (
    BackendError,
    BagstoreError,
    BagstoreIndexError,
    ChangesLost,
    ChangesPruned,
    ConfigurationError,
    Conflict,
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
from bagstore.subscriber import Subscriber
from bagstore.tables import Model, RowMissing, Rows, Table, auto_id

__version__ = "0.1.0"

# The library logs under "bagstore.<module>" and prints nothing; an application
# that configures no logging sees nothing (docs/configuration.md, "Logging").
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "MAX_BODY_BYTES",
    "BackendError",
    "BagstoreError",
    "BagstoreIndexError",
    "Change",
    "ChangePage",
    "ChangesLost",
    "ChangesPruned",
    "CleanStats",
    "Cleaner",
    "ConfigurationError",
    "Conflict",
    "DataStore",
    "Datastore",
    "DuplicateValue",
    "Index",
    "IndexNotReady",
    "InvalidEntity",
    "InvalidQuery",
    "KeyMigrating",
    "Model",
    "MoveStats",
    "Mover",
    "NoIndexForQuery",
    "QueryResult",
    "Retryable",
    "RowMissing",
    "Rows",
    "ShardTimeout",
    "ShardUnavailable",
    "StalePlacement",
    "Subscriber",
    "Table",
    "__version__",
    "auto_id",
    "new_id",
    "open",
    "testing",
]
