"""Gemma 3's tokenizer rebuilt from a GGUF file with the ``tokenizers`` library (no torch, no transformers).

A Gemma GGUF (``tokenizer.ggml.model = "llama"``) holds the SentencePiece vocabulary, scores and
token types but no merges. This builds the same tokenizer transformers builds from the file
(checked id-for-id against ``AutoTokenizer.from_pretrained(..., gguf_file=...)``):

* model: BPE with byte fallback (``<0x00>``..``<0xFF>``), ``<unk>`` fused; merges are derived
  from the vocabulary: every split of a token into two vocabulary tokens is a merge, ranked by
  the position of the merged token in the file (earlier first; within one token, the longer
  left part first). Gemma's scores are not used: the file order is the merge order.
* tokens made only of spaces are stored with real spaces (``"  "``); the normalizer turns every
  space into U+2581, so those are respelled ``"▁▁"`` etc. before building.
* normalizer: space -> U+2581, nothing else (no NFKC, no prefix space); no pre-tokenizer.
* control tokens (type 3: ``<bos>``, ``<start_of_turn>``, ``<unusedN>``, ...) are special added
  tokens; user-defined ones (type 4: newline / tab runs, ``<start_of_image>``, ...) are plain
  added tokens; both match the raw text whole.
* ``<bos>`` is prepended when the file's ``add_bos_token`` says so; decoding maps U+2581 back
  to spaces and fuses byte-fallback pieces.

Building takes a few seconds; the result is cached as ``tokenizer.json`` in the weight cache dir,
named by the GGUF's sha256 (computed once per file: ``gguf_loader.file_sha256``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from .gguf_loader import open_reader, default_cache_dir, file_sha256, replace_atomically

SPIECE_SPACE = "\u2581"
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKENIZER_FORMAT = 1


def _respell(token: str) -> str:
    return SPIECE_SPACE * len(token) if " " in token and not token.strip() else token


def derive_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary listed best-first (see the module docstring)."""
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for tok in tokens:
        for cut in range(len(tok) - 1, 0, -1):  # longer left part first
            left, right = tok[:cut], tok[cut:]
            if left in index and right in index:
                merges.append((left, right))
    return merges


def build_tokenizer(
    tokens: Sequence[str], token_types: Sequence[int], *, bos_token_id: int, unk_token_id: int, add_bos_token: bool
):
    """A ``tokenizers.Tokenizer`` from GGUF vocabulary arrays."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    spelled = [_respell(t) for t in tokens]
    if len(set(spelled)) != len(spelled):
        raise ValueError("tokenizer vocabulary has duplicate tokens after respelling spaces")
    vocab = {t: i for i, t in enumerate(spelled)}
    tk = Tokenizer(
        BPE(
            vocab=vocab,
            merges=derive_merges(spelled),
            unk_token=spelled[unk_token_id],
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    tk.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    tk.pre_tokenizer = None
    tk.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = np.asarray(token_types)
    tk.add_special_tokens(
        [AddedToken(spelled[i], normalized=False, special=True) for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)]
    )
    # user-defined tokens whose text is spelled as in the vocabulary (the space runs are not: they
    # are reached through the normalizer and the merges instead)
    tk.add_tokens(
        [
            AddedToken(tokens[i], normalized=False, special=False)
            for i in np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED)
            if tokens[i] == spelled[i]
        ]
    )
    if add_bos_token:
        bos = spelled[bos_token_id]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)]
        )
    return tk


def _read_vocab(path: Path):
    reader = open_reader(path)

    def get(key):
        f = reader.fields.get(key)
        if f is None:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
        return f

    model = get("tokenizer.ggml.model").contents()
    if model != "llama":
        raise ValueError(
            f"{path}: tokenizer.ggml.model is {model!r}; only the SentencePiece ('llama') "
            "vocabulary of Gemma is supported"
        )
    f = get("tokenizer.ggml.tokens")
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    types = np.asarray(get("tokenizer.ggml.token_type").contents(), dtype=np.int32)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens but {len(types)} token types")

    def scalar(key, default):
        fld = reader.fields.get(key)
        return default if fld is None else fld.contents()

    return (
        tokens,
        types,
        int(scalar("tokenizer.ggml.bos_token_id", 2)),
        int(scalar("tokenizer.ggml.unknown_token_id", 3)),
        bool(scalar("tokenizer.ggml.add_bos_token", True)),
    )


class Gemma3Tokenizer:
    """Thin wrapper: ``encode(text) -> list[int]`` (with ``<bos>``), ``decode(ids) -> str``."""

    def __init__(self, tokenizer) -> None:
        self.tk = tokenizer

    @classmethod
    def from_gguf(
        cls, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, use_cache: bool = True
    ) -> "Gemma3Tokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        cp = cdir / f"{file_sha256(path)}.tokenizer.v{TOKENIZER_FORMAT}.json"
        if use_cache and cp.is_file():
            try:
                return cls(Tokenizer.from_file(str(cp)))
            except Exception:
                pass  # rebuilt below
        tokens, types, bos, unk, add_bos = _read_vocab(path)
        tk = build_tokenizer(tokens, types, bos_token_id=bos, unk_token_id=unk, add_bos_token=add_bos)
        if use_cache:
            replace_atomically(cp, tk.save)
        return cls(tk)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tk.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(int(i))

    def token_to_id(self, t: str) -> int | None:
        return self.tk.token_to_id(t)
