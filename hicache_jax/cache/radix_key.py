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

Token ids are in ``[0, 2**32)``, the range every tier can hold (L3 keys encode tokens as
uint32): ``as_token_ids`` rejects others with ValueError naming the argument, and never wraps
(a uint64 above 2**63, an int beyond int64).

Tenant identity, one rule in every tier
---------------------------------------
``extra_key`` and ``cache_salt`` are identified by type and value, never by Python's ``==``
(under which ``True == 1 == 1.0``). Each is canonicalised once, at construction
(``canonical_namespace_value``), and ``RadixKey.namespace`` is the pair of canonical values;
the tree (L1/L2) compares and hashes those, and L3 derives its key namespace from the same
pair (``encode_namespace``, typed JSON). The accepted values and their identity:

* ``None`` (the default namespace), ``str`` and ``bytes`` (``bytearray`` as ``bytes``): by
  value; ``"1"``, ``b"1"`` and ``1`` are three tenants. These stay as they are.
* ``bool`` (and ``numpy.bool_``), ``int`` (and numpy integers), ``float`` (and numpy
  floats): tagged ``("b", v)``, ``("i", int(v))``, ``("f", repr(float(v)))``; so ``True``,
  ``1`` and ``1.0`` are three tenants, ``numpy.int64(1)`` and ``1`` one, ``0.0`` and ``-0.0``
  two, and every NaN one.
* ``tuple`` of accepted values: ``("t", canonical items)``.

Anything else (lists, dicts, sets, arbitrary objects) has no stable, process-independent
encoding and is rejected with TypeError naming the argument when the key is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

TOKEN_DTYPE = np.int64
TOKEN_LIMIT = 1 << 32  # token ids are in [0, TOKEN_LIMIT)
_U64 = np.uint64


def _in_range(arr: np.ndarray) -> bool:
    """Whether every id of a non-empty int64 array is in ``[0, 2**32)``. As uint64 a negative
    id is >= 2**63, so the largest covers both bounds; ``argmax`` finds it (a plain C loop)
    at about a third of a ufunc reduction's fixed cost, which dominates at prompt sizes (keys
    are built per request)."""
    u = arr.view(_U64)
    return u[u.argmax()] < TOKEN_LIMIT


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
        try:
            arr = np.asarray(tokens, dtype=TOKEN_DTYPE) if len(tokens) else np.zeros(0, TOKEN_DTYPE)
        except OverflowError:
            bad = next(int(t) for t in tokens if not 0 <= t < TOKEN_LIMIT)
            raise ValueError(f"{name}: token ids must be in [0, 2**32), got {bad}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype != TOKEN_DTYPE:
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= TOKEN_LIMIT:  # before a cast could wrap
            raise ValueError(f"{name}: token ids must be in [0, 2**32), got {int(arr.max())}")
        arr = arr.astype(TOKEN_DTYPE)
    if arr.size and not _in_range(arr):
        bad = arr[(arr < 0) | (arr >= TOKEN_LIMIT)]
        raise ValueError(f"{name}: token ids must be in [0, 2**32), got {bad[:4].tolist()}")
    return arr


def canonical_namespace_value(value: object, name: str = "extra_key") -> Hashable:
    """The canonical, type-aware identity of one namespace value (see the module docstring);
    TypeError naming ``name`` for a value without a stable encoding."""
    if value is None:
        return None
    t = type(value)
    if t is str or t is bytes:
        return value
    if isinstance(value, (bool, np.bool_)):
        return ("b", bool(value))
    if isinstance(value, (int, np.integer)):
        return ("i", int(value))
    if isinstance(value, (float, np.floating)):
        return ("f", float.__repr__(float(value)))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, tuple):
        return ("t", tuple(canonical_namespace_value(v, name) for v in value))
    raise TypeError(
        f"{name}: expected None, a bool, int, float, str, bytes or a tuple of those (a typed, "
        f"process-stable tenant identity), got {type(value).__name__}"
    )


def _json_value(c: Hashable) -> object:
    if c is None:
        return None
    if type(c) is str:
        return {"s": c}
    if type(c) is bytes:
        return {"x": c.hex()}
    tag, payload = c
    if tag == "t":
        return {"t": [_json_value(x) for x in payload]}
    return {tag: payload}


def encode_namespace(salt: str, namespace: tuple) -> str:
    """Canonical, process-stable string of a ``RadixKey.namespace`` (canonical values) under a
    storage ``salt``: ``""`` for no salt and the default namespace, otherwise typed JSON. The
    L3 key namespace's ``extra_key`` field; the same identity the tree uses."""
    if not salt and namespace[0] is None and namespace[1] is None:
        return ""
    return json.dumps([salt, [_json_value(c) for c in namespace]], sort_keys=True, separators=(",", ":"))


DEFAULT_NAMESPACE = (None, None)


_I64 = np.dtype(TOKEN_DTYPE)


def _fast_token_ids(tokens: object, name: str) -> np.ndarray:
    """``as_token_ids`` with the common case (a native 1-D int64 array in range) checked with
    no further calls; anything else takes the full path (convert or raise)."""
    if (
        type(tokens) is np.ndarray
        and tokens.dtype is _I64
        and tokens.ndim == 1
        and (not tokens.shape[0] or _in_range(tokens))
    ):
        return tokens
    return as_token_ids(tokens, name)


@dataclass(frozen=True, eq=False, init=False)
class RadixKey:
    """Token ids (int64 in ``[0, 2**32)``, read-only) plus the namespace they live in.

    ``namespace`` is ``(canonical extra_key, canonical cache_salt)``: two keys share a tenant
    exactly when their values are equal *and of the same kind* (``True``, ``1`` and ``1.0``
    are three tenants; ``1`` and ``numpy.int64(1)`` one). The tree and L3 both use it (see
    the module docstring for the accepted values); others raise TypeError here.
    """

    token_ids: np.ndarray
    extra_key: Hashable = None
    cache_salt: Hashable = None
    token_bytes: bytes = field(init=False, repr=False)  # the ids' native int64 bytes
    namespace: tuple = field(init=False, repr=False)  # canonical (extra_key, cache_salt)

    def __init__(self, token_ids: object, extra_key: Hashable = None, cache_salt: Hashable = None) -> None:
        # Written straight into __dict__ (frozen: no __setattr__), once; keys are built per request.
        data = _fast_token_ids(token_ids, "token_ids").tobytes()  # the one copy of the tokens
        ns = (
            DEFAULT_NAMESPACE
            if extra_key is None and cache_salt is None
            else (
                canonical_namespace_value(extra_key, "extra_key"),
                canonical_namespace_value(cache_salt, "cache_salt"),
            )
        )
        d = self.__dict__
        d["token_ids"] = np.frombuffer(data, TOKEN_DTYPE)
        d["extra_key"] = extra_key
        d["cache_salt"] = cache_salt
        d["token_bytes"] = data
        d["namespace"] = ns

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def prefix(self, n: int) -> "RadixKey":
        """The first ``n`` tokens in the same namespace."""
        return RadixKey(self.token_ids[:n], self.extra_key, self.cache_salt)


def as_radix_key(key: object, name: str = "key") -> RadixKey:
    """Accept a RadixKey or a bare token sequence (default namespace)."""
    if isinstance(key, RadixKey):
        return key
    data = _fast_token_ids(key, name).tobytes()  # checked once, here, under the caller's name
    out = object.__new__(RadixKey)
    d = out.__dict__
    d["token_ids"] = np.frombuffer(data, TOKEN_DTYPE)
    d["extra_key"] = d["cache_salt"] = None
    d["token_bytes"] = data
    d["namespace"] = DEFAULT_NAMESPACE
    return out


def joined_key(key: RadixKey, tail: np.ndarray) -> RadixKey:
    """``key`` followed by ``tail`` (int64 ids, already checked), in ``key``'s namespace: one
    copy of the bytes, no re-validation of ``key``'s tokens or namespace."""
    data = key.token_bytes + tail.tobytes()
    out = object.__new__(RadixKey)
    d = out.__dict__
    d["token_ids"] = np.frombuffer(data, TOKEN_DTYPE)
    d["extra_key"] = key.extra_key
    d["cache_salt"] = key.cache_salt
    d["token_bytes"] = data
    d["namespace"] = key.namespace
    return out


def aligned_len(n: int, page_size: int) -> int:
    return n - n % page_size


def page_key(tokens: np.ndarray, offset: int, page_size: int) -> bytes:
    """Child-dict key: the raw bytes of the page starting at ``offset``."""
    return tokens[offset : offset + page_size].tobytes()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 arrays (in tokens, not rounded)."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    if eq.all():
        return n
    return int(eq.argmin())
