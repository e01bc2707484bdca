"""Saved weights of a target + draft pair (``.npz``), and the trained toy pair in this package.

File format: one ``.npz`` with ``config`` (the target's ``ModelConfig`` as JSON), ``meta``
(JSON: how it was trained) and one float16 array per parameter, named ``target/<path>`` and
``draft/<path>`` (``<path>``: the NNX parameter path joined by ``/``). float16 keeps the toy
pair under 300 KB; loading casts to the module's dtype (float32), so the models that serve
are exactly the rounded ones the training script evaluated.

``load_pair`` validates names and shapes against freshly built modules (ValueError naming
the parameter otherwise); ``PairWeights.digest`` (SHA-256 of the file) identifies the
weights, e.g. in L3 keys, where a model built from a seed and a trained one of the same
shape must never share pages.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .draft import DraftHead
from .model import Transformer

# The trained toy pair (scripts/train_spec_pair.py writes it; tests and ``bench spec`` load it).
TOY_PAIR_PATH = Path(__file__).with_name("spec_toy_pair.npz")


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` as numpy, by ``/``-joined path."""
    return {
        "/".join(map(str, path)): np.asarray(var[...]) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def apply_params(model: nnx.Module, params: dict[str, np.ndarray], what: str) -> None:
    """Set every parameter of ``model`` from ``params`` (exactly its names and shapes)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {"/".join(map(str, path)): var for path, var in flat}
    if set(names) != set(params):
        missing, extra = sorted(set(names) - set(params)), sorted(set(params) - set(names))
        raise ValueError(f"{what}: parameters do not match the model (missing {missing[:4]}, unexpected {extra[:4]})")
    for name, var in names.items():
        arr = params[name]
        if tuple(arr.shape) != tuple(var[...].shape):
            raise ValueError(f"{what}: parameter {name} has shape {arr.shape}, the model expects {var[...].shape}")
        var[...] = jnp.asarray(arr, dtype=var[...].dtype)
    nnx.update(model, nnx.from_flat_state(flat))


@runtime_checkable
class ModelWeights(Protocol):
    """What ``Engine(weights=...)`` takes: trained weights for ``config``. ``target()`` builds
    the model the paged step runs (any family: ``paged_forward``), ``draft()`` its speculative
    draft head or None (the weights have none), ``digest`` identifies the weights (L3 keys).
    ``PairWeights`` (the toy pair) and ``models.gemma3.paged.Gemma3Weights`` are two."""

    config: ModelConfig
    digest: str

    def target(self) -> nnx.Module: ...

    def draft(self) -> "DraftHead | None": ...


@dataclass(frozen=True)
class PairWeights:
    """A loaded target + draft pair: build modules with ``target()`` / ``draft()``."""

    config: ModelConfig
    target_params: dict
    draft_params: dict
    meta: dict
    digest: str

    def target(self) -> Transformer:
        model = Transformer(self.config)
        apply_params(model, self.target_params, "target")
        return model

    def draft(self) -> DraftHead:
        head = DraftHead(self.config)
        apply_params(head, self.draft_params, "draft")
        return head


def save_pair(path: str | Path, target: Transformer, draft: DraftHead, meta: dict | None = None) -> int:
    """Write ``target`` and ``draft`` (float16) to ``path``; returns the file size in bytes."""
    arrays = {
        "config": np.array(json.dumps(asdict(target.cfg), sort_keys=True)),
        "meta": np.array(json.dumps(meta or {}, sort_keys=True)),
    }
    for prefix, model in (("target", target), ("draft", draft)):
        for name, arr in flat_params(model).items():
            arrays[f"{prefix}/{name}"] = arr.astype(np.float16)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    Path(path).write_bytes(buf.getvalue())
    return len(buf.getvalue())


def load_pair(path: str | Path = TOY_PAIR_PATH) -> PairWeights:
    raw = Path(path).read_bytes()
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        config = ModelConfig(**json.loads(str(z["config"])))
        meta = json.loads(str(z["meta"]))
        parts: dict[str, dict] = {"target": {}, "draft": {}}
        for key in z.files:
            if key in ("config", "meta"):
                continue
            prefix, _, name = key.partition("/")
            if prefix not in parts:
                raise ValueError(f"path: unexpected array {key!r} in {path}")
            parts[prefix][name] = z[key]
    pair = PairWeights(config, parts["target"], parts["draft"], meta, hashlib.sha256(raw).hexdigest())
    pair.target(), pair.draft()  # validates names and shapes now, not at first use
    return pair
