"""ServeGen reader: per-window counts, fitted burstiness, client selection, length sampling, speed."""
from __future__ import annotations

import gzip
import time
from pathlib import Path

import numpy as np
import pytest

from loadgen import servegen
from loadgen.servegen import (RATE_COLUMNS, client_arrivals, read_lengths, read_rates, sample_lengths,
                              select_clients, servegen_traces)
from loadgen.traces import TraceError

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"
LEN_HEADER = ("category,model,client_id,window_start_s,input_tokens_mean,input_tokens_p50,input_tokens_p90,"
              "input_tokens_p99,output_tokens_mean,output_tokens_p50,output_tokens_p90,output_tokens_p99")


def gz(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def files(tmp_path):
    rates = [",".join(RATE_COLUMNS)]
    # client 1: Gamma CV 2 at 40 req/s in window 0, nothing in 600, Weibull k=0.5 at 20 req/s in 1200
    rates.append("language,m-x,1,0,40.0,2.0,Gamma,0.25,0.1")
    rates.append("language,m-x,1,1200,20.0,2.2,Weibull,0.5,0.05")
    rates.append("language,m-x,2,0,1.0,1.0,Gamma,1.0,1.0")
    rates.append("language,m-x,2,600,1.0,1.0,Gamma,1.0,1.0")
    rates.append("language,m-y,9,0,100.0,1.0,Gamma,1.0,0.01")
    lens = [LEN_HEADER, "language,m-x,1,0,120,100,300,500,60,50,90,120",
            "language,m-x,3,0,1200,1000,1000,1000,30,20,20,20",
            "language,m-x,4,0,,,,,,,,"]  # an empty window: no data, must be skipped
    return gz(tmp_path / "rates.csv.gz", rates), gz(tmp_path / "lens.csv.gz", lens)


def test_window_counts_and_fitted_burstiness(files):
    table = read_rates(files[0], "m-x")
    assert table.clients() == [1, 2]
    t = client_arrivals(table, 1, 0.0, 1800.0, seed=3)
    assert np.all(np.diff(t) >= 0) and t.min() >= 0 and t.max() < 1800
    counts = np.histogram(t, bins=[0, 600, 1200, 1800])[0]
    assert counts.tolist() == [24000, 0, 12000]  # rate × 600 exactly (integral expectations)
    cv_gamma = np.diff(t[t < 600]).std() / np.diff(t[t < 600]).mean()
    assert cv_gamma == pytest.approx(2.0, rel=0.12)  # Gamma shape 0.25 → CV 2
    g = np.diff(t[t >= 1200])
    assert g.std() / g.mean() == pytest.approx(np.sqrt(24 / 4 - 1), rel=0.15)  # Weibull k=0.5 → CV √5


def test_span_cut_and_determinism(files):
    table = read_rates(files[0], "m-x")
    a = client_arrivals(table, 2, 300.0, 600.0, seed=1)
    assert a.min() >= 0 and a.max() < 600 and 450 <= a.size <= 750
    assert np.array_equal(a, client_arrivals(table, 2, 300.0, 600.0, seed=1))
    assert not np.array_equal(a, client_arrivals(table, 2, 300.0, 600.0, seed=2))


def test_select_clients(files):
    table = read_rates(files[0], "m-x")
    assert select_clients(table, 0, 1800, top=2) == [1, 2]
    assert select_clients(table, 600, 600, top=1) == [2]  # client 1 is idle in [600, 1200)
    with pytest.raises(TraceError, match="client 1 has no requests"):
        select_clients(table, 600, 600, ids=[1])
    with pytest.raises(TraceError, match="only 1 clients"):
        select_clients(table, 600, 600, top=2)


def test_lengths_lognormal_through_p50_p90_capped_at_p99(files):
    stats = read_lengths(files[1], "m-x")
    assert set(stats.per_client) == {1, 3}
    inp, out = sample_lengths(stats, 1, np.zeros(20000), seed=5)
    assert np.median(inp) == pytest.approx(100, rel=0.05)
    assert np.percentile(inp, 90) == pytest.approx(300, rel=0.08)
    assert inp.max() == 500 and out.max() == 120 and inp.min() >= 1
    # a client without rows uses the per-window median over the model's clients: p50 = median(100, 1000)
    inp2, _ = sample_lengths(stats, 77, np.zeros(4000), seed=5)
    assert np.median(inp2) == pytest.approx(550, rel=0.08)


def test_servegen_traces_and_bad_files(files, tmp_path):
    traces = servegen_traces(files[0], files[1], "m-x", 0.0, 1800.0, seed=1, top=2)
    assert [t.name for t in traces] == ["servegen:m-x:1", "servegen:m-x:2"]
    assert traces[0].period_s == 1800.0 and traces[0].rate_rps == pytest.approx(36000 / 1800)
    with pytest.raises(TraceError, match="no rows for model 'm-z'"):
        read_rates(files[0], "m-z")
    bad = gz(tmp_path / "bad.csv.gz", [",".join(RATE_COLUMNS), "language,m-x,1,0,fast,1,Gamma,1,1"])
    with pytest.raises(TraceError, match=r"bad.csv.gz: line 2, column rate_rps: expected a number"):
        read_rates(bad, "m-x")
    bad2 = gz(tmp_path / "bad2.csv.gz", [",".join(RATE_COLUMNS), "language,m-x,1,0,1,1,Pareto,1,1"])
    with pytest.raises(TraceError, match=r"line 2, column iat_dist: expected Gamma or Weibull"):
        read_rates(bad2, "m-x")
    with pytest.raises(TraceError, match="line 1: expected header"):
        read_rates(gz(tmp_path / "h.csv.gz", ["a,b,c"]), "m-x")


@pytest.mark.skipif(not (TRACES / "servegen_client_rates_600s.csv.gz").is_file(), reason="shared traces not present")
def test_real_servegen_file_is_fast():
    servegen._tables.cache_clear()
    t = time.process_time()  # CPU time: wall time on a shared 2-core machine depends on the neighbours
    traces = servegen_traces(TRACES / "servegen_client_rates_600s.csv.gz", TRACES / "servegen_client_lengths_6h.csv.gz",
                             "m-large", 50400.0, 3600.0, seed=1, top=16)
    elapsed = time.process_time() - t
    assert elapsed < 5.0, f"reading the ServeGen files took {elapsed:.2f} s"
    assert len(traces) == 16
    rates = [t.rate_rps for t in traces]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0
