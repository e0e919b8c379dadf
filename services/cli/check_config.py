"""``slicesched check-config``: validate the cluster and tenants files, the policy and the environment exactly as
``slicesched up`` does before it starts anything (:mod:`services.cli.preflight`); the same refusals, the same
messages, exit status 2."""
from __future__ import annotations

import argparse

from services.cli.preflight import add_config_args, check_mesh


def configure(p: argparse.ArgumentParser) -> None:
    add_config_args(p)


def run(args: argparse.Namespace) -> int:
    mesh = check_mesh(args.cluster, args.tenants, args.policy)
    print(f"ok: {len(mesh.cluster.devices)} devices in {args.cluster}, {len(mesh.tenants.tenants)} tenants in "
          f"{args.tenants}, policy {mesh.policy}")
    return 0
