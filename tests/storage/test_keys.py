import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from hicache_jax import KVGeometry
from hicache_jax.storage import Namespace, page_keys, pool_page_keys
from hicache_jax.storage.keys import encode_page_tokens, encoded_page_keys, keys_to_array

from storage_helpers import REPO

NS = Namespace(model="m", weights_revision="r1", kv_dtype="bfloat16", page_size=4, layout="page_first")
TOKENS = np.arange(1000, 1000 + 4 * 6)

_CODE = (
    "import json, numpy as np; from hicache_jax.storage import Namespace, page_keys; "
    "ns = Namespace(model='m', weights_revision='r1', kv_dtype='bfloat16', page_size=4, layout='page_first'); "
    "print(json.dumps([k.hex() for k in page_keys(ns, np.arange(1000, 1024))]))"
)


def test_keys_identical_across_processes():
    outs = set()
    for seed in ("0", "1", "random"):  # different hash seeds must not matter
        r = subprocess.run(
            [sys.executable, "-c", _CODE],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip())
    assert len(outs) == 1
    assert json.loads(outs.pop()) == [k.hex() for k in page_keys(NS, TOKENS)]


def test_format_is_pinned():
    # Changing the key format silently would orphan every stored page: bump KEY_FORMAT_VERSION instead.
    import hashlib

    ns_blob = json.dumps(
        {
            "extra_key": "",
            "kv_dtype": "bfloat16",
            "layout": "page_first",
            "model": "m",
            "page_size": 4,
            "pool": "target",
            "tp_rank": 0,
            "tp_size": 1,
            "weights_revision": "r1",
            "key_format": 1,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    seed = hashlib.sha256(b"hicache_jax/ns/v1\0" + ns_blob).digest()
    assert NS.digest == seed
    d0 = hashlib.sha256(seed + np.arange(1000, 1004, dtype="<u4").tobytes()).digest()
    d1 = hashlib.sha256(d0 + np.arange(1004, 1008, dtype="<u4").tobytes()).digest()
    assert page_keys(NS, TOKENS)[:2] == [d0, d1]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "m2"),
        ("weights_revision", "r2"),
        ("kv_dtype", "float8_e4m3fn"),
        ("layout", "layer_first"),
        ("pool", "draft"),
        ("tp_size", 2),
        ("tp_rank", None),
        ("extra_key", "lora-7"),
        ("page_size", None),
    ],
)
def test_every_namespace_field_changes_every_key(field, value):
    base = page_keys(NS, TOKENS)
    if field == "tp_rank":
        ns = dataclasses.replace(NS, tp_size=2, tp_rank=1)
        other = page_keys(dataclasses.replace(NS, tp_size=2, tp_rank=0), TOKENS)
        assert not set(page_keys(ns, TOKENS)) & set(other)
    elif field == "page_size":
        ns = dataclasses.replace(NS, page_size=2)
    else:
        ns = dataclasses.replace(NS, **{field: value})
    keys = page_keys(ns, TOKENS)
    assert keys and not set(keys) & set(base)


def test_chain_continues_and_depends_on_prefix():
    full = page_keys(NS, TOKENS)
    assert len(full) == 6 and all(len(k) == 32 for k in full)
    assert page_keys(NS, TOKENS[8:], prev=full[1]) == full[2:]
    # same page tokens after a different prefix -> different key
    other = page_keys(NS, np.concatenate([[7, 7, 7, 7], TOKENS[4:8]]))
    assert other[1] != full[1]
    # a trailing partial page gets no key
    assert page_keys(NS, TOKENS[:10]) == full[:2]
    assert page_keys(NS, []) == []


def test_encoded_page_keys_are_the_page_keys_of_the_encoding():
    data = encode_page_tokens(TOKENS)
    full = page_keys(NS, TOKENS)
    assert encoded_page_keys(NS, data) == full
    assert encoded_page_keys(NS, data[8 * 4 :], prev=full[1]) == full[2:]  # 2 pages of 4 tokens, 4 bytes each
    assert encoded_page_keys(NS, data[: 10 * 4]) == full[:2]  # a trailing partial page gets no key
    assert encoded_page_keys(NS, b"") == []
    with pytest.raises(TypeError, match="data"):
        encoded_page_keys(NS, TOKENS)
    with pytest.raises(TypeError, match="ns"):
        encoded_page_keys("ns", data)
    with pytest.raises(ValueError, match="prev"):
        encoded_page_keys(NS, data, prev=b"short")


def test_pool_keys_are_disjoint():
    by_pool = pool_page_keys([NS, NS.for_pool("draft"), NS.for_pool("swa")], TOKENS)
    assert by_pool["target"] == page_keys(NS, TOKENS)
    all_keys = [k for ks in by_pool.values() for k in ks]
    assert len(set(all_keys)) == 18


def test_token_encoding_width_and_range():
    assert encode_page_tokens([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    with pytest.raises(ValueError, match="2\\*\\*32"):
        page_keys(NS, np.array([0, 1, 2, 2**32], dtype=np.int64))
    with pytest.raises(ValueError):
        page_keys(NS, [-1, 0, 0, 0])
    with pytest.raises(TypeError):
        page_keys(NS, [0.5, 1.0, 2.0, 3.0])
    # dtype of the input array does not matter, only the values
    assert page_keys(NS, TOKENS.astype(np.int32)) == page_keys(NS, TOKENS.astype(np.uint64))


def test_namespace_validation_and_from_geometry():
    g = KVGeometry.mha(2, 16, 2, 64, "fp8")
    ns = Namespace.from_geometry(g, "page_first", model="llama", pool="draft")
    assert (ns.kv_dtype, ns.page_size, ns.layout, ns.pool) == ("float8_e4m3fn", 16, "page_first", "draft")
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace(model="m", weights_revision="", kv_dtype="bfloat16", page_size=4, layout="x", tp_size=2, tp_rank=2)
    with pytest.raises(TypeError, match="page_size"):
        Namespace(model="m", weights_revision="", kv_dtype="bfloat16", page_size="4", layout="x")
    with pytest.raises(ValueError, match="model"):
        Namespace(model="", weights_revision="", kv_dtype="bfloat16", page_size=4, layout="x")
    with pytest.raises(ValueError):
        page_keys(NS, TOKENS, prev=b"short")
    assert keys_to_array(page_keys(NS, TOKENS)).shape == (6, 32)
