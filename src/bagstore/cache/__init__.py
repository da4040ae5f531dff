"""The cache: level 1 per request, level 2 on memcached, Redis or in process.

``Datastore(..., cache=URL)`` takes one of::

    "memcached://h1:11211,h2:11211"   pymemcache HashClient, keys spread over the servers
    "redis://host:6379/0"             redis-py (rediss:// too)
    "memory"                          this process's shared LRU ("memory://NAME?size=N")
    None                              no level 2 (``ds.request()`` still works)

or a ready :class:`Cache` object.  Query parameters tune it: ``timeout`` and
``connect_timeout`` (seconds, default 0.2), ``ttl`` (entities, default 3600 s),
``list_ttl`` (query pages, 600 s), ``marker_ttl`` (writers' markers, 60 s),
``size`` (memory: entries).  The design is in ``docs/cache.md`` and
:mod:`bagstore.cache.layer`.

    >>> layer = open_layer("memory", prefix="bs:doc:")
    >>> layer.cache.name
    'memory (max 100000 entries)'
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from bagstore.cache.base import Cache, CacheStats, CacheUnavailable, LevelStats
from bagstore.cache.layer import CacheLayer
from bagstore.cache.memory import MemoryCache
from bagstore.cache.request import request
from bagstore.cache.shared import Cell
from bagstore.errors import ConfigurationError

__all__ = [
    "Cache",
    "CacheLayer",
    "CacheStats",
    "CacheUnavailable",
    "LevelStats",
    "MemoryCache",
    "open_cache",
    "open_layer",
    "request",
]

_PREFIX = re.compile(r"[!-~]{1,120}")
_LAYER_PARAMS = ("ttl", "list_ttl", "marker_ttl")
_CLIENT_PARAMS = ("timeout", "connect_timeout")


def _number(params: dict[str, str], name: str, default: float) -> float:
    text = params.pop(name, None)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigurationError(f"cache URL parameter {name}={text!r} is not a number") from None
    if value <= 0:
        raise ConfigurationError(f"cache URL parameter {name} must be positive, not {text}")
    return value


def _split(url: str) -> tuple[Any, dict[str, str]]:
    parts = urlsplit(url)
    return parts, dict(parse_qsl(parts.query, keep_blank_values=True))


def open_cache(url: str) -> tuple[Cache, bool]:
    """The level-2 client a cache URL names, and whether the caller owns it
    (a shared ``memory`` cache is not closed with one datastore)."""
    if url == "memory":
        url = "memory://default"
    parts, params = _split(url)
    for name in _LAYER_PARAMS:
        params.pop(name, None)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from bagstore.cache.memory import shared

        size = int(_number(params, "size", 100_000))
        _no_more(url, params)
        return shared(parts.netloc or "default", size), False
    timeout = _number(params, "timeout", 0.2)
    connect_timeout = _number(params, "connect_timeout", 0.2)
    if scheme == "memcached":
        from bagstore.cache.memcached import MemcachedCache

        _no_more(url, params)
        return MemcachedCache(
            _servers(url, parts.netloc), timeout=timeout, connect_timeout=connect_timeout
        ), True
    if scheme in ("redis", "rediss", "unix"):
        from bagstore.cache.redis import RedisCache

        clean = urlunsplit(parts._replace(query=urlencode(params)))
        return RedisCache(clean, timeout=timeout, connect_timeout=connect_timeout), True
    raise ConfigurationError(
        f"unknown cache {url!r}: use memcached://host:port[,host:port...], "
        "redis://host:port/db, or memory"
    )


def _no_more(url: str, params: dict[str, str]) -> None:
    if params:
        raise ConfigurationError(f"cache URL {url!r}: unknown parameters {sorted(params)}")


def _servers(url: str, netloc: str) -> list[tuple[str, int]]:
    servers = []
    for item in netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = item.strip(), "11211"
        if not host or not port.isdigit():
            raise ConfigurationError(f"cache URL {url!r}: {item!r} is not host:port")
        servers.append((host.strip("[]"), int(port)))
    return servers


def open_layer(
    cache: object, *, prefix: str, cell: Cell | None = None, store: str | None = None
) -> CacheLayer:
    """The caching layer for ``Datastore(cache=...)``: a URL, a Cache, or None.

    ``cell`` and ``store``: where the store's cache state is shared between
    processes, and the store's id (see :mod:`bagstore.cache.shared`); not used
    for an in-process ``memory`` cache, which no other process reads."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise ConfigurationError(
            f"cache_prefix {prefix!r} must be 1 to 120 printable ASCII characters, no spaces"
        )
    if cache is None:
        return CacheLayer(None, prefix)
    if isinstance(cache, str):
        client, owns = open_cache(cache)
        _, params = _split(cache if cache != "memory" else "memory://")
        ttls = {name: int(_number(params, name, 0)) for name in _LAYER_PARAMS if name in params}
        if isinstance(client, MemoryCache):
            cell = None
        return CacheLayer(
            client,
            prefix,
            owns_cache=owns,
            cell=cell,
            store=store,
            ttl=ttls.get("ttl", 3600),
            list_ttl=ttls.get("list_ttl", 600),
            marker_ttl=ttls.get("marker_ttl", 60),
        )
    if isinstance(cache, Cache):
        if isinstance(cache, MemoryCache):
            cell = None
        return CacheLayer(cache, prefix, owns_cache=False, cell=cell, store=store)
    raise ConfigurationError(f"cache must be a URL, a bagstore.cache.Cache or None, not {cache!r}")
