"""memcached through pymemcache's ``HashClient``: keys spread over the servers.

``HashClient`` hashes each key to one server (rendezvous hashing) and groups a
multi-get per server.  It is built here so that a failing server never moves its
keys to another one (``retry_attempts`` is effectively infinite: a server that
comes back must not serve entries that were invalidated on a stand-in while it
was away), with short timeouts, pooled connections (thread-safe), replies
awaited by default (``default_noreply=False``), and a serde that stores bytes
only (never pickle).  Errors are *not* swallowed here (no ``ignore_exc``): the
caching layer catches :attr:`MemcachedCache.errors`, counts them and reads the
database instead.  While a server is marked failing, ``HashClient`` answers its
keys with defaults for ``retry_timeout`` seconds without touching the network;
a store that reports failure that way raises :class:`CacheUnavailable`.

    >>> c = MemcachedCache([("127.0.0.1", 11211)])  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

from bagstore.cache.base import CacheUnavailable
from bagstore.errors import ConfigurationError

__all__ = ["MemcachedCache"]


class _BytesSerde:
    """Values are bytes both ways: nothing is ever pickled."""

    def serialize(self, key: Any, value: Any) -> tuple[bytes, int]:
        if not isinstance(value, bytes):
            raise TypeError(f"bagstore stores bytes in memcached, not {type(value).__name__}")
        return value, 0

    def deserialize(self, key: Any, value: bytes, flags: int) -> bytes:
        return value


class _Rendezvous:
    """Rendezvous (highest random weight) hashing of keys onto servers, like
    pymemcache's own ``RendezvousHash`` but with a C hash (blake2b) instead of its
    pure-Python murmur3, which costs tens of microseconds a key."""

    def __init__(self) -> None:
        self.nodes: list[str] = []
        self._seeds: list[bytes] = []

    def add_node(self, node: str) -> None:
        self.nodes.append(node)
        self._seeds = [n.encode() + b"\0" for n in self.nodes]

    def remove_node(self, node: str) -> None:
        self.nodes.remove(node)
        self._seeds = [n.encode() + b"\0" for n in self.nodes]

    def get_node(self, key: str | bytes) -> str | None:
        nodes = self.nodes
        if len(nodes) <= 1:
            return nodes[0] if nodes else None
        raw = key.encode() if isinstance(key, str) else key
        best, best_score = nodes[0], b""
        for node, seed in zip(nodes, self._seeds, strict=True):
            score = blake2b(seed + raw, digest_size=8).digest()
            if score > best_score:
                best, best_score = node, score
        return best


class MemcachedCache:
    """A :class:`~bagstore.cache.base.Cache` over one or more memcached servers."""

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        *,
        timeout: float = 0.2,
        connect_timeout: float = 0.2,
        retry_timeout: float = 1.0,
    ) -> None:
        try:
            from pymemcache.client.hash import HashClient
            from pymemcache.exceptions import MemcacheClientError, MemcacheError
        except ImportError:  # pragma: no cover - depends on the installation
            raise ConfigurationError(
                "a memcached:// cache needs pymemcache: pip install 'bagstore[memcached]'"
            ) from None
        if not servers:
            raise ConfigurationError("a memcached cache needs at least one host:port")
        self.servers = list(servers)
        self.name = "memcached " + ",".join(f"{h}:{p}" for h, p in self.servers)
        self.errors: tuple[type[BaseException], ...] = (
            MemcacheError,
            OSError,
            CacheUnavailable,
            KeyError,  # HashClient's failed-server bookkeeping is not thread-safe
        )
        self._client_error = MemcacheClientError
        self._client = HashClient(
            self.servers,
            hasher=_Rendezvous,
            serde=_BytesSerde(),
            connect_timeout=connect_timeout,
            timeout=timeout,
            no_delay=True,
            use_pooling=True,
            retry_attempts=sys.maxsize,
            retry_timeout=retry_timeout,
            dead_timeout=sys.maxsize,
            ignore_exc=False,
            default_noreply=False,
        )

        # One server: multi-gets go to its client directly, skipping HashClient's
        # per-key check and hashing (a third of a cached query page's time).
        # (HashClient's failure bookkeeping is private: without it, no shortcut.)
        clients = list(self._client.clients.values())
        failed = getattr(self._client, "_failed_clients", None)
        self._failed: Any = failed if isinstance(failed, dict) else None
        self._single: Any = clients[0] if len(clients) == 1 and self._failed is not None else None

    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, Any]]:
        if not keys:
            return {}
        single = self._single
        if single is not None and single.server not in self._failed:
            try:
                fast: dict[str, tuple[bytes, Any]] = single.gets_many(list(keys))
                return fast
            except OSError:
                pass  # again through HashClient, which marks the server failing
        got: dict[str, tuple[bytes, Any]] = self._client.gets_many(list(keys))
        return got

    def add_many(self, items: Mapping[str, bytes], ttl: int) -> None:
        # Fills need no reply: a refused add (a marker is there) is the point.
        for key, value in items.items():
            self._client.add(key, value, ttl, noreply=True)

    def set_many(self, items: Mapping[str, bytes], ttl: int) -> list[str]:
        if not items:
            return []
        failed = self._client.set_many(dict(items), ttl, noreply=False)
        return [str(k) for k in failed]

    def cas(self, key: str, token: Any, value: bytes, ttl: int) -> bool:
        return bool(self._client.cas(key, value, token, ttl, noreply=False))

    def bump(self, keys: Sequence[str], now_us: int, ttl: int) -> None:
        for key in keys:
            try:
                got = self._client.incr(key, 1, noreply=False)
            except self._client_error:  # not a number: garbage, start afresh
                if not self._client.set(key, str(now_us).encode(), ttl, noreply=False):
                    raise CacheUnavailable(f"could not reset revision {key}") from None
                continue
            if got is None:  # missing: start at the current time
                if self._client.add(key, str(now_us).encode(), ttl, noreply=False):
                    continue
                got = self._client.incr(key, 1, noreply=False)  # another process added it
            if got is None or got is False:
                raise CacheUnavailable(f"could not bump revision {key}")

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._client.delete(key, noreply=False)

    def close(self) -> None:
        # Not HashClient.close(): it skips a server it has marked failing,
        # leaving that server's pooled sockets open.
        for client in self._client.clients.values():
            client.close()
