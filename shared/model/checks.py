"""Deployment checks of the models: what ``check-config`` and ``up`` both refuse before anything starts, and what
a worker refuses at its start (the same functions).

- every device is home to exactly one tenant (each device runs one worker, which serves its home tenant);
- every tenant's model fits each of its home devices: weights plus the KV cache of one full-context sequence
  (vLLM's rule) within the device's memory less the cluster's headroom, refused with the sizes named;
- a checkpoint's tensors are exactly the ones the model reads, with their shapes and (GGUF) quantization types;
- a checkpoint's tokenizer can be built (e.g. a GGUF file's ``tokenizer.ggml.model`` is supported).
"""
from __future__ import annotations

from shared.config import ClusterConfig, ConfigError, DeviceConfig, TenantConfig, TenantsConfig

MIB = 1 << 20


def fit_problem(tenant: TenantConfig, device: DeviceConfig, headroom_fraction: float) -> str | None:
    """Why ``tenant``'s model does not fit ``device`` (None when it does)."""
    cfg = tenant.model.config
    usable = int(device.memory_bytes * (1 - headroom_fraction))
    weights = cfg.weight_bytes()
    kv = cfg.kv_bytes_per_token() * cfg.max_position_embeddings
    if weights + kv <= usable:
        return None
    return (f"model {tenant.model.label} does not fit device {device.id}: it needs {weights / MIB:.1f} MiB of "
            f"weights + {kv / MIB:.1f} MiB of KV cache for one {cfg.max_position_embeddings}-token sequence = "
            f"{(weights + kv) / MIB:.1f} MiB, the device has {usable / MIB:.1f} MiB usable "
            f"({device.memory_bytes / MIB:.1f} MiB less {headroom_fraction:.0%} headroom); give the device more "
            "memory_gb, or the model a smaller dtype or max_model_len")


def home_problem(device: DeviceConfig, tenants: TenantsConfig) -> str | None:
    homes = [t.name for t in tenants.tenants if device.id in t.home_devices]
    if len(homes) == 1:
        return None
    return (f"device {device.id!r} must be home to exactly one tenant (each device runs one worker for its home "
            f"tenant), found {len(homes)}{': ' + ', '.join(homes) if homes else ''}")


def check_checkpoint(tenant: TenantConfig, file: str, where: str) -> None:
    """Tensors and tokenizer of a checkpoint tenant (``ConfigError`` naming the tenants file field and the
    checkpoint's own file and tensor/field)."""
    spec = tenant.model
    if not spec.checkpoint:
        return
    from shared.model.tokenizer import load_tokenizer
    from shared.model.weights import check_tensors, checkpoint_tensors
    try:
        check_tensors(spec.checkpoint, spec.config, checkpoint_tensors(spec.checkpoint, spec.config))
        load_tokenizer(spec.checkpoint, spec.config)
    except ValueError as e:
        raise ConfigError(file, f"{where}.model.checkpoint", str(e)) from None


def check_deployment(cluster: ClusterConfig, tenants: TenantsConfig) -> None:
    """Everything above for a cluster and its tenants; the first problem as a :class:`ConfigError`."""
    for d in cluster.devices:
        p = home_problem(d, tenants)
        if p:
            raise ConfigError(tenants.source, "home_devices", p)
    for i, t in enumerate(tenants.tenants):
        for h in t.home_devices:
            p = fit_problem(t, cluster.device(h), cluster.headroom_fraction)
            if p:
                raise ConfigError(tenants.source, f"tenants[{i}].model", p)
        check_checkpoint(t, tenants.source, f"tenants[{i}]")
