"""Helpers for validating the deployment files without a container engine or a cluster.

* :func:`interpolate` — Compose variable interpolation (``${VAR}``, ``${VAR:-default}``, ``$$`` ...).
* :func:`kustomize_build` — ``kubectl kustomize`` (kustomize v5) of a ``k8s/`` directory, parsed; a test that
  needs it is skipped, with the reason, where kubectl is not installed.
* :func:`flow_allowed` — evaluates NetworkPolicies for one connection between two pods.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = "slicesched"
SERVICES = ("gateway", "gmg", "simulator", "scheduler", "worker")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def load_module(path: Path, name: str) -> ModuleType:
    """Import a standalone script (e.g. ``deploy/redis/render_acl.py``) by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# ------------------------------------------------------------------ compose interpolation
_INTERP = re.compile(r"\$(?:(?P<esc>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


def _interp_str(s: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group("esc"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        b = _BRACED.match(m.group("braced"))
        if b is None or "$" in (b.group("arg") or ""):
            raise ValueError(f"invalid or unsupported interpolation {m.group(0)!r} in {s!r}")
        name, op, arg = b.group("name"), b.group("op"), b.group("arg") or ""
        val = env.get(name)
        if op is None:
            return val or ""
        if op == ":-":
            return val if val else arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if (op == ":?" and not val) or val is None:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return val
        if op == ":+":
            return arg if val else ""
        return arg if val is not None else ""

    return _INTERP.sub(sub, s)


def interpolate(obj: Any, env: dict[str, str]) -> Any:
    """Compose-style interpolation of every string value (keys are left alone, as Compose does)."""
    if isinstance(obj, dict):
        return {k: interpolate(v, env) for k, v in obj.items()}
    if isinstance(obj, list):
        return [interpolate(v, env) for v in obj]
    if isinstance(obj, str):
        return _interp_str(obj, env)
    return obj


def parse_duration_s(value: str) -> float:
    """Compose durations such as ``25s``, ``1m30s``, ``500ms``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a duration: {value!r}")
    return sum(float(n) * units[u] for n, u in parts)


# ------------------------------------------------------------------ kustomize
KUBECTL = shutil.which("kubectl")
NO_KUBECTL = "kubectl not found on PATH: the k8s/ manifests are rendered with `kubectl kustomize` (kustomize v5)"


class KustomizeError(RuntimeError):
    """``kubectl kustomize`` refused a kustomization; the message is kubectl's."""


def kustomize_build(directory: Path) -> list[dict]:
    """Render a kustomization directory with ``kubectl kustomize`` (skips the calling test without kubectl)."""
    if KUBECTL is None:
        pytest.skip(NO_KUBECTL)
    p = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if p.returncode:
        raise KustomizeError(f"kubectl kustomize {directory}: {p.stderr.strip()}")
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def find(resources: list[dict], kind: str, name: str) -> dict:
    hits = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def workloads(resources: list[dict]) -> list[dict]:
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


# ------------------------------------------------------------------ NetworkPolicy evaluation
def _selector_matches(sel: dict | None, labels: dict) -> bool:
    sel = sel or {}
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        present, val = e["key"] in labels, labels.get(e["key"])
        op = e["operator"]
        if op == "In" and val not in e["values"]:
            return False
        if op == "NotIn" and present and val in e["values"]:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, pod: dict) -> bool:
    if "ipBlock" in peer:
        return False
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is None:
        return pod["namespace"] == policy_ns and _selector_matches(pod_sel, pod["labels"])
    ns_labels = {"kubernetes.io/metadata.name": pod["namespace"]}
    return _selector_matches(ns_sel, ns_labels) and _selector_matches(pod_sel, pod["labels"])


def _port_matches(ports: list | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        lo = p.get("port")
        if lo is None:
            return True
        if not isinstance(lo, int):
            raise ValueError(f"named port {lo!r}: give numbers in NetworkPolicies")
        if lo <= port <= p.get("endPort", lo):
            return True
    return False


def _direction_allows(policies: list[dict], subject: dict, peer: dict, port: int, protocol: str,
                      direction: str) -> bool:
    selecting = [p for p in policies if p["metadata"]["namespace"] == subject["namespace"]
                 and _selector_matches(p["spec"]["podSelector"], subject["labels"])
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # a pod no policy selects for this direction is not isolated
    field, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for pol in selecting:
        for rule in pol["spec"].get(field) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(x, pol["metadata"]["namespace"], peer) for x in peers)) \
                    and _port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def flow_allowed(resources: list[dict], src: dict, dst: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether NetworkPolicies let ``src`` open a connection to ``dst:port``.

    A pod is ``{"namespace": ..., "labels": {...}}``; only policies in ``resources`` count (a pod outside the
    rendered namespace is not isolated on egress here).
    """
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    return (_direction_allows(policies, src, dst, port, protocol, "Egress")
            and _direction_allows(policies, dst, src, port, protocol, "Ingress"))
