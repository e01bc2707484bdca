"""Radix keys: token ids plus a namespace, validated once at the API boundary.

Pure numpy. A ``RadixKey`` is what the tree indexes: int64 token ids and a namespace built
from ``extra_key`` (LoRA id, tenant, ...) and ``cache_salt``. A key is immutable: it copies
the tokens once, into ``token_bytes`` (their native int64 bytes, which the tree compares and
keys its children by), and ``token_ids`` is a read-only array over those bytes, so a caller
that later reuses its own buffer cannot change a key the tree is working with. Keys in
different namespaces never share a node: the root's children are keyed by
``(namespace, first page)`` and every node below inherits its parent's namespace.

Matching works in whole pages: ``aligned_len`` rounds down to a page multiple, and a child
is found by the bytes of its first page (``page_key``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

TOKEN_DTYPE = np.int64


def as_token_ids(tokens: object, name: str = "token_ids") -> np.ndarray:
    """Return ``tokens`` as a 1-D int64 array; TypeError/ValueError naming ``name`` otherwise.

    An int64 array is used as is (no copy): the tree copies the slices it keeps.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, range)):
            raise TypeError(f"{name}: expected a sequence of ints, got {type(tokens).__name__}")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in tokens):
            bad = next(t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
            raise TypeError(f"{name}: expected integer token ids, got {type(bad).__name__} {bad!r}")
        arr = np.asarray(tokens, dtype=TOKEN_DTYPE) if len(tokens) else np.zeros(0, TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype != TOKEN_DTYPE:
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
        arr = arr.astype(TOKEN_DTYPE)
    return arr


@dataclass(frozen=True, eq=False)
class RadixKey:
    """Token ids (int64, read-only) plus the namespace they live in."""

    token_ids: np.ndarray
    extra_key: Hashable = None
    cache_salt: Hashable = None
    token_bytes: bytes = field(init=False, repr=False)  # the ids' native int64 bytes
    namespace: tuple = field(init=False, repr=False)  # (extra_key, cache_salt)

    def __post_init__(self) -> None:
        data = as_token_ids(self.token_ids).tobytes()  # the one copy of the tokens
        object.__setattr__(self, "token_bytes", data)
        object.__setattr__(self, "token_ids", np.frombuffer(data, TOKEN_DTYPE))
        for name in ("extra_key", "cache_salt"):
            try:
                hash(getattr(self, name))
            except TypeError:
                raise TypeError(f"{name}: expected a hashable value, got {type(getattr(self, name)).__name__}") from None
        object.__setattr__(self, "namespace", (self.extra_key, self.cache_salt))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def prefix(self, n: int) -> "RadixKey":
        """The first ``n`` tokens in the same namespace."""
        return RadixKey(self.token_ids[:n], self.extra_key, self.cache_salt)


def as_radix_key(key: object, name: str = "key") -> RadixKey:
    """Accept a RadixKey or a bare token sequence (default namespace)."""
    if isinstance(key, RadixKey):
        return key
    return RadixKey(as_token_ids(key, name))


def aligned_len(n: int, page_size: int) -> int:
    return n - n % page_size


def page_key(tokens: np.ndarray, offset: int, page_size: int) -> bytes:
    """Child-dict key: the raw bytes of the page starting at ``offset``."""
    return tokens[offset:offset + page_size].tobytes()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 arrays (in tokens, not rounded)."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    if eq.all():
        return n
    return int(eq.argmin())
