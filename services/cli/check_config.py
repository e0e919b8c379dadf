"""``slicesched check-config``: validate the cluster and tenants files."""
from __future__ import annotations

import argparse

from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.model.checks import check_deployment


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants.yaml"))


def run(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    check_deployment(cluster, tenants)  # the same checks `up` makes: homes, model fit, checkpoint tensors
    print(f"ok: {len(cluster.devices)} devices in {args.cluster}, {len(tenants.tenants)} tenants in {args.tenants}")
    return 0
