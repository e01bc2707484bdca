"""Per-request bookkeeping for the request-level helpers (``cache_unfinished_req`` etc.).

Pure numpy. A ``CacheRequest`` is the slice of a scheduler's request that the cache needs:
the tokens so far, one device page per started page, the node locked on the request's
behalf (one of the cache's caller locks on that node), how many leading pages belong to the tree (the rest belong to the request), and the request's
eviction priority (``eviction_policy="priority"``: a node keeps the highest priority that
inserted through it; larger survives longer).

Hits by tier (set by ``begin_request``, never changed after): ``device_hit_tokens`` (the
prefix already on the device), ``host_hit_tokens`` (loaded back from host copies) and
``storage_hit_tokens`` (loaded back from pages an L3 prefetch attached), the same split as
the ``cached_tokens{cache_source}`` metric; ``hit_tokens`` has them as a dict.

With a component that keeps its own page ids (e.g. ``swa``), ``component_pages[name]`` holds
that component's ids the same way: one per started page, -1 where the request holds none
(pages out of its sliding window). The first ``cached_pages`` entries are the tree's (only
those the request's lock holds: its window), the rest the request's own.

Growing a request: ``extend(key, new_pages)`` takes the whole grown key and checks that it
starts with the current tokens (one compare of every token: fine per prompt or chunk);
``append(tokens, new_pages)`` takes only the new tokens (a decode step's one token) and costs
O(new tokens): they wait in a list and ``key`` joins them onto the key the first time it is
read (the request helpers read it when they insert). ``num_tokens`` is the length either way,
without building the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..allocator import ID_DTYPE, as_page_ids
from .radix_key import TOKEN_DTYPE, TOKEN_LIMIT, RadixKey, as_radix_key, as_token_ids, joined_key
from .tree_node import TreeNode


@dataclass
class CacheRequest:
    # The tokens so far (a property, installed below the class: the key as last set or built,
    # plus the tokens ``append`` added since, joined on first read).
    key: RadixKey
    page_size: int = 1
    # One device page id per started page of ``key`` (ceil(len / page_size)); the first
    # ``cached_pages`` are owned by the tree (and protected by the lock on ``last_node``),
    # the rest by the request until it inserts them.
    device_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, ID_DTYPE))
    last_node: TreeNode | None = None  # holds one device lock while not None
    cached_pages: int = 0
    priority: int = 0
    # Components with their own page ids: name -> one id per started page, -1 where none.
    component_pages: dict | None = None
    # Prompt tokens each tier served at ``begin_request`` (module docstring).
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    # A ``retention.RetentionHint`` its inserts apply (``begin_request(retain=)``), or None.
    retain: object = None
    # The request helpers of the cache whose ``begin_request`` made it (None: built by hand);
    # another cache's helpers refuse it (its page ids are not theirs).
    owner: object = field(default=None, repr=False, compare=False)
    # Set when ``cache_finished_req`` / ``abort_request`` released it: it holds nothing now.
    released: bool = False

    def __copy__(self) -> CacheRequest:
        out = object.__new__(CacheRequest)
        out.__dict__.update(self.__dict__)
        out._tail = list(self._tail)  # ``append`` grows it in place: a copy gets its own
        return out

    @property
    def num_tokens(self) -> int:
        """``len(key)``, without joining the tokens ``append`` added onto the key; TypeError
        naming ``req.key`` when the key is not a ``RadixKey``."""
        key = self._key
        if type(key) is not RadixKey and not isinstance(key, RadixKey):
            raise TypeError(f"req.key: expected a RadixKey, got {type(key).__name__}")
        return key.token_ids.shape[0] + len(self._tail)

    @property
    def hit_tokens(self) -> dict[str, int]:
        """``{"device", "host", "storage"}``: the prompt tokens each tier served (no overlap)."""
        return {"device": self.device_hit_tokens, "host": self.host_hit_tokens, "storage": self.storage_hit_tokens}

    def extend(self, key: object, new_pages: object, component_pages: dict | None = None) -> None:
        """Grow the request to ``key`` (which must start with the current tokens), adding
        ``new_pages`` (freshly allocated device pages) so there is one page per started page,
        and, per component with its own page ids, as many of its ids (-1 where none; a
        component the request tracks must be given, an untracked one starts at -1 for the
        pages it had).

        Validates before changing anything.
        """
        key = as_radix_key(key)
        if key.namespace != self.key.namespace:
            raise ValueError(f"key: namespace {key.namespace} differs from the request's {self.key.namespace}")
        if key is not self.key and not key.token_bytes.startswith(self.key.token_bytes):  # one memcmp
            raise ValueError("key: must extend the request's current tokens")
        pages = as_page_ids(new_pages, "new_pages")
        page_size = self.page_size
        want = -(-len(key) // page_size)
        if self.device_pages.shape[0] + pages.shape[0] != want:
            raise ValueError(
                f"new_pages: {len(key)} tokens need {want} pages in all, the request has "
                f"{self.device_pages.shape[0]} and got {pages.shape[0]} more"
            )
        if component_pages is None and self.component_pages is None:
            self.key = key
            self.device_pages = np.concatenate([self.device_pages, pages])
            return
        extra = self._component_extension(component_pages, pages.shape[0])
        self.key = key
        self._add_pages(pages, extra)

    def append(self, tokens: object, new_pages: object, component_pages: dict | None = None) -> None:
        """Grow the request by ``tokens`` (the new token ids only: a list of ints or a 1-D
        integer array), adding ``new_pages`` so there is one page per started page, and, per
        component with its own page ids, as many of its ids (as ``extend``).

        ``extend(RadixKey(tokens so far + tokens), new_pages, component_pages)`` in effect, in
        time O(len(tokens)): the current tokens are neither copied nor compared (the caller
        says what follows them). Validates before changing anything.
        """
        n = self.num_tokens  # TypeError naming req.key for one that is not a RadixKey
        # The usual call (a decode step: one int token, no page or one) checked inline.
        if type(tokens) is list and (
            len(tokens) == 1
            and type(tokens[0]) is int
            and 0 <= tokens[0] < TOKEN_LIMIT
            or all(type(t) is int and 0 <= t < TOKEN_LIMIT for t in tokens)
        ):
            new = tokens
        else:
            new = as_token_ids(tokens, "tokens").tolist()
        if type(new_pages) is np.ndarray and new_pages.shape == _NONE:
            pages = _NO_PAGES  # no page (as_page_ids takes any empty array); never stored itself
        else:
            pages = as_page_ids(new_pages, "new_pages")
        n += len(new)
        want = -(-n // self.page_size)
        have = self.device_pages.shape[0]
        if have + pages.shape[0] != want:
            raise ValueError(
                f"new_pages: {n} tokens need {want} pages in all, the request has {have} and got {pages.shape[0]} more"
            )
        if component_pages is None and self.component_pages is None:
            self._tail += new
            if pages.shape[0]:
                self.device_pages = np.concatenate([self.device_pages, pages])
            return
        extra = self._component_extension(component_pages, pages.shape[0])
        self._tail += new
        self._add_pages(pages, extra)

    def _add_pages(self, pages: np.ndarray, extra: dict) -> None:
        """The validated new device pages and per-component ids become the request's."""
        self.device_pages = np.concatenate([self.device_pages, pages])
        if extra:
            old = dict(self.component_pages or {})
            n_old = self.device_pages.shape[0] - pages.shape[0]
            for name, arr in extra.items():
                prev = old.get(name)
                if prev is None:
                    prev = np.full(n_old, -1, ID_DTYPE)
                old[name] = np.concatenate([prev, arr])
            self.component_pages = old

    def _component_extension(self, component_pages: dict | None, n: int) -> dict:
        """``extend``'s per-component ids, validated (nothing changed yet)."""
        extra = {}
        if component_pages is not None:
            if not isinstance(component_pages, dict):
                raise TypeError(
                    f"component_pages: expected a dict of name -> page ids, got {type(component_pages).__name__}"
                )
            for name, ids in component_pages.items():
                arr = _as_ids_or_none(ids, f"component_pages[{name!r}]")
                if arr.shape[0] != n:
                    raise ValueError(
                        f"component_pages[{name!r}]: expected {n} ids (one per new page), got {arr.shape[0]}"
                    )
                extra[name] = arr
        for name in self.component_pages or {}:
            if name not in extra:
                raise ValueError(
                    f"component_pages: the request tracks {name!r} pages; give one id per new page (-1 for none)"
                )
        return extra


_NONE = (0,)
_NO_PAGES = np.zeros(0, ID_DTYPE)


def _get_key(self: CacheRequest) -> RadixKey:
    tail = self._tail
    if tail:  # join what ``append`` added (validated there), once
        self._key = joined_key(self._key, np.array(tail, TOKEN_DTYPE))
        self._tail = []
    return self._key


def _set_key(self: CacheRequest, key: RadixKey) -> None:
    self._key = key  # checked where it is used (``extend``, ``append``, the request helpers)
    self._tail = []


# Installed after ``@dataclass`` read the field list: ``key`` stays the first field (the
# constructor's first argument; its ``self.key = key`` runs the setter).
CacheRequest.key = property(_get_key, _set_key, doc="The request's tokens so far (a ``RadixKey``).")


def _as_ids_or_none(ids: object, name: str) -> np.ndarray:
    """Page ids that may be -1 (none): an int32 copy; TypeError / ValueError naming ``name``."""
    arr = as_page_ids(ids, name)
    if arr.size and int(arr.min()) < -1:
        raise ValueError(f"{name}: ids must be >= -1 (-1: no page), got {int(arr.min())}")
    return arr
