"""``loadgen replay`` end to end: keys, prompts, signals, the replay itself, and the files in ``--out``."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
import yaml

from loadgen.prompts import synthesizer_for
from loadgen.replay import ReplayOptions, ReplayResult, replay
from loadgen.report import RequestRecord, SlaTarget, summarize, summary_markdown
from loadgen.workload import load_workload
from shared.config import ConfigError, TenantsConfig, dev_api_keys
from shared.workload import Workload, WorkloadRequest

log = structlog.get_logger(__name__)


def load_keys(tenants: TenantsConfig, api_key_file: str | None = None,
              tenants_file: str | None = None) -> dict[str, str]:
    """One API key per tenant: a keys file (tenant → key or [keys]) or a tenants file's plain-text dev keys.

    With neither, the workload's own tenants file is tried. A tenant without a key is an error naming the file.
    """
    if api_key_file:
        p = Path(api_key_file)
        if not p.is_file():
            raise ConfigError(p, "(file)", "file not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(p, "(yaml)", f"invalid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(p, "(top level)", "expected a mapping tenant → key")
        raw = raw.get("keys", raw) if isinstance(raw.get("keys"), dict) else raw
        src = {str(k): (v if isinstance(v, list) else [v]) for k, v in raw.items()}
        where = p
    else:
        where = Path(tenants_file or tenants.source)
        src = dev_api_keys(where)
    keys = {}
    for name in tenants.names():
        vals = [v for v in src.get(name, []) if isinstance(v, str) and v]
        if not vals:
            raise ConfigError(where, name, "no API key for this tenant (give --api-key-file or plain-text api_keys)")
        keys[name] = vals[0]
    return keys


def select_requests(w: Workload, duration_s: float | None, max_requests: int | None) -> list[WorkloadRequest]:
    """The requests to send: those before ``duration_s``, at most ``max_requests`` (earliest first)."""
    reqs = [r for r in w.requests if duration_s is None or r.arrival_s < duration_s]
    return reqs[:max_requests] if max_requests is not None else reqs


def sla_targets(tenants: TenantsConfig) -> dict[str, SlaTarget]:
    """Each tenant's targets: absolute, or priced per request (``sla: {slowdown: k}``) from its lengths."""
    from shared.costmodel.sla import RequestTargets
    return {t.name: SlaTarget(t.sla.ttft_ms / 1000.0, t.sla.tpot_ms / 1000.0,
                              RequestTargets(t.sla, t.model.config) if t.sla.per_request else None)
            for t in tenants.tenants}


def write_outputs(out_dir: Path, records: list[RequestRecord], summary: dict[str, Any]) -> None:
    """``requests.jsonl`` (sorted by arrival), ``summary.json`` and ``summary.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in sorted(records, key=lambda r: (r.arrival_s, r.id)):
            f.write(json.dumps(r.to_dict()) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(summary))


async def _run(reqs: list[WorkloadRequest], opts: ReplayOptions) -> ReplayResult:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("replay_already_stopping")
        else:
            log.warning("replay_stop_requested", grace_s=opts.grace_s)
        stop.set()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        return await replay(reqs, opts, stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run_replay(workload_path: str, url: str, out_dir: str, api_key_file: str | None = None,
               tenants_file: str | None = None, rate_scale: float | None = None, duration_s: float | None = None,
               max_requests: int | None = None, timeout_s: float = 300.0, grace_s: float = 5.0,
               progress: bool = True) -> dict[str, Any]:
    """Load the workload, replay it against ``url`` and write the outputs; returns the summary."""
    w = load_workload(workload_path, rate_scale=rate_scale)
    keys = load_keys(w.tenants, api_key_file, tenants_file)
    synths = {t.name: synthesizer_for(t) for t in w.tenants.tenants}
    reqs = select_requests(w, duration_s, max_requests)
    opts = ReplayOptions(url=url, keys=keys, synthesizers=synths, timeout_s=timeout_s, grace_s=grace_s,
                         progress=progress)
    log.info("replay_start", workload=w.name, requests=len(reqs), url=url, rate_scale=w.rate_scale)
    started = datetime.now(timezone.utc)
    t = time.perf_counter()
    result = asyncio.run(_run(reqs, opts))
    extra = {"workload": w.source, "url": url, "rate_scale": w.rate_scale,
             "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.perf_counter() - t,
             "scheduled_requests": len(reqs), "not_sent": result.not_sent,
             "max_send_lag_s": max((r.send_lag_s for r in result.records), default=0.0)}
    summary = summarize(result.records, sla_targets(w.tenants), partial=result.partial,
                        tenants=w.tenants.names(), extra=extra)
    write_outputs(Path(out_dir), result.records, summary)
    log.info("replay_done", partial=result.partial, records=len(result.records), out=out_dir,
             tokens_per_s=round(summary["tokens_per_s"], 2), violation_rate=round(summary["violation_rate"], 4))
    return summary
