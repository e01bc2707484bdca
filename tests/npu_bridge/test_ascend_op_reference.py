"""Tier 1 (CPU): the Ascend op's torch reference and the signature binding, without any NPU package."""

import inspect

import numpy as np
import pytest
import torch

from hicache_jax import KVGeometry
from npu_bridge import make_torch_backend
from npu_bridge.ascend_op import (
    D2H,
    FAST2D,
    FLAG_1D,
    H2D,
    OpSignatureError,
    bind_op,
    page_token_indices,
    transfer_kv_dim_exchange_reference as op,
)

L, PAGE, H, D = 3, 4, 2, 5


def pools(seed=0, dtype=torch.int16, width=D):
    g = torch.Generator().manual_seed(seed)
    dev = torch.randint(-1000, 1000, (L, 6, PAGE, H, width), generator=g).to(dtype)
    host = torch.zeros((5, L, PAGE, H, width), dtype=dtype)
    return dev, host


def tok(pages):
    return page_token_indices(np.array(pages), PAGE)


def test_d2h_then_h2d_moves_whole_pages_all_layers():
    dk, hk = pools(0)
    dv, hv = pools(1)
    dik, hik = pools(2, width=3)
    op(tok([4, 1]), tok([0, 3]), dk, hk, dv, hv, dik, hik, page_size=PAGE, direction=D2H, flags=FAST2D)
    for d, h in ((dk, hk), (dv, hv), (dik, hik)):
        assert torch.equal(h[0], d[:, 4]) and torch.equal(h[3], d[:, 1])
        assert not h[[1, 2, 4]].any()
    op(tok([2, 5]), tok([0, 3]), dk, hk, dv, hv, dik, hik, page_size=PAGE, direction=H2D, flags=FAST2D)
    for d, h in ((dk, hk), (dv, hv), (dik, hik)):
        assert torch.equal(d[:, 2], h[0]) and torch.equal(d[:, 5], h[3])


def test_empty_v_is_skipped_and_k_only_allowed():
    dk, hk = pools(0)
    ev = torch.zeros((L, 6, PAGE, H, 0), dtype=torch.int16)
    eh = torch.zeros((5, L, PAGE, H, 0), dtype=torch.int16)
    op(tok([1]), tok([2]), dk, hk, ev, eh, page_size=PAGE, direction=D2H, flags=FAST2D)
    op(tok([3]), tok([4]), dk, hk, None, None, page_size=PAGE, direction=D2H, flags=FAST2D)
    assert torch.equal(hk[2], dk[:, 1]) and torch.equal(hk[4], dk[:, 3])


def test_partial_pages_rejected():
    dk, hk = pools()
    with pytest.raises(ValueError, match="multiple of page_size"):
        op(torch.arange(6), torch.arange(6), dk, hk, page_size=PAGE, direction=D2H, flags=FAST2D)
    ragged = torch.tensor([4, 5, 6, 8])  # starts page 1 but runs into page 2
    with pytest.raises(ValueError, match="whole aligned pages"):
        op(ragged, tok([0]), dk, hk, page_size=PAGE, direction=D2H, flags=FAST2D)
    unaligned = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match="whole aligned pages"):
        op(tok([0]), unaligned, dk, hk, page_size=PAGE, direction=D2H, flags=FAST2D)
    assert not hk.any()


def test_non_strict_uses_only_the_first_token_of_each_page_like_the_kernel():
    dk, hk = pools()
    # first token 9 -> page 2; the rest of the group is ignored, as by the kernel
    op(
        torch.tensor([9, 0, 0, 0]),
        torch.tensor([4, 99, 99, 99]),
        dk,
        hk,
        page_size=PAGE,
        direction=D2H,
        flags=FAST2D,
        strict=False,
    )
    assert torch.equal(hk[1], dk[:, 2]) and not hk[[0, 2, 3, 4]].any()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(flags=FLAG_1D), ValueError, "FAST2D"),
        (dict(direction=3), ValueError, "direction"),
        (dict(host_indices=tok([1, 2])), ValueError, "pages"),
        (dict(host_k=torch.zeros((5, L + 1, PAGE, H, D), dtype=torch.int16)), ValueError, "layer counts"),
        (dict(host_k=torch.zeros((5, L, PAGE, H, D + 1), dtype=torch.int16)), ValueError, "page shapes"),
        (dict(host_k=torch.zeros((5, L, PAGE * H * D), dtype=torch.int16)), ValueError, "5-D"),
        (dict(device_indices=tok([6])), IndexError, "out of range"),
        (dict(page_size=2), ValueError, "page_size"),
    ],
)
def test_bad_inputs_rejected(kwargs, exc, match):
    dk, hk = pools()
    args = dict(
        device_indices=tok([1]),
        host_indices=tok([2]),
        device_k=dk,
        host_k=hk,
        page_size=PAGE,
        direction=D2H,
        flags=FAST2D,
    )
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        op(**args)
    assert not hk.any()


def test_v_sized_by_k_element_size_and_contiguity_checked():
    dk, hk = pools()
    dv, hv = pools(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="element size"):
        op(tok([1]), tok([2]), dk, hk, dv, hv, page_size=PAGE, direction=D2H, flags=FAST2D)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros((L, 5, PAGE, H, D), dtype=torch.int16).transpose(0, 1)  # right shape, not contiguous
        op(tok([1]), tok([2]), dk, strided, page_size=PAGE, direction=D2H, flags=FAST2D)


# ---- signature binding ---------------------------------------------------------------------
def pinned(
    device_indices,
    host_indices,
    device_k,
    host_k,
    device_v,
    host_v,
    device_index_k=None,
    host_index_k=None,
    page_size=128,
    direction=1,
    flags=2,
):
    return dict(locals())


def newest(
    device_indices,
    host_indices,
    device_k,
    host_k,
    device_v,
    host_v,
    device_index_k=None,
    host_index_k=None,
    device_index_k_scale=None,
    host_index_k_scale=None,
    page_size=128,
    direction=1,
    flags=2,
):
    return dict(locals())


def fork_a(
    device_indices,
    host_indices,
    device_k,
    host_k,
    device_v,
    host_v,
    layer_start,
    layer_num,
    page_size=128,
    direction=1,
    flags=2,
):
    return dict(locals())


def fork_b(
    device_indices,
    host_indices,
    device_k,
    host_k,
    device_v,
    host_v,
    layer_num,
    layer_start,
    page_size=128,
    direction=1,
    flags=2,
):
    return dict(locals())


def var_kw(device_indices, host_indices, **kwargs):
    return dict(device_indices=device_indices, host_indices=host_indices, **kwargs)


def no_v(device_indices, host_indices, device_k, host_k, page_size=128, direction=1, flags=2):
    return dict(locals())


CORE = dict(
    device_indices="di",
    host_indices="hi",
    device_k="dk",
    host_k="hk",
    device_v="dv",
    host_v="hv",
    page_size=4,
    direction=D2H,
    flags=FAST2D,
)


@pytest.mark.parametrize("fn", [pinned, newest, fork_a, fork_b, var_kw])
def test_binding_calls_by_keyword(fn):
    got = bind_op(fn, need_v=True).call(dict(CORE), num_layers=7)
    for k, v in CORE.items():
        assert got[k] == v
    if fn in (fork_a, fork_b):  # forks' layer range, whatever its position
        assert got["layer_start"] == 0 and got["layer_num"] == 7
    if fn is newest:
        assert got["device_index_k_scale"] is None


def test_binding_rejects_what_a_keyword_call_cannot_satisfy():
    def posonly(
        device_indices, host_indices, device_k, host_k, device_v, host_v, /, page_size=128, direction=1, flags=2
    ):
        pass

    def unknown(
        device_indices, host_indices, device_k, host_k, device_v, host_v, workspace, page_size=128, direction=1, flags=2
    ):
        pass

    with pytest.raises(OpSignatureError, match="positional-only"):
        bind_op(posonly, need_v=True)
    with pytest.raises(OpSignatureError, match="workspace"):
        bind_op(unknown, need_v=True)
    with pytest.raises(OpSignatureError, match="device_v"):
        bind_op(no_v, need_v=True)
    assert bind_op(no_v, need_v=False).kwargs(dict(CORE), 1).keys() == {
        "device_indices",
        "host_indices",
        "device_k",
        "host_k",
        "page_size",
        "direction",
        "flags",
    }

    class Opaque:  # e.g. an extension callable whose signature cannot be read
        __signature__ = "unreadable"

        def __call__(self, *args, **kwargs):
            pass

    with pytest.raises(OpSignatureError, match="cannot read the signature"):
        bind_op(Opaque(), need_v=False)
    assert inspect.signature(op).parameters.keys() >= set(CORE)  # the reference speaks the wrapper's names


def test_engine_makes_one_keyword_call_per_batch_with_cpu_indices():
    calls = []

    def recording(**kwargs):
        calls.append(kwargs)
        op(**kwargs)

    recording.__signature__ = inspect.signature(pinned)
    g = KVGeometry.mha(L, PAGE, H, D, "float16")
    dev, host, eng = make_torch_backend(g, 6, 5, "page_first_direct", impl="reference", op=recording)
    dev.write("k", np.arange(6), np.arange(L * 6 * PAGE * H * D, dtype=np.uint16).reshape(L, 6, PAGE, H, D))
    eng.backup([5, 0, 2], [1, 4, 0]).wait()
    lh = eng.load([1, 4, 0], [1, 3, 4])
    lh.wait()
    assert [c["direction"] for c in calls] == [D2H, H2D]
    for c in calls:
        assert c["flags"] & FAST2D and c["page_size"] == PAGE
        for k in ("device_indices", "host_indices"):
            assert c[k].device.type == "cpu" and c[k].dtype == torch.int64 and c[k].numel() == 3 * PAGE
        assert c["device_k"].shape == (L, 6, PAGE, H, D) and c["host_k"].shape == (5, L, PAGE, H, D)
        assert c["host_k"].dtype == c["device_k"].dtype  # host bytes viewed in the device dtype
    assert calls[0]["device_indices"][::PAGE].tolist() == [20, 0, 8]
    np.testing.assert_array_equal(dev.read("k", [1, 3, 4]), dev.read("k", [5, 0, 2]))
