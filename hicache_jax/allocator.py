"""Page allocator: integer page ids over a fixed-size pool.

Pure numpy. Used for the device (L1) pool and the host (L2) pool alike.

Contract:
* ``alloc(n)`` returns ``n`` distinct free page ids (int32 array, lowest ids first on a
  fresh allocator) or ``None`` when fewer than ``n`` are free: running out is a normal
  condition under memory pressure (the caller evicts and retries), not an error.
* ``free(ids)`` validates the whole batch first (range, duplicates, double free) and raises
  ``ValueError`` naming the offending ids, changing no state; only then are they returned.
* Ids never escape as views into internal state (the free list is copied out).

Threading: not thread-safe; the owner (the cache manager's thread) calls it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ._checks import physical_memory_bytes

ID_DTYPE = np.int32
MAX_PAGES = int(np.iinfo(ID_DTYPE).max) + 1  # page ids [0, MAX_PAGES) fit ID_DTYPE
_BYTES_PER_PAGE = 1 + np.dtype(np.intp).itemsize  # an allocator's bitmap and free stack


_I32 = np.iinfo(ID_DTYPE)
_I32_MIN, _I32_MAX = int(_I32.min), int(_I32.max)  # iinfo's attributes are computed per access
_EMPTY_IDS = np.zeros(0, ID_DTYPE)


def _as_int32(arr: np.ndarray, name: str) -> np.ndarray:
    """An int32 copy of a non-empty 1-D integer id array; ValueError if an id does not fit."""
    if arr.dtype != ID_DTYPE:  # an int32 array fits by construction: no range pass
        lo, hi = int(_MIN(arr)), int(_MAX(arr))
        if lo < _I32_MIN or hi > _I32_MAX:
            raise ValueError(f"{name}: page id out of int32 range")
    return arr.astype(ID_DTYPE, copy=True)


def _int_array(ids: object, name: str) -> np.ndarray | None:
    """``ids`` as a non-empty 1-D integer ndarray (no copy), None when empty; raises otherwise."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.size == 0:
        return None
    if arr.dtype.kind not in "iu":  # bool is kind 'b', floats 'f', objects 'O'
        raise TypeError(f"{name}: expected integer page ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of page ids, got shape {arr.shape}")
    return arr


# ufunc reductions called directly: ndarray.min/max/any go through Python wrappers that cost
# more than the reduction itself on the small arrays this module sees all the time.
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
try:  # np.count_nonzero without its Python wrapper (same function, no axis handling)
    from numpy._core.multiarray import count_nonzero
except ImportError:  # pragma: no cover - other numpy layouts
    count_nonzero = np.count_nonzero


def as_page_ids(ids: object, name: str = "page_ids") -> np.ndarray:
    """Validate ``ids`` as a 1-D array of integer page ids; returns an int32 copy.

    Raises TypeError for non-integer input (floats, bools, objects) and ValueError for
    the wrong rank. Range checks belong to the owner of the pool.
    """
    arr = _int_array(ids, name)
    return _EMPTY_IDS.copy() if arr is None else _as_int32(arr, name)


def has_duplicates(arr: np.ndarray) -> bool:
    """Whether a 1-D id array repeats an id (a set for tiny batches, a sort otherwise)."""
    n = arr.shape[0]
    if n < 2:
        return False
    if n <= 8:  # a Python set beats numpy's fixed per-call costs only for a handful of ids
        return len(set(arr.tolist())) != n
    s = np.array(arr)
    s.sort()
    return bool(count_nonzero(s[1:] == s[:-1]))


def check_page_ids(ids: object, num_pages: int, name: str = "page_ids", unique: bool = True) -> np.ndarray:
    """`as_page_ids` plus range [0, num_pages) and (optionally) no-duplicate checks.

    This runs on every transfer and free, so the happy path costs a handful of numpy calls
    (with ``unique``, one sorted copy gives the bounds and the duplicate test at once); the
    detailed message is built only when a check fails.
    """
    arr = _int_array(ids, name)
    if arr is None:
        return _EMPTY_IDS.copy()
    n = arr.shape[0]
    if unique and n > 8:
        s = np.array(arr)
        s.sort()
        lo, hi = int(s[0]), int(s[-1])
        dup = bool(count_nonzero(s[1:] == s[:-1]))
    else:
        lo, hi = int(_MIN(arr)), int(_MAX(arr))
        dup = unique and n > 1 and len(set(arr.tolist())) != n
    if lo < _I32_MIN or hi > _I32_MAX:
        raise ValueError(f"{name}: page id out of int32 range")
    out = arr.astype(ID_DTYPE, copy=True)
    if lo < 0 or hi >= num_pages:
        bad = out[(out < 0) | (out >= num_pages)]
        raise ValueError(f"{name}: ids out of range [0, {num_pages}): {bad[:8].tolist()}")
    if dup:
        uniq, counts = np.unique(out, return_counts=True)
        raise ValueError(f"{name}: duplicate ids {uniq[counts > 1][:8].tolist()}")
    return out


class PageAllocator:
    """Free-list allocator over page ids ``[0, num_pages)``."""

    def __init__(self, num_pages: int, name: str = "pages") -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)):
            raise TypeError(f"num_pages: expected an int, got {type(num_pages).__name__}")
        if not 0 <= num_pages <= MAX_PAGES:
            raise ValueError(f"num_pages: expected an int in [0, {MAX_PAGES}] (page ids are int32), got {num_pages}")
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        ram = physical_memory_bytes()
        if ram is not None and num_pages * _BYTES_PER_PAGE > ram:
            raise ValueError(
                f"num_pages: expected bookkeeping that fits this machine's {ram / 2**30:.1f} GiB of "
                f"memory, got {num_pages} pages ({num_pages * _BYTES_PER_PAGE / 2**30:.1f} GiB)"
            )
        self.name = name
        self.num_pages = int(num_pages)
        self._allocated = np.zeros(self.num_pages, dtype=bool)
        # Stack: the top (end) is handed out first; reversed so a fresh allocator gives 0, 1, 2...
        # Held as intp: numpy's fancy indexing (the bitmap updates) converts int32 indices first.
        self._free = np.arange(self.num_pages, dtype=np.intp)[::-1].copy()
        self._top = self.num_pages

    # ---- queries -------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Number of free pages."""
        return self._top

    @property
    def used(self) -> int:
        return self.num_pages - self._top

    def is_allocated(self, ids: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = check_page_ids(ids, self.num_pages, "ids", unique=False)
        return self._allocated[arr]

    def allocated_mask(self, ids: np.ndarray) -> np.ndarray:
        """``is_allocated`` for ids the caller already checked (``check_page_ids``) against this pool."""
        return self._allocated[ids]

    # ---- mutation ------------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray | None:
        """Take ``n`` free pages; ``None`` (and no change) when fewer than ``n`` are free."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n: expected an int page count, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n: expected >= 0 pages, got {n}")
        if n > self._top:
            return None
        top = self._top
        ids = self._free[top - n : top][::-1]
        self._allocated[ids] = True
        self._top = top - n
        return ids.astype(ID_DTYPE)  # a copy, never a view of the free list

    def free(self, ids: Iterable[int] | np.ndarray) -> None:
        """Return pages to the pool. Validates the whole batch before changing anything."""
        self._free_checked(check_page_ids(ids, self.num_pages, "ids", unique=True))

    def free_owned(self, ids: np.ndarray) -> None:
        """``free`` for an owner that guarantees its ids are distinct integer ids of this pool
        (the cache freeing pages its tree held: its ownership bitmap rules out repeats).

        Still refuses (ValueError, no change) to free a page that is not allocated.
        """
        self._free_checked(ids)

    def _free_checked(self, ids: np.ndarray) -> None:
        n = ids.shape[0]
        if not n:
            return
        arr = ids.astype(np.intp, copy=False)  # not kept: the free list copies it below
        held = self._allocated[arr]
        if count_nonzero(held) != n:
            not_held = arr[~held]
            raise ValueError(f"ids: double free of {self.name} pages {not_held[:8].tolist()} (not allocated)")
        self._allocated[arr] = False
        top = self._top
        self._free[top : top + n] = arr[::-1]
        self._top = top + n

    def reset(self) -> None:
        """Free every page."""
        self.__init__(self.num_pages, self.name)

    def check(self) -> None:
        """Verify internal consistency (free list and bitmap agree); raises AssertionError."""
        free = self._free[: self._top]
        assert np.unique(free).size == free.size, f"{self.name}: duplicate ids in the free list"
        assert not self._allocated[free].any(), f"{self.name}: a free-listed page is marked allocated"
        assert int(self._allocated.sum()) == self.num_pages - self._top, f"{self.name}: counts disagree"

    def __repr__(self) -> str:
        return f"PageAllocator({self.name!r}, {self.used}/{self.num_pages} used)"
