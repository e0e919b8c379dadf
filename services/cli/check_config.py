"""``slicesched check-config``: everything a service of the mesh would refuse at its start, checked without
starting anything; ``slicesched up`` runs the same :func:`check_mesh` before it starts Redis or any service, so
both refuse the same configurations with the same message (``ConfigError`` naming the file or variable, exit 2).

It calls the same functions the services call on start-up, so a configuration ``up`` refuses is refused here, and
one ``up`` accepts is not refused later by a service:

* the cluster and tenants files (every field; home devices exist);
* every device is home to exactly one tenant (each worker serves one);
* each tenant checkpoint's tokenizer loads (the gateway tokenizes);
* the policy (``--policy`` or ``SLICESCHED_POLICY``) and its parameters (cluster file, ``SLICESCHED_POLICY_PARAMS``);
* every numeric ``SLICESCHED_*`` setting of the services (shell, gateway, workers, emulated workers, GMG).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from shared.model.checks import check_deployment
from shared.config import (DEFAULT_POLICY, REPO_CONFIGS, ClusterConfig, ConfigError, Settings, TenantsConfig,
                           home_tenant_of, load_cluster, load_tenants)


@dataclass(frozen=True)
class MeshConfig:
    """The validated configuration of one mesh."""

    cluster: ClusterConfig
    tenants: TenantsConfig
    policy: str


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--cluster``, ``--tenants`` and ``--policy``, with the same defaults for ``up`` and ``check-config``."""
    p.add_argument("--cluster", default=os.environ.get("SLICESCHED_CLUSTER", str(REPO_CONFIGS / "cluster.yaml")))
    p.add_argument("--tenants", default=os.environ.get("SLICESCHED_TENANTS", str(REPO_CONFIGS / "tenants.yaml")))
    p.add_argument("--policy", default=None,
                   help=f"the scheduler's policy (default $SLICESCHED_POLICY or {DEFAULT_POLICY}; docs/policies.md)")


def check_mesh(cluster_file: str, tenants_file: str, policy: str | None = None) -> MeshConfig:
    """Validate everything the mesh's services validate at start (see the module docstring); raises
    :class:`ConfigError` with the message the refusing service would give."""
    cluster = load_cluster(cluster_file)
    tenants = load_tenants(tenants_file, cluster)
    for d in cluster.devices:
        home_tenant_of(cluster, tenants, d.id)
    check_deployment(cluster, tenants)  # model architectures, checkpoint tensors, fit on each home device
    _check_tokenizers(tenants)
    name = _check_policy(cluster, policy)
    _check_environment(cluster)
    return MeshConfig(cluster, tenants, name)


def _check_tokenizers(tenants: TenantsConfig) -> None:
    for i, t in enumerate(tenants.tenants):
        if t.model.checkpoint:
            from shared.model.tokenizer import load_tokenizer

            try:
                load_tokenizer(t.model.checkpoint, t.model.config)
            except ValueError as e:  # what the gateway refuses at its start
                raise ConfigError(tenants.source, f"tenants[{i}].model.checkpoint", str(e)) from None


def _check_policy(cluster: ClusterConfig, policy: str | None) -> str:
    from services.scheduler.policy import load_live_policy

    named = ("arguments", "--policy")
    if policy is None:
        policy = os.environ.get("SLICESCHED_POLICY") or DEFAULT_POLICY
        named = ("environment", "SLICESCHED_POLICY")
    # the scheduler would refuse these at its start; say so now, not after the services' start timeout
    params_json = os.environ.get("SLICESCHED_POLICY_PARAMS", "")
    for where, field, params in ((*named, ""), ("environment", "SLICESCHED_POLICY_PARAMS", params_json)):
        try:
            load_live_policy(policy, params, cluster.policy_params.get(policy))
        except (KeyError, ValueError) as e:
            raise ConfigError(where, field, str(e).strip("'\"")) from None
    return policy


def _check_environment(cluster: ClusterConfig) -> None:
    from services.gateway.core import GatewayLimits
    from services.gmg.reconcile import ReconcileOptions
    from services.scheduler.steering import steering_settings
    from services.worker.__main__ import engine_knobs
    from services.worker.emulated import emulated_time_scale
    from services.worker.lease_agent import LeaseOptions
    from services.worker.service import worker_env_threads

    env = dict(os.environ)
    env.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")  # `up` sets it; only the other settings are checked
    Settings.from_env(env)  # every service: drain time, gateway and metrics ports
    GatewayLimits.from_env(env)
    ReconcileOptions.from_env(env)
    steering_settings(env)  # the scheduler's use of the simulator's corrections
    real = [d for d in cluster.devices if d.backend != "emulated"]
    if real:  # what `python -m services.worker` checks
        engine_knobs(env)
        LeaseOptions.from_env(env)
        for d in real:
            worker_env_threads(d)
    if len(real) < len(cluster.devices):
        emulated_time_scale(env)


def configure(p: argparse.ArgumentParser) -> None:
    add_config_args(p)


def run(args: argparse.Namespace) -> int:
    mesh = check_mesh(args.cluster, args.tenants, args.policy)
    print(f"ok: {len(mesh.cluster.devices)} devices in {args.cluster}, {len(mesh.tenants.tenants)} tenants in "
          f"{args.tenants}, policy {mesh.policy}")
    return 0
