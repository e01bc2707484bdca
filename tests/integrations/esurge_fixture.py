"""A tiny random Llama served by EasyDeL's eSurge on the CPU, with no downloads (test support).

What eSurge 0.3.0 needs on a CPU without network, kept here and out of the library:

1. A tokenizer on disk (eSurge's tokenizer / detokenizer worker processes load it by path):
   a word-level tokenizer over ``w0 .. w{V-3}`` saved with ``save_pretrained``.
2. Importing easydel without torch fails in HF patch helpers: the modeling modules it patches
   are replaced by empty modules before easydel is imported (``install_import_shims``).
3. The KV budget falls back to 4 GiB on a CPU (about a million pages: out of memory):
   ``per_device_hbm_budget_bytes`` is replaced so eSurge gets ``num_pages`` pages.

ejkernel's compile cache goes to ``<repo>/.cache/ejkernel`` (``COMPILE_FUNC_DIR``) so engines
after the first start in seconds. ``close_engine`` always terminates the engine AND shuts down
its worker processes (``terminate()`` alone leaves them running).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("COMPILE_FUNC_DIR", str(ROOT / ".cache" / "ejkernel"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's own persistent compile cache: eSurge compiles every bucket at start (minutes cold).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

VOCAB = 256
PAGE = 16
_SHIMMED = ("glm4v_moe", "dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe")


def install_import_shims() -> None:
    """Empty stand-ins for the HF modeling modules easydel patches (they need torch)."""
    import transformers.models as tm

    for m in _SHIMMED:
        name = f"transformers.models.{m}.modeling_{m}"
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        try:
            parent = __import__(f"transformers.models.{m}", fromlist=["_"])
            setattr(parent, f"modeling_{m}", mod)
        except Exception:  # noqa: BLE001 - a model package missing in this transformers: nothing to patch
            pass
    del tm


def word(i: int) -> str:
    return f"w{i}"


def build_tokenizer(path: str):
    """A word-level tokenizer (``<unk>``=0, ``<eos>``=1, words w0..) saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for i in range(VOCAB - 2):
        vocab[word(i)] = i + 2
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def prompt(seed: int, n: int) -> str:
    """``n`` words (one token each), deterministic in ``seed``."""
    import random

    r = random.Random(seed)
    return " ".join(word(r.randrange(VOCAB - 2)) for _ in range(n))


def tokenize(text: str) -> list[int]:
    """What the saved tokenizer gives for ``prompt`` text (no special tokens added)."""
    return [int(w[1:]) + 2 for w in text.split()]


def tiny_llama(seed: int = 0):
    install_import_shims()
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    cfg = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg.attn_mechanism = "ragged_page_attention_v3"
    return ed.LlamaForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def start_engine(model, tokenizer_dir: str, num_pages: int = 11, async_scheduling: bool = False, **kw):
    """An eSurge engine on ``model`` with ``num_pages`` KV pages (page 0 is eSurge's null page)."""
    install_import_shims()
    import easydel.caching.ragged_page.cache as rp
    from easydel.inference.esurge import eSurge
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    c = model.config
    # eSurge divides this budget by 2 (K, V) * layers * page * kv heads * head_dim * 2 bytes (bf16).
    budget = num_pages * 2 * c.num_hidden_layers * PAGE * c.num_key_value_heads * c.head_dim * 2
    rp.per_device_hbm_budget_bytes = lambda *a, **k: budget  # noqa: ARG005 - the CPU fallback is 4 GiB
    args = dict(model=model, processor=tok, max_model_len=256, max_num_seqs=2, page_size=PAGE,
                max_num_batched_tokens=256, enable_prefix_caching=True, async_scheduling=async_scheduling,
                silent_mode=True)
    args.update(kw)
    engine = eSurge(**args)
    got = engine.scheduler.kv_cache_manager.page_pool.num_pages
    if got != num_pages:
        close_engine(engine)
        raise RuntimeError(f"eSurge made {got} KV pages, the test asked for {num_pages}")
    return engine


def close_engine(engine) -> None:
    """Terminate the scheduler and shut down the tokenizer / detokenizer worker processes."""
    try:
        engine.terminate()
    finally:
        wm = getattr(engine, "_worker_manager", None)
        if wm is not None:
            wm.shutdown()


def greedy(engine, text: str, max_tokens: int = 8, **params) -> list[int]:
    from easydel.inference.sampling_params import SamplingParams

    out = engine.generate(text, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
    return list(out[0].outputs[0].token_ids)
