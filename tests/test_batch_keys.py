"""A batch's index keys and buckets (a ``put_many``'s, an index at a time):
the same as each entity's alone, whatever the values."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagstore import errors, keys
from bagstore.index import Index
from bagstore.keys import encode_value
from bagstore.sharding.hashing import bucket_list, bucket_of
from tests.test_keys import indexable

# -- a batch's encodings (put_many): the same as one value's at a time ---------------

_not_indexable = st.one_of(
    st.none(),
    st.just(Decimal("1.5")),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(type("Str", (str,), {}), st.text(max_size=3)),
)
_batch_value = st.one_of(
    indexable,
    _not_indexable,
    st.text(min_size=1, max_size=3).map(lambda s: s * 120),  # some over KEY_LIMIT bytes
    st.lists(st.one_of(indexable, _not_indexable), max_size=4),
)


def _encoded_or_none(v: object) -> bytes | None:
    try:
        return encode_value(v)
    except keys.UnindexableValue:
        return None


@given(st.lists(_batch_value, max_size=12))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_encode_scalars_is_encode_value_of_each(values: list[object]) -> None:
    assert keys.encode_scalars(values) == [_encoded_or_none(v) for v in values]


@given(st.lists(_batch_value, max_size=12), st.booleans(), st.sampled_from([1, 7, 1024]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_rows_for_many_is_rows_for_of_each(values: list[object], unique: bool, n: int) -> None:
    index = Index("t_batch", ["v"], unique=unique)
    pairs = [
        (bytes([i]) * 16, {} if v is None and i % 2 else {"v": v}) for i, v in enumerate(values)
    ]
    assert bucket_list([p[0] for p in pairs], n) == [bucket_of(p[0], n) for p in pairs]
    one_by_one: list[object] = []
    for entity_id, entity in pairs:
        try:
            one_by_one.append(index.rows_for(entity, entity_id, n))
        except errors.InvalidEntity as exc:  # the batch raises the first entity's error
            one_by_one.append(str(exc))
            break
    try:
        batch: list[object] = list(index.rows_for_many(pairs, n))
    except errors.InvalidEntity as exc:
        batch = [*one_by_one[:-1], str(exc)]
    assert batch == one_by_one


# -- one entity's rows (a put's): the scalar path inline is the general formula ------


@given(_batch_value, st.booleans(), st.sampled_from([1, 7, 1024]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_rows_for_of_a_scalar_is_the_truncated_key_and_its_full_hash(
    value: object, unique: bool, n: int
) -> None:
    """``rows_for`` cuts a one-property scalar key inline and makes its row
    in C: the row is still ``(truncate(key), id, bucket_of(key))``, and a
    unique key too long to keep whole is refused."""
    index = Index("t_one", ["v"], unique=unique)
    entity_id = bytes(range(16))
    key = _encoded_or_none(value)
    if type(value) is list or key is None:
        return  # (lists and what cannot be indexed: the general path, pinned above)
    if unique and len(key) > keys.KEY_LIMIT:
        try:
            index.rows_for({"v": value}, entity_id, n)
        except errors.InvalidEntity as exc:
            assert "over the" in str(exc)
        else:
            raise AssertionError("a unique key too long was kept")
        return
    (row,) = index.rows_for({"v": value}, entity_id, n)
    assert row == ((keys.truncate(key)[0],), entity_id, bucket_of(key, n))
    assert type(row).__name__ == "IndexRow" and row.keys[0] == keys.truncate(key)[0]
