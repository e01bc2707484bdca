"""``hicache-jax bench multiturn --engine easydel``: its defaults, its usage errors (before any
engine is built) and the hand-off to the eSurge benchmark (pure Python: no easydel needed)."""

from __future__ import annotations

import pytest

from hicache_jax import cli
from hicache_jax.bench import options


def _parse(*argv: str):
    args = cli.parser().parse_args(["bench", "multiturn", *argv])
    options.apply_quick(args.subparser, args, "multiturn")
    return args


def test_esurge_sizes_replace_only_the_defaults():
    args = _parse("--engine", "easydel", "--clients", "3")
    assert args.clients == 3  # given: kept
    assert (args.rounds, args.first_len, args.turn_len, args.device_pages) == (4, 160, 24, 24)
    assert (args.model, args.answer_len, args.max_batch, args.storage_backend) == ("bench", 1, 1, "file")
    quick = _parse("--engine", "easydel", "--quick")
    assert (quick.model, quick.clients, quick.rounds, quick.first_len, quick.device_pages) == ("tiny", 4, 3, 96, 16)
    assert quick.page_size == 16  # not the reference engine's quick page size


def test_reference_engine_defaults_unchanged():
    args = _parse()
    assert (args.engine, args.clients, args.device_pages, args.answer_len) == ("reference", 8, 320, 16)
    quick = _parse("--quick")
    assert (quick.model, quick.page_size, quick.device_pages) == ("tiny", 8, 48)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--answer-len", "4"], "--answer-len"),
        (["--num-processes", "2"], "--num-processes"),
        (["--request-rate", "2"], "--request-rate"),
        (["--page-size", "8"], "--page-size"),
        (["--attention", "mla"], "--attention"),
        (["--deterministic"], "--deterministic"),
        (["--model", "hybrid"], "--model"),
        (["--storage-backend", "mooncake"], "--storage-backend"),
        (["--engines", "2"], "--engines"),
    ],
)
def test_what_esurge_cannot_honour_is_a_usage_error(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--engine", "easydel", *argv)
    assert e.value.code == 2
    assert f"{option} " in capsys.readouterr().err


def test_options_map_onto_the_trace():
    from hicache_jax.integrations.easydel import bench

    cfg = bench.from_multiturn_args(
        _parse("--engine", "easydel", "--host-ratio", "2", "--layers", "3", "--storage-backend", "none")
    )
    assert (cfg.conversations, cfg.turns, cfg.first, cfg.follow, cfg.pages) == (6, 4, 160, 24, 24)
    assert (cfg.host_pages, cfg.hidden, cfg.layers, cfg.storage_backend) == (48, 768, 3, "none")
    cfg.check()
    t = bench.trace(cfg)
    assert [len(p.split()) for p in t[1]] == [184] * 6 and t[1][0].startswith(t[0][0])


def test_multiturn_hands_easydel_runs_to_the_esurge_benchmark(monkeypatch):
    from hicache_jax.bench import multiturn
    from hicache_jax.integrations.easydel import bench

    seen = []
    monkeypatch.setattr(bench, "multiturn", lambda args: seen.append(args) or {"engine": "easydel"})
    args = _parse("--engine", "easydel")
    assert multiturn.multiturn(args) == {"engine": "easydel"} and seen == [args]


def test_without_easydel_the_run_says_where_it_lives(monkeypatch):
    import importlib.util

    from hicache_jax.integrations.easydel import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "easydel" else real(name, *a))
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("built an engine without easydel"))
    with pytest.raises(RuntimeError, match=".venv-easydel"):
        bench.multiturn(_parse("--engine", "easydel"))
