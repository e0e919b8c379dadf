"""Frozen configuration objects built from ``cluster.yaml`` / ``tenants.yaml`` plus the environment.

Every validation problem raises :class:`ConfigError` naming the file, the field path and what is wrong;
command-line entry points turn it into a one-line message and exit code 2.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shared.config_error import ConfigError
from shared.costmodel.profiles import LINK_KINDS
from shared.model.config import PRESETS, ModelConfig
from shared.model.hf_config import GenerationDefaults

BACKENDS = ("cpu", "cuda", "emulated")
DEVICE_KINDS = ("cpu", "a100-80gb", "h100-80gb", "h200")
GIB = 1024**3


# The live scheduler's policy unless ``--policy`` / ``SLICESCHED_POLICY`` names another (docs/policies.md).
DEFAULT_POLICY = "slice"


def env_number(name: str, default: float, kind: type = float, *, minimum: float | None = None,
               above: float | None = None, maximum: float | None = None, env: Any = None) -> Any:
    """The number in environment variable ``name`` (``default`` when unset or empty), as ``kind`` (int or float).

    A value that is not a finite number of that kind, or outside the bounds (``minimum`` ≤ v, ``above`` < v,
    v ≤ ``maximum``), raises :class:`ConfigError` naming the variable — never a bare ``ValueError`` traceback."""
    e = os.environ if env is None else env
    raw = e.get(name)
    if raw is None or str(raw).strip() == "":
        return kind(default)
    what = "an integer" if kind is int else "a number"
    try:
        v = kind(str(raw).strip())
    except ValueError:
        raise ConfigError("environment", name, f"expected {what}, got {raw!r}") from None
    if kind is float and not math.isfinite(v):
        raise ConfigError("environment", name, f"expected a finite number, got {raw!r}")
    if minimum is not None and v < minimum:
        raise ConfigError("environment", name, f"must be >= {minimum:g}, got {raw!r}")
    if above is not None and not v > above:
        raise ConfigError("environment", name, f"must be > {above:g}, got {raw!r}")
    if maximum is not None and v > maximum:
        raise ConfigError("environment", name, f"must be <= {maximum:g}, got {raw!r}")
    return v


@dataclass(frozen=True)
class DeviceConfig:
    id: str
    backend: str  # cpu | cuda | emulated
    kind: str  # profile name: cpu | a100-80gb | h100-80gb | h200
    memory_bytes: int
    host: str = "localhost"
    cuda_index: int | None = None
    threads: int = 1


@dataclass(frozen=True)
class ClusterConfig:
    devices: tuple[DeviceConfig, ...]
    name: str = "local"
    headroom_fraction: float = 0.05
    intra_host_link: str = "shm"  # cpu: shm; gpus: cuda_ipc / nvlink
    inter_host_link: str = "tcp"  # cpu: tcp; gpus: nccl
    source: str = "<memory>"
    # per policy name, parameters the live scheduler applies on this cluster (``policies:`` in the file); the
    # environment's SLICESCHED_POLICY_PARAMS overrides them key by key
    policy_params: dict = field(default_factory=dict, hash=False, compare=False)

    def device(self, device_id: str) -> DeviceConfig:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(device_id)

    def link_kind(self, a: str, b: str) -> str:
        return self.intra_host_link if self.device(a).host == self.device(b).host else self.inter_host_link


@dataclass(frozen=True)
class SLA:
    """A tenant's latency targets.

    Absolute (``slowdown`` 0): every request must meet ``ttft_ms`` and ``tpot_ms``. Per request (``slowdown`` > 0,
    DESIGN §9's default): a request's targets are ``slowdown`` × its own isolated TTFT and TPOT on the tenant's
    home device kind (:func:`shared.costmodel.sla.request_targets`); ``ttft_ms``/``tpot_ms`` then hold the targets
    of the reference request (:data:`shared.costmodel.sla.REFERENCE_REQUEST`), for what needs one figure per tenant (admission, the policies' heuristics)."""

    ttft_ms: float
    tpot_ms: float
    slowdown: float = 0.0
    kind: str = ""  # per request: the device kind the isolated latencies are priced on (the first home device's)

    @property
    def per_request(self) -> bool:
        return self.slowdown > 0


@dataclass(frozen=True)
class ModelSpec:
    """Where a tenant's model comes from: a preset name, an inline config (random weights), or a checkpoint
    (a directory or ``.gguf`` file, resolved to its path; docs/models.md)."""

    config: ModelConfig
    preset: str | None = None
    checkpoint: str | None = None
    seed: int = 0
    generation: GenerationDefaults = GenerationDefaults()  # the checkpoint's sampling defaults

    @property
    def label(self) -> str:
        """What the start-up banner says the tenant serves."""
        if self.checkpoint:
            return f"{Path(self.checkpoint).name} ({self.config.architecture}, {self.config.dtype})"
        return f"{self.preset or 'inline config'} (random weights, seed {self.seed})"


@dataclass(frozen=True)
class Quota:
    tokens_per_min: int = 0  # 0 = unlimited
    max_concurrency: int = 0  # 0 = unlimited


@dataclass(frozen=True)
class TenantConfig:
    name: str
    model: ModelSpec
    sla: SLA
    home_devices: tuple[str, ...]
    api_key_hashes: tuple[str, ...] = ()  # "sha256:<hex>"
    max_queue: int = 256
    quota: Quota = field(default_factory=Quota)
    weight: float = 1.0  # relative offered load (used when sizing containers offline)


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[TenantConfig, ...]
    source: str = "<memory>"

    def get(self, name: str) -> TenantConfig:
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(name)

    def names(self) -> list[str]:
        return [t.name for t in self.tenants]

    def home_of(self) -> dict[str, str]:
        """Device id -> the name of the tenant at home there."""
        return {d: t.name for t in self.tenants for d in t.home_devices}


def hash_api_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


# ---------------------------------------------------------------- parsing helpers
def _load_yaml(path: str | Path) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(p, "(file)", "file not found")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        raise ConfigError(p, where, f"invalid YAML: {getattr(e, 'problem', e)}") from None


def _req(d: dict, key: str, file: Path, path: str, types: type | tuple, *, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise ConfigError(file, f"{path}.{key}" if path else key, "required field is missing")
        return default
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(file, f"{path}.{key}", f"expected {_tn(types)}, got {v!r}")
    if not isinstance(v, types):
        raise ConfigError(file, f"{path}.{key}", f"expected {_tn(types)}, got {type(v).__name__} {v!r}")
    return v


def _tn(types: type | tuple) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _memory_bytes(d: dict, file: Path, path: str) -> int:
    if "memory_gb" in d:
        v = _req(d, "memory_gb", file, path, (int, float))
        b = int(float(v) * GIB)
    elif "memory_bytes" in d:
        b = _req(d, "memory_bytes", file, path, int)
    else:
        raise ConfigError(file, f"{path}.memory_gb", "required field is missing (or give memory_bytes)")
    if b <= 0:
        raise ConfigError(file, f"{path}.memory_gb", "must be positive")
    return b


# ---------------------------------------------------------------- cluster
def parse_cluster(data: Any, file: str | Path = "<memory>") -> ClusterConfig:
    file = Path(file)
    if not isinstance(data, dict):
        raise ConfigError(file, "(top level)", "expected a mapping with a 'devices' list")
    meta = data.get("cluster", {}) or {}
    if not isinstance(meta, dict):
        raise ConfigError(file, "cluster", "expected a mapping")
    devs_raw = _req(data, "devices", file, "", list)
    if not devs_raw:
        raise ConfigError(file, "devices", "at least one device is required")
    devices, seen = [], set()
    for i, d in enumerate(devs_raw):
        path = f"devices[{i}]"
        if not isinstance(d, dict):
            raise ConfigError(file, path, "expected a mapping")
        did = _req(d, "id", file, path, str)
        if not did or any(c in did for c in " {}:*"):
            raise ConfigError(file, f"{path}.id", f"invalid device id {did!r} (no spaces, braces, ':' or '*')")
        if did in seen:
            raise ConfigError(file, f"{path}.id", f"duplicate device id {did!r}")
        seen.add(did)
        backend = _req(d, "backend", file, path, str)
        if backend not in BACKENDS:
            raise ConfigError(file, f"{path}.backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
        kind = _req(d, "kind", file, path, str, default="cpu" if backend == "cpu" else "h100-80gb")
        if kind not in DEVICE_KINDS:
            raise ConfigError(file, f"{path}.kind", f"must be one of {', '.join(DEVICE_KINDS)}, got {kind!r}")
        cuda_index = _req(d, "cuda_index", file, path, (int, type(None)), default=None)
        threads = _req(d, "threads", file, path, int, default=1)
        if threads <= 0:
            raise ConfigError(file, f"{path}.threads", "must be a positive integer")
        devices.append(DeviceConfig(id=did, backend=backend, kind=kind, memory_bytes=_memory_bytes(d, file, path),
                                    host=str(_req(d, "host", file, path, str, default="localhost")),
                                    cuda_index=cuda_index, threads=threads))
    headroom = _req(meta, "headroom_fraction", file, "cluster", (int, float), default=0.05)
    if not 0 <= headroom < 1:
        raise ConfigError(file, "cluster.headroom_fraction", "must be in [0, 1)")
    links = _req(data, "links", file, "", dict, default={}) or {}
    intra = _req(links, "intra_host", file, "links", str, default="shm")
    inter = _req(links, "inter_host", file, "links", str, default="tcp")
    for k, v in (("intra_host", intra), ("inter_host", inter)):
        if v not in LINK_KINDS:
            raise ConfigError(file, f"links.{k}", f"must be one of {', '.join(LINK_KINDS)}, got {v!r}")
    pols = _req(data, "policies", file, "", dict, default={}) or {}
    for name, params in pols.items():
        if not isinstance(params, dict):
            raise ConfigError(file, f"policies.{name}", "expected a mapping of parameter -> value")
    return ClusterConfig(devices=tuple(devices), name=str(meta.get("name", "local")),
                         headroom_fraction=float(headroom), intra_host_link=intra, inter_host_link=inter,
                         source=str(file), policy_params={str(k): dict(v) for k, v in pols.items()})


def load_cluster(path: str | Path) -> ClusterConfig:
    return parse_cluster(_load_yaml(path), path)


# ---------------------------------------------------------------- tenants
def _parse_model(m: Any, file: Path, path: str) -> ModelSpec:
    if isinstance(m, str):
        m = {"preset": m}
    if not isinstance(m, dict):
        raise ConfigError(file, path, "expected a preset name or a mapping with preset/config/checkpoint")
    seed = _req(m, "seed", file, path, int, default=0)
    given = [k for k in ("preset", "config", "checkpoint") if k in m]
    if len(given) != 1:
        raise ConfigError(file, path, "give exactly one of preset, config or checkpoint")
    if "preset" in m:
        name = _req(m, "preset", file, path, str)
        if name not in PRESETS:
            raise ConfigError(file, f"{path}.preset", f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
        cfg = PRESETS[name]
        overrides = _req(m, "overrides", file, path, dict, default={})
        try:
            cfg = cfg.with_(**overrides)
        except TypeError as e:
            raise ConfigError(file, f"{path}.overrides", str(e)) from None
        spec = ModelSpec(config=cfg, preset=name, seed=seed)
    elif "config" in m:
        raw = _req(m, "config", file, path, dict)
        try:
            cfg = ModelConfig.from_dict(raw)
        except TypeError as e:
            raise ConfigError(file, f"{path}.config", str(e)) from None
        spec = ModelSpec(config=cfg, seed=seed)
    else:
        from shared.model.checkpoint import inspect_checkpoint, resolve_checkpoint
        for k in sorted(set(m) - {"checkpoint", "dtype", "max_model_len", "seed"}):
            raise ConfigError(file, f"{path}.{k}", "unknown field (checkpoint, dtype, max_model_len, seed)")
        dtype = _req(m, "dtype", file, path, str, default=None)
        if dtype not in (None, "float32", "float16", "bfloat16"):
            raise ConfigError(file, f"{path}.dtype", f"must be float32, float16 or bfloat16, got {dtype!r}")
        mml = _req(m, "max_model_len", file, path, int, default=None)
        if mml is not None and mml <= 0:
            raise ConfigError(file, f"{path}.max_model_len", f"must be positive, got {mml}")
        try:
            ck = resolve_checkpoint(_req(m, "checkpoint", file, path, str), file.parent)
            info = inspect_checkpoint(ck, dtype=dtype, max_model_len=mml, check_weights=False)
        except ValueError as e:  # CheckpointError names the checkpoint's own file and field
            raise ConfigError(file, f"{path}.checkpoint", str(e)) from None
        spec = ModelSpec(config=info.config, checkpoint=str(ck), seed=seed, generation=info.generation)
    errs = spec.config.validate()
    if errs:
        raise ConfigError(file, f"{path}.{errs[0].split(':')[0]}", errs[0].split(": ", 1)[1])
    return spec


def parse_tenants(data: Any, file: str | Path = "<memory>", cluster: ClusterConfig | None = None) -> TenantsConfig:
    file = Path(file)
    if not isinstance(data, dict):
        raise ConfigError(file, "(top level)", "expected a mapping with a 'tenants' list")
    raw = _req(data, "tenants", file, "", list)
    if not raw:
        raise ConfigError(file, "tenants", "at least one tenant is required")
    out, names, keys = [], set(), {}
    device_ids = {d.id for d in cluster.devices} if cluster else None
    for i, t in enumerate(raw):
        path = f"tenants[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(file, path, "expected a mapping")
        name = _req(t, "name", file, path, str)
        if not name or any(c in name for c in " {}:*/"):
            raise ConfigError(file, f"{path}.name", f"invalid tenant name {name!r}")
        if name in names:
            raise ConfigError(file, f"{path}.name", f"duplicate tenant name {name!r}")
        names.add(name)
        model = _parse_model(_req(t, "model", file, path, (str, dict)), file, f"{path}.model")
        homes = _req(t, "home_devices", file, path, list)
        if not homes or not all(isinstance(h, str) for h in homes):
            raise ConfigError(file, f"{path}.home_devices", "expected a non-empty list of device ids")
        if device_ids is not None:
            for h in homes:
                if h not in device_ids:
                    raise ConfigError(file, f"{path}.home_devices", f"unknown device {h!r} (not in {cluster.source})")
        sla = _parse_sla(_req(t, "sla", file, path, dict), file, f"{path}.sla", model,
                         cluster.device(homes[0]).kind if cluster is not None else None)
        hashes = []
        for j, k in enumerate(_req(t, "api_keys", file, path, list, default=[]) or []):
            if not isinstance(k, str) or len(k) < 8:
                raise ConfigError(file, f"{path}.api_keys[{j}]", "an API key must be a string of at least 8 characters")
            hashes.append(hash_api_key(k))
        for j, h in enumerate(_req(t, "api_key_hashes", file, path, list, default=[]) or []):
            if not isinstance(h, str) or not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", h):
                raise ConfigError(file, f"{path}.api_key_hashes[{j}]", "expected 'sha256:' followed by 64 hex digits")
            hashes.append(h.lower())
        for h in hashes:
            if h in keys:
                raise ConfigError(file, f"{path}.api_keys", f"an API key is shared with tenant {keys[h]!r}")
            keys[h] = name
        q = _req(t, "quota", file, path, dict, default={}) or {}
        quota = Quota(tokens_per_min=_req(q, "tokens_per_min", file, f"{path}.quota", int, default=0),
                      max_concurrency=_req(q, "max_concurrency", file, f"{path}.quota", int, default=0))
        max_queue = _req(t, "max_queue", file, path, int, default=256)
        if max_queue <= 0:
            raise ConfigError(file, f"{path}.max_queue", "must be a positive integer")
        weight = _req(t, "weight", file, path, (int, float), default=1.0)
        out.append(TenantConfig(name=name, model=model, sla=sla, home_devices=tuple(homes),
                                api_key_hashes=tuple(hashes), max_queue=max_queue, quota=quota, weight=float(weight)))
    return TenantsConfig(tenants=tuple(out), source=str(file))


def _parse_sla(raw: dict, file: str | Path, path: str, model: ModelSpec, kind: str | None) -> SLA:
    """``{ttft_ms, tpot_ms}`` (absolute targets) or ``{slowdown: k}`` (k × each request's isolated latency on the
    tenant's home device kind ``kind``, which must then be known: parse with the cluster)."""
    for k in raw:
        if k not in ("ttft_ms", "tpot_ms", "slowdown"):
            raise ConfigError(file, f"{path}.{k}", "unknown field (valid: slowdown, or ttft_ms and tpot_ms)")
    if "slowdown" in raw:
        if "ttft_ms" in raw or "tpot_ms" in raw:
            raise ConfigError(file, path, "give either slowdown (per-request targets) or ttft_ms and tpot_ms "
                                          "(absolute targets), not both")
        k = _req(raw, "slowdown", file, path, (int, float))
        if not k > 1:
            raise ConfigError(file, f"{path}.slowdown", f"must be > 1 (a multiple of the isolated latency), got {k!r}")
        if kind is None:
            raise ConfigError(file, f"{path}.slowdown", "a per-request SLA needs the cluster file (the home devices' "
                                                        "kind prices each request's isolated latency)")
        from shared.costmodel.sla import reference_targets  # lazy: the cost model reads this module
        ttft_s, tpot_s = reference_targets(model.config, kind, float(k))
        return SLA(ttft_s * 1e3, tpot_s * 1e3, float(k), kind)
    ttft = _req(raw, "ttft_ms", file, path, (int, float))
    tpot = _req(raw, "tpot_ms", file, path, (int, float))
    if ttft <= 0 or tpot <= 0:
        raise ConfigError(file, path, "ttft_ms and tpot_ms must be positive")
    return SLA(float(ttft), float(tpot))


def load_tenants(path: str | Path, cluster: ClusterConfig | None = None) -> TenantsConfig:
    return parse_tenants(_load_yaml(path), path, cluster)


def home_tenant_of(cluster: ClusterConfig, tenants: TenantsConfig, device_id: str) -> TenantConfig:
    """The one tenant at home on ``device_id``; a mesh worker serves exactly one (``ConfigError`` otherwise)."""
    homes = [t for t in tenants.tenants if device_id in t.home_devices]
    if len(homes) != 1:
        raise ConfigError(tenants.source, "home_devices",
                          f"device {device_id!r} must be home to exactly one tenant, found {len(homes)}")
    return homes[0]


def dev_api_keys(path: str | Path) -> dict[str, list[str]]:
    """Plain-text dev keys per tenant as written in a tenants file (for the launcher's banner)."""
    data = _load_yaml(path)
    return {t["name"]: list(t.get("api_keys") or []) for t in data.get("tenants", []) if isinstance(t, dict)}


def redis_cluster_setting(env: Any = None) -> bool | None:
    """``SLICESCHED_REDIS_CLUSTER``: True (``1``/``yes``: REDIS_URL is a Redis Cluster node), False (``0``/``no``:
    a single server) or None (``auto``, the default: ask the server, see ``shared/redis_util.py``)."""
    raw = str((os.environ if env is None else env).get("SLICESCHED_REDIS_CLUSTER", "auto")).strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "yes", "true", "on"):
        return True
    if raw in ("0", "no", "false", "off"):
        return False
    raise ConfigError("environment", "SLICESCHED_REDIS_CLUSTER", f"{raw!r} is not one of auto, 1, 0")


# ---------------------------------------------------------------- runtime settings
REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class Settings:
    """Process-level settings from the environment (built once in each ``__main__``)."""

    redis_url: str
    prefix: str = "slicesched:"
    cluster_file: str = str(REPO_CONFIGS / "cluster.yaml")
    tenants_file: str = str(REPO_CONFIGS / "tenants.yaml")
    log_format: str = "auto"  # json | console | auto
    log_level: str = "info"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    metrics_port: int = 0  # services other than the gateway serve /metrics + /health here (0 = pick free)
    metrics_host: str = "127.0.0.1"  # loopback unless SLICESCHED_METRICS_HOST (or a non-loopback gateway host) says so
    deadline_chunks: bool = False  # workers: SLICESCHED_DEADLINE_CHUNKS=1 (shared/model/deadline.py)
    step_cap_s: float = 0.0  # workers: SLICESCHED_STEP_CAP_S, 0 = off (shared/model/step_cap.py)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        e = os.environ if env is None else env
        url = e.get("REDIS_URL", "")
        if not url:
            raise ConfigError("environment", "REDIS_URL", "not set (the launcher sets it; or export REDIS_URL)")
        env_number("SLICESCHED_DRAIN_S", 20.0, float, minimum=0, env=e)  # read by every service's shell
        redis_cluster_setting(e)  # read by shared/redis_util.py, as is:
        env_number("SLICESCHED_REDIS_WAIT_MS", 100, int, minimum=0, env=e)
        port = env_number("SLICESCHED_GATEWAY_PORT", 8000, int, minimum=0, maximum=65535, env=e)
        mport = env_number("SLICESCHED_METRICS_PORT", 0, int, minimum=0, maximum=65535, env=e)
        deadline = env_number("SLICESCHED_DEADLINE_CHUNKS", 0, int, minimum=0, maximum=1, env=e)
        step_cap = env_number("SLICESCHED_STEP_CAP_S", 0.0, float, minimum=0, env=e)
        gw_host = e.get("SLICESCHED_GATEWAY_HOST", "127.0.0.1")
        metrics_host = e.get("SLICESCHED_METRICS_HOST") or (
            "127.0.0.1" if gw_host in ("127.0.0.1", "localhost", "::1") else gw_host)
        prefix = e.get("SLICESCHED_PREFIX", "slicesched:")
        if not prefix.endswith(":"):
            prefix += ":"
        return cls(redis_url=url, prefix=prefix,
                   cluster_file=e.get("SLICESCHED_CLUSTER", str(REPO_CONFIGS / "cluster.yaml")),
                   tenants_file=e.get("SLICESCHED_TENANTS", str(REPO_CONFIGS / "tenants.yaml")),
                   log_format=e.get("SLICESCHED_LOG_FORMAT", "auto"), log_level=e.get("SLICESCHED_LOG_LEVEL", "info"),
                   gateway_host=gw_host, gateway_port=port, metrics_port=mport, metrics_host=metrics_host,
                   deadline_chunks=bool(deadline), step_cap_s=step_cap)


def load_runtime(env: dict[str, str] | None = None) -> tuple[Settings, ClusterConfig, TenantsConfig]:
    """Settings from the environment plus the cluster and tenants files they name (every service's start)."""
    settings = Settings.from_env(env)
    cluster = load_cluster(settings.cluster_file)
    return settings, cluster, load_tenants(settings.tenants_file, cluster)
