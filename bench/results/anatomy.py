"""The "where the violations are" table of docs/results.md, from ``docs/results/anatomy-<workload>.json``
(``slicesched bench anatomy``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def load_anatomies(out_dir: Path, order: tuple[str, ...] = ()) -> dict[str, Any]:
    """workload stem → anatomy result, in ``order`` first."""
    found = {p.stem[len("anatomy-"):]: json.loads(p.read_text()) for p in sorted(out_dir.glob("anatomy-*.json"))}
    keys = [w for w in order if w in found] + sorted(w for w in found if w not in order)
    return {w: found[w] for w in keys}


def _f(x: Any, spec: str) -> str:
    return "–" if x is None else f"{x:{spec}}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def anatomy_section(anatomies: Mapping[str, Any]) -> list[str]:
    """One row per workload and policy, every policy at the same load (the scale named in the row)."""
    if not anatomies:
        return []
    metas = [a["meta"] for a in anatomies.values()]
    lines = ["### Where the violations are (simulated)", "",
             f"Fidelity **simulated**; {metas[0]['machine']}; {', '.join(sorted({m['date'] for m in metas}))}; "
             "produced by " + ", ".join(f"`{m['command']}`" for m in metas) + ". Each policy replayed at the rate "
             "scale of `slice`'s ≤ 9% boundary above, and `container` also at its own (same seed, trace and "
             "partition), recording every device's busy "
             "time in 0.25 s bins ([simulator.md](simulator.md#where-the-violations-are-bench-anatomy)). "
             "*Idle elsewhere* is the idle time, in device-equivalents (1.0 = one whole device idle throughout), on "
             "the devices outside the violating request's own container while it waited for its first token — what "
             "a placement policy could at most have reached for it, ignoring memory and staging; *own busy* is how "
             "busy its own container was over the same wait.", "",
             "| workload | policy | scale | violations | TTFT / TPOT / not served | TTFT over target, median (p90) "
             "| own busy during those waits, median | idle elsewhere, median (p90) | waits with ≥ 1 idle device "
             "elsewhere | devices busy: own / guest | leases (lifetime median) |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for w, a in anatomies.items():
        for name, r in a["runs"].items():
            c, tv, d, ls = r["by_cause"], r["ttft_violations"], r["devices"], r["leases"]
            ex, ib = tv["excess_ms"], tv["idle_elsewhere"]
            leases = "–" if not ls["granted"] else f"{ls['granted']} ({_f(ls['lifetime_s']['p50'], '.2f')} s)"
            lines.append(f"| {w} | {name} | {r.get('scale', a['scale']):.3g} | {_pct(r['violation_rate'])} | {c['ttft']} / {c['tpot']}"
                         f" / {c['not_served']} | {_f(ex['p50'], '.0f')} ms ({_f(ex['p90'], '.0f')}) | "
                         f"{_pct(tv['own_container_busy']['p50'])} | {_f(ib['p50'], '.1f')} ({_f(ib['p90'], '.1f')}) | "
                         f"{_pct(tv['with_idle_device_elsewhere'])} | {_pct(d['own_busy_mean'])} / "
                         f"{_pct(d['guest_busy_mean'])} | {leases} |")
    return lines + [""]
