"""The texts the Gemma 3 checks run on: strings for the tokenizer, prompts for logits and greedy.

Every prompt is cut from this repository's own files (README, docs, source), so the texts are
real English, Markdown and Python without shipping anyone else's text. ``PROMPT_CHARS`` sets
each prompt's length in characters (about 16 to 1,500 tokens: four prompts cross the 512-token
sliding window); the token counts themselves come from the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STRINGS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  leading two spaces",
    "trailing spaces   ",
    "multiple     internal      spaces",
    "a\tb\t\tc\t\t\t\td",
    "line1\nline2\n\nline4\n\n\n\nline8",
    "\n\nstarts with newlines",
    "windows\r\nline\r\nendings",
    "Hello, World! How's it going? (fine) [ok] {yes}",
    "naïve café résumé coöperate façade",
    "日本語のテキストと中文文本和한국어 텍스트",
    "Ελληνικά και русский язык и עברית ו-العربية",
    "emoji: 😀😃🤖🚀👨\u200d👩\u200d👧\u200d👦🏳️\u200d🌈 flags 🇫🇷🇯🇵",
    "rare chars: \x00 \x01 \x7f \u200b zero-width \ufeff bom 🧪",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    '{"key": [1, 2.5, -3e10, true, null], "s": "q\\"uote"}',
    "https://example.com/path?query=1&x=%20#frag user@example.org",
    "1234567890 3.14159 -42 1e-6 0xDEADBEEF 1,000,000",
    "<start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWrite a poem.<end_of_turn>\n<start_of_turn>model\nRoses are red.<end_of_turn>\n",
    "<bos>explicit bos in text<eos>",
    "<unused0> <mask> <pad> [multimodal] <start_of_image>",
    "<start_of_turn> not a special <end_of_turn",
    "ALL CAPS TEXT AND MiXeD cAsE",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "    indented code line",
    "\t\ttab indented\n\t\t\tdeeper",
    "▁ literal metaspace ▁▁ chars",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word word",
    "Mixed 中文 and English, with numbers 2024年12月31日.",
    "Ça va? ¿Qué tal? ¡Hola! «quotes» „German“ ‘single’ “double”",
    "\xa0non-breaking\xa0spaces\u2003em space",
    "ﬁ ligature, ＦＵＬＬＷＩＤＴＨ, ①②③, Å vs Å (NFC vs NFD)",
    "end with newline\n",
]

# name -> (file, first character, characters)
PROMPT_CHARS = {
    "readme_short": ("README.md", 0, 70),
    "chat_turns": (None, 0, 0),
    "docs_dataplane": ("docs/data-plane.md", 0, 1600),
    "code_tree": ("hicache_jax/cache/tree.py", 0, 2400),
    "docs_exactness": ("docs/exactness.md", 0, 2300),
    "readme_long": ("README.md", 2000, 3600),
    "code_transfer": ("hicache_jax/backends/jax/transfer_engine.py", 0, 4800),
    "docs_events": ("docs/kv-events-and-routing.md", 0, 5000),
}

CHAT = (
    "<start_of_turn>user\nWhat does a hierarchical KV cache keep, and where?<end_of_turn>\n"
    "<start_of_turn>model\nIt keeps the attention keys and values of earlier prompts in device memory, "
    "host memory and storage.<end_of_turn>\n<start_of_turn>user\nWhy would a request skip its prefill?"
    "<end_of_turn>\n<start_of_turn>model\n"
)


def prompts() -> dict[str, str]:
    out = {}
    for name, (path, start, chars) in PROMPT_CHARS.items():
        out[name] = CHAT if path is None else (ROOT / path).read_text(encoding="utf-8")[start : start + chars]
    return out
