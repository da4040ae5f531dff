"""Yupoo's PHP example (the seed: ShardedDBTable Photos, DBTable Users, Posts
with isolate_key topic_id) in bagstore's API, as the README writes it, on
SQLite, on one MariaDB server and on two."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import bagstore
from bagstore.tables import id_of_pk
from tests import servers
from tests.conftest import Topology

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "class Photo(bagstore.Model" in b]
    return block


@pytest.fixture
def where(topo3: Topology) -> Iterator[Topology]:
    yield topo3
    topo3.close()
    if topo3.is_mysql:  # the global tables' database, beside the catalog's
        parts = urlsplit(topo3.urls[0])
        home = parts.path.lstrip("/").split("?")[0] + "_global"
        servers.drop_databases(parts.hostname or "127.0.0.1", parts.port or 3306, [home])


def test_yupoos_example_runs_on_every_backend(where: Topology) -> None:
    code = _example()
    assert "where = tempfile.mkdtemp()" in code
    code = code.replace("where = tempfile.mkdtemp()", f"where = {where.urls!r}")
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)
    photo_cls, user_cls = namespace["Photo"], namespace["User"]
    # what the example left, read again through new tables
    photos = photo_cls.open(where.urls)
    users = user_cls.open(where.urls)
    try:
        assert photos.load(1, 10001) is None  # deleted
        zola = users.load(1)
        assert zola is not None and zola.username == "zola"
        # Users and Posts live in the global database, the photos on the shards
        assert users.ds.router.pinned and not photos.ds.router.pinned
        assert len(photos.ds.router.backends) == 4
        # more photos of user 1: each on user 1's bucket; load reads that shard
        made = [
            photos.insert(photo_cls(user_id=1, title=f"p{i}", posted_date=None)) for i in range(5)
        ]
        assert [p.photo_id for p in made] == sorted(p.photo_id for p in made)
        buckets = {photos.ds.bucket_of_id(id_of_pk(p.photo_id)) for p in made}
        assert len(buckets) == 1
        assert all(photos.load(1, p.photo_id) == p for p in made)
    finally:
        photos.close()
        users.close()


class Post(
    bagstore.Model,
    kind="posts",
    global_kind=True,
    isolate_key="topic_id",
    indexes=[("topic_id", "posted_at")],
):
    post_id: int = bagstore.auto_id()
    topic_id: int
    author_id: int
    content: str = ""
    posted_at: datetime | None = None


def test_posts_pages_are_cached_per_topic(where: Topology) -> None:
    """Yupoo's isolate_key: a post in topic 1 leaves topic 2's cached pages
    alone (the table-wide revision narrowed to the topic), and a post in
    topic 2 is seen at once."""
    posts = Post.open(where.urls, cache="memory://yupoo_posts")
    try:
        (index,) = [i for i, _ in posts.ds.indexes().values()]
        assert index.shard_on == "topic_id"  # the scope of its pages' revisions
        at = datetime(2010, 7, 1, 9)
        posts.insert(Post(topic_id=2, author_id=1, content="a", posted_at=at))
        assert [p.content for p in posts.fetch(topic_id=2)] == ["a"]
        assert [p.content for p in posts.fetch(topic_id=2)] == ["a"]  # a cached page
        misses = posts.ds.stats()["l2"]["misses"]
        posts.insert(Post(topic_id=1, author_id=1, content="b", posted_at=at))
        assert [p.content for p in posts.fetch(topic_id=2)] == ["a"]
        assert posts.ds.stats()["l2"]["misses"] == misses  # still cached: another topic
        posts.insert(Post(topic_id=2, author_id=1, content="c", posted_at=at))
        assert [p.content for p in posts.fetch(topic_id=2)] == ["a", "c"]  # never stale
        assert posts.ds.stats()["l2"]["misses"] > misses
    finally:
        posts.close()
