"""NoIndexForQuery suggests an index that answers the query, and the command to add it."""

from __future__ import annotations

import itertools
import json
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import bagstore
from bagstore.cli import cli
from bagstore.query import parse_filters, plan_query

ENTITIES: list[dict[str, Any]] = [
    {"a": i % 4, "b": (i * 7) % 5, "c": [i % 3, (i + 1) % 6]} if i % 5 else {"a": i % 4, "b": i}
    for i in range(30)
]


def _store(path: str) -> bagstore.Datastore:
    ds = bagstore.open(path, shards=2, buckets=16)
    ds.put_many([dict(e) for e in ENTITIES])
    return ds


@pytest.fixture
def ds(tmp_path: Path) -> Iterator[bagstore.Datastore]:
    store = _store(str(tmp_path / "store"))
    yield store
    store.close()


def _add(ds: bagstore.Datastore, index: bagstore.Index) -> None:
    ds.add_index(index)
    bagstore.Cleaner(ds, settle=0).backfill(index.table)


def test_a_property_given_twice_is_indexed_once(ds: bagstore.Datastore) -> None:
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(b=3, b__gt=2)
    assert exc.value.index.properties == ("b",)  # was ['b', 'b']
    assert exc.value.command == "bagstore index add index_b --properties b"
    assert str(exc.value) == (
        "no ready index answers this query; add one with: bagstore index add index_b --properties b"
    )
    _add(ds, exc.value.index)
    # the equality is looked up, the range re-checked on each entity
    assert {e["b"] for e in ds.query(b=3, b__gt=2)} == {3}
    assert ds.query(b=1, b__gt=2) == []
    want = sorted(e["b"] for e in ENTITIES if e["b"] in (1, 3, 25) and e["b"] >= 3)
    assert sorted(e["b"] for e in ds.query(b__in=[1, 3, 25], b__gte=3)) == want
    assert 1 not in want and 25 in want


def test_equal_properties_come_first_then_the_range_or_the_order(
    ds: bagstore.Datastore,
) -> None:
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(c__gt=1, b__in=[1, 2], a=3)
    # plain equality first (so that shard_on, the first, reads one shard), then __in
    assert exc.value.index.properties == ("a", "b", "c")
    assert exc.value.index.shard_on == "a"
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(a=1, order="-c")
    assert exc.value.index.properties == ("a", "c")
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(a=1, order="a")  # ordering by an equal property needs no other
    assert exc.value.index.properties == ("a",)


def test_the_suggested_name_is_never_a_retired_or_existing_table(
    ds: bagstore.Datastore,
) -> None:
    first = bagstore.Index("index_a", ["a"])
    _add(ds, first)
    ds.retire_index("index_a")
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(a=1)
    assert exc.value.index == bagstore.Index("index_a_2", ["a"])  # was index_a again
    assert "bagstore index add index_a_2 --properties a" in str(exc.value)
    # another kind's index table, and one differing only in case, are taken too
    other = bagstore.open(
        ds.router.opener.root or "", kind="photos", indexes=[bagstore.Index("INDEX_A_2", ["x"])]
    )
    try:
        with pytest.raises(bagstore.NoIndexForQuery) as exc:
            ds.query(a=1)
        assert exc.value.index.table == "index_a_3"
        _add(ds, exc.value.index)  # and add_index takes it
        assert len(ds.query(a=1)) == len([e for e in ENTITIES if e["a"] == 1])
    finally:
        other.close()


def test_long_property_names_give_a_name_that_fits(ds: bagstore.Datastore) -> None:
    long = "p" * 30
    with pytest.raises(bagstore.NoIndexForQuery) as exc:
        ds.query(**{long: 1, f"{long}_x__gt": 2})
    table = exc.value.index.table
    assert len(table) <= 40 and "__" not in table
    ds.add_index(exc.value.index)  # a name add_index accepts


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"a__gt": 1, "b__lt": 3}, "ranges on ['a', 'b']"),
        ({"a__gt": 1, "order": "b"}, "in the order of 'a', not of 'b'"),
        ({"id": b"x" * 16}, "reserved"),
        ({"a__gt": 1, "a__gte": 2}, "at most one lower and one upper bound"),
    ],
)
def test_a_query_no_index_can_answer_is_invalid(
    ds: bagstore.Datastore, filters: dict[str, Any], message: str
) -> None:
    with pytest.raises(bagstore.InvalidQuery, match="no index can answer this query") as exc:
        ds.query(**filters)
    assert message in str(exc.value)
    assert not isinstance(exc.value, bagstore.NoIndexForQuery)


def test_the_cli_prints_the_command_and_the_command_works(tmp_path: Path) -> None:
    runner = CliRunner()
    store = str(tmp_path / "store")
    assert runner.invoke(cli, ["--store", store, "init", "--shards", "2"]).exit_code == 0
    put = runner.invoke(cli, ["--store", store, "put"], input='[{"score": 5}, {"score": 7}]')
    assert put.exit_code == 0, put.output
    result = runner.invoke(cli, ["--store", store, "query", "score=5", "score__gt=6"])
    assert result.exit_code == 2
    line = f"bagstore --store {shlex.quote(store)} index add index_score --properties score"
    assert result.stderr == (
        f"error: no ready index answers this query; add one with: {line}\n"
    )  # one line, no Python repr
    added = runner.invoke(cli, shlex.split(line)[1:])
    assert added.exit_code == 0, added.output
    assert (
        runner.invoke(
            cli, ["--store", store, "clean", "--index", "index_score", "--settle", "0"]
        ).exit_code
        == 0
    )
    found = runner.invoke(cli, ["--store", store, "query", "score__in=[5,7]", "score__gt=6"])
    assert found.exit_code == 0, found.output
    assert [json.loads(line)["score"] for line in found.stdout.splitlines()] == [7]


# -- the property: a suggestion, once added and backfilled, answers ---------------------
PROPS = ["a", "b", "c"]
OPS = ["", "__in", "__gt", "__gte", "__lt", "__lte"]


@st.composite
def queries(draw: st.DrawFn) -> tuple[dict[str, Any], str | None]:
    names = draw(
        st.lists(st.tuples(st.sampled_from(PROPS), st.sampled_from(OPS)), min_size=1, max_size=4)
    )
    filters: dict[str, Any] = {}
    for prop, op in names:
        if op == "__in":
            filters[prop + op] = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))
        else:
            filters[prop + op] = draw(st.integers(-1, 6))
    order = draw(st.none() | st.sampled_from([*PROPS, "-b"]))
    return filters, order


def _matches(entity: dict[str, Any], filters: dict[str, Any]) -> bool:
    for name, value in filters.items():
        prop, _, op = name.partition("__")
        v = entity.get(prop)
        values = v if isinstance(v, list) else ([] if v is None else [v])
        tests = {
            "": lambda x, w=value: x == w,
            "in": lambda x, w=value: x in w,
            "gt": lambda x, w=value: x > w,
            "gte": lambda x, w=value: x >= w,
            "lt": lambda x, w=value: x < w,
            "lte": lambda x, w=value: x <= w,
        }
        if not any(tests[op](x) for x in values):
            return False
    return True


def _no_index_could(filters: dict[str, Any], order: str | None) -> bool:
    """Whether every index on any ordering of any of the query's properties
    refuses the query (what InvalidQuery claims)."""
    props = sorted(
        {n.partition("__")[0] for n in filters} | ({order.lstrip("-")} if order else set())
    )
    parsed = parse_filters(filters)
    for size in range(1, len(props) + 1):
        for chosen in itertools.permutations(props, size):
            try:
                plan_query(bagstore.Index("t", list(chosen)), parsed, order)
            except bagstore.InvalidQuery:
                continue
            return False
    return True


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(query=queries(), retire_first=st.booleans())
def test_the_suggested_index_answers_once_added_and_backfilled(
    query: tuple[dict[str, Any], str | None], retire_first: bool
) -> None:
    filters, order = query
    with tempfile.TemporaryDirectory() as path:
        ds = _store(path)
        try:
            try:
                ds.query(order=order, **filters)
            except bagstore.NoIndexForQuery as exc:
                suggested, command = exc.index, exc.command
            except bagstore.InvalidQuery:
                event("no index could answer")
                assert _no_index_could(filters, order)
                return
            else:
                raise AssertionError("a store without indexes answered a query")
            assert len(set(suggested.properties)) == len(suggested.properties)
            words = shlex.split(command)
            assert words[:4] == ["bagstore", "index", "add", suggested.table]
            assert words[4:] == ["--properties", ",".join(suggested.properties)]
            if retire_first:  # its name is then taken: the next suggestion differs
                _add(ds, suggested)
                ds.retire_index(suggested.table)
                with pytest.raises(bagstore.NoIndexForQuery) as again:
                    ds.query(order=order, **filters)
                assert again.value.index.properties == suggested.properties
                assert again.value.index.table != suggested.table
                suggested = again.value.index
            _add(ds, suggested)
            event(f"answered through an index on {len(suggested.properties)} properties")
            got = ds.query(order=order, **filters)
            want = [e for e in ENTITIES if _matches(e, filters)]
            assert sorted(map(repr, ({k: e[k] for k in e if k != "id"} for e in got))) == sorted(
                map(repr, want)
            )
        finally:
            ds.close()
