"""``hicache-jax chat`` and ``hicache-jax generate``: text in, text out through the cache, on a
real checkpoint (``--model gemma3-270m``, the ``models`` extra).

``generate PROMPT``: one greedy continuation of the text. ``chat``: a conversation read from
standard input, one line per turn (or ``--turns "..." "..."``), in the question / answer form a
base checkpoint continues well: the optional ``--context`` text (a file), then per turn
``Question: <line>`` / ``Answer:`` and the model's answer (greedy, to the end of its paragraph
or ``--max-new-tokens``; one example answer first sets the style, as in ``bench multiturn``). The conversation is kept as token ids and
only extended, so each turn's prompt starts with the previous turn's prompt and answer: the
cache serves it. Every turn prints what the cache served (tokens per tier: device, host,
storage), what was computed, and the time to the first token.

L3 persists on disk (``--storage-dir``, default ``~/.cache/hicache_jax/chat-l3/<model>``, file
backend): a second invocation of the same conversation (same ``--context`` and turns) is served
from storage. ``--no-storage`` keeps everything in memory.

Bad input is a usage error (exit 2) before the model loads where it can be known then (a
missing ``--context`` file, a bad size); a prompt longer than ``--max-context`` is reported
with its length when it is met, and nothing is cached for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .bench.options import REAL_MODELS, bounded

DESCRIPTION_CHAT = "chat with a real checkpoint through the cache (turns from stdin or --turns)"
DESCRIPTION_GENERATE = "one greedy continuation of PROMPT through the cache"
MAX_CONTEXT = 32768  # Gemma 3 270M's positions


def default_storage_dir(model: str) -> Path:
    base = os.environ.get("HICACHE_JAX_CHAT_L3") or os.path.join(Path.home(), ".cache", "hicache_jax", "chat-l3")
    return Path(base) / model


def add_arguments(p: argparse.ArgumentParser, mode: str) -> None:
    """The options of ``chat`` (``mode='chat'``) or ``generate``."""
    if mode == "generate":
        p.add_argument("prompt", help="the text to continue")
    else:
        p.add_argument("--turns", nargs="+", default=None, help="the user's turns (default: one per line of stdin)")
        p.add_argument(
            "--context",
            type=_existing_file,
            default=None,
            help="a text file put before the first question (e.g. a document the questions are about)",
        )
    p.add_argument("--model", choices=REAL_MODELS, default=REAL_MODELS[0], help="the checkpoint")
    p.add_argument(
        "--max-new-tokens",
        type=bounded(int, 1, 4096),
        default=64 if mode == "chat" else 48,
        help="tokens generated per turn at most",
    )
    p.add_argument(
        "--max-context",
        type=bounded(int, 16, MAX_CONTEXT),
        default=4096,
        help="longest prompt + answer in tokens (fixes the engine's attention width)",
    )
    p.add_argument("--page-size", type=bounded(int, 1, 4096), default=16, help="tokens per KV page")
    p.add_argument("--device-pages", type=bounded(int, 4, 1 << 20), default=512, help="L1 pool size in pages")
    p.add_argument(
        "--storage-dir",
        default=None,
        help=f"L3 directory (file backend), kept across invocations (default: {default_storage_dir('<model>')})",
    )
    p.add_argument("--no-storage", action="store_true", help="no L3: nothing persists after the process")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the parser's types cannot see, refused as a usage error before anything loads."""
    from .bench.options import path_problem

    if args.storage_dir is not None:
        why = path_problem(args.storage_dir, directory=True)
        if why is not None:
            parser.error(
                f"argument --storage-dir: expected a directory the L3 can use or create, got "
                f"{args.storage_dir!r} ({why})"
            )


def _existing_file(text: str) -> Path:
    p = Path(text)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"expected a readable text file, got {text!r} (no such file)")
    return p


class ChatSession:
    """A model, its tokenizer and an engine with L1/L2/L3, serving one conversation.

    Threading: one thread (the engine's owner). ``close()`` finishes every L3 write."""

    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        from .bench.serving import real_weights
        from .engine import Engine, EngineCacheConfig
        from .host_pool import HostPoolConfig
        from .storage.config import StorageConfig

        self.weights = real_weights(args.model)
        self.tokenizer = tokenizer
        storage = None
        if not args.no_storage:
            path = Path(args.storage_dir) if args.storage_dir else default_storage_dir(args.model)
            path.mkdir(parents=True, exist_ok=True)
            storage = StorageConfig(
                backend="file",
                path=str(path),
                prefetch_policy="wait_complete",
                prefetch_threshold_tokens=args.page_size,
            )
        self.storage_path = None if storage is None else storage.path
        cache = EngineCacheConfig(
            page_size=args.page_size,
            device_pages=args.device_pages,
            host=HostPoolConfig(ratio=2.0),
            max_batch=1,
            prefill_chunk=512,
            max_context=args.max_context,
            storage=storage,
        )
        self.engine = Engine(self.weights.config, cache, weights=self.weights)
        from .bench.text_conversations import stop_tokens

        self.stop = sorted(set(stop_tokens(tokenizer)) | {self.weights.gemma.eos_token_id})
        self.max_context = args.max_context

    def close(self) -> None:
        self.engine.close()

    def check_fits(self, ids: list[int], new: int) -> None:
        if len(ids) + new > self.max_context:
            raise ValueError(f"prompt: {len(ids)} tokens + {new} new exceed --max-context {self.max_context}")

    def run(self, ids: list[int], new: int):
        """Greedy-decode ``new`` tokens after ``ids``; the engine's ``RequestResult``."""
        self.check_fits(ids, new)
        return self.engine.generate([ids], new, stop_tokens=self.stop)[0]


def describe_turn(res) -> str:
    c = res.cached_tokens
    served = ", ".join(f"{t} {c[t]}" for t in ("device", "host", "storage") if c[t]) or "nothing"
    return (
        f"prompt {res.prompt_len} tokens: cache served {served}; computed {res.prefill_tokens}; "
        f"TTFT {res.ttft_s * 1e3:,.0f} ms"
    )


def run(args: argparse.Namespace, mode: str) -> int:
    from .bench.serving import real_tokenizer

    try:
        tokenizer = real_tokenizer(args.model)
        if mode == "generate":  # a prompt too long is known before the model loads
            n = len(tokenizer.encode(args.prompt))
            if n + args.max_new_tokens > args.max_context:
                raise ValueError(
                    f"prompt: {n} tokens + {args.max_new_tokens} new exceed --max-context {args.max_context}"
                )
        session = ChatSession(args, tokenizer)
    except (ModuleNotFoundError, ValueError) as e:  # the models extra missing, a prompt too long
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if mode == "generate":
            return _generate(session, args)
        return _chat(session, args)
    except ValueError as e:  # a prompt longer than the context: said, nothing served
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        session.close()


def _generate(session: ChatSession, args) -> int:
    tok = session.tokenizer
    ids = tok.encode(args.prompt)
    res = session.run(ids, args.max_new_tokens)
    print(args.prompt + tok.decode(res.tokens, skip_special_tokens=True))
    print(f"[{describe_turn(res)}]", file=sys.stderr)
    return 0


def _chat(session: ChatSession, args) -> int:
    from .bench.text_conversations import ANSWER_STYLE, PARAGRAPH_END

    tok = session.tokenizer
    context = args.context.read_text(encoding="utf-8") if args.context else ""
    history = tok.encode(context + ANSWER_STYLE if context else ANSWER_STYLE.lstrip())
    brk = tok.encode(PARAGRAPH_END, add_special_tokens=False)
    turns = args.turns if args.turns is not None else (line.rstrip("\n") for line in sys.stdin)
    if session.storage_path:
        print(f"[L3: {session.storage_path}]", file=sys.stderr)
    for n, line in enumerate(turns, 1):
        if not line.strip():
            continue
        question = tok.encode(f"Question: {line.strip()}\nAnswer:", add_special_tokens=False)
        ids = history + (question if history[-len(brk) :] == brk else brk + question)
        t0 = time.perf_counter()
        res = session.run(ids, args.max_new_tokens)
        print(f"you> {line.strip()}")
        print(f"model> {tok.decode(res.tokens, skip_special_tokens=True).strip()}")
        print(f"[turn {n}: {describe_turn(res)}; {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
        history = ids + res.tokens  # the cache holds all of it but the last token: the next turn is served it
    return 0
