"""L3 page keys: a SHA-256 chain over token pages, seeded with a namespace digest.

Pure Python + numpy + hashlib. Stable across processes, machines and Python versions:
nothing here uses Python's ``hash`` (randomised per process), ``pickle`` or dict order.

Scheme (format version 1)::

    ns   = SHA-256(b"hicache_jax/ns/v1\\0" + canonical JSON of the Namespace fields)
    d_0  = SHA-256(ns   || tokens_0 as little-endian uint32)
    d_i  = SHA-256(d_i-1 || tokens_i as little-endian uint32)

``d_i`` (32 raw bytes) is the key of page ``i``; ``d_i.hex()`` is its printable form.
Unlike upstream (whose first page has no prior digest and whose chain ignores model, dtype,
layout and salt, as upstream's storage keys), every key here depends on the whole namespace, so a
bf16 page can never answer for an fp8 one, nor one model's KV for another's.

Token width: uint32 little-endian (4 bytes per token), as upstream. Every vocabulary in use
is far below 2**32; ids outside ``[0, 2**32)`` are rejected with ``ValueError`` rather than
silently wrapped, so a caller that ever needs wider ids gets a loud error (bump the format
version and switch to uint64 then).

Pools: each pool (``target``, ``draft``, ``swa`` ...) gets its own namespace (``pool`` field),
so its keys are disjoint from every other pool's even for the same tokens.

Threading: all functions are pure; ``Namespace`` is immutable and caches its digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Sequence

import numpy as np

from .._checks import check_int

KEY_BYTES = 32
KEY_FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u4")  # fixed width, explicit little-endian
_NS_PREFIX = b"hicache_jax/ns/v1\0"


def _check_str(name: str, value: object, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name}: expected a non-empty string")
    return value


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two processes to share a stored page.

    ``layout`` is the host layout whose transfer order the stored bytes use (pages are stored
    as raw host bits; a reader with another layout would see scrambled KV, so it must miss).
    ``tp_size``/``tp_rank``: KV heads are sharded by TP, so each rank stores its own shard.
    ``extra_key`` is the cache salt (LoRA id, tenant salt, ...); ``""`` means none.
    """

    model: str
    weights_revision: str
    kv_dtype: str
    page_size: int
    layout: str
    pool: str = "target"
    tp_size: int = 1
    tp_rank: int = 0
    extra_key: str = ""
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_str("model", self.model, allow_empty=False)
        _check_str("weights_revision", self.weights_revision)
        _check_str("kv_dtype", self.kv_dtype, allow_empty=False)
        _check_str("layout", self.layout, allow_empty=False)
        _check_str("pool", self.pool, allow_empty=False)
        _check_str("extra_key", self.extra_key)
        check_int("page_size", self.page_size, 1)
        check_int("tp_size", self.tp_size, 1)
        check_int("tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank: expected < tp_size={self.tp_size}, got {self.tp_rank}")
        fields_ = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        fields_["key_format"] = KEY_FORMAT_VERSION
        # Canonical JSON (sorted keys, no whitespace, ASCII) is byte-stable across processes.
        blob = json.dumps(fields_, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        object.__setattr__(self, "_digest", hashlib.sha256(_NS_PREFIX + blob).digest())

    @classmethod
    def from_geometry(
        cls,
        geom: object,
        layout: object,
        *,
        model: str,
        weights_revision: str = "",
        pool: str = "target",
        tp_size: int = 1,
        tp_rank: int = 0,
        extra_key: str = "",
    ) -> "Namespace":
        """Build from a ``KVGeometry`` and a ``HostLayout`` (dtype and page size come from them).

        The geometry's shape (layers, heads, head dim) is folded into ``model`` implicitly:
        the same model id always has the same shape; a mismatch is still caught on read by
        the stored page size check.
        """
        layout_name = getattr(layout, "value", layout)
        return cls(
            model=model,
            weights_revision=weights_revision,
            kv_dtype=geom.dtype,
            page_size=geom.page_size,
            layout=str(layout_name),
            pool=pool,
            tp_size=tp_size,
            tp_rank=tp_rank,
            extra_key=extra_key,
        )

    def for_pool(self, pool: str) -> "Namespace":
        return replace(self, pool=pool)

    @property
    def digest(self) -> bytes:
        """32-byte namespace digest: the seed of every key chain in this namespace."""
        return self._digest


def encode_page_tokens(tokens: object) -> bytes:
    """Little-endian uint32 bytes of one page's token ids (range-checked, never wrapped)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D page of token ids, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("tokens: token ids must be in [0, 2**32) for the uint32 key encoding")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def page_keys(ns: Namespace, tokens: object, prev: bytes | None = None) -> list[bytes]:
    """Keys of every *full* page of ``tokens`` (a trailing partial page gets no key).

    ``prev`` continues a chain: pass the key of the page just before ``tokens`` (e.g. the
    parent node's last page key); ``None`` starts at the namespace seed. Keys are 32 raw bytes.
    """
    _check_chain(ns, prev)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {arr.shape}")
    return _chain(ns, encode_page_tokens(arr) if arr.size else b"", prev)


def encoded_page_keys(ns: Namespace, data: bytes, prev: bytes | None = None) -> list[bytes]:
    """``page_keys`` of tokens already encoded (``encode_page_tokens``' little-endian uint32
    bytes, e.g. of ids known to be in range): the keys of every full page of ``data``, with
    no pass over the tokens before hashing."""
    _check_chain(ns, prev)
    if not isinstance(data, bytes):
        raise TypeError(f"data: expected bytes (encode_page_tokens' output), got {type(data).__name__}")
    return _chain(ns, data, prev)


def _check_chain(ns: object, prev: object) -> None:
    if not isinstance(ns, Namespace):
        raise TypeError(f"ns: expected a Namespace, got {type(ns).__name__}")
    if prev is not None and (not isinstance(prev, (bytes, bytearray)) or len(prev) != KEY_BYTES):
        raise ValueError(f"prev: expected {KEY_BYTES} raw bytes or None")


def _chain(ns: Namespace, data: bytes, prev: bytes | None) -> list[bytes]:
    step = ns.page_size * TOKEN_DTYPE.itemsize
    digest = bytes(prev) if prev is not None else ns.digest
    sha256 = hashlib.sha256
    out = []
    for off in range(0, (len(data) // step) * step, step):
        digest = sha256(digest + data[off : off + step]).digest()
        out.append(digest)
    return out


def pool_page_keys(
    namespaces: Sequence[Namespace], tokens: object, prev: dict[str, bytes] | None = None
) -> dict[str, list[bytes]]:
    """``page_keys`` for several pools at once (one chain per pool namespace)."""
    prev = prev or {}
    return {ns.pool: page_keys(ns, tokens, prev.get(ns.pool)) for ns in namespaces}


def keys_to_array(keys: Iterable[bytes]) -> np.ndarray:
    """Pack keys into a ``uint8[n, 32]`` array (the on-disk form in segments)."""
    keys = list(keys)
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise ValueError(f"keys: expected {KEY_BYTES}-byte keys, got {k!r:.40}")
    if not keys:
        return np.zeros((0, KEY_BYTES), np.uint8)
    return np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), KEY_BYTES).copy()


def check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(
            f"key: expected {KEY_BYTES} raw bytes, got {type(key).__name__} "
            f"of length {len(key) if hasattr(key, '__len__') else '?'}"
        )
    return bytes(key)
