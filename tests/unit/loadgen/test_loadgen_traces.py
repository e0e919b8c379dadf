"""Trace readers: exact parsing, sorting, and errors that name the file, line and column."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces import (TraceError, expand_path, guess_format, parse_columns, read_azure, read_csv_trace,
                            read_jsonl, read_trace)
from shared.config import ConfigError

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"


def write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_azure_wallclock_with_seven_fraction_digits(tmp_path):
    f = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 23:59:59.5000000,374,44\n"
              "2023-11-16 23:59:59.6805900,10,0\n"
              "2023-11-17 00:00:01.0000001,396,109")  # no trailing newline, crosses midnight
    tr = read_azure(f)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 0.18059, 1.5000001], abs=1e-6)
    assert tr.input_tokens.tolist() == [374, 10, 396]
    assert tr.output_tokens.tolist() == [44, 0, 109]
    assert tr.period_s == pytest.approx(1.5000001 + 1.5000001 / 2)


@pytest.mark.skipif(not (TRACES / "azure_llm_2023_conv.csv").is_file(), reason="shared traces not present")
def test_real_azure_conv_matches_published_stats():
    tr = read_azure(TRACES / "azure_llm_2023_conv.csv")
    assert len(tr) == 19366
    assert tr.arrival_s[0] == 0.0 and np.all(np.diff(tr.arrival_s) >= 0)
    assert tr.arrival_s[-1] == pytest.approx(3501.72, abs=0.01)  # 18:15:46.68 → 19:14:08.40
    assert float(np.median(tr.input_tokens)) == 1020 and float(np.median(tr.output_tokens)) == 129


def test_azure_bad_value_names_line_and_column(tmp_path):
    f = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,abc,44\n")
    with pytest.raises(TraceError) as e:
        read_azure(f)
    assert str(e.value) == f"{f}: line 3, column ContextTokens: expected an integer token count, got 'abc'"
    assert isinstance(e.value, ConfigError)


def test_azure_bad_timestamp_and_missing_column(tmp_path):
    f = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 25:00:00.0,1,1\n")
    with pytest.raises(TraceError, match=r"line 2, column TIMESTAMP: expected a wall-clock"):
        read_azure(f)
    g = write(tmp_path / "b.csv", "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 10:00:00.0,1,1\n")
    with pytest.raises(TraceError, match=r"b.csv: line 1, column ContextTokens: no such column"):
        read_azure(g)
    with pytest.raises(TraceError, match="file not found"):
        read_azure(tmp_path / "nope.csv")


def test_jsonl_ms_timestamps_sorted(tmp_path):
    rows = [{"timestamp": 2500, "input_length": 7, "output_length": 3},
            {"timestamp": 1000, "input_length": 5, "output_length": 2},
            {"timestamp": 1000.5, "input_length": 6, "output_length": 1}]
    f = write(tmp_path / "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    tr = read_jsonl(f)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 0.0005, 1.5])
    assert tr.input_tokens.tolist() == [5, 6, 7]
    assert guess_format(f) == "jsonl"


def test_jsonl_errors_name_line_and_field(tmp_path):
    f = write(tmp_path / "t.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\n'
              '{"timestamp": 2, "input_length": 2}\n')
    with pytest.raises(TraceError, match=r"t.jsonl: line 2, column output_length: required field is missing"):
        read_jsonl(f)
    g = write(tmp_path / "g.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 2,,}\n')
    with pytest.raises(TraceError, match=r"g.jsonl: line 2, column 17: invalid JSON"):
        read_jsonl(g)
    h = write(tmp_path / "h.jsonl", '{"timestamp": "x", "input_length": 2, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"line 1, column timestamp"):
        read_jsonl(h)


def test_generic_csv_with_mapping_and_unit(tmp_path):
    f = write(tmp_path / "g.csv", "id,ts_ms,prompt,completion\na,1500,10,4\nb,500,20,8\n")
    tr = read_trace(f, "csv", parse_columns("time=ts_ms,input=prompt,output=completion"), time_unit="ms")
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 1.0])
    assert tr.input_tokens.tolist() == [20, 10] and tr.output_tokens.tolist() == [8, 4]
    assert tr.rate_rps == pytest.approx(2 / 2.0)


def test_generic_csv_errors(tmp_path):
    f = write(tmp_path / "g.csv", "ts,p,c\n1,10,4\n2,-3,4\n")
    cols = {"time": "ts", "input": "p", "output": "c"}
    with pytest.raises(TraceError, match=r"g.csv: line 3, column p: token count must be positive"):
        read_csv_trace(f, cols)
    with pytest.raises(TraceError, match=r"line 1, column q: no such column"):
        read_csv_trace(f, cols | {"input": "q"})
    g = write(tmp_path / "h.csv", "ts,p,c\n1,10\n")
    with pytest.raises(TraceError, match=r"h.csv: line 2: expected 3 columns, got 2"):
        read_csv_trace(g, cols)
    with pytest.raises(TraceError, match=r"line 2, column ts: expected a finite non-negative number"):
        read_csv_trace(write(tmp_path / "i.csv", "ts,p,c\nnan,1,1\n"), cols)
    with pytest.raises(TraceError, match="needs a column mapping"):
        read_trace(f, "csv")
    with pytest.raises(ConfigError, match="KEY=COLUMN"):
        parse_columns("time=ts,prompt=p")


def test_expand_path_uses_env_and_default(tmp_path):
    assert expand_path("${SLICESCHED_TRACES}/x.csv", env={"SLICESCHED_TRACES": str(tmp_path)}) == tmp_path / "x.csv"
    default = expand_path("${SLICESCHED_TRACES}/x.csv", env={})
    assert default.parent.name == "traces" and default.parent.parent.name == "shared"
    assert expand_path("rel.csv", base_dir=tmp_path, env={}) == tmp_path / "rel.csv"
