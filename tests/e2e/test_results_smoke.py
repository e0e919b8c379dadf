"""``slicesched bench results`` end to end: the files, figures and README block it produces, with finite numbers.

The default suite runs the sim part on a small synthetic workload and checks that the timeline's streams survive
the consumers' trimming on a real Redis; the quick run of every fidelity (two meshes) is marked slow.
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import yaml

from services.cli.main import main
from bench.results.render import BEGIN, END


@pytest.fixture()
def small(tmp_path) -> Path:
    """A 4-device modelled cluster, 3 tenants, one minute of Azure-format arrivals."""
    rng = random.Random(3)
    lines, t = ["TIMESTAMP,ContextTokens,GeneratedTokens"], 0.0
    for _ in range(240):
        t += rng.expovariate(4.0)
        s = int(t)
        lines.append(f"2023-11-16 18:{s // 60:02d}:{s % 60:02d}.{int((t - s) * 1e7):07d},"
                     f"{rng.randint(50, 2000)},{rng.randint(2, 200)}")
    (tmp_path / "trace.csv").write_text("\n".join(lines))
    devices = [{"id": f"g{i}", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80, "host": f"n{i // 2}"}
               for i in range(4)]
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"cluster": {"name": "c4"}, "devices": devices,
                                                           "links": {"intra_host": "nvlink", "inter_host": "nccl"}}))
    tenants = [{"name": f"t{i}", "model": {"preset": "llama-7b"}, "sla": {"ttft_ms": 109, "tpot_ms": 28.8},
                "home_devices": [f"g{i}"]} for i in range(3)]
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    wl = {"name": "small", "tenants": "tenants.yaml", "traces": [{"path": str(tmp_path / "trace.csv"),
                                                                  "format": "azure"}],
          "alpha": 1.3, "seed": 1, "duration_s": 60}
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(wl))
    (tmp_path / "README.md").write_text("# Project\n\n## Results\n")
    return tmp_path


def _finite(res: dict, policies: list[str]) -> None:
    for name in policies:
        p = res["policies"][name]
        for key in ("max_scale_9", "tokens_per_s_9", "max_scale_1", "tokens_per_s_1"):
            assert isinstance(p[key], (int, float)) and math.isfinite(p[key]), (name, key, p[key])
        assert p["tokens_per_s_9"] >= p["tokens_per_s_1"] >= 0
    assert res["runs"] and all(math.isfinite(r["tokens_per_s"]) and 0 <= r["violation_rate"] <= 1
                               for r in res["runs"])
    m = res["meta"]
    assert m["machine"] and m["date"] and m["command"].startswith("slicesched bench compare") and m["quick"]


def _readme_block(readme: Path) -> str:
    text = readme.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.startswith("# Project\n\n## Results\n")
    return text[text.index(BEGIN):text.index(END)]


def test_quick_sim_part_writes_json_figure_page_and_readme(small):
    out = small / "docs" / "results"
    rc = main(["bench", "results", "--quick", "--only", "sim", "--out", str(out), "--readme", str(small / "README.md"),
               "--sim-workloads", str(small / "small.yaml"), "--sim-cluster", str(small / "cluster.yaml"),
               "--sim-policies", "container,slice", "--sim-duration-s", "15", "--tolerance", "1",
               "--start-scale", "12"])  # a coarse bracket: about three points per policy
    assert rc == 0
    res = json.loads((out / "sim-small.json").read_text())
    _finite(res, ["container", "slice"])
    assert res["fidelity"] == "sim" and res["meta"]["fidelity_label"] == "simulated"
    assert res["meta"]["duration_s"] == 15 and res["meta"]["shortened"] and res["meta"]["tenants"] == 3
    assert "--only sim" in res["meta"]["results_command"]
    png = out / "sim-small.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 150_000
    md = (small / "docs" / "results.md").read_text()
    assert "### small (simulated)" in md and "](results/sim-small.png)" in md and "**simulated**" in md
    a = json.loads((out / "anatomy-small.json").read_text())  # where the violations are, at slice's boundary
    assert a["scale"] == res["per_seed"][str(res["seeds"][0])]["policies"]["slice"]["max_scale_9"]
    assert set(a["runs"]) == {"container", "slice", "container at its boundary"}
    assert "### Where the violations are (simulated)" in md and "| small | slice |" in md
    ratio = res["ratio_to_container"]["slice"]["9"]
    assert f"| small | {ratio:.2f} |" in _readme_block(small / "README.md")


@pytest.mark.integration
async def test_held_streams_survive_trimming_and_give_the_timeline(redis, redis_url, prefix):
    import redis as syncredis

    from shared.codec import encode
    from shared.messages import LeaseGranted, StepReport, WorkerMsg, EventsMsg, events_stream, worker_stream
    from shared.streams import FIELD_MSG, FIELD_TYPE, safe_trim
    from bench.results.timeline import build_timeline, hold_streams, read_stream

    ev, wk = events_stream(prefix), worker_stream(prefix, "d1")
    await redis.xgroup_create(ev, "gmg", id="$", mkstream=True)
    await redis.xgroup_create(wk, "worker", id="$", mkstream=True)
    r = syncredis.Redis.from_url(redis_url)
    hold_streams(r, [ev, wk])
    hold_streams(r, [ev, wk])  # idempotent
    t0 = 1_700_000_000.0
    for i in range(5):
        rep = StepReport(msg_id=f"s{i}", device="d1", tenant="b", window_start_ts=t0 + i, window_end_ts=t0 + i + 1,
                         steps=1, busy_ms=100.0, busy_intervals=[(t0 + i, t0 + i + 0.1)])
        await redis.xadd(ev, {FIELD_TYPE: "StepReport", FIELD_MSG: encode(rep)})
    g = LeaseGranted(msg_id="g", lease_id="L", tenant="a", home_device="d0", guest_device="d1", segments=["mlp[0]"],
                     start_ts=t0 + 1, end_ts=t0 + 3)
    await redis.xadd(wk, {FIELD_TYPE: "LeaseGranted", FIELD_MSG: encode(g)})
    await redis.xadd(ev, {FIELD_TYPE: "StepReport", FIELD_MSG: b"\xc1 not msgpack"})
    for stream, group in ((ev, "gmg"), (wk, "worker")):  # the services read, ack and trim
        got = await redis.xreadgroup(group, "c", {stream: ">"})
        await redis.xack(stream, group, *[eid for _, entries in got for eid, _ in entries])
        await safe_trim(redis, stream)
    events, worker = read_stream(r, ev, EventsMsg, chunk=2), read_stream(r, wk, WorkerMsg)
    r.close()
    assert len(events) == 5 and len(worker) == 1  # the poison entry is skipped, nothing was trimmed
    tl = build_timeline(events, worker, t0=t0)
    assert [x[1] for x in tl["own"]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert tl["leases"] == [["d1", "d0", "a", 1.0, 3.0, "segments", "window"]]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)  # two meshes, several points each: minutes, far past the suite's 120 s default
def test_quick_run_of_every_fidelity(small):
    out = small / "docs" / "results"
    rc = main(["bench", "results", "--quick", "--out", str(out), "--readme", str(small / "README.md"),
               "--sim-workloads", str(small / "small.yaml"), "--sim-cluster", str(small / "cluster.yaml"),
               "--sim-policies", "container,slice,pooled-bound", "--sim-duration-s", "20",
               "--mesh-duration-s", "10", "--tolerance", "1"])
    assert rc == 0
    for name, fid in (("emulated", "emulated"), ("emulated-prediction", "sim"), ("real", "real")):
        res = json.loads((out / f"{name}.json").read_text())
        assert res["fidelity"] == fid
        _finite(res, ["container", "slice"])
        assert (out / f"{name}.png").stat().st_size < 150_000
    for fid in ("emulated", "real"):
        tl = json.loads((out / f"{fid}-timeline.json").read_text())
        assert tl["policy"] == "slice" and tl["devices"] and tl["own"], fid
        assert all(0 <= a < b for _, a, b, _ in tl["own"])
        assert (out / f"{fid}-timeline.png").stat().st_size < 150_000
    md = (small / "docs" / "results.md").read_text()
    for label in ("**simulated**", "**emulated mesh**", "**real CPU mesh**", "Measured vs predicted"):
        assert label in md
    block = _readme_block(small / "README.md")
    assert "**Emulated mesh**" in block and "**Real CPU mesh**" in block
    assert not re.search(r"\b(nan|inf)\b", block.lower())
