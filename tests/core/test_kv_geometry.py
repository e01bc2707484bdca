import numpy as np
import pytest

from hicache_jax import KVGeometry


def test_mha_derived_sizes():
    g = KVGeometry.mha(num_layers=4, page_size=16, num_kv_heads=8, head_dim=128, dtype="bf16")
    assert g.dtype == "bfloat16" and g.components == ("k", "v")
    assert g.page_shape == (16, 8, 128)
    assert g.bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert g.bytes_per_page == g.bytes_per_token * 16
    assert g.container_dtype == np.uint16


def test_mla_width_is_lora_plus_rope():
    g = KVGeometry.mla(num_layers=2, page_size=1, kv_lora_rank=512, qk_rope_head_dim=64, dtype="fp8")
    assert g.components == ("kv",) and g.page_shape == (1, 1, 576)
    assert g.dtype == "float8_e4m3fn" and g.itemsize == 1
    assert g.bytes_per_token == 2 * 576


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(kind="gqa", num_layers=1, page_size=1), ValueError, "kind"),
        (dict(kind="mha", num_layers=0, page_size=1), ValueError, "num_layers"),
        (dict(kind="mha", num_layers=1, page_size=0), ValueError, "page_size"),
        (dict(kind="mha", num_layers=1.5, page_size=1), TypeError, "num_layers"),
        (dict(kind="mha", num_layers=1, page_size=1, dtype="int8"), ValueError, "dtype"),
        (dict(kind="mha", num_layers=1, page_size=1, num_kv_heads=0), ValueError, "num_kv_heads"),
        (dict(kind="mla", num_layers=1, page_size=1), ValueError, "kv_lora_rank"),
    ],
)
def test_invalid_geometry_rejected(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KVGeometry(**kwargs)
