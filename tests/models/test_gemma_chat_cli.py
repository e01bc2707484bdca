"""``hicache-jax chat`` / ``generate`` on Gemma 3 270M, as a user runs them: two processes of
the same conversation over one L3 directory. The first computes every turn but the cached
part of its history (turn 2 is served the document and turn 1 from the device); the second, a
new process, is served turn 1's document from storage and prints the same answers. A prompt
longer than ``--max-context`` is refused before the model loads, naming the lengths.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"
TURNS = ["What does the loader cache?", "Which layers attend fully?"]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "hicache_jax.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _served(stderr: str) -> list[dict[str, int]]:
    """Per turn, the tokens the cache served by tier (from the ``[turn n: ...]`` lines)."""
    out = []
    for line in re.findall(r"\[turn \d+: prompt (\d+) tokens: cache served ([^;]*);", stderr):
        tiers = dict.fromkeys(("device", "host", "storage"), 0)
        for tier, n in re.findall(r"(device|host|storage) (\d+)", line[1]):
            tiers[tier] = int(n)
        out.append({"prompt": int(line[0]), **tiers})
    return out


def test_gemma_chat_second_process_is_served_from_storage(gguf, tmp_path):
    # The document's first 4,000 characters (~1,100 tokens; at most ~1,600 at 2.5 characters a
    # token), so that editing docs/models.md cannot push the prompt past --max-context.
    doc = tmp_path / "doc.md"
    doc.write_text(DOC.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    args = [
        "chat",
        "--context",
        str(doc),
        "--turns",
        *TURNS,
        "--max-new-tokens",
        "12",
        "--max-context",
        "2048",
        "--storage-dir",
        str(tmp_path / "l3"),
    ]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _cli(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = _served(first.stderr), _served(second.stderr)
    print(first.stdout, first.stderr[-600:], second.stderr[-600:], sep="\n")
    assert len(a) == len(b) == 2
    doc_tokens = a[0]["prompt"] - 12  # the document is most of turn 1's prompt
    assert a[0]["device"] + a[0]["host"] + a[0]["storage"] == 0  # a new directory: nothing to serve
    assert a[1]["device"] >= a[0]["prompt"] - 16  # turn 2: turn 1's prompt and answer, from the device
    assert b[0]["storage"] >= doc_tokens - 16 and b[0]["device"] == b[0]["host"] == 0  # a new process: L3
    answers = [line for line in first.stdout.splitlines() if line.startswith("model> ")]
    assert len(answers) == 2 and all(len(x) > len("model> ") for x in answers)
    assert second.stdout == first.stdout  # the same text, served from storage


def test_gemma_generate_refuses_a_prompt_longer_than_the_context(gguf, tmp_path):
    r = _cli("generate", "word " * 300, "--max-context", "64", "--storage-dir", str(tmp_path / "l3"), timeout=300)
    assert r.returncode == 2
    assert re.search(r"error: prompt: \d+ tokens \+ 48 new exceed --max-context 64", r.stderr), r.stderr
    assert not (tmp_path / "l3").exists()  # refused before anything was built
