"""Hostile input to the change feed and to every option that takes seconds or a
rate: a clear bagstore exception (``error:`` and exit 2 at the command line),
never another exception, and the feed reads on as before.

Found by these tests before their fixes: a cursor holding any character outside
ASCII raised TypeError (the signature's comparison) or UnicodeEncodeError (a lone
surrogate) rather than InvalidQuery; ``max_age`` / ``max_changes`` / ``lease`` too
large for a 64-bit int raised OverflowError; NaN passed every ``FloatRange`` of the
command line and every ``< 0`` check of the API (``changes --interval nan
--follow`` an internal error, ``clean --follow --interval nan`` or ``-1`` a loop
that never waited, ``--interval inf`` an internal error).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bagstore
from bagstore.changes import MOST_MAX_AGE, MOST_MAX_CHANGES, FeedSettings
from tests.test_cli_hostile import FAST as HOSTILE
from tests.test_cli_hostile import Cli, any_char, assert_one_error, check_result

FAST = settings(HOSTILE, max_examples=150)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A SQLite store whose feed holds three changes, a consumer, and the cursor
    after its first page."""
    ds = bagstore.open(tmp_path_factory.mktemp("fed"))
    ds.feed.enable(bodies=True)
    ids = [ds.put({"n": n}) for n in range(3)]
    ds.subscribe("reader", lambda changes: None).close()
    page = ds.changes()
    assert [c.id for c in page] == ids
    yield ds, page
    ds.close()


def _still_reads(ds: bagstore.Datastore, page: list[bagstore.Change]) -> None:
    again = ds.changes()
    assert again == page and ds.changes(since=again.cursor) == []


anything = st.one_of(
    st.text(any_char),
    st.binary(),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
)


@FAST
@given(value=anything)
def test_any_value_as_a_cursor_is_invalid_query(fed: Any, value: object) -> None:
    ds, page = fed
    if value == page.cursor:
        return
    with pytest.raises(bagstore.InvalidQuery):
        ds.changes(since=value)


positions_like = st.one_of(
    anything,
    st.none(),
    st.dictionaries(
        st.one_of(st.integers(), st.text(max_size=2), st.booleans()), anything, max_size=3
    ),
)


@FAST
@given(positions=positions_like, limit=anything, buckets=st.one_of(st.none(), anything))
def test_any_arguments_of_the_feeds_reads_are_invalid_query_or_read(
    fed: Any, positions: object, limit: object, buckets: object
) -> None:
    """``ds.feed.read`` and ``ds.feed.ends`` (what consumers are made of): a
    positions dict of buckets to positions, a limit from 1 to 10,000 and
    bucket numbers of the store, or InvalidQuery (TypeError and ValueError
    before, from deep inside the reader); the feed reads on."""
    ds, page = fed
    try:
        changes, after = ds.feed.read(positions, limit, buckets)  # type: ignore[arg-type]
    except bagstore.InvalidQuery:
        pass
    else:  # what was valid reads as ever
        assert type(limit) is int and 1 <= limit <= 10_000
        assert isinstance(positions, dict) and isinstance(after, dict)
        assert all(isinstance(c, bagstore.Change) for c in changes)
    try:
        ends = ds.feed.ends(buckets)  # type: ignore[arg-type]
    except bagstore.InvalidQuery:
        assert buckets is not None
    else:
        assert set(ends) <= set(range(ds.placement.buckets))
    _still_reads(ds, page)


@FAST
@given(at=st.integers(0, 200), cut=st.integers(0, 3), extra=st.text(any_char, max_size=4))
def test_a_cursor_altered_anywhere_is_invalid_query(
    fed: Any, at: int, cut: int, extra: str
) -> None:
    ds, page = fed
    good = page.cursor
    at = min(at, len(good))
    bad = good[:at] + extra + good[at + cut :]
    if bad == good:
        assert ds.changes(since=bad) == []
        return
    with pytest.raises(bagstore.InvalidQuery):
        ds.changes(since=bad)


def test_cursors_outside_ascii_name_what_they_are_not(fed: Any) -> None:
    ds, page = fed
    for bad in (page.cursor + "\u00e9", page.cursor[:-2] + "\ud800", "c1.\udc80.x", "c1.\u00e9"):
        with pytest.raises(bagstore.InvalidQuery, match="not a change feed cursor"):
            ds.changes(since=bad)
    _still_reads(ds, page)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_age": MOST_MAX_AGE + 1},
        {"max_age": 2**64},
        {"max_changes": MOST_MAX_CHANGES + 1},
        {"max_changes": 2**100},
        {"max_age": 0},
        {"max_age": 3.5},
        {"max_changes": True},
    ],
)
def test_retention_beyond_its_range_is_refused(fed: Any, kwargs: dict[str, Any]) -> None:
    ds, page = fed
    before = ds.feed.settings()
    with pytest.raises(bagstore.ConfigurationError, match="must be an integer from 1 to"):
        ds.feed.enable(**kwargs)
    assert ds.feed.settings() == before
    _still_reads(ds, page)


@pytest.mark.parametrize("bodies", [1, 0, "yes", None, [True]])
def test_bodies_other_than_a_bool_are_refused(fed: Any, bodies: object) -> None:
    ds, page = fed
    before = ds.feed.settings()
    with pytest.raises(bagstore.ConfigurationError, match="bodies must be True or False"):
        ds.feed.enable(bodies=bodies)
    assert ds.feed.settings() == before
    _still_reads(ds, page)


def test_retention_at_its_bounds_is_taken(tmp_path: Path) -> None:
    with bagstore.open(tmp_path) as ds:
        ds.feed.enable(max_age=MOST_MAX_AGE, max_changes=MOST_MAX_CHANGES)
        ds.put({"n": 1})
        assert ds.feed.settings() == FeedSettings(False, MOST_MAX_AGE, MOST_MAX_CHANGES)
        assert bagstore.Cleaner(ds).prune_changes() == 0  # the cutoff is a 64-bit int
        assert len(ds.changes()) == 1


@pytest.mark.parametrize("lease", [math.nan, math.inf, -1.0, 0.0, 0.0001, 86_401, 1e300, "5", True])
def test_a_lease_out_of_range_is_refused(fed: Any, lease: object) -> None:
    ds, _ = fed
    with pytest.raises(bagstore.ConfigurationError, match="lease must be a number of seconds"):
        ds.subscribe("leaser", lambda changes: None, lease=lease)


def test_seconds_and_rates_of_the_cleaner_and_mover_refuse_nan_and_infinities(fed: Any) -> None:
    ds, _ = fed
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(bagstore.ConfigurationError, match="settle"):
            bagstore.Cleaner(ds, settle=bad)
        with pytest.raises(bagstore.ConfigurationError, match="max_rate"):
            bagstore.Cleaner(ds, max_rate=bad)
        with pytest.raises(bagstore.ConfigurationError, match="interval"):
            bagstore.Cleaner(ds).follow(interval=bad, passes=1)
        with pytest.raises(bagstore.ConfigurationError, match="margin"):
            bagstore.Cleaner(ds).follow(margin=bad, passes=1)
        with pytest.raises(bagstore.ConfigurationError, match="grace"):
            ds.move_buckets([0], to=0, grace=bad)
    for sweep_every in (0, -1, 1.5):
        with pytest.raises(bagstore.ConfigurationError, match="sweep_every"):
            bagstore.Cleaner(ds).follow(sweep_every=sweep_every, passes=1)  # type: ignore[arg-type]


# -- the command line ---------------------------------------------------------------
@pytest.fixture(scope="module")
def fed_cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    c = Cli(tmp_path_factory.mktemp("fedcli") / "store")
    c.ok("init", "--shards", "2", "--buckets", "16")
    c.ok("feed", "on", "--bodies")
    c.ok("put", '[{"n": 1}, {"n": 2}]')
    return c


@FAST
@given(since=st.text(any_char, min_size=1).filter(lambda s: "\x00" not in s))
def test_any_text_as_the_cursor_at_the_command_line(fed_cli: Cli, since: str) -> None:
    result = fed_cli("changes", "--json", "--since", since)
    check_result(result, json_lines=True)
    assert result.exit_code == 2


@FAST
@given(name=st.text(any_char, min_size=1).filter(lambda s: "\x00" not in s))
def test_any_consumer_name_at_the_command_line(fed_cli: Cli, name: str) -> None:
    for args in (("consumers", "drop", name), ("consumers", "reset", name, "--to", "end")):
        result = fed_cli(*args)
        check_result(result)
        assert result.exit_code == 2  # no consumer of that name (or not a name)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("changes", "--follow", "--interval", "nan"), "'nan' is not a number"),
        (("changes", "--follow", "--interval", "inf"), "not in the range"),
        (("changes", "--follow", "--interval", "0"), "not in the range"),
        (("clean", "--follow", "--interval", "nan"), "'nan' is not a number"),
        (("clean", "--follow", "--interval", "-1"), "not in the range"),
        (("clean", "--follow", "--interval", "1e300"), "not in the range"),
        (("clean", "--repair", "--duty", "nan"), "'nan' is not a number"),
        (("clean", "--repair", "--max-rate", "nan"), "max_rate must be"),
        (("clean", "--repair", "--max-rate", "inf"), "max_rate must be"),
        (("shard", "move", "1", "--to", "0", "--grace", "nan"), "'nan' is not a number"),
        (("shard", "rebalance", "--max-rate", "nan"), "max_rate must be"),
        (("shard", "watch", "--interval", "nan"), "'nan' is not a number"),
        (("shard", "watch", "--lease", "nan"), "'nan' is not a number"),
        (("shard", "failover", "0", "--to", "h:1", "--timeout", "nan"), "'nan' is not a number"),
        (("feed", "on", "--max-age", str(2**70)), "max_age must be an integer from 1 to"),
        (("feed", "on", "--max-changes", "0"), "max_changes must be an integer from 1 to"),
    ],
)
def test_numbers_out_of_range_at_the_command_line(
    fed_cli: Cli, args: tuple[str, ...], fragment: str
) -> None:
    result = fed_cli(*args)
    assert_one_error(result, fragment)
    assert fed_cli.ok("changes", "--json").stdout.count("\n") == 2  # the feed as it was
