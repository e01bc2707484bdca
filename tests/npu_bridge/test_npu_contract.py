"""Tier 2, MOCKED contract: npu_bridge against FAKE torch_npu and sgl_kernel_npu.kvcacheio.

Wiring only, no Ascend hardware or kernel: each test runs ``fakes/contract_driver.py`` in a
subprocess (the fake renames torch's PrivateUse1 backend to 'npu', which is one-shot), with
``fakes/`` on sys.path. Asserted: lazy imports, keyword-only calls, direction codes, one op
call per batch, CPU-side int64 token indices, pinned host allocation requested, the op
called inside the side stream, side streams ordered after the compute stream, signature
skew handled, and the data the fake op moved.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.npu_contract

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CORE_KWARGS = {"device_indices", "host_indices", "device_k", "host_k", "page_size", "direction", "flags"}


def drive(*args, variant="pinned"):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE / "fakes"), str(ROOT)]), FAKE_OP_VARIANT=variant)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    r = subprocess.run(
        [sys.executable, str(HERE / "fakes" / "contract_driver.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("REPORT ")]
    assert r.returncode == 0 and lines, f"driver failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("REPORT ") :])


def _calls(events):
    return [e for e in events if e["kind"] == "op_call"]


@pytest.mark.parametrize("kind", ["mha", "mla", "mla_norope"])
def test_mocked_op_contract_roundtrip(kind):
    rep = drive("roundtrip", kind)
    # lazy: torch_npu / the kernel package load only when an npu backend is built
    for stage in ("before_import", "after_import_npu_bridge"):
        assert not rep[stage]["torch_npu"] and not rep[stage]["sgl_kernel_npu.kvcacheio"], rep[stage]
    assert rep["after_backend"]["torch_npu"] and rep["after_backend"]["sgl_kernel_npu.kvcacheio"]
    assert rep["impl"] == "ascend", rep["reason"]
    # device pool on npu, host pool requested pinned, nothing else pinned or on host for the device
    allocs = rep["allocs"]
    assert [a["device"] for a in allocs if not a["pin_memory"]] == ["npu", "npu"]  # k+v, or lora+rope
    host_allocs = [a for a in allocs if a["pin_memory"]]
    assert host_allocs and all(a["device"] == "cpu" for a in host_allocs) and rep["host_pinned_attr"]
    assert len(host_allocs) == (1 if kind == "mha" else 2)  # kv_split: separate lora and rope arrays
    streams = rep["streams"]
    for phase, direction, stream in (("backup_events", 2, streams["d2h"]), ("load_events", 1, streams["h2d"])):
        events = rep[phase]
        calls = _calls(events)
        assert len(calls) == 1, f"{phase}: expected one op call per batch, got {len(calls)}"
        call = calls[0]
        assert call["n_positional"] == 0 and CORE_KWARGS <= set(call["keywords"]), call
        assert {"device_v", "host_v"} <= set(call["keywords"])
        assert call["direction"] == direction and call["flags"] & 2 and call["page_size"] == 4
        assert call["index_devices"] == ["cpu", "cpu"] and call["index_dtypes"] == ["torch.int64"] * 2
        assert call["n_indices"] == 2 * 4  # two whole pages of token indices
        assert call["stream"] == stream, "the op must run inside the side stream context"
        # the side stream waited for the compute stream before the copy, and an event follows it
        kinds = [(e["kind"], e.get("stream")) for e in events]
        assert (
            kinds.index(("wait_stream", stream))
            < kinds.index(("op_call", stream))
            < kinds.index(("event_record", stream))
        )
    assert rep["backup_calls_before_complete"] == 1  # launched at issue time, not at wait
    assert rep["layers_done"] == [True] * 3
    assert [e["kind"] for e in rep["stream_wait_events"]] == ["wait_event"]  # no host block
    assert rep["roundtrip_ok"] and rep["pages_moved"]


def test_mocked_deferred_mode_calls_op_only_on_complete():
    rep = drive("deferred", "mla")
    assert rep["impl"] == "ascend"
    assert rep["backup_calls_before_complete"] == 0
    assert len(_calls(rep["backup_events"])) == 1 and len(_calls(rep["load_events"])) == 1
    assert rep["roundtrip_ok"] and rep["pages_moved"]


def test_mocked_lazy_imports():
    rep = drive("lazy")
    for stage in ("before", "after_import", "after_devices"):
        assert not rep[stage]["torch_npu"], stage
    assert not rep["before"]["torch"] and not rep["after_import"]["torch"]  # numpy-only modules pull no torch
    assert rep["device"] == "npu:0" and rep["after_resolve_npu"]["torch_npu"]
    assert not rep["after_resolve_npu"]["sgl_kernel_npu.kvcacheio"]  # the op loads only for an engine


@pytest.mark.parametrize(
    "variant, extra", [("pinned", set()), ("newest", set()), ("fork", {"layer_start", "layer_num"})]
)
def test_mocked_signature_skew_binds_by_keyword(variant, extra):
    rep = drive("binding", variant=variant)
    for impl in ("auto", "ascend"):
        assert rep[impl]["impl"] == "ascend", rep
        (call,) = rep[impl]["call"]
        assert call["n_positional"] == 0
        assert set(call["keywords"]) == CORE_KWARGS | {"device_v", "host_v"} | extra  # never the *_scale extras
        if extra:
            assert call["layer_args"] == {"layer_start": 0, "layer_num": 3}


@pytest.mark.parametrize("variant, match", [("posonly", "positional-only"), ("unknown", "stream_handle")])
def test_mocked_unusable_signature_falls_back_or_raises(variant, match):
    rep = drive("binding", variant=variant)
    assert rep["auto"]["impl"] == "torch" and match in rep["auto"]["reason"]
    assert rep["ascend"]["error"] == "OpSignatureError" and match in rep["ascend"]["message"]


def test_mocked_missing_kernel_package():
    rep = drive("no_kernel")
    assert rep["auto"] == {"impl": "torch", "reason": "sgl_kernel_npu.kvcacheio is not installed"}
    assert rep["ascend"]["error"] == "MissingDependencyError"
    assert "sgl_kernel_npu.kvcacheio" in rep["ascend"]["message"]
