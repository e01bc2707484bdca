"""Bad input to the Gemma 3 loader: a clear error naming the file, and nothing cached under its key."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

from hicache_jax.models import gemma3
from hicache_jax.models.gemma3 import gguf_loader, load_gguf, model_file


def _bad_copy(src: Path, dst: Path, keep: int | None = None, patch: tuple[int, bytes] | None = None) -> Path:
    with open(src, "rb") as f, open(dst, "wb") as g:
        if keep is None:
            shutil.copyfileobj(f, g)
        else:
            g.write(f.read(keep))
    if patch is not None:
        with open(dst, "r+b") as g:
            g.seek(patch[0])
            g.write(patch[1])
    return dst


@pytest.mark.parametrize("case", ["truncated", "header_only", "bad_magic", "empty"])
def test_gemma_corrupted_or_truncated_gguf_names_the_file_and_caches_nothing(gguf, tmp_path, case):
    size = gguf.stat().st_size
    bad = tmp_path / f"{case}.gguf"
    if case == "truncated":
        _bad_copy(gguf, bad, keep=size - 4096)
    elif case == "header_only":
        _bad_copy(gguf, bad, keep=64 << 10)
    elif case == "bad_magic":
        _bad_copy(gguf, bad, keep=64 << 10, patch=(0, b"NOPE"))
    else:
        bad.write_bytes(b"")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=str(bad)):
        load_gguf(bad, cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())


def test_gemma_gguf_with_a_poisoned_norm_is_refused(gguf, tmp_path):
    """The first norm weight (F32) overwritten with NaN bytes dequantizes to non-finite values: refused."""
    import numpy as np

    reader = gguf_loader.open_reader(gguf)
    t = next(t for t in reader.tensors if t.name.endswith("norm.weight"))  # the first norm: fails early
    bad = _bad_copy(gguf, tmp_path / "nan.gguf", patch=(int(t.data_offset), np.full(4, np.nan, np.float32).tobytes()))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="non-finite"):
        load_gguf(bad, cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_gemma_missing_file_and_wrong_model_name_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        load_gguf(tmp_path / "no-such.gguf", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="model: expected one of \\['gemma3-270m'\\]"):
        model_file("gemma-7b")
    real_import = importlib.import_module

    def no_weights(name, *a, **k):
        if name == gemma3.MODEL_PACKAGES["gemma3-270m"][0]:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_weights)
    with pytest.raises(ModuleNotFoundError, match=r"hicache-jax\[models\]"):
        model_file("gemma3-270m")
