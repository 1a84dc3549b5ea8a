"""store/kept.py: the bounded least-recently-used map behind the memos of checked files."""

from __future__ import annotations

from hypothesis import given, strategies as st

from cachekit.store.kept import Kept


def test_the_least_recently_used_go_first_and_a_value_over_the_bound_is_not_kept():
    kept: Kept[bytes] = Kept(10, len)
    kept.put("a", b"1234")
    kept.put("b", b"1234")
    assert kept.get("a") == b"1234"  # now "b" is the least recently used
    kept.put("c", b"1234")
    assert (kept.get("a"), kept.get("b"), kept.get("c")) == (b"1234", None, b"1234")
    kept.put("big", b"x" * 11)
    assert kept.get("big") is None and kept.get("a") == b"1234"
    kept.put("a", b"123456")  # replacing a value counts its new size only
    assert (kept.get("a"), kept.get("c")) == (b"123456", b"1234")
    kept.clear()
    kept.put("d", b"x" * 10)
    assert kept.get("d") == b"x" * 10


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 12), st.booleans())))
def test_it_keeps_what_a_plain_model_keeps(steps):
    """Against a list in use order: the same values, never more bytes than the bound."""
    kept: Kept[bytes] = Kept(20, len)
    model: list[tuple[str, bytes]] = []
    for stamp, size, get in steps:
        if get:
            hit = [v for k, v in model if k == stamp]
            assert kept.get(stamp) == (hit[0] if hit else None)
            model = [(k, v) for k, v in model if k != stamp] + [(stamp, v) for v in hit]
        elif size <= 20:
            model = [(k, v) for k, v in model if k != stamp] + [(stamp, b"x" * size)]
            while sum(len(v) for _, v in model) > 20:
                model.pop(0)
            kept.put(stamp, b"x" * size)
    assert {k: kept.get(k) for k in "abcdef"} == {k: dict(model).get(k) for k in "abcdef"}
