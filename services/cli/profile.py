"""``slicesched profile``: micro-benchmark the real operators on the local device and write a measured profile.

Times the model's own segment code over a grid of shapes (:mod:`shared.costmodel.profiling`), fits the
efficiencies per (operator class, size bucket) and the per-class launch overheads the cost model's roofline uses
(:mod:`shared.costmodel.fitting`), measures the engine's per-step overhead, writes the profile YAML, and prints
the fitted profile's prediction error against a fresh measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

QUICK_BUDGET_S = 2.0
FULL_BUDGET_S = 60.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run the benchmarks")
    p.add_argument("--model", action="append", default=None,
                   help="model preset(s) whose shapes are benchmarked (repeat or comma-separate; default: tiny on "
                        "cpu, llama-7b on cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the CPU workers use 1)")
    p.add_argument("--out", default=None, help="profile YAML to write (default: profile-<kind>.yaml)")
    p.add_argument("--kind", default=None, help="device kind written in the profile (default: detected)")
    p.add_argument("--quick", action="store_true", help="a small grid and short budget (tests; < 20 s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"seconds of measurement for the fit (default {FULL_BUDGET_S:g}, --quick {QUICK_BUDGET_S:g}); "
                        "the fresh validation pass takes half as long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write fit, validation errors and metadata here")


def _fail(msg: str) -> int:
    print(f"slicesched profile: {msg}", file=sys.stderr)
    return 2


def machine_description(device: str) -> str:
    """A one-line description of the machine (CPU model and cores; the GPU's name on cuda)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{os.cpu_count()}-core {cpu}, {platform.system()}"
    if device == "cuda":
        import torch
        desc = f"{torch.cuda.get_device_name()} ({desc})"
    return desc


def detect_kind(device: str) -> str:
    """The profile kind of the local device: ``cpu``, or a GPU kind from its name."""
    if device == "cpu":
        return "cpu"
    import torch
    name = torch.cuda.get_device_name().lower()
    for key, kind in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb")):
        if key in name:
            return kind
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def _base_profile(kind: str):
    """The shipped profile of ``kind`` (links and memory are not measured here), else the CPU one."""
    from shared.config import ConfigError
    from shared.costmodel import load_profile
    try:
        return load_profile(kind)
    except ConfigError:
        return load_profile("cpu")


DISPLAY_GROUPS = (16, 64, 256, 1024)  # token ranges of the printed summary (the profile's buckets are finer)


def summarize_errors(rows: list[tuple[Any, Any, float, float]]) -> list[dict[str, Any]]:
    """Group (config, measurement, predicted ms, error) rows by operator and token range."""
    import bisect
    bounds = DISPLAY_GROUPS
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _, m, _, err in rows:
        c = m.case
        op = c.kind if c.kind != "attn" else ("attn decode" if not c.prefill else
                                                "attn prefill" if not c.decode_ctx else "attn mixed")
        b = bisect.bisect_left(bounds, c.tokens)
        lo = 1 if b == 0 else bounds[b - 1] + 1
        rng = f"{lo}-{bounds[b]}" if b < len(bounds) else f">{bounds[-1]}"
        groups[(op, rng)].append(abs(err))
    return [{"operator": op, "tokens": rng, "cases": len(v), "mape": sum(v) / len(v), "worst": max(v)}
            for (op, rng), v in groups.items()]


def run(args: argparse.Namespace) -> int:
    from shared.model.config import PRESETS

    models = [m for item in (args.model or ["tiny" if args.device == "cpu" else "llama-7b"])
              for m in item.split(",") if m]
    bad = [m for m in models if m not in PRESETS]
    if bad:
        return _fail(f"unknown model preset {bad[0]!r}; valid: {', '.join(PRESETS)}")
    if args.threads < 1:
        return _fail("--threads must be >= 1")
    if args.budget_s is not None and args.budget_s <= 0:
        return _fail("--budget-s must be positive")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is available on this machine")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    kind = args.kind or detect_kind(args.device)
    profile, fit, rows = measure_and_fit(args, kind, {m: PRESETS[m] for m in models})
    mape = sum(abs(r[3]) for r in rows) / len(rows)
    summary = summarize_errors(rows)
    print("| operator | tokens | shapes | MAPE | worst |")
    print("|---|---|---:|---:|---:|")
    for s in summary:
        print(f"| {s['operator']} | {s['tokens']} | {s['cases']} | {s['mape']:.1%} | {s['worst']:.1%} |")
    print(f"all {len(rows)} shapes: MAPE {mape:.1%} against a fresh measurement (mean of uninterrupted calls)")
    date, machine = time.strftime("%Y-%m-%d", time.gmtime()), machine_description(args.device)
    threads = args.threads if args.device == "cpu" else torch.get_num_threads()
    meta = {"date": date, "machine": machine, "torch": str(torch.__version__), "threads": threads, "models": models,
            "fit": {"log_rms": round(fit.log_rms, 4), "validation_mape": round(mape, 4), "shapes": len(rows)}}
    out = Path(args.out or f"profile-{kind}.yaml")
    from shared.costmodel.fitting import write_profile
    write_profile(out, profile, _header(args, models, meta), meta)
    print(f"wrote {out} ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr)
    if args.json_out:
        names = {cfg: name for name, cfg in ((m, PRESETS[m]) for m in models)}
        doc = {"profile": profile.to_dict(), "meta": meta, "validation_mape": mape, "summary": summary,
               "validation": [{"model": names[cfg], "case": m.case.label, "measured_ms": m.value_ms,
                               "mean_all_ms": m.mean_ms, "median_ms": m.median_ms, "interrupted": m.interrupted,
                               "rel_se": m.rel_se, "predicted_ms": pred, "error": err} for cfg, m, pred, err in rows]}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    return 0


def measure_and_fit(args: argparse.Namespace, kind: str, cfgs: dict[str, Any]) -> tuple[Any, Any, list]:
    """Peaks, step overhead, the fit pass, the profile, and its errors against a fresh measurement pass."""
    import torch

    from shared.costmodel.fitting import STARTS, build_profile, fit_rates, prediction_errors
    from shared.costmodel.profiling import (SegmentBench, default_cases, measure, measure_peaks,
                                            measure_step_overhead)

    budget = args.budget_s or (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    first = next(iter(cfgs.values()))
    peak_flops, bandwidth = measure_peaks(args.device, getattr(torch, first.dtype))
    steps = 20 if args.quick else 60
    step_s = sum(measure_step_overhead(c, args.device, steps=steps) for c in cfgs.values()) / len(cfgs)
    print(f"peaks: GEMM {peak_flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s; "
          f"engine step overhead {step_s * 1e3:.3f} ms", file=sys.stderr)
    benches = {m: SegmentBench(c, args.device, seed=args.seed) for m, c in cfgs.items()}
    cases = {m: default_cases(c, quick=args.quick) for m, c in cfgs.items()}
    print(f"measuring {sum(len(v) for v in cases.values())} shapes of {', '.join(cfgs)} on {args.device} for "
          f"~{budget:.0f} s ...", file=sys.stderr)

    def one_pass(seconds: float, seed: int) -> list:
        return [(cfgs[m], x) for m in cfgs for x in measure(benches[m], cases[m], seconds / len(cfgs), seed=seed)]

    data = one_pass(budget, args.seed)
    fit = fit_rates(data, peak_flops=peak_flops, mem_bandwidth=bandwidth, per_class_launch=True,
                    starts=STARTS[::4] if args.quick else STARTS)
    base = _base_profile(kind)
    memory = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else base.memory_bytes
    profile = build_profile(fit, kind=kind, peak_flops=peak_flops, mem_bandwidth=bandwidth, memory_bytes=memory,
                            links=base.links, step_overhead_s=step_s)
    print(f"fitted in {fit.iterations} iterations (weighted RMS log-error {fit.log_rms:.3f}); "
          f"fresh measurement for ~{budget / 2:.0f} s ...", file=sys.stderr)
    return profile, fit, prediction_errors(profile, one_pass(budget / 2, args.seed + 1))


def _header(args: argparse.Namespace, models: list[str], meta: dict[str, Any]) -> str:
    command = (f"slicesched profile --device {args.device} --model {','.join(models)} --threads {args.threads}"
               + (" --quick" if args.quick else "") + (f" --budget-s {args.budget_s:g}" if args.budget_s else ""))
    clock = "thread CPU-time" if args.device == "cpu" else "synchronised wall"
    return (f"Measured by `{command}` on {meta['date']}.\n"
            f"{meta['machine']}; torch {meta['torch']}, {meta['threads']} thread(s). The real segment code timed "
            f"on the {clock} clock\n(mean of uninterrupted calls in interleaved rounds), fitted per (operator "
            "class, size bucket); peaks are the\nfastest GEMM and copy measured (small sizes stay in cache). "
            "Links and memory_bytes are not measured here\n(kept from the previous profile).")
