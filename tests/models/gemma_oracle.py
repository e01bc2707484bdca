"""The oracle for the Gemma 3 checks: Hugging Face transformers' ``Gemma3ForCausalLM`` (float32,
CPU; eager attention for the teacher-forced logits, SDPA for the greedy decode steps) on the
same GGUF. Runs in the torch environment (``.venv-torch``: torch,
transformers, accelerate, gguf), never in the JAX one; ``test_gemma_oracle.py`` starts it.

usage: gemma_oracle.py SPEC.json OUT_DIR

SPEC: {"gguf": path, "strings": [...], "prompts": {name: text}, "greedy": {name: n_tokens},
       "topk": k, "full_every": n}
OUT_DIR/oracle.json: the versions, load times, for each string its ids and decodes, for each prompt
its ids, greedy continuation (EOS masked at every step, as ``generate(min_new_tokens=n)`` does;
decoded one token at a time on the KV cache the prompt's forward left, so no prompt is computed
twice) and the top-2 logit gap at each of its steps. OUT_DIR/<prompt>.npz:
``ids``, the top-k logit ids and values at every position, the log-sum-exp of every row, and full
logit rows at every ``full_every``-th position and the last (``full_pos``, ``full_logits``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, out_dir: str) -> None:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = Path(spec["gguf"])
    torch.set_num_threads(1)  # the suite runs two workers on two cores
    _share_gguf_reader()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t2 = time.perf_counter()
    result = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "tokenizer_load_s": t1 - t0,
        "model_load_s": t2 - t1,
        "strings": [],
        "prompts": {},
    }
    for s in spec["strings"]:
        ids = tok(s, add_special_tokens=True)["input_ids"]
        result["strings"].append(
            {
                "text": s,
                "ids": ids,
                "decoded": tok.decode(ids),
                "decoded_skip": tok.decode(ids, skip_special_tokens=True),
            }
        )
    k, every = spec["topk"], spec["full_every"]
    # What ``generate(min_new_tokens=n)`` masks at every step: the generation config's EOS ids.
    eos = model.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos))
    started = {}  # name -> (the KV cache its forward left, its last logit row, its length)
    with torch.no_grad():
        for name, text in spec["prompts"].items():
            ids = tok(text, add_special_tokens=True)["input_ids"]
            x = torch.tensor([ids])
            ts = time.perf_counter()
            fwd = model(input_ids=x, use_cache=True)
            logits = fwd.logits[0].float()
            forward_s = time.perf_counter() - ts
            top_vals, top_ids = torch.topk(logits, k, dim=-1)
            full_pos = sorted(set(range(0, len(ids), every)) | {len(ids) - 1})
            np.savez(
                out / f"{name}.npz",
                ids=np.array(ids, np.int32),
                topk_ids=top_ids.numpy().astype(np.int32),
                topk_vals=top_vals.numpy(),
                lse=torch.logsumexp(logits, dim=-1).numpy(),
                full_pos=np.array(full_pos, np.int32),
                full_logits=logits[full_pos].numpy(),
            )
            result["prompts"][name] = {"ids": ids, "forward_s": forward_s}
            if spec["greedy"].get(name, 0):
                started[name] = (fwd.cache, logits[-1].clone(), len(ids))
            del fwd, logits
        if started:
            n_new = {spec["greedy"][n] for n in started}
            assert len(n_new) == 1, "one continuation length for every prompt"
            # Decode steps attend through torch's fused SDPA: eager attention materializes every
            # query head's copy of the shared KV head and its score rows, 5x the attention time
            # of a step here (the teacher-forced logits above are eager's).
            model.set_attn_implementation("sdpa")
            ts = time.perf_counter()
            for name, (tokens, gaps) in _greedy(model, started, n_new.pop()).items():
                result["prompts"][name].update(greedy=tokens, greedy_top2_gap=gaps)
            result["greedy_s"] = time.perf_counter() - ts
    (out / "oracle.json").write_text(json.dumps(result, ensure_ascii=False, indent=1), encoding="utf-8")


def _share_gguf_reader() -> None:
    """transformers parses the GGUF's header with ``gguf.GGUFReader`` three times (tokenizer,
    config, state dict), ~12 s each on one core for this file (its 262,144 vocabulary strings
    are read one memmap slice at a time). The reader is a read-only view of the file, so one per
    path serves all three: the same library reads the same bytes, once. It also slices a plain
    ndarray view of its memory map instead of the ``np.memmap`` (whose Python-level
    ``__getitem__`` is half the parse): the same bytes, read by the same code."""
    import gguf
    import numpy as np

    class PlainViewReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    readers: dict = {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = PlainViewReader(path, mode)
        return readers[key]

    gguf.GGUFReader = shared


def _greedy(model, started: dict, n_new: int) -> dict[str, tuple[list[int], list[float]]]:
    """``n_new`` greedy tokens after each prompt of ``started`` (name -> the KV cache its
    forward left, the logit row of its last position, its length), EOS masked at every step
    as ``generate(min_new_tokens=n_new)`` does; with the gap between the two best logits at
    each step (a divergence where it is tiny is a near-tie, float32 rounding, not a wrong
    model).

    All prompts decode as one left-padded batch, as ``generate`` decodes a padded batch: their
    caches are joined into one (``_joined_cache``), the attention mask hides the padding, each
    row's positions count from its first real token. A step reads the weights once for every
    row (decoding is memory-bound: ~1 GB of float32 weights per step), and no prompt is
    computed twice (its cache comes from the teacher-forced forward)."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos))
    names = list(started)
    lengths = torch.tensor([started[n][2] for n in names])
    width = int(lengths.max())
    cache = _joined_cache(model, [started[n][0] for n in names], width)
    real = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # left padding: False
    scores = torch.stack([started[n][1] for n in names])
    out = {n: ([], []) for n in names}
    for step in range(n_new):
        scores = scores.clone()
        scores[:, eos] = -torch.inf
        top2 = torch.topk(scores, 2, dim=-1).values
        chosen = torch.argmax(scores, dim=-1)  # generate's greedy choice (first index of the max)
        for i, n in enumerate(names):
            out[n][0].append(int(chosen[i]))
            out[n][1].append(float(top2[i, 0] - top2[i, 1]))
        if step + 1 == n_new:
            break
        real = torch.cat([real, torch.ones((len(names), 1), dtype=torch.bool)], dim=1)
        fwd = model(
            input_ids=chosen[:, None],
            attention_mask=real.long(),
            cache=cache,
            cache_position=torch.tensor([width + step]),
            position_ids=(lengths + step)[:, None],
            use_cache=True,
        )
        cache, scores = fwd.cache, fwd.logits[:, -1].float()
    return out


def _joined_cache(model, caches: list, width: int):
    """One batched KV cache of ``caches`` (batch-1 caches of one prompt each, as the model's
    forward left them), every row left-padded with zeros to ``width`` positions: what a padded
    batch's forward would have stored (a sliding layer keeps its last ``window - 1`` positions,
    and padding sits left of a row's tokens). Built through the public ``Cache.update``."""
    import torch
    from transformers import DynamicCache

    joined = DynamicCache(config=model.config)
    for i in range(len(joined.layers)):
        keys, values = [], []
        for c in caches:
            k, v = c.layers[i].keys, c.layers[i].values
            pad = width - k.shape[-2]
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        joined.update(torch.cat(keys), torch.cat(values), i)
    return joined


if __name__ == "__main__":
    main(*sys.argv[1:3])
