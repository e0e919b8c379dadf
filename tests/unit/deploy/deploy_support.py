"""Helpers for validating the deployment files without a container engine or a cluster.

* :func:`interpolate` — Compose variable interpolation (``${VAR}``, ``${VAR:-default}``, ``$$`` ...).
* :func:`kustomize_build` — the subset of ``kustomize build`` that ``k8s/`` uses: ``resources`` (files and
  directories) and ``patches`` given by ``path`` (strategic-merge patches matched by apiVersion, kind, name and
  namespace). Any other kustomization field, patch form or list-merge rule raises :class:`UnsupportedKustomize`,
  so the manifests cannot drift into features this renderer would silently get wrong.
* :func:`flow_allowed` — evaluates NetworkPolicies for one connection between two pods.
"""
from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

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


# ------------------------------------------------------------------ minimal kustomize
class UnsupportedKustomize(ValueError):
    """The kustomization uses something this renderer does not implement."""


KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
# Strategic-merge rules of the Kubernetes API types for the list fields a patch may touch here.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}
REPLACE_LISTS = {"tolerations", "command", "args", "ingress", "egress"}


def _res_id(r: dict) -> tuple:
    md = r.get("metadata") or {}
    return r.get("apiVersion"), r.get("kind"), md.get("name"), md.get("namespace")


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Apply a strategic-merge patch (maps merge, keyed lists merge by key, other lists are replaced)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if k.startswith("$"):
                raise UnsupportedKustomize(f"patch directive {k!r} is not supported")
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(patch, list):
        if key in MERGE_KEYS and isinstance(base, list):
            mk, result = MERGE_KEYS[key], copy.deepcopy(base)
            for item in patch:
                idx = next((i for i, x in enumerate(result) if x.get(mk) == item.get(mk)), None)
                if idx is None:
                    result.append(copy.deepcopy(item))
                else:
                    result[idx] = strategic_merge(result[idx], item)
            return result
        if key not in REPLACE_LISTS:
            raise UnsupportedKustomize(f"list field {key!r}: no strategic-merge rule known here")
    return copy.deepcopy(patch)


def kustomize_build(directory: Path) -> list[dict]:
    """Render a kustomization directory (the subset described in the module docstring)."""
    kfile = directory / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - KUSTOMIZATION_FIELDS
    if unknown:
        raise UnsupportedKustomize(f"{kfile}: unsupported fields {sorted(unknown)}")
    resources: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        resources += kustomize_build(path) if path.is_dir() else load_docs(path)
    for patch_entry in k.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise UnsupportedKustomize(f"{kfile}: only 'path' patches are supported, got {patch_entry}")
        for patch in load_docs(directory / patch_entry["path"]):
            matches = [i for i, r in enumerate(resources) if _res_id(r) == _res_id(patch)]
            if len(matches) != 1:
                raise UnsupportedKustomize(f"{patch_entry['path']}: {len(matches)} targets for {_res_id(patch)}")
            resources[matches[0]] = strategic_merge(resources[matches[0]], patch)
    ids = [_res_id(r)[1:] for r in resources]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise UnsupportedKustomize(f"{directory}: duplicate resources {sorted(dup)}")
    return resources


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
