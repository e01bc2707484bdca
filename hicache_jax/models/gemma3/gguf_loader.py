"""Read a Gemma 3 GGUF file (llama.cpp layout): a validated config and float32 numpy weights.

``load_gguf(path)`` returns ``(Gemma3Config, weights)``. ``weights`` maps the GGUF tensor names
(``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...) to float32 arrays in the file's logical
layout: a matrix is ``[out_features, in_features]`` (numpy shape = reversed GGUF ``ne``), the
embedding is ``[vocab, hidden]``, and norm weights are exactly as stored. llama.cpp's converter
stores Gemma's RMSNorm weights as ``1 + w`` (the multiplicative scale), while HF Gemma keeps ``w``
and computes ``x * (1 + w)``; ``hf_norm_weight`` converts (HF's own GGUF loader subtracts 1 too).

Dequantizing (``gguf.quants.dequantize``, numpy) takes a few seconds; the result is cached as
one uncompressed ``.npz`` in ``cache_dir`` (default ``$HICACHE_JAX_MODEL_CACHE`` or
``~/.cache/hicache_jax/gguf``), named by the GGUF file's sha256, so later loads only hash the
file and read the arrays. A file that cannot be parsed, is truncated, has tensors whose sizes or
shapes disagree with its metadata, or dequantizes to non-finite values raises ``ValueError``
naming the file, and nothing is cached.

Metadata the GGUF does not carry for Gemma 3 takes the values llama.cpp and transformers use:
a sliding-window pattern of 6 (every 6th layer full), a local RoPE base of 10,000, and
``query_pre_attn_scalar = head_dim`` (every Gemma 3 size but 27B; for the 62-layer 27B,
``hidden / heads``, as llama.cpp decides it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np

ARCH = "gemma3"
CACHE_FORMAT = 1  # bump when the cached arrays' meaning changes
_CONFIG_KEY = "__config_json__"

# Defaults for metadata a Gemma 3 GGUF omits (see the module docstring).
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_ROPE_LOCAL_BASE = 10_000.0


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 text-model hyperparameters (validated in ``__post_init__``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]  # per layer: "sliding" or "full"
    rope_theta_global: float  # RoPE base of the full-attention layers
    rope_theta_local: float  # RoPE base of the sliding-window layers
    rope_scale_global: float = 1.0  # linear position scaling of the full layers (1.0: none)
    query_pre_attn_scalar: float = 256.0  # scores are scaled by query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_id: int = 1
    pad_token_id: int = 0
    unk_token_id: int = 3
    add_bos_token: bool = True

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
            "sliding_window",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Gemma3Config.{f}: expected a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Gemma3Config: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Gemma3Config.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"Gemma3Config.layer_types: expected a tuple of {self.num_layers} entries, got {self.layer_types!r}"
            )
        bad = [t for t in self.layer_types if t not in ("sliding", "full")]
        if bad:
            raise ValueError(f"Gemma3Config.layer_types: entries must be 'sliding' or 'full', got {bad[0]!r}")
        for f in (
            "rms_norm_eps",
            "rope_theta_global",
            "rope_theta_local",
            "rope_scale_global",
            "query_pre_attn_scalar",
        ):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v <= 0:
                raise ValueError(f"Gemma3Config.{f}: expected a positive finite number, got {v!r}")
        for f in ("attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0):
                raise ValueError(f"Gemma3Config.{f}: expected None or a positive number, got {v!r}")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise ValueError(f"Gemma3Config.{f}: expected a token id in [0, {self.vocab_size}), got {v!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Gemma3Config":
        d = json.loads(text)
        d["layer_types"] = tuple(d["layer_types"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------------------------
# reading the file


def _reader_class():
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map.

    The reader parses the header one small slice at a time (this file: ~790,000 slices, most of
    them the 262,144 vocabulary strings); slicing an ``np.memmap`` runs the subclass's Python
    ``__getitem__`` / ``__array_finalize__`` for each, half the parse (10.3 s -> 5.5 s on this
    VM). The view reads the same mapped bytes (its base keeps the map open); tensors' ``data``
    become plain ndarray views too. Same library, same parse: only the slicing is cheaper."""
    global _READER
    if _READER is None:
        import gguf

        class PlainViewReader(gguf.GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                if type(self.data) is np.memmap:  # the first read: swap in the plain view
                    self.data = self.data.view(np.ndarray)
                return super()._get(offset, dtype, count, override_order)

        _READER = PlainViewReader
    return _READER


_READER = None


def open_reader(path: Path):
    try:
        return _reader_class()(str(path), "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct/numpy errors...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field_value(reader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def _require(path: Path, meta: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in meta or meta[key] is None:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    v = meta[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
        raise ValueError(f"{path}: GGUF metadata {key!r} should be an integer, got {v!r}")
    if kind is float and not isinstance(v, (int, float, np.floating, np.integer)):
        raise ValueError(f"{path}: GGUF metadata {key!r} should be a number, got {v!r}")
    return kind(v)


def read_metadata(reader, path: Path) -> dict[str, Any]:
    """All scalar / string metadata (token arrays are left out: see ``tokenizer``)."""
    out: dict[str, Any] = {}
    for key in reader.fields:
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            out[key] = _field_value(reader, key)
        except Exception as e:
            raise ValueError(f"{path}: GGUF metadata {key!r} cannot be read ({type(e).__name__}: {e})") from e
    return out


def config_from_metadata(meta: Mapping[str, Any], path: Path, n_vocab_tokens: int | None = None) -> Gemma3Config:
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected {ARCH!r}")
    a = ARCH + "."
    n_layers = _require(path, meta, a + "block_count", int)
    hidden = _require(path, meta, a + "embedding_length", int)
    n_heads = _require(path, meta, a + "attention.head_count", int)
    n_kv = _require(path, meta, a + "attention.head_count_kv", int)
    k_len = _require(path, meta, a + "attention.key_length", int)
    v_len = _require(path, meta, a + "attention.value_length", int)
    if k_len != v_len:
        raise ValueError(
            f"{path}: attention.key_length {k_len} != attention.value_length {v_len} (Gemma 3 uses one head_dim)"
        )
    pattern = meta.get(a + "attention.sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, (list, tuple)):  # newer llama.cpp files: one bool per layer, True = sliding
        if len(pattern) != n_layers or not all(isinstance(x, (bool, np.bool_)) for x in pattern):
            raise ValueError(f"{path}: attention.sliding_window_pattern should be {n_layers} booleans, got {pattern!r}")
        layer_types = tuple("sliding" if x else "full" for x in pattern)
    elif isinstance(pattern, (int, np.integer)) and not isinstance(pattern, bool) and pattern >= 1:
        layer_types = tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(n_layers))
    else:
        raise ValueError(
            f"{path}: attention.sliding_window_pattern {pattern!r} is neither a period nor per-layer booleans"
        )
    qpas = meta.get(a + "attention.query_pre_attn_scalar")  # not written by llama.cpp today
    if qpas is None:
        # llama.cpp's rule: the 62-layer 27B model scales by hidden / heads, every other size by head_dim
        qpas = hidden / n_heads if n_layers == 62 else float(k_len)
    rope_scale = 1.0
    scaling_type = meta.get(a + "rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"{path}: rope.scaling.type {scaling_type!r} is not supported (only 'linear')")
        rope_scale = float(_require(path, meta, a + "rope.scaling.factor", float))
    vocab = meta.get(a + "vocab_size", n_vocab_tokens)
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no {a}vocab_size, no tokenizer.ggml.tokens)")
    tok = "tokenizer.ggml."
    return Gemma3Config(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_require(path, meta, a + "feed_forward_length", int),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=k_len,
        max_position_embeddings=_require(path, meta, a + "context_length", int),
        rms_norm_eps=_require(path, meta, a + "attention.layer_norm_rms_epsilon", float),
        sliding_window=_require(path, meta, a + "attention.sliding_window", int),
        layer_types=layer_types,
        rope_theta_global=_require(path, meta, a + "rope.freq_base", float),
        rope_theta_local=float(meta.get(a + "rope.freq_base_swa", DEFAULT_ROPE_LOCAL_BASE)),
        rope_scale_global=rope_scale,
        query_pre_attn_scalar=float(qpas),
        attn_logit_softcapping=(
            None if meta.get(a + "attn_logit_softcapping") is None else float(meta[a + "attn_logit_softcapping"])
        ),
        final_logit_softcapping=(
            None if meta.get(a + "final_logit_softcapping") is None else float(meta[a + "final_logit_softcapping"])
        ),
        tie_word_embeddings=True,  # checked against the tensors in expected_shapes
        bos_token_id=int(meta.get(tok + "bos_token_id", 2)),
        eos_token_id=int(meta.get(tok + "eos_token_id", 1)),
        pad_token_id=int(meta.get(tok + "padding_token_id", 0)),
        unk_token_id=int(meta.get(tok + "unknown_token_id", 3)),
        add_bos_token=bool(meta.get(tok + "add_bos_token", True)),
    )


def expected_shapes(cfg: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """numpy shapes (out, in) of every tensor a Gemma 3 GGUF holds."""
    H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, H), "output_norm.weight": (H,)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        shapes.update(
            {
                b + "attn_norm.weight": (H,),
                b + "attn_q.weight": (cfg.num_heads * D, H),
                b + "attn_k.weight": (cfg.num_kv_heads * D, H),
                b + "attn_v.weight": (cfg.num_kv_heads * D, H),
                b + "attn_q_norm.weight": (D,),
                b + "attn_k_norm.weight": (D,),
                b + "attn_output.weight": (H, cfg.num_heads * D),
                b + "post_attention_norm.weight": (H,),
                b + "ffn_norm.weight": (H,),
                b + "ffn_gate.weight": (F, H),
                b + "ffn_up.weight": (F, H),
                b + "ffn_down.weight": (H, F),
                b + "post_ffw_norm.weight": (H,),
            }
        )
    return shapes


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def hf_norm_weight(stored: np.ndarray) -> np.ndarray:
    """GGUF stores Gemma norm scales as ``1 + w``; HF Gemma's ``weight`` is ``w``."""
    return stored - np.float32(1.0)


def _dequantize_all(reader, path: Path, cfg: Gemma3Config) -> dict[str, np.ndarray]:
    import gguf
    from gguf import quants

    want = expected_shapes(cfg)
    file_size = path.stat().st_size
    have = {t.name: t for t in reader.tensors}
    if "output.weight" in have:
        raise ValueError(f"{path}: has an untied output.weight; only tied Gemma 3 embeddings are supported")
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise ValueError(f"{path}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    out: dict[str, np.ndarray] = {}
    for name, shape in want.items():
        t = have[name]
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        n = int(np.prod(shape))
        if int(t.n_elements) != n or tuple(int(x) for x in reversed(list(t.shape))) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(reversed(list(t.shape)))}, expected {shape}")
        if n % block:
            raise ValueError(
                f"{path}: tensor {name}: {n} elements is not a whole number of {t.tensor_type.name} blocks"
            )
        nbytes = n // block * type_size
        if int(t.data_offset) + nbytes > file_size or int(t.data.nbytes) != nbytes:
            raise ValueError(
                f"{path}: tensor {name} data runs past the end of the file "
                f"(offset {int(t.data_offset)} + {nbytes} bytes > {file_size}): truncated?"
            )
        try:
            a = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(
                f"{path}: tensor {name} ({t.tensor_type.name}) cannot be dequantized ({type(e).__name__}: {e})"
            ) from e
        a = np.ascontiguousarray(np.asarray(a, dtype=np.float32).reshape(shape))
        if not np.isfinite(a).all():
            raise ValueError(f"{path}: tensor {name} ({t.tensor_type.name}) holds non-finite values: corrupted?")
        out[name] = a
    return out


# ---------------------------------------------------------------------------------------------
# the cache


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: the weights and
# the tokenizer are both cached under the file's digest, and hashing 250 MB twice costs a second


def file_sha256(path: Path) -> str:
    """The file's SHA-256 (hex), computed once per path, size and modification time."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


def replace_atomically(p: Path, write) -> None:
    """Make ``p`` by ``write(temporary path)`` in its directory, then rename: readers never see
    a partial file, and a failed write leaves nothing behind."""
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_cache_dir() -> Path:
    env = os.environ.get("HICACHE_JAX_MODEL_CACHE")
    if env:
        return Path(env) / "gguf"
    return Path.home() / ".cache" / "hicache_jax" / "gguf"


def _cache_path(cache_dir: Path, digest: str) -> Path:
    return cache_dir / f"{digest}.f32.v{CACHE_FORMAT}.npz"


def _read_cache(p: Path) -> tuple[Gemma3Config, dict[str, np.ndarray]] | None:
    try:
        with np.load(p, allow_pickle=False) as z:
            cfg = Gemma3Config.from_json(str(z[_CONFIG_KEY][()]))
            weights = {k: z[k] for k in z.files if k != _CONFIG_KEY}
    except Exception:
        return None  # unreadable / stale cache: rebuilt by the caller
    want = expected_shapes(cfg)
    if set(weights) != set(want) or any(
        weights[k].shape != s or weights[k].dtype != np.float32 for k, s in want.items()
    ):
        return None
    return cfg, weights


def _write_cache(p: Path, cfg: Gemma3Config, weights: Mapping[str, np.ndarray]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **{_CONFIG_KEY: np.array(cfg.to_json())}, **weights)

    replace_atomically(p, write)


def _config_of(reader, path: Path) -> Gemma3Config:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return config_from_metadata(read_metadata(reader, path), path, None if tokens is None else len(tokens.data))


def load_config(path: str | os.PathLike) -> Gemma3Config:
    """The validated config of a Gemma 3 GGUF (metadata only; no tensors read)."""
    path = Path(path)
    return _config_of(open_reader(path), path)


def load_gguf(
    path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, use_cache: bool = True
) -> tuple[Gemma3Config, dict[str, np.ndarray]]:
    """``(config, float32 weights by GGUF name)``; see the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = file_sha256(path)
    cp = _cache_path(cdir, digest)
    if use_cache and cp.is_file():
        hit = _read_cache(cp)
        if hit is not None:
            return hit
    reader = open_reader(path)
    cfg = _config_of(reader, path)
    weights = _dequantize_all(reader, path, cfg)
    del reader
    if use_cache:
        _write_cache(cp, cfg, weights)
    return cfg, weights
