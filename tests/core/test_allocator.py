import numpy as np
import pytest

from hicache_jax import PageAllocator


def test_alloc_free_roundtrip_and_counts():
    a = PageAllocator(8)
    ids = a.alloc(3)
    assert ids.tolist() == [0, 1, 2] and ids.dtype == np.int32
    assert a.available == 5 and a.used == 3
    more = a.alloc(5)
    assert sorted(more.tolist()) == [3, 4, 5, 6, 7]
    assert a.alloc(1) is None  # exhausted: no error, no change
    assert a.available == 0
    a.free(ids)
    assert a.available == 3 and not a.is_allocated([0, 1, 2]).any()
    again = a.alloc(3)
    assert sorted(again.tolist()) == [0, 1, 2]
    a.check()


def test_alloc_returns_none_when_short_and_changes_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    assert a.alloc(2) is None
    assert a.available == 1
    a.check()


def test_alloc_zero_and_free_empty():
    a = PageAllocator(2)
    assert a.alloc(0).size == 0
    a.free([])
    assert a.available == 2


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([9], ValueError, "out of range"),
        ([-1], ValueError, "out of range"),
        ([1, 1], ValueError, "duplicate"),
        ([0.0], TypeError, "integer"),
        ([[1]], ValueError, "1-D"),
        ([True], TypeError, "integer"),
    ],
)
def test_free_rejects_bad_ids_without_state_change(bad, exc, match):
    a = PageAllocator(8)
    a.alloc(4)
    before = (a.available, a._allocated.copy())
    with pytest.raises(exc, match=match):
        a.free(bad)
    assert a.available == before[0] and (a._allocated == before[1]).all()
    a.check()


def test_double_free_detected_and_batch_is_atomic():
    a = PageAllocator(8)
    ids = a.alloc(4)
    a.free(ids[:2])
    with pytest.raises(ValueError, match="double free"):
        a.free(ids)  # ids[:2] already free: the whole batch is refused
    assert a.is_allocated(ids[2:]).all() and a.available == 6
    a.check()


@pytest.mark.parametrize("n, exc", [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_alloc_rejects_bad_counts(n, exc):
    a = PageAllocator(4)
    with pytest.raises(exc, match="n:"):
        a.alloc(n)
    assert a.available == 4


def test_random_alloc_free_keeps_invariants():
    rng = np.random.default_rng(0)
    a = PageAllocator(64)
    held: list[int] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            k = int(rng.integers(1, len(held) + 1))
            rng.shuffle(held)
            a.free(held[:k])
            held = held[k:]
        else:
            got = a.alloc(int(rng.integers(0, 10)))
            if got is not None:
                assert not set(got.tolist()) & set(held)
                held += got.tolist()
        assert a.available + len(held) == 64
    a.check()
