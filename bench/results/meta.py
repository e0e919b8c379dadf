"""What every published result carries: the machine, the date, the exact command and the fidelity label."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]

FIDELITY_LABELS = {"sim": "simulated", "emulated": "emulated mesh", "real": "real CPU mesh"}


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.lower().startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return ""


def _gpu_names() -> list[str]:
    """GPU names from ``nvidia-smi -L`` (empty when there is none or the tool is missing)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.split(":", 1)[1].split("(")[0].strip() for ln in out.splitlines() if ln.startswith("GPU")]


def describe_machine(cpuinfo: str | None = None, cores: int | None = None, gpus: Sequence[str] | None = None) -> str:
    """E.g. ``2-core CPU VM (AMD EPYC), no GPU``: cores as ``nproc`` counts them, "VM" when the CPU reports a
    hypervisor, the CPU model from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = _gpu_names() if gpus is None else list(gpus)
    kind = "VM" if " hypervisor" in cpuinfo else "machine"
    model = _cpu_model(cpuinfo)
    gpu = f"{len(gpus)}× {gpus[0]}" if gpus else "no GPU"
    return f"{cores}-core CPU {kind}{f' ({model})' if model else ''}, {gpu}"


def today() -> str:
    """UTC date as ``date -u +%F`` prints it."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def display_path(path: str | Path) -> str:
    """A path as a reader should type it: relative to the repository root when it lies inside it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def compare_command(workload: str, cluster: str, policies: Sequence[str], fidelity: str, json_out: str | Path,
                    options: dict[str, Any]) -> str:
    """The ``slicesched bench compare`` command line equivalent to one part of the results run."""
    argv = ["slicesched", "bench", "compare", "--workload", display_path(workload), "--cluster",
            display_path(cluster), "--policies", ",".join(policies), "--fidelity", fidelity]
    for key in ("duration_s", "plan_duration_s", "start_scale", "tolerance", "max_scale", "jobs"):
        if options.get(key) is not None:
            argv += [f"--{key.replace('_', '-')}", f"{options[key]:g}"]
    for key in ("seeds", "tuning_seeds"):
        if options.get(key):
            argv += [f"--{key.replace('_', '-')}", ",".join(map(str, options[key]))]
    if isinstance(options.get("containers"), str):
        argv += ["--containers", options["containers"]]
    if options.get("deadline_chunks"):
        argv += ["--deadline-chunks", ",".join(options["deadline_chunks"])]
    if options.get("step_cap"):
        argv += ["--step-cap", ",".join(f"{p}={v:g}" for p, v in options["step_cap"].items())]
    argv += ["--json", display_path(json_out)]
    return shlex.join(argv)


def describe_setup(workload: str | Path, cluster: str | Path, fidelity: str) -> dict[str, Any]:
    """Devices and tenants of a run, as a reader wants them in a table's heading."""
    from collections import Counter

    import yaml

    from shared.config import load_cluster, load_tenants
    c = load_cluster(cluster)
    kinds = Counter((d.kind, d.backend) for d in c.devices)
    form = {"sim": "{n}× modelled {kind}", "emulated": "{n}× emulated device ({kind} profile)",
            "real": "{n}× {kind} device ({backend} backend, real compute)"}[fidelity]
    devices = ", ".join(form.format(n=n, kind=kind, backend=backend) for (kind, backend), n in kinds.items())
    t = (yaml.safe_load(Path(workload).read_text()) or {}).get("tenants")
    tenants = len(load_tenants(Path(workload).parent / t, c).tenants) if isinstance(t, str) else None
    return {"devices": devices, "device_count": len(c.devices), "tenants": tenants,
            "workload": display_path(workload), "cluster": display_path(cluster)}


# not code: the pages (which a results run itself rewrites) and the raw results beside them
_NOT_CODE = (":(exclude)docs", ":(exclude)*.md")


def code_commit(repo: Path = REPO) -> str | None:
    """The commit the code ran at (short hash), ``+changes`` when tracked files other than the docs differ from
    it (a results run rewrites docs/results* and the README itself); None outside a git checkout."""
    def git(*argv: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_CODE)
    return head + ("+changes" if changed else "")


def run_meta(fidelity: str, *, command: str, results_command: str, wall_s: float, quick: bool,
             duration_s: float | None, full_duration_s: float | None, machine: str | None = None,
             setup: dict[str, Any] | None = None, commit: str | None = None) -> dict[str, Any]:
    """The ``meta`` block stored with every raw result file."""
    shortened = duration_s is not None and (full_duration_s is None or duration_s < full_duration_s)
    return {"fidelity": fidelity, "fidelity_label": FIDELITY_LABELS[fidelity],
            "machine": machine or describe_machine(), "date": today(), "commit": commit or code_commit(),
            "command": command,
            "results_command": results_command, "wall_s": round(wall_s, 1), "quick": quick,
            "duration_s": duration_s, "full_duration_s": full_duration_s, "shortened": shortened,
            **(setup or {})}
