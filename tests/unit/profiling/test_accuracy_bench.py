"""``slicesched bench accuracy`` without the mesh: the simulator replay, the calibration helpers, and the whole
analysis on real measurements saved from a short run of the CPU mesh (data/accuracy_raw_short.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.accuracy_mesh import MeshMeasurement, SegmentBucket
from bench.accuracy_sim import replay
from bench.bench_accuracy import (calibration_requests, correction_factors, drift, evaluate, fit,
                                         loop_overhead, match_requests, measured_arrivals, measured_segments,
                                         noise_floor, path_latency, solo_groups)
from services.cli.main import main
from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.costmodel import cost_for
from shared.costmodel.accuracy import BucketStats
from shared.workload import WorkloadRequest

RAW = Path(__file__).parent / "data" / "accuracy_raw_short.json"


@pytest.fixture(scope="module")
def mesh_cfg():
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    return cluster, load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)


def _meas(**kw) -> MeshMeasurement:
    base = dict(t0_ts=1000.0, requests=[], segments=[], memory={}, capacity_bytes={}, reports=[], worker_requests=[])
    return MeshMeasurement(**(base | kw))


def test_replay_times_one_request_with_the_cost_model(mesh_cfg):
    cluster, tenants = mesh_cfg
    req = WorkloadRequest("r0", 0.5, "tiny-a", 100, 5)
    rep = replay(cluster, tenants, [req])
    cost = cost_for(tenants.get("tiny-a").model.config, "cpu")
    prefill = cost.iteration_time(0, 0, 100, 100 * 101 // 2, 100, 1)
    ttft, tpot = rep.requests["r0"]
    assert ttft == pytest.approx(prefill, rel=1e-9)
    decode = [cost.iteration_time(1, 100 + i) for i in range(1, 5)]
    assert tpot == pytest.approx(sum(decode) / 4, rel=1e-9)
    # one prefill + four decode iterations, all on cpu0, expanded into 4 attn + 4 mlp each
    assert len(rep.iterations) == 5 and {it.device for it in rep.iterations} == {"cpu0"}
    segs = rep.segment_predictions()
    assert segs[("cpu0", "mlp", 1)].count == 4 * 4 and segs[("cpu0", "mlp", 128)].count == 4
    assert segs[("cpu0", "head", 128)].mean == pytest.approx(cost.head_time(1) * 1e3)
    # memory: weights from the start, plus the request's KV blocks while it runs
    tl = rep.memory["cpu0"]
    kv = -(-105 // 16) * 16 * cost.kv_bytes_per_token
    assert max(b for _, b in tl) == cost.weight_bytes + kv and tl[-1][1] == cost.weight_bytes


def test_replay_shift_delivery_and_drift(mesh_cfg):
    cluster, tenants = mesh_cfg
    req = [WorkloadRequest("r0", 0.0, "tiny-b", 64, 3)]
    base = replay(cluster, tenants, req).requests["r0"]
    moved = replay(cluster, tenants, req, arrival_shift_s=0.01, delivery_s=0.002).requests["r0"]
    assert moved[0] == pytest.approx(base[0] + 0.012) and moved[1] == pytest.approx(base[1])
    # the client's end of stream 1 ms after the worker's finish, its first token 2 ms after: TPOT over 2 steps
    tail = replay(cluster, tenants, req, delivery_s=0.002, done_s=0.001).requests["r0"]
    assert tail[0] == pytest.approx(base[0] + 0.002) and tail[1] == pytest.approx(base[1] - 0.0005)
    assert replay(cluster, tenants, req, delivery_s=1.0, done_s=0.0).requests["r0"][1] == 0.0  # never below zero
    slow = replay(cluster, tenants, req, drift={"cpu1": [(0.0, 2.0)]})
    assert slow.requests["r0"][0] == pytest.approx(2 * base[0]) and slow.requests["r0"][1] == pytest.approx(2 * base[1])
    assert all(it.scale == 2.0 for it in slow.iterations)


def test_match_requests_and_path_latency():
    recs = [{"id": "a", "tenant": "t", "status": "ok", "sent_ts": 1000.0, "ttft_s": 0.050, "input_tokens": 10,
             "output_tokens": 4, "e2e_s": 0.104},
            {"id": "b", "tenant": "t", "status": "ok", "sent_ts": 1000.1, "ttft_s": 0.070, "input_tokens": 10,
             "output_tokens": 4, "e2e_s": 0.098}]
    workers = [{"device": "d", "tenant": "t", "prompt_tokens": 10, "completion_tokens": 4, "started": 0.11,
                "first_token": 0.16, "finish": 0.2},
               {"device": "d", "tenant": "t", "prompt_tokens": 10, "completion_tokens": 4, "started": 0.01,
                "first_token": 0.04, "finish": 0.1}]
    m = _meas(requests=recs, worker_requests=workers)
    pairs = match_requests(m)
    assert [(r["id"], w["started"]) for r, w in pairs] == [("a", 0.01), ("b", 0.11)]
    d_in, d_out, d_done = path_latency(m)
    assert d_in == pytest.approx(0.01)  # both requests reach the worker 10 ms after they are sent
    assert d_out == pytest.approx(0.01)  # and their first token reaches the client 10 ms after the worker has it
    assert d_done == pytest.approx(0.001)  # their ends of stream 4 ms after and 2 ms before the worker's finish
    for r in recs:
        del r["e2e_s"]
    assert path_latency(m)[2] == pytest.approx(d_out)  # no end times: the client's TPOT is taken as the worker's


def test_solo_groups_and_noise_floor():
    recs, workers = [], []
    for i in range(6):  # six requests alone on device d, identical work; TPOT 2 ms but one at 3 ms
        recs.append({"id": f"a{i}", "tenant": "t", "status": "ok", "sent_ts": 1000.0 + i, "ttft_s": 0.05,
                     "tpot_s": 0.003 if i == 5 else 0.002, "input_tokens": 100, "output_tokens": 4})
        workers.append({"device": "d", "tenant": "t", "prompt_tokens": 100, "completion_tokens": 4,
                        "started": i + 0.01, "first_token": i + 0.05, "finish": i + 0.1})
    # and two that overlap each other on device d: not alone, never scored
    for j, at in enumerate((10.0, 10.05)):
        recs.append({"id": f"b{j}", "tenant": "t", "status": "ok", "sent_ts": 1000.0 + at, "ttft_s": 0.5,
                     "tpot_s": 0.009, "input_tokens": 100, "output_tokens": 4})
        workers.append({"device": "d", "tenant": "t", "prompt_tokens": 100, "completion_tokens": 4,
                        "started": at + 0.01, "first_token": at + 0.05, "finish": at + 0.2})
    m = _meas(requests=recs, worker_requests=workers)
    groups = solo_groups(m)
    assert [i for i, _ in groups["ttft"][("d", "t", 100)]] == [f"a{i}" for i in range(6)]
    assert list(groups["tpot"]) == [("d", "t", 128)]  # TPOT grouped by the prompt's power-of-two bucket
    nf = noise_floor(m)
    assert nf["ttft"]["median"] == 0.0 and nf["tpot"]["median"] == 0.0  # five of six at 2 ms: median APE 0
    assert nf["tpot"]["items"] == 6 and nf["tpot"]["ids"] == [f"a{i}" for i in range(6)]
    assert noise_floor(m, min_size=7)["tpot"]["items"] == 0


def test_loop_overhead_and_correction_factors():
    workers = [{"device": "d", "started": 0.0, "finish": 1.0}, {"device": "d", "started": 0.5, "finish": 1.5}]
    reports = [{"device": "d", "end": 1.0, "steps": 100, "segment_ms": 1000.0, "segments": []}]
    # 1.5 s with work, 1.0 s of it in segments, over 100 iterations: 5 ms per iteration
    assert loop_overhead(_meas(worker_requests=workers, reports=reports)) == {"d": pytest.approx(0.005)}
    meas = {("d", "mlp", 1): BucketStats(10, 20.0), ("d", "mlp", 2): BucketStats(10, 60.0),
            ("d", "attn", 1): BucketStats(5, 5.0)}
    pred = {("d", "mlp", 1): BucketStats(4, 4.0), ("d", "mlp", 2): BucketStats(1, 2.0)}
    # (20 + 60) measured against 10 × 1 + 10 × 2 predicted; attn never predicted; each bucket with ≥ 5
    # measured executions also gets its own factor (mean 2 ms vs 1 ms; 6 ms vs 2 ms)
    assert correction_factors(meas, pred) == {"d": {"mlp": pytest.approx(80 / 30), "mlp@1": pytest.approx(2.0),
                                                    "mlp@2": pytest.approx(3.0)}}
    assert correction_factors(meas, pred, min_bucket=11) == {"d": {"mlp": pytest.approx(80 / 30)}}


def test_drift_is_causal_ewma():
    reports = [{"device": "d", "end": 1.0, "segments": [["mlp[0]", 1, 10, 20.0]]},
               {"device": "d", "end": 2.0, "segments": [["mlp[1]", 1, 10, 40.0], ["head", 1, 5, 1.0]]}]
    pts = drift(_meas(reports=reports), {("d", "mlp", 1): 1.0}, alpha=0.5)["d"]
    assert pts == [(1.0, pytest.approx(2.0)), (2.0, pytest.approx(3.0))]  # head: no prediction, left out


def test_measured_segments_pool_layers_and_devices():
    segs = [SegmentBucket("a", "t", "mlp[0]", 4, 2, 2.0, 2.0), SegmentBucket("a", "t", "mlp[3]", 4, 2, 6.0, 18.0),
            SegmentBucket("b", "u", "mlp[1]", 4, 1, 4.0, 16.0)]
    pooled = measured_segments(_meas(segments=segs))
    assert pooled[("mlp", 4)].count == 5 and pooled[("mlp", 4)].mean == pytest.approx(12.0 / 5)
    assert measured_segments(_meas(segments=segs), pool_devices=False)[("a", "mlp", 4)].count == 4


def test_calibration_traffic_is_deterministic_and_covers_every_tenant(mesh_cfg):
    _, tenants = mesh_cfg
    a, b = calibration_requests(tenants, 10.0), calibration_requests(tenants, 10.0)
    assert a == b and {r.tenant for r in a} == set(tenants.names())
    assert all(0 <= r.arrival_s < 10 and 16 <= r.input_tokens <= 256 and 8 <= r.output_tokens <= 64 for r in a)


def test_bench_from_saved_mesh_measurements(tmp_path, capsys):
    out = tmp_path / "acc.json"
    rc = main(["bench", "accuracy", "--from-raw", str(RAW), "--duration-s", "6", "--calibration-s", "3",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("segment_mape", "ttft_median_ape", "tpot_median_ape", "memory_error_pct_capacity"):
        assert 0 <= res[key] < 50, key  # fractions
        assert res["profile_only"][key] >= 0
    assert res["headline"] == "calibrated" and {"calibrated", "online", "calibration"} <= set(res)
    assert res["requests"] == len(json.loads(RAW.read_text())["phases"]["run"]["requests"])
    rows = res["calibrated"]["detail"]["segments"]["rows"]
    assert rows and all(r["count"] >= 20 for r in rows)
    # weights and KV are accounted the same way on both sides: well under 5 % of capacity apart
    assert res["memory_error_pct_capacity"] < 0.05
    assert "per-segment latency MAPE" in capsys.readouterr().out
    # the diagnostic fit on the scored phase itself reproduces every scored bucket's mean (the refit over the
    # batches of a corrected replay makes it self-consistent); the calibrated prediction does not get that
    assert res["in_sample"]["segment_mape"] < 0.02 < res["segment_mape"]
    assert res["calibration"]["fit_rounds"] == 3 and res["machine_noise"] == []


def test_fit_refits_factors_over_the_batches_of_the_corrected_replay(mesh_cfg):
    """One round learns the factors against the uncorrected replay's batches, which are not the ones the mesh ran
    (a slower device batches more); refitting over the corrected replay's batches closes the gap."""
    cluster, tenants = mesh_cfg
    run = MeshMeasurement.from_dict(json.loads(RAW.read_text())["phases"]["run"])
    _, evaluated = measured_arrivals(str(REPO_CONFIGS / "workloads" / "tiny-bursty.yaml"), 6.0)
    mape = []
    for rounds in (1, 3):
        cost_of, (d_in, d_out, d_done), learned = fit(cluster, tenants, run, evaluated, rounds=rounds)
        assert learned["fit_rounds"] == rounds and learned["correction_factors"]
        rep = replay(cluster, tenants, evaluated, cost_of=cost_of, arrival_shift_s=d_in, delivery_s=d_out,
                     done_s=d_done)
        mape.append(evaluate(run, rep, 20)["segment_mape"])
    assert mape[1] < 0.02 and mape[0] > 5 * mape[1]


def test_machine_noise_is_saved_with_the_raw_measurements_and_reported(tmp_path, capsys):
    raw = json.loads(RAW.read_text())
    noise = {"window_s": 0.05, "calls_per_window": 9, "windows": 80, "median_s": 0.05, "median_abs_dev": 0.057,
             "p10": 0.88, "p90": 1.11, "min": 0.7, "max": 1.3, "lag1_autocorr": 0.71}
    raw["machine_noise"] = [noise]
    saved = tmp_path / "raw.json"
    saved.write_text(json.dumps(raw))
    out = tmp_path / "acc.json"
    assert main(["bench", "accuracy", "--from-raw", str(saved), "--duration-s", "6", "--calibration-s", "3",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["machine_noise"] == [noise]
    printed = capsys.readouterr().out
    assert "machine steadiness" in printed and "80 windows of 50 ms" in printed and "5.7%" in printed


def test_bench_rejects_bad_arguments(capsys):
    assert main(["bench", "accuracy", "--duration-s", "0"]) == 2
    assert main(["bench", "accuracy", "--machine-noise-s", "-1"]) == 2
    assert main(["bench", "accuracy", "--machine-noise-s", "0.3"]) == 2  # not three 200 ms windows
    assert main(["bench", "accuracy", "--workload", "/nonexistent.yaml"]) == 2
    err = capsys.readouterr().err
    assert "nonexistent.yaml" in err and "Traceback" not in err


def test_from_raw_takes_the_phase_lengths_the_measurements_were_taken_with(tmp_path, capsys):
    raw = json.loads(RAW.read_text())
    saved = tmp_path / "raw.json"
    saved.write_text(json.dumps({"settings": {"duration_s": 6.0, "calibration_s": 3.0}, "phases": raw["phases"]}))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["bench", "accuracy", "--from-raw", str(saved), "--json", str(a)]) == 0  # no flags: the file's
    assert main(["bench", "accuracy", "--from-raw", str(RAW), "--duration-s", "6", "--calibration-s", "3",
                 "--json", str(b)]) == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["duration_s"] == 6.0 and ra["segment_mape"] == rb["segment_mape"]
    assert ra["ttft_median_ape"] == rb["ttft_median_ape"]
    capsys.readouterr()
    # a phase length other than the one measured would analyse other requests than those measured: refused
    assert main(["bench", "accuracy", "--from-raw", str(saved), "--duration-s", "30"]) == 2
    assert "differs from the 6 the raw measurements" in capsys.readouterr().err


def test_trace_calibration_is_shaped_like_the_workload_but_never_its_requests():
    from bench.bench_accuracy import measured_arrivals, trace_calibration_requests
    wl = "configs/workloads/tiny-bursty.yaml"
    _, measured = measured_arrivals(wl, 30.0)
    cal = trace_calibration_requests(wl, 20.0)
    assert cal and all(0 <= r.arrival_s < 20.0 for r in cal)
    assert {r.tenant for r in cal} <= {r.tenant for r in measured} | {"tiny-a", "tiny-b"}
    assert not {r.request_id for r in cal} & {r.request_id for r in measured}
    assert {(round(r.arrival_s, 3), r.input_tokens) for r in cal} != {(round(r.arrival_s, 3), r.input_tokens)
                                                                      for r in measured if r.arrival_s < 20.0}
