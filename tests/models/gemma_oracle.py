"""The oracle for the Gemma 3 checks: Hugging Face transformers' ``Gemma3ForCausalLM`` (float32,
eager attention, CPU) on the same GGUF. Runs in the torch environment (``.venv-torch``: torch,
transformers, accelerate, gguf), never in the JAX one; ``test_gemma_oracle.py`` starts it.

usage: gemma_oracle.py SPEC.json OUT_DIR

SPEC: {"gguf": path, "strings": [...], "prompts": {name: text}, "greedy": {name: n_tokens},
       "topk": k, "full_every": n}
OUT_DIR/oracle.json: the versions, load times, for each string its ids and decodes, for each prompt
its ids, greedy continuation (``min_new_tokens``: never stopped at eos; all prompts in one
left-padded batch) and the top-2 logit gap at each of its steps. OUT_DIR/<prompt>.npz:
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
    with torch.no_grad():
        for name, text in spec["prompts"].items():
            ids = tok(text, add_special_tokens=True)["input_ids"]
            x = torch.tensor([ids])
            ts = time.perf_counter()
            logits = model(input_ids=x, use_cache=False).logits[0].float()
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
        # Greedy continuations of every prompt in spec["greedy"], generated as one left-padded
        # batch (the attention mask keeps the padding out; positions count from each row's first
        # real token): one LM-head pass per step for all rows instead of one per row.
        names = [n for n, k in spec["greedy"].items() if k]
        if names:
            n_new = spec["greedy"][names[0]]
            assert all(spec["greedy"][n] == n_new for n in names), "one continuation length for the batch"
            rows = [result["prompts"][n]["ids"] for n in names]
            width = max(len(r) for r in rows)
            x = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                x[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
            ts = time.perf_counter()
            g = model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
                return_dict_in_generate=True,
                output_scores=True,
                pad_token_id=0,
            )
            result["greedy_s"] = time.perf_counter() - ts
            # the gap between the two best logits at each generated step: a divergence where it
            # is tiny is a near-tie (float32 rounding), not a wrong model
            top2 = [torch.topk(sc.float(), 2, dim=-1).values for sc in g.scores]
            for i, n in enumerate(names):
                result["prompts"][n].update(
                    greedy=g.sequences[i, width:].tolist(), greedy_top2_gap=[float(v[i, 0] - v[i, 1]) for v in top2]
                )
    (out / "oracle.json").write_text(json.dumps(result, ensure_ascii=False, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])
