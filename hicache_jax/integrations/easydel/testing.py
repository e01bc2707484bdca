"""A random Llama served by EasyDeL's eSurge on a CPU, with no downloads: the one copy that the
adapter's tests, ``examples/easydel_engine.py`` and the eSurge benchmark share.

Not needed to use the adapter: with a real model and tokenizer, build eSurge as usual and
``attach``. This module exists because eSurge 0.3.0 needs three things worked around on a CPU
without network, and the demo, the benchmark and the tests must do it the same way:

1. A tokenizer on disk (eSurge's tokenizer / detokenizer worker processes load it by path):
   ``build_tokenizer`` saves a word-level tokenizer over ``w0 .. w{VOCAB-3}``.
2. Importing easydel without torch fails in HF patch helpers: ``install_import_shims``
   replaces the modeling modules it patches by empty modules (before easydel is imported).
3. eSurge's KV budget falls back to 4 GiB on a CPU (about a million pages: out of memory):
   ``start_engine`` replaces ``per_device_hbm_budget_bytes`` so eSurge makes ``num_pages``.

``prepare_cpu(cache_dir)`` does what must happen before JAX and easydel are imported: the CPU
platform, JAX's persistent compile cache and ejkernel's (``COMPILE_FUNC_DIR``) under
``cache_dir`` (eSurge compiles every bucket at start: a minute cold, seconds warm), the shims.
``close_engine`` terminates the engine AND shuts down its worker processes (eSurge's
``terminate()`` alone leaves them running); ``worker_pids`` lists them so a caller can check.

Threading: call from one thread (the process's main thread); nothing here is shared state
except the patched budget function and ``sys.modules`` entries, both process-wide.
"""

from __future__ import annotations

import os
import random
import sys
import types

VOCAB = 256  # <unk>=0, <eos>=1, words w0.. from 2
PAGE = 16
# transformers modeling modules easydel 0.3.0 patches at import; each needs torch.
_SHIMMED = ("glm4v_moe", "dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe")


def prepare_cpu(cache_dir: str | None = None) -> None:
    """Run eSurge on the CPU with persistent compile caches under ``cache_dir`` (default
    ``~/.cache/hicache_jax/esurge``). Call before easydel is imported and before JAX runs
    anything (values already in the environment win)."""
    if cache_dir is None:
        cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "hicache_jax", "esurge")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("COMPILE_FUNC_DIR", os.path.join(cache_dir, "ejkernel"))  # read when ejkernel loads
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cache_dir, "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "jax" in sys.modules:  # JAX read its environment at import (this package imports it): tell it now
        import jax

        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    install_import_shims()


def install_import_shims() -> None:
    """Empty stand-ins for the HF modeling modules easydel patches (they need torch)."""
    import importlib

    for m in _SHIMMED:
        name = f"transformers.models.{m}.modeling_{m}"
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        try:
            setattr(importlib.import_module(f"transformers.models.{m}"), f"modeling_{m}", mod)
        except Exception:  # noqa: BLE001 - a model package missing in this transformers: nothing to patch
            pass


def word(i: int) -> str:
    return f"w{i}"


def prompt(seed: int, n: int) -> str:
    """``n`` words (one token each), deterministic in ``seed``."""
    r = random.Random(seed)
    return " ".join(word(r.randrange(VOCAB - 2)) for _ in range(n))


def tokenize(text: str) -> list[int]:
    """What the saved tokenizer gives for ``prompt`` text (no special tokens added)."""
    return [int(w[1:]) + 2 for w in text.split()]


def build_tokenizer(path: str):
    """A word-level tokenizer (``<unk>``=0, ``<eos>``=1, words w0..) saved to ``path``; returns it
    loaded back from there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


def random_llama(seed: int = 0, hidden: int = 64, layers: int = 2, max_positions: int = 512):
    """A random bf16 Llama (4 query heads, 2 KV heads, head_dim ``hidden // 4``) for eSurge's
    ragged page attention v3. The defaults are the tests' tiny model."""
    install_import_shims()
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    cfg = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=max_positions)
    cfg.attn_mechanism = "ragged_page_attention_v3"
    return ed.LlamaForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def start_engine(model, tokenizer_dir: str, num_pages: int = 11, async_scheduling: bool = False,
                 page_size: int = PAGE, **kw):
    """An eSurge engine on ``model`` with exactly ``num_pages`` KV pages of ``page_size`` tokens
    (page 0 is eSurge's null page). ``kw`` overrides eSurge's arguments (``max_model_len`` 256,
    ``max_num_seqs`` 2, ``max_num_batched_tokens`` 256 by default)."""
    install_import_shims()
    import easydel.caching.ragged_page.cache as rp
    from easydel.inference.esurge import eSurge
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    c = model.config
    # eSurge divides this budget by 2 (K, V) * layers * page * kv heads * head_dim * 2 bytes (bf16).
    budget = num_pages * 2 * c.num_hidden_layers * page_size * c.num_key_value_heads * c.head_dim * 2
    rp.per_device_hbm_budget_bytes = lambda *a, **k: budget  # noqa: ARG005 - the CPU fallback is 4 GiB
    args = dict(model=model, processor=tok, max_model_len=256, max_num_seqs=2, page_size=page_size,
                max_num_batched_tokens=256, enable_prefix_caching=True, async_scheduling=async_scheduling,
                silent_mode=True)
    args.update(kw)
    engine = eSurge(**args)
    got = engine.scheduler.kv_cache_manager.page_pool.num_pages
    if got != num_pages:
        close_engine(engine)
        raise RuntimeError(f"eSurge made {got} KV pages, {num_pages} were asked for")
    return engine


def worker_pids(engine) -> list[int]:
    """Process ids of the engine's tokenizer / detokenizer worker processes still running
    (read before ``close_engine``; ``process_alive`` tells afterwards whether one survived)."""
    wm = getattr(engine, "_worker_manager", None)  # eSurge keeps its worker manager private
    procs = (getattr(wm, "_tokenizer_process", None), getattr(wm, "_detokenizer_process", None))
    return [int(p.pid) for p in procs if p is not None and p.poll() is None]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``; ``os.kill`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def close_engine(engine) -> None:
    """Terminate the scheduler and shut down the tokenizer / detokenizer worker processes."""
    try:
        engine.terminate()
    finally:
        wm = getattr(engine, "_worker_manager", None)
        if wm is not None:
            wm.shutdown()


def greedy(engine, text: str, max_tokens: int = 8, **params) -> list[int]:
    """The greedy tokens eSurge generates for ``text``."""
    from easydel.inference.sampling_params import SamplingParams

    out = engine.generate(text, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
    return list(out[0].outputs[0].token_ids)
