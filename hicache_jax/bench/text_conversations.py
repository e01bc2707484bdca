"""Multi-turn conversations in real text for a real model (``bench multiturn --model gemma3-270m``).

Each client holds a conversation about one of two shared documents (so clients share long
system prompts, as chat deployments do): the document, then rounds of ``Question: ...`` /
``Answer:`` in which the model writes every answer (greedy, up to the end of its paragraph or
``answer_len`` tokens; one example answer after the document sets the style). The
documents are this package's own module docstrings, read from the installed source files (no
download, and the text ships with the wheel); the questions are written here. A Gemma 3 270M
base checkpoint continues a document Q&A far better than chat-turn markers, hence the format.

Tokens: the history is kept as token ids and only ever extended (document ids, then per round
the question's ids and the generated answer's), never re-tokenized, so every round's prompt
starts with the previous round's prompt and answer exactly: what a prefix cache can reuse.
Contexts run from ~1,000 to ~2,500 tokens over four rounds of 32-token answers.

``salt`` changes the first words of every document: the warm-up's conversations share no
prefix with the measured ones (their L3 pages never hit).
"""

from __future__ import annotations

import ast
import importlib.util

import numpy as np

# Two document sets (module docstrings of this package): ~1,000 and ~2,200 Gemma 3 tokens;
# clients alternate between them.
DOCUMENT_MODULES = (
    ("hicache_jax.engine.page_audit", "hicache_jax.host_pool"),
    ("hicache_jax.engine.engine",),
)

QUESTIONS = (
    "What does this part of the cache do?",
    "Which memory tiers are mentioned, and what is kept in each?",
    "What happens when a request shares a prefix with an earlier one?",
    "Which thread owns the pools?",
    "How are pages copied between the device and the host?",
    "What is checked to make sure the bytes are right?",
    "What happens when a copy fails?",
    "Summarize the text in two sentences.",
    "What does the sliding window change?",
    "Which numbers would you measure first?",
    "What is the page size used for?",
    "Name one thing a user must call and when.",
)


def arrival_times(rng: np.random.Generator, rate: float, n: int) -> list[float]:
    """A round's ``n`` arrival offsets in seconds: a Poisson process of ``rate`` requests per
    second starting at 0, or all at 0 when ``rate`` <= 0 (closed loop)."""
    if rate > 0:
        gaps = rng.exponential(1.0 / rate, n)
        return (np.cumsum(gaps) - gaps[0]).tolist()
    return [0.0] * n


def module_docstring(name: str) -> str:
    """A module's docstring read from its source file (the module is not imported)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"name: no module {name!r} to read a document from")
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    if not doc:
        raise ValueError(f"name: module {name!r} has no docstring")
    return doc


# After the document: how the questions are answered, shown once (a base checkpoint follows an
# example far better than an instruction), then the conversation's own questions.
ANSWER_STYLE = (
    "\n\nQuestions about the text above, each answered in one or two plain sentences.\n\n"
    "Question: What is this text about?\nAnswer: It documents part of a Python package that keeps "
    "the attention keys and values of earlier requests, so that a new request with the same "
    "beginning is answered faster."
)
# An answer ends at its paragraph's end (the token of a blank line), or at most ``answer_len``.
PARAGRAPH_END = "\n\n"


def document(index: int, salt: str = "") -> str:
    mods = DOCUMENT_MODULES[index % len(DOCUMENT_MODULES)]
    parts = [f"{salt}Documentation of the hicache_jax package."]
    parts += [f"Module {m}:\n{module_docstring(m)}" for m in mods]
    return "\n\n".join(parts) + ANSWER_STYLE


def stop_tokens(tokenizer) -> list[int]:
    """The ids that end an answer: the paragraph break, and EOS."""
    ids = tokenizer.encode(PARAGRAPH_END, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"tokenizer: {PARAGRAPH_END!r} is not one token ({ids}); answers cannot stop on it")
    eos = tokenizer.token_to_id("<eos>")
    return sorted({ids[0]} | ({eos} if eos is not None else set()))


class TextConversations:
    """The clients' conversations as token ids (the ``Conversations`` interface of
    ``bench.serving``: ``prompts()`` then ``answered(results)`` each round)."""

    def __init__(self, args, tokenizer, seed: int, salt: str = "") -> None:
        self.args = args
        self.tokenizer = tokenizer
        rng = np.random.default_rng(seed)
        docs = [tokenizer.encode(document(i, salt)) for i in range(len(DOCUMENT_MODULES))]
        self.doc_of = [c % len(docs) for c in range(args.clients)]
        self.histories = [list(docs[d]) for d in self.doc_of]
        self.question_order = [rng.permutation(len(QUESTIONS)).tolist() for _ in range(args.clients)]
        self.answers: list[list[list[int]]] = [[] for _ in range(args.clients)]
        self.round = 0
        self.rng = rng
        self.stop_tokens = stop_tokens(tokenizer)
        self._break = tokenizer.encode(PARAGRAPH_END, add_special_tokens=False)

    def _question_ids(self, client: int, rnd: int) -> list[int]:
        """The next question; after the blank line that ended the answer, or with one."""
        q = QUESTIONS[self.question_order[client][rnd % len(QUESTIONS)]]
        ids = self.tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)
        h = self.histories[client]
        return ids if h[-len(self._break) :] == self._break else self._break + ids

    def prompts(self) -> tuple[list[list[int]], list[float]]:
        a = self.args
        for c, h in enumerate(self.histories):
            h.extend(self._question_ids(c, self.round))
        self.round += 1
        return [list(h) for h in self.histories], arrival_times(self.rng, a.request_rate, a.clients)

    def answered(self, results: list) -> None:
        for c, (h, res) in enumerate(zip(self.histories, results)):
            h.extend(res.tokens)
            self.answers[c].append(list(res.tokens))

    def max_context(self, rounds: int, answer_len: int) -> int:
        """An upper bound of the longest prompt + answer over ``rounds`` rounds."""
        longest_q = len(self._break) + max(
            len(self.tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)) for q in QUESTIONS
        )
        return max(len(h) for h in self.histories) + rounds * (longest_q + answer_len) + 16

    def transcript(self, client: int) -> list[tuple[str, str]]:
        """Client ``client``'s (question, answer) pairs so far, as text."""
        return [
            (
                QUESTIONS[self.question_order[client][r % len(QUESTIONS)]],
                self.tokenizer.decode(ans, skip_special_tokens=True).strip(),
            )
            for r, ans in enumerate(self.answers[client])
        ]
