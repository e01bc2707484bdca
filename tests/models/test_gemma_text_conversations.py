"""``bench.text_conversations`` with Gemma 3's tokenizer (no model run): every round's prompt
extends the previous prompt and answer token for token (what a prefix cache can serve), two
shared documents of ~1,000 and ~2,200 tokens, the warm-up's salt shares no prefix with them,
answers stop at a paragraph break, and a new question follows it without a second break."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from hicache_jax.bench.text_conversations import DOCUMENT_MODULES, QUESTIONS, TextConversations, document


@dataclass
class _Result:
    tokens: list[int]


@pytest.fixture(scope="module")
def tok(gguf):
    from hicache_jax.models.gemma3 import Gemma3Tokenizer

    return Gemma3Tokenizer.from_gguf(gguf)


def test_gemma_conversations_only_ever_extend(tok):
    args = argparse.Namespace(clients=4, rounds=3, request_rate=0.0)
    conv = TextConversations(args, tok, seed=0)
    brk = tok.encode("\n\n", add_special_tokens=False)
    assert conv.stop_tokens == sorted({brk[0], tok.token_to_id("<eos>")})
    docs = [len(tok.encode(document(i))) for i in range(len(DOCUMENT_MODULES))]
    assert 800 <= docs[0] <= 1300 and 2000 <= docs[1] <= 2600, docs
    previous = None
    for r in range(args.rounds):
        prompts, arrivals = conv.prompts()
        assert arrivals == [0.0] * 4 and len(prompts) == 4
        if previous is not None:
            for c, (p, (q, a)) in enumerate(zip(prompts, previous)):
                assert p[: len(q) + len(a)] == q + a, (r, c)  # the last prompt and answer, exactly
                question = tok.decode(p[len(q) + len(a) :])
                want = "Question: " if a[-1:] == brk else "\n\nQuestion: "
                assert question.startswith(want) and question.endswith("\nAnswer:"), question
        # answers: one ending at a paragraph break, one cut at the length limit (no break)
        answers = [tok.encode(" An answer.", add_special_tokens=False) + (brk if c % 2 == 0 else []) for c in range(4)]
        conv.answered([_Result(a) for a in answers])
        previous = list(zip(prompts, answers))
    assert prompts[0][: docs[0]] == prompts[2][: docs[0]] and prompts[1][: docs[1]] == prompts[3][: docs[1]]
    assert conv.max_context(args.rounds, 32) >= max(len(p) for p in prompts) + 32
    assert [q for q, _a in conv.transcript(0)] == [QUESTIONS[i] for i in conv.question_order[0][:3]]
    warm = TextConversations(args, tok, seed=1, salt="Warm-up copy. ")
    assert all(w[1] != p[1] for w, p in zip(warm.histories, conv.histories))  # no shared page past BOS
