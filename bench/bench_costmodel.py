"""``slicesched bench costmodel``: the cost model's GPU profiles against measured H100/A100 timings (Vidur).

Prints, per GPU and measured model, the mean absolute percentage error of the cost model's per-operator times
against Vidur's measurements for each operator family (GEMM, norm, rotary, activation, residual add, embedding)
and of its transfer times against measured NCCL send/recv, optionally beside a "before" set of profiles. With
``--fit-out DIR`` it first fits the H100 and A100 profiles to the timings (:mod:`shared.costmodel.measured_fit`),
derives the H200 one from the H100 fit, writes them to DIR with their provenance, and compares the fitted
profiles against the ones they replace. Attention is not in the data (modelled from first principles).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shared.argtypes import positive_float

FAMILY_TITLES = {"gemm": "GEMM", "norm": "norm", "rotary": "rotary", "activation": "activation",
                 "residual": "residual add", "embedding": "embedding"}
FIT_COMMAND = "slicesched bench costmodel --against ../shared/profiles/vidur --fit-out shared/costmodel/profiles"


def configure(p: argparse.ArgumentParser) -> None:
    from shared.costmodel.measured import DEFAULT_DIR
    p.add_argument("--against", default=DEFAULT_DIR,
                   help=f"directory of Vidur's measured timings (default {DEFAULT_DIR}; README there)")
    p.add_argument("--gpu", action="append", choices=("h100", "a100"), default=None,
                   help="GPU(s) to compare (repeat; default: both)")
    p.add_argument("--profiles", default=None,
                   help="directory with <kind>.yaml profiles to compare (default: the shipped profiles)")
    p.add_argument("--before", default=None,
                   help="directory with <kind>.yaml profiles shown as the 'before' column (e.g. an older commit's "
                        "shared/costmodel/profiles)")
    p.add_argument("--fit-out", default=None,
                   help="fit the H100/A100 profiles to the timings, derive H200 from the H100 fit, write "
                        "<kind>.yaml there; the profiles they replace become the 'before' column")
    p.add_argument("--holdout", action="append", default=[],
                   help="measured model left out of the fit (repeat), e.g. meta-llama/Llama-2-7b-hf; its rows "
                        "stay in the table (validation)")
    p.add_argument("--max-mape", type=positive_float, default=None,
                   help="exit 1 when any family's MAPE (any GPU, model, or the NVLink fit rows) exceeds this "
                        "fraction, e.g. 0.10")
    p.add_argument("--json", dest="json_out", default=None, help="write every figure (and the fit) here")


def _fail(msg: str) -> int:
    print(f"slicesched bench costmodel: {msg}", file=sys.stderr)
    return 2


def _profiles(directory: str | None, gpus: list[str]) -> dict:
    from shared.costmodel import load_profile, load_profile_file
    from shared.costmodel.measured import GPU_KINDS
    if directory is None:
        return {g: load_profile(GPU_KINDS[g]) for g in gpus}
    return {g: load_profile_file(Path(directory) / f"{GPU_KINDS[g]}.yaml") for g in gpus}


def run(args: argparse.Namespace) -> int:
    from shared.costmodel.measured import compare, load_measurements

    gpus = sorted(set(args.gpu or ["h100", "a100"]))
    t0 = time.perf_counter()
    data = load_measurements(args.against, gpus)
    models = {t.model for t in data.compute}
    bad = [m for m in args.holdout if m not in models]
    if bad:
        return _fail(f"--holdout {bad[0]!r} is not a measured model; measured: {', '.join(sorted(models))}")
    if args.holdout and not args.fit_out:
        return _fail("--holdout only applies to a fit (--fit-out DIR)")
    gpus = [g for g in gpus if data.compute_for(g)]
    profiles = _profiles(args.profiles, gpus)
    before = _profiles(args.before, gpus) if args.before else None
    fit_doc = None
    if args.fit_out:
        before, profiles, fit_doc = profiles, *_fit(args, data, profiles)
    after = compare(profiles, data)
    old = compare(before, data) if before else None
    print(_header(args, data, profiles, before))
    print(compute_table(after, old))
    print("\nBy batch size (all models; rows in parentheses):\n")
    print(token_table(after))
    print()
    print(transfer_table(after, old, data))
    worst = worst_family(after)
    print(f"\nlargest family MAPE: {worst[0]:.1%} ({worst[1]}); {len(data.compute)} model files, "
          f"{sum(len(t.rows) for t in data.compute)} TP-1 rows x 10 operators ({time.perf_counter() - t0:.1f} s)")
    if args.json_out:
        doc = {"against": args.against, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "profiles": {g: {"kind": p.kind, "source": p.source, "file": _rel(p.file)} for g, p in profiles.items()},
               "after": after, "before": old, "fit": fit_doc}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    if args.max_mape is not None and worst[0] > args.max_mape:
        print(f"above --max-mape {args.max_mape:.1%}", file=sys.stderr)
        return 1
    return 0


def _rel(path: str) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def _fit(args: argparse.Namespace, data, bases: dict) -> tuple[dict, dict]:
    """Fit, derive H200, write the files; the fitted profiles (as loaded back) and a JSON summary."""
    import dataclasses

    from shared.costmodel import load_profile, load_profile_file
    from shared.costmodel.measured import NVLINK_TOPOLOGIES, Measurements, compare
    from shared.costmodel.measured_fit import derive_profile, fit_all, fitted_profile_yaml, provenance

    topo = {gpu: t for t, gpu in NVLINK_TOPOLOGIES.items()}
    train = Measurements(data.root, tuple(t for t in data.compute if t.model not in args.holdout), data.transfer)
    fits = fit_all(train, bases, topo)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    command = FIT_COMMAND + "".join(f" --holdout {m}" for m in args.holdout) \
        + "".join(f" --gpu {g}" for g in (args.gpu or []))
    scores = compare(fits, train)
    out = Path(args.fit_out)
    out.mkdir(parents=True, exist_ok=True)
    written, loaded = [], {}
    for gpu, prof in fits.items():
        s = {r["family"]: r["mape"] for r in scores["compute"] if r["gpu"] == gpu and r["model"] == "all"}
        s.update({"nvlink": r["mape"] for r in scores["transfer"]
                  if r["gpu"] == gpu and r["topology"] == topo.get(gpu) and r["scope"] == "intra-node"})
        prof = dataclasses.replace(prof, source=f"fitted to measured {gpu.upper()} operator and NVLink timings "
                                                "(Vidur); attention from first principles")
        prov = provenance(train, gpu, topo.get(gpu), s, date, command, args.holdout)
        path = out / f"{prof.kind}.yaml"
        path.write_text(fitted_profile_yaml(prof, _file_header(prof, gpu), prov))
        loaded[gpu] = load_profile_file(path)
        written.append(str(path))
        if gpu == "h100":
            h200 = _h200_base(args)
            derived = derive_profile(loaded[gpu], h200, source="derived from the h100-80gb fit with datasheet "
                                     "ratios (no H200 measurements), uncalibrated")
            prov = {"derived": "H200 is not measured: the H100 fit's efficiencies, launch overheads and NVLink "
                    "latency/bandwidth (same NVLink 4) on H200 datasheet peaks (989 TFLOP/s, 4.8 TB/s HBM3e, "
                    "141 GB); below: the H100 fit it comes from", **prov,
                    "mape_after_fit": "none: no H200 measurements"}
            p200 = out / f"{derived.kind}.yaml"
            p200.write_text(fitted_profile_yaml(derived, _h200_header(), prov))
            load_profile_file(p200)
            written.append(str(p200))
    load_profile.cache_clear()
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    return loaded, {"written": written, "holdout": list(args.holdout), "date": date, "command": command}


def _h200_base(args: argparse.Namespace):
    from shared.costmodel import load_profile, load_profile_file
    return load_profile_file(Path(args.profiles) / "h200.yaml") if args.profiles else load_profile("h200")


def _file_header(prof, gpu: str) -> str:
    name = {"h100": "NVIDIA H100 80GB SXM5", "a100": "NVIDIA A100 80GB SXM4"}[gpu]
    return (f"{name}: datasheet peaks, memory and links, except what is fitted to measured timings (Vidur, see\n"
            "`provenance` at the end): the efficiencies and launch overheads of GEMMs, RMSNorm, RoPE, SiLU*mul,\n"
            "residual adds and the embedding, and the NVLink latency and bandwidth. Attention is modelled from\n"
            "first principles (datasheet peaks x estimated efficiencies): the data has no attention kernels.\n"
            "Memory efficiencies above 1 are operands served from the L2 cache (e.g. residual adds).\n"
            f"Written by\n`{FIT_COMMAND}`; do not edit by hand.")


def _h200_header() -> str:
    return ("NVIDIA H200 141GB SXM: DERIVED, not measured. Datasheet peaks, memory and links; the efficiencies,\n"
            "launch overheads and NVLink of the H100 fit to measured timings (same compute and NVLink, HBM3e at\n"
            "4.8 TB/s instead of 3.35). Attention is modelled from first principles, as on the H100.\n"
            f"Written by\n`{FIT_COMMAND}`; do not edit by hand.")


def _header(args, data, profiles: dict, before: dict | None) -> str:
    from shared.costmodel.measured import VIDUR_SOURCE
    lines = [f"cost model vs measured timings: {VIDUR_SOURCE}; {data.root}",
             "MAPE of per-operator times over every TP-1 row (1-4096 tokens); attention is not measured (modelled "
             "from first principles)"]
    lines += [f"profile {g}: {p.kind} ({p.file}; {p.source})" for g, p in profiles.items()]
    if before:
        lines.append("in parentheses: " + ", ".join(f"{p.kind} ({p.file})" for p in before.values()))
    return "\n".join(lines) + "\n"


def _cell(after: float, before: float | None) -> str:
    return f"{after:.1%}" + (f" ({before:.1%})" if before is not None else "")


def compute_table(after: dict, before: dict | None) -> str:
    """Markdown: one row per (GPU, model), one column per operator family, MAPE after (before)."""
    def index(res: dict) -> dict:
        return {(r["gpu"], r["model"], r["family"]): r["mape"] for r in res["compute"]}
    a, b = index(after), index(before) if before else {}
    rows = sorted({(g, m) for g, m, _ in a}, key=lambda k: (k[0], k[1] == "all", k[1]))
    head = "| GPU | model | " + " | ".join(FAMILY_TITLES.values()) + " |"
    out = [head, "|---|---|" + "---:|" * len(FAMILY_TITLES)]
    for g, m in rows:
        cells = [_cell(a[(g, m, f)], b.get((g, m, f))) if (g, m, f) in a else "-" for f in FAMILY_TITLES]
        out.append(f"| {g.upper()} | {'all models' if m == 'all' else m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def transfer_table(after: dict, before: dict | None, data) -> str:
    """Markdown: one row per send/recv file and scope (ranks in one node / in two)."""
    from shared.costmodel.measured import NVLINK_TOPOLOGIES
    old = {(r["topology"], r["scope"]): r["mape"] for r in (before or {}).get("transfer", [])}
    same = {}
    for i, t in enumerate(data.transfer):
        for u in data.transfer[:i]:
            if (t.intra, t.inter) == (u.intra, u.inter):
                same[t.topology] = u.topology
    out = ["| send/recv file | ranks | predicted over | rows, bytes | MAPE | < 1 MiB | 1-16 MiB | > 16 MiB | worst | "
           "note |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in after["transfer"]:
        note = []
        if NVLINK_TOPOLOGIES.get(r["topology"]) and r["scope"] == "intra-node":
            note.append("fitted")
        if r["topology"] in same:
            note.append(f"same rows as {same[r['topology']]}")
        lo, hi = r["bytes"]
        by = [f"{r['by_size'][k]:.1%}" if k in r["by_size"] else "-" for k in ("<1MiB", "1-16MiB", ">16MiB")]
        out.append(f"| {r['topology']} | {r['scope']} | {r['gpu'].upper()} {r['link']} | {r['rows']}, "
                   f"{lo / 1024:.0f} KiB-{hi / 2**20:.0f} MiB | {_cell(r['mape'], old.get((r['topology'], r['scope'])))}"
                   f" | {' | '.join(by)} | {r['worst']:.0%} | {', '.join(note)} |")
    return "\n".join(out)


def token_table(after: dict) -> str:
    """Markdown: MAPE per (GPU, family) over the rows of each token range (all models pooled)."""
    ranges = ("1-64", "65-512", ">512")
    idx = {(r["gpu"], r["family"], r["tokens"]): (r["mape"], r["rows"]) for r in after["by_tokens"]}
    out = ["| GPU | family | " + " | ".join(f"{x} tokens" for x in ranges) + " |", "|---|---|" + "---:|" * 3]
    for gpu in sorted({g for g, _, _ in idx}):
        for fam, title in FAMILY_TITLES.items():
            cells = [f"{idx[(gpu, fam, x)][0]:.1%} ({idx[(gpu, fam, x)][1]})" if (gpu, fam, x) in idx else "-"
                     for x in ranges]
            out.append(f"| {gpu.upper()} | {title} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def worst_family(res: dict) -> tuple[float, str]:
    """The largest MAPE over (GPU, model, family) rows and the fitted NVLink rows, with its label."""
    from shared.costmodel.measured import NVLINK_TOPOLOGIES
    cands = [(r["mape"], f"{r['family']} {r['gpu'].upper()} {r['model']}") for r in res["compute"]]
    cands += [(r["mape"], f"NVLink {r['topology']}") for r in res["transfer"]
              if r["topology"] in NVLINK_TOPOLOGIES and r["scope"] == "intra-node"]
    return max(cands)
