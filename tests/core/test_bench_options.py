"""Benchmark options are validated at parse time: a bad size is an argparse usage error naming
the option, before any engine is built (it used to build engines for 11-14 s and then die with
a StatisticsError, or print a traceback from numpy)."""

from __future__ import annotations

import argparse

import pytest

from hicache_jax.bench import options

PARSERS = {
    "multiturn": options.multiturn_arguments,
    "ttft": options.ttft_arguments,
    "two-run": options.two_run_arguments,
    "transfer": options.transfer_arguments,
    "spec": options.spec_arguments,
    "restart": options.restart_arguments,
}

BAD = [
    ("multiturn", ["--rounds", "0"]),
    ("multiturn", ["--clients", "-1"]),
    ("multiturn", ["--num-processes", "0"]),
    ("multiturn", ["--page-size", "0"]),
    ("multiturn", ["--host-ratio", "-1"]),
    ("multiturn", ["--host-ratio", "0"]),
    ("multiturn", ["--request-rate", "-2"]),
    ("multiturn", ["--device-pages", "x"]),
    ("ttft", ["--reps", "0"]),
    ("ttft", ["--reuse", "1.5"]),
    ("ttft", ["--reuse", "-0.1"]),
    ("ttft", ["--prompt-len", "0"]),
    ("two-run", ["--num-prompts", "-3"]),
    ("transfer", ["--page-sizes", "0"]),
    ("transfer", ["--page-counts", "16", "-1"]),
    ("transfer", ["--stream-unroll", "0"]),
    ("transfer", ["--layers", "0"]),
    ("spec", ["--k", "0"]),
    ("spec", ["--max-context", "-5"]),
]


def _parser(name):
    p = argparse.ArgumentParser(prog=f"hicache-jax bench {name}")
    PARSERS[name](p)
    return p


@pytest.mark.parametrize("name,argv", BAD, ids=[f"{n}:{' '.join(a)}" for n, a in BAD])
def test_bad_sizes_are_usage_errors_naming_the_option(name, argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser(name).parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "expected" in err, err


def test_good_values_and_defaults_parse():
    assert _parser("ttft").parse_args(["--reuse", "1", "--reps", "1"]).reuse == 1.0
    assert _parser("ttft").parse_args(["--reuse", "0"]).reuse == 0.0
    args = _parser("multiturn").parse_args(["--turn-len", "0", "--request-rate", "0"])
    assert args.turn_len == 0 and args.request_rate == 0.0
    assert _parser("spec").parse_args([]).device_pages == 0  # 0 = three requests' worth
    for name in PARSERS:  # every default passes its own validation
        _parser(name).parse_args([])


COMBINATIONS = [
    (["--router", "prefix"], "--router"),  # one engine: nothing to route between
    (["--engines", "2", "--router", "prefix", "prefix"], "--router"),
    (["--engines", "2", "--num-processes", "2"], "--engines"),
    (["--engines", "2", "--model", "hybrid-tiny"], "--engines"),
    (["--engines", "2", "--storage-backend", "mooncake", "--mooncake-master", "h:1"], "--mooncake-master"),
]


@pytest.mark.parametrize("argv,option", COMBINATIONS, ids=[" ".join(a) for a, _o in COMBINATIONS])
def test_multiturn_option_combinations_are_usage_errors(argv, option, capsys):
    """--engines / --router combinations are refused by the CLI before anything is built."""
    from hicache_jax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "multiturn", *argv])
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_multiturn_routed_combinations_that_are_fine_pass_the_check():
    p = _parser("multiturn")
    for argv in (
        [],
        ["--engines", "4"],
        ["--engines", "2", "--router", "prefix"],
        [
            "--engines",
            "2",
            "--storage-backend",
            "mooncake",
            "--mooncake-master",
            "h:1",
            "--mooncake-metadata",
            "http://h:2/metadata",
            "--router",
            "prefix",
        ],
    ):
        args = p.parse_args(argv)
        options.check(p, args, "multiturn")
    assert p.parse_args([]).router == ["round_robin", "prefix"]


def test_router_names_match_the_routed_benchmark():
    from hicache_jax.bench import routed

    assert options.ROUTERS == routed.POLICIES
