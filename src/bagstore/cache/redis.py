"""Redis through redis-py, with compare-and-set and revision bumps as Lua scripts.

One client (a thread-safe connection pool) with short timeouts and *no* retries
(redis-py retries ten times with back-off by default: a dead server would stall
every read).  After a connection error the client stays away for
``retry_timeout`` seconds, raising :class:`CacheUnavailable` at once, so that a
server that is down or black-holed costs one timeout per interval, not one per
read.  The caching layer catches :attr:`RedisCache.errors`, counts them and
reads the database instead.

* compare-and-set: ``GET`` the key, ``SET`` it only if it still holds the value
  read before (the marker, whose random nonce makes it unique): one round trip.
* bump: ``INCR`` each revision; one that did not exist (``INCR`` gives 1) is set
  to the current time in microseconds instead, so a revision never goes back
  to an earlier value after an eviction: one round trip for all of them.

    >>> c = RedisCache("redis://127.0.0.1:6379/0")  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bagstore.cache.base import CacheUnavailable
from bagstore.errors import ConfigurationError

__all__ = ["RedisCache"]

CAS_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

BUMP_SCRIPT = """
for i, key in ipairs(KEYS) do
  local ok, value = pcall(redis.call, 'INCR', key)
  if not ok or value == 1 then
    redis.call('SET', key, ARGV[1], 'EX', ARGV[2])
  end
end
return #KEYS
"""


class RedisCache:
    """A :class:`~bagstore.cache.base.Cache` over one Redis server (``redis://`` URL)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 0.2,
        connect_timeout: float = 0.2,
        retry_timeout: float = 1.0,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover - depends on the installation
            raise ConfigurationError(
                "a redis:// cache needs redis-py: pip install 'bagstore[redis]'"
            ) from None
        self.name = "redis " + url.split("@")[-1].removeprefix("redis://")
        self.errors: tuple[type[BaseException], ...] = (
            redis.RedisError,
            OSError,
            CacheUnavailable,
        )
        self._connection_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            single_connection_client=False,
        )
        self._cas = self._client.register_script(CAS_SCRIPT)
        self._bump = self._client.register_script(BUMP_SCRIPT)
        self._retry_timeout = retry_timeout
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _guard(self) -> None:
        if self._down_until and time.monotonic() < self._down_until:
            raise CacheUnavailable(f"{self.name} failed less than {self._retry_timeout:g} s ago")

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, self._connection_errors):
            with self._lock:
                self._down_until = time.monotonic() + self._retry_timeout

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._guard()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            self._failed(exc)
            raise
        if self._down_until:
            self._down_until = 0.0
        return result

    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, Any]]:
        if not keys:
            return {}
        values = self._call(self._client.mget, list(keys))
        return {k: (v, v) for k, v in zip(keys, values, strict=True) if v is not None}

    def _pipeline(self, items: Mapping[str, bytes], ttl: int, *, nx: bool) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key, value in items.items():
            pipe.set(key, value, ex=ttl if ttl > 0 else None, nx=nx)
        return list(pipe.execute())

    def add_many(self, items: Mapping[str, bytes], ttl: int) -> None:
        if items:
            self._call(self._pipeline, items, ttl, nx=True)

    def set_many(self, items: Mapping[str, bytes], ttl: int) -> list[str]:
        if not items:
            return []
        replies = self._call(self._pipeline, items, ttl, nx=False)
        return [k for k, ok in zip(items, replies, strict=True) if not ok]

    def cas(self, key: str, token: Any, value: bytes, ttl: int) -> bool:
        return bool(self._call(self._cas, keys=[key], args=[token, value, max(ttl, 1) * 1000]))

    def bump(self, keys: Sequence[str], now_us: int, ttl: int) -> None:
        if keys:
            self._call(self._bump, keys=list(keys), args=[now_us, max(ttl, 1)])

    def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(self._client.delete, *keys)

    def close(self) -> None:
        self._client.close()
