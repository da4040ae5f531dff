"""Entity codec benchmark: bagstore.codec beside the pipelines it was chosen against.

Run from the repository root::

    python -m bench.codec

Part 1 times encode + decode of a ~310-byte FriendFeed-style entity (16-byte ``id``
and ``user_id`` bytes, title, link, published datetime, tags) through each pipeline,
median of 5 runs, and prints the rate, the ratio to ``bagstore.codec`` and the
encoded size.  Part 2 sweeps body sizes to show where compression starts to pay
(bytes saved against microseconds spent), zstd-3 beside zlib-6: the data behind
``bagstore.codec.COMPRESS_THRESHOLD``.  The whole run takes well under 20 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import zstandard

from bagstore import codec
from bench.common import Row, print_rows

RUNS = 5
RUN_SECONDS = 0.12  # each of the 5 runs of a pipeline lasts about this long

Pipeline = tuple[Callable[[dict[str, Any]], bytes], Callable[[bytes], Any]]


def friendfeed_entity() -> dict[str, Any]:
    """A ~310-byte entity shaped like a FriendFeed post."""
    return {
        "id": os.urandom(16),
        "user_id": os.urandom(16),
        "title": (
            "How FriendFeed uses MySQL to store schema-less data, and why that design still"
            " works well today"
        ),
        "link": "https://backchannel.org/blog/friendfeed-schemaless-mysql?utm_source=ff&ref=rss",
        "published": dt.datetime(2009, 2, 27, 18, 43, 5, 123456, tzinfo=dt.UTC),
        "tags": ["mysql", "python", "schemaless", "sharding", "friendfeed", "indexes"],
    }


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


def pipelines() -> dict[str, Pipeline]:
    """name -> (encode, decode); single-threaded, so shared zstd contexts are fine here."""
    zc = zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()

    def mp_pack(entity: dict[str, Any]) -> bytes:
        data: bytes = msgpack.packb(entity, datetime=True)
        return data

    def mp_unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, timestamp=3)

    found: dict[str, Pipeline] = {
        "json + zlib (no types back)": (
            lambda e: zlib.compress(json.dumps(e, default=_json_default).encode()),
            lambda b: json.loads(zlib.decompress(b)),
        ),
        "msgpack raw": (mp_pack, mp_unpack),
        "msgpack + zlib-6": (
            lambda e: zlib.compress(mp_pack(e)),
            lambda b: mp_unpack(zlib.decompress(b)),
        ),
        "msgpack + zstd-3": (
            lambda e: zc.compress(mp_pack(e)),
            lambda b: mp_unpack(zd.decompress(b)),
        ),
    }
    try:
        import orjson  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # optional, only for comparison
        pass
    else:
        found["orjson + zstd-3 (no types back)"] = (
            lambda e: zc.compress(orjson.dumps(e, default=_json_default)),
            lambda b: orjson.loads(zd.decompress(b)),
        )
    found["bagstore.codec"] = (codec.encode, codec.decode)
    return found


def _loop(
    encode: Callable[[dict[str, Any]], bytes],
    decode: Callable[[bytes], Any],
    entity: dict[str, Any],
    n: int,
) -> float:
    start = time.perf_counter()
    for _ in range(n):
        decode(encode(entity))
    return time.perf_counter() - start


def roundtrips_per_second(pipeline: Pipeline, entity: dict[str, Any], runs: int = RUNS) -> float:
    """Median rate of RUNS runs of encode + decode, each run about RUN_SECONDS long."""
    encode, decode = pipeline
    n = 200
    while (spent := _loop(encode, decode, entity, n)) < RUN_SECONDS / 4:
        n *= 4
    n = max(1, int(n * RUN_SECONDS / spent))
    return statistics.median(n / _loop(encode, decode, entity, n) for _ in range(runs))


def _time_us(fn: Callable[[], object], n: int) -> float:
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(best)


def _text_corpus(min_len: int) -> str:
    """Real English prose (stdlib docstrings), so compression ratios are honest."""
    import argparse
    import collections
    import email
    import http.client
    import logging
    import threading

    modules = [argparse, collections, email, http.client, logging, threading, json, dt]
    docs = [m.__doc__ or "" for m in modules]
    docs += [cls.__doc__ or "" for cls in (dict, list, str, bytes, int, float, dt.datetime)]
    text = " ".join(" ".join(docs).split())
    return text * (min_len // len(text) + 2)


def threshold_sweep() -> None:
    """Bytes saved and time spent by zstd-3 and zlib-6 for bodies of growing size."""
    body_lengths = (0, 64, 192, 320, 448, 704, 960, 1472, 2496, 4544, 16384)
    corpus = _text_corpus(max(body_lengths) * 2)
    zc = zstandard.ZstdCompressor(level=3, write_checksum=True)
    zd = zstandard.ZstdDecompressor()
    print()
    print("Compression by msgpack payload size: FriendFeed entity + a prose 'body'.")
    print("body = stored bytes (raw: payload + 5); saved = vs raw; c/d = µs to compress/decompress")
    print(
        f"{'payload':>7} | {'zstd-3':>6} {'saved':>9} {'c µs':>6} {'d µs':>5}"
        f" | {'zlib-6':>6} {'saved':>9} {'c µs':>6} {'d µs':>5}"
    )
    for body_len in body_lengths:
        entity = friendfeed_entity()
        start = (body_len * 7) % (len(corpus) - body_len)
        entity["body"] = corpus[start : start + body_len]
        payload = msgpack.packb(entity, datetime=True)  # what the codec stores
        raw_len = len(payload) + 5  # format byte + CRC-32
        z = zc.compress(payload)
        zl = zlib.compress(payload)
        n = 300 if len(payload) > 4000 else 1500
        row = [f"{len(payload):>7}"]
        for body, comp, decomp in (
            (z, functools.partial(zc.compress, payload), functools.partial(zd.decompress, z)),
            (zl, functools.partial(zlib.compress, payload), functools.partial(zlib.decompress, zl)),
        ):
            saved = raw_len - (len(body) + 1)
            row.append(
                f"{len(body) + 1:>6} {saved:>5} {saved / raw_len:>3.0%}"
                f" {_time_us(comp, n):>6.1f} {_time_us(decomp, n):>5.1f}"
            )
        print(" | ".join(row))
    print(
        f"bagstore.codec compresses payloads over COMPRESS_THRESHOLD = {codec.COMPRESS_THRESHOLD}"
        " bytes with zstd-3, and keeps the result only when it is smaller."
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m bench.codec``."""
    p = argparse.ArgumentParser(description="bagstore.codec beside other pipelines")
    p.add_argument("--quick", action="store_true", help="fewer runs, no compression sweep")
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="rich")
    args = p.parse_args(argv)
    runs = 3 if args.quick else RUNS
    entity = friendfeed_entity()
    rates: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name, pipeline in pipelines().items():
        sizes[name] = len(pipeline[0](entity))
        rates[name] = roundtrips_per_second(pipeline, entity, runs)
    ours = rates["bagstore.codec"]
    payload = len(msgpack.packb(entity, datetime=True))
    rows = [
        Row(f"encode + decode vs {name}", ours, rate)
        for name, rate in rates.items()
        if name != "bagstore.codec"
    ]
    print_rows(
        f"bench.codec: encode + decode of a {payload}-byte (msgpack) entity, per second, "
        f"median of {runs} runs; encoded bytes: "
        + ", ".join(f"{name} {size}" for name, size in sizes.items()),
        rows,
        fmt=args.format,
    )
    if not args.quick:
        threshold_sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
