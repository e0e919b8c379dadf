"""Command-line numbers and URLs: a bad value is argparse's one-line error naming the option (exit 2) — before
2026-12-01 `bench compare --tolerance 0` bisected forever, `--start-scale 0` reported a silent 0, `bench whatif
--warmup -1` and `simulate --seed -1` ended in tracebacks, and `loadgen replay --url notaurl` sent every request
into connection errors."""
from __future__ import annotations

import argparse

import pytest

from loadgen.cli import main as loadgen_main
from services.cli.main import main as cli_main
from shared.argtypes import fraction, http_url, name_seconds, nonneg_float, nonneg_int, positive_float, positive_int


@pytest.mark.parametrize("parse, good, bad", [
    (positive_float, [("0.04", 0.04), ("3", 3.0)], ["0", "-1", "nan", "inf", "x"]),
    (nonneg_float, [("0", 0.0), ("2.5", 2.5)], ["-0.1", "nan", ""]),
    (positive_int, [("1", 1), ("64", 64)], ["0", "-3", "1.5", "two"]),
    (nonneg_int, [("0", 0), ("7", 7)], ["-1", "0.5"]),
    (fraction, [("0", 0.0), ("0.09", 0.09), ("1", 1.0)], ["1.01", "-0.1"]),
])
def test_number_types(parse, good, bad):
    for text, value in good:
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_name_seconds_maps_each_name_to_its_seconds():
    assert name_seconds("container=0.04, slice=0.06") == {"container": 0.04, "slice": 0.06}
    assert name_seconds("container=0") == {"container": 0.0}
    for bad, why in (("container", "NAME=SECONDS"), ("=0.04", "NAME=SECONDS"), ("container=-1", ">= 0"),
                     ("container=x", "a number"), ("a=1,a=2", "names repeat"), (",", "NAME=SECONDS")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            name_seconds(bad)


def test_http_url():
    assert http_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert http_url("https://gw.example:443") == "https://gw.example:443"
    for text in ["notaurl", "127.0.0.1:8000", "ftp://h", "http://", "http://h:99999"]:
        with pytest.raises(argparse.ArgumentTypeError):
            http_url(text)


@pytest.mark.parametrize("argv, expected", [
    (["--tolerance", "0"], "argument --tolerance: must be positive, got 0"),
    (["--start-scale", "0"], "argument --start-scale: must be positive, got 0"),
    (["--jobs", "0"], "argument --jobs: must be positive, got 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
])
def test_bench_compare_refuses_values_that_hang_or_mislead(argv, expected, capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main(["bench", "compare", "--workload", "w.yaml", "--cluster", "c.yaml", *argv])
    assert ei.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["bench", "whatif", "--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["bench", "simspeed", "--duration-s", "-5"], "argument --duration-s: must be positive"),
    (["bench", "overload", "--max-violation", "2"], "argument --max-violation: must be between 0 and 1"),
    (["simulate", "--cluster", "c", "--workload", "w", "--policy", "slice", "--seed", "-1"],
     "argument --seed: must be >= 0"),
])
def test_other_commands_refuse_bad_numbers(argv, expected, capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main(argv)
    assert ei.value.code == 2 and expected in capsys.readouterr().err


def test_loadgen_replay_refuses_a_url_that_is_not_http(capsys, tmp_path):
    with pytest.raises(SystemExit) as ei:
        loadgen_main(["replay", "--workload", "w.yaml", "--url", "notaurl", "--out", str(tmp_path / "o")])
    assert ei.value.code == 2
    assert "argument --url: expected an http:// or https:// URL with a host" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
