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
The replies of multi-gets are parsed by bagstore (``_client_classes``), everything
else by pymemcache.

    >>> c = MemcachedCache([("127.0.0.1", 11211)])  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
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


#: Bytes asked of the socket per read while collecting a multi-get's reply.
_RECV = 65536
#: Longest key memcached takes.
_MAX_KEY = 250


@functools.cache
def _client_classes() -> tuple[type, type]:
    """``(Client, HashClient)`` subclasses whose multi-gets read the reply in
    large blocks and parse it by offsets.

    pymemcache reads a ``get`` reply a line and a value at a time in 4 KB
    reads, copying the rest of its buffer at each step and checking each key on
    its own; a cached query page (one multi-get of ~20 entities) spent about half
    its time there.  This override (``_fetch_cmd`` of ``get``/``gets``, the hook
    pymemcache's ``Client`` exposes for other ways of reading values) keeps
    pymemcache's connection, pooling, timeouts, errors and server hashing; only
    the reply's parsing is ours.  Every other command is pymemcache's own.
    """
    from pymemcache.client.base import Client
    from pymemcache.client.hash import HashClient
    from pymemcache.exceptions import (
        MemcacheIllegalInputError,
        MemcacheUnexpectedCloseError,
        MemcacheUnknownError,
    )

    class BlockClient(Client):  # type: ignore[misc]
        def _fetch_cmd(
            self, name: bytes, keys: Iterable[Any], expect_cas: bool, key_prefix: bytes = b""
        ) -> dict[Any, Any]:
            if name not in (b"get", b"gets") or key_prefix or self.allow_unicode_keys:
                return super()._fetch_cmd(name, keys, expect_cas, key_prefix)  # type: ignore[no-any-return]
            keys = list(keys)
            wanted = _checked_keys(keys, MemcacheIllegalInputError)
            cmd = b"".join((name, b" ", b" ".join(wanted), b"\r\n"))
            try:
                if self.sock is None:
                    self._connect()
                self.sock.sendall(cmd)
                return self._read_values(name, dict(zip(wanted, keys, strict=True)), expect_cas)
            except Exception:
                self.close()
                if self.ignore_exc:
                    return {}
                raise

        def _read_values(
            self, name: bytes, by_key: dict[bytes, Any], expect_cas: bool
        ) -> dict[Any, Any]:
            sock = self.sock
            # bagstore's own serde hands the bytes back as they are: not called
            deserialize = None if type(self.serde) is _BytesSerde else self.serde.deserialize
            header = _VALUE_CAS if expect_cas else _VALUE
            buf, pos = b"", 0
            out: dict[Any, Any] = {}
            while True:
                m = header.match(buf, pos)
                if m is None:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:  # the line is not all here yet
                        buf, pos = _more(sock, buf[pos:], MemcacheUnexpectedCloseError), 0
                        continue
                    line = buf[pos:end]
                    if line == b"END":
                        return out
                    self._raise_errors(line, name)
                    raise MemcacheUnknownError(line[:64])
                key, flags, size, cas = m.groups()
                start = m.end()
                stop = start + int(size)
                if len(buf) < stop + 2:
                    buf = _at_least(sock, buf[pos:], stop + 2 - pos, MemcacheUnexpectedCloseError)
                    start, stop, pos = start - pos, stop - pos, 0
                if buf[stop : stop + 2] != b"\r\n":
                    raise MemcacheUnknownError(f"a value of {int(size)} bytes not ended by CRLF")
                wanted = by_key.get(key)
                if wanted is None:
                    raise MemcacheUnknownError(f"a value for a key not asked for: {key[:64]!r}")
                value = buf[start:stop]
                if deserialize is not None:
                    value = deserialize(wanted, value, int(flags))
                out[wanted] = (value, cas) if expect_cas else value
                pos = stop + 2

    class BlockHashClient(HashClient):  # type: ignore[misc]
        client_class = BlockClient

    return BlockClient, BlockHashClient


#: The header line of one value in a ``get`` / ``gets`` reply.
_VALUE = re.compile(rb"VALUE (\S+) (\d+) (\d+)()\r\n")
_VALUE_CAS = re.compile(rb"VALUE (\S+) (\d+) (\d+) (\d+)\r\n")
#: Bytes a memcached key cannot hold: whitespace, control bytes and DEL.
_NOT_IN_KEY = bytes(range(33)) + b"\x7f"


def _checked_keys(keys: list[Any], error: type[Exception]) -> list[bytes]:
    """The keys as ASCII bytes, refused (``error``) if memcached could not take
    them: empty, over 250 bytes, not ASCII, or holding whitespace or a control byte."""
    if all(type(k) is str for k in keys):  # checked all at once, as one string
        try:
            joined = " ".join(keys).encode("ascii")
        except UnicodeEncodeError:
            joined = b""
        lengths = list(map(len, keys))
        if (
            joined
            and min(lengths) > 0
            and max(lengths) <= _MAX_KEY
            # the only bytes below 0x21 are the len(keys) - 1 separators
            and len(joined.translate(None, _NOT_IN_KEY)) == len(joined) - len(keys) + 1
        ):
            return joined.split(b" ")
    out = []
    for key in keys:
        try:
            raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
        except (UnicodeEncodeError, TypeError):
            raise error(f"not a memcached key: {key!r}") from None
        if (
            not 0 < len(raw) <= _MAX_KEY
            or not raw.isascii()
            or len(raw.translate(None, _NOT_IN_KEY)) != len(raw)
        ):
            raise error(f"not a memcached key: {key!r}")
        out.append(raw)
    return out


def _more(sock: Any, rest: bytes, closed: type[Exception]) -> bytes:
    """``rest`` and the next block read from ``sock``."""
    chunk: bytes = sock.recv(_RECV)
    if not chunk:
        raise closed()
    return rest + chunk


def _at_least(sock: Any, rest: bytes, size: int, closed: type[Exception]) -> bytes:
    """``rest`` read on until it holds ``size`` bytes: the blocks are joined once,
    not re-copied at each read (a value can be a megabyte)."""
    chunks, have = [rest], len(rest)
    while have < size:
        chunk = sock.recv(max(_RECV, size - have))
        if not chunk:
            raise closed()
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


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
            import pymemcache.client.hash  # noqa: F401 - imported here, so a missing one is told
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
        _, hash_client = _client_classes()
        self._client = hash_client(
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

    def ping(self) -> bool:
        """Whether every server stores a value now, and says so (one ``set`` on
        each, past HashClient's bookkeeping of failed servers): what the caching
        layer asks before it trusts level 2 again after a failure."""
        return all(
            client.set("bagstore:ping", b"1", 10, noreply=False) is True
            for client in self._client.clients.values()
        )

    def close(self) -> None:
        # Not HashClient.close(): it skips a server it has marked failing,
        # leaving that server's pooled sockets open.
        for client in self._client.clients.values():
            client.close()
