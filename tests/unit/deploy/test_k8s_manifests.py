"""k8s/: every rendered manifest (base and the gpu overlay) validated against the Kubernetes JSON schemas that
ship with kubernetes-validate (offline, strict: unknown fields are errors), plus the semantics SliceScheduler
relies on. The manifests are rendered with ``kubectl kustomize`` (tests that need them skip without kubectl). No
cluster runs here; nothing is applied.
"""
from __future__ import annotations

import copy
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import (NAMESPACE, REPO, SERVICES, KustomizeError, find, flow_allowed, kustomize_build,
                            workloads)
from kubernetes_validate import utils as kv

from shared.config import parse_cluster, parse_tenants

BASE = REPO / "k8s" / "base"
GPU = REPO / "k8s" / "overlays" / "gpu"
K8S_VERSIONS = ("1.30.0", "1.33.0")


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize_build(BASE)


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return kustomize_build(GPU)


def _app(resources: list[dict], name: str) -> dict:
    kind = "StatefulSet" if name == "worker" else "Deployment"
    return find(resources, kind, f"slicesched-{name}")


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _env_config(resources: list[dict]) -> dict[str, str]:
    return find(resources, "ConfigMap", "slicesched-env")["data"]


def _cluster(resources):
    return parse_cluster(yaml.safe_load(find(resources, "ConfigMap", "slicesched-cluster")["data"]["cluster.yaml"]),
                         "k8s:slicesched-cluster")


def _tenants_raw(resources) -> dict:
    return yaml.safe_load(find(resources, "Secret", "slicesched-tenants")["stringData"]["tenants.yaml"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("tree", ["base", "gpu"])
def test_every_manifest_validates_against_the_kubernetes_schema(tree, version, request):
    resources = request.getfixturevalue(tree)
    assert len(resources) >= 20
    failures = []
    for r in resources:
        try:
            kv.validate(r, version, strict=True)
        except kv.ValidationError as e:
            failures.append(f"{r['kind']}/{r['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
        except kv.SchemaNotFoundError as e:  # an unknown kind is a failure, not a skip
            failures.append(e.message)
    assert not failures, "\n".join(failures)


def test_the_schema_check_has_teeth(base):
    bad = copy.deepcopy(_app(base, "gateway"))
    _container(bad)["readinessProbe"] = {"httpGet": {"path": "/health", "portt": 8000}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("files, says", [
    ({"kustomization.yaml": "resources: []\nimagez: [{name: x, newTag: y}]\n"}, "imagez"),
    ({"kustomization.yaml": "resources: [missing.yaml]\n"}, "missing.yaml"),
    ({"kustomization.yaml": "resources: [cm.yaml]\npatches: [{path: patch.yaml}]\n",
      "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a, namespace: slicesched}\n",
      "patch.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b, namespace: slicesched}\n"}, "patch"),
])
def test_a_broken_kustomization_fails_the_render(tmp_path, files, says):
    """A kustomization kubectl cannot render fails with its reason (never an empty or partial render)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(KustomizeError, match=says):
        kustomize_build(tmp_path)


def test_every_resource_sits_in_the_namespace(base, gpu):
    for r in base + gpu:
        if r["kind"] == "Namespace":
            assert r["metadata"]["name"] == NAMESPACE
            assert r["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        else:
            assert r["metadata"].get("namespace") == NAMESPACE, f"{r['kind']}/{r['metadata']['name']}"


@pytest.mark.parametrize("tree", ["base", "gpu"])
def test_pods_meet_the_restricted_pod_security_standard(tree, request):
    for w in workloads(request.getfixturevalue(tree)):
        spec = w["spec"]["template"]["spec"]
        name = w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        assert not spec.get("hostNetwork") and not spec.get("hostIPC") and not spec.get("hostPID"), name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["readOnlyRootFilesystem"] is True, f"{name}/{c['name']}"
            assert not sc.get("privileged"), name
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{name}/{c['name']} {part}"


@pytest.mark.parametrize("tree", ["base", "gpu"])
def test_services_run_the_entry_points_with_probes_and_drain_time(tree, request):
    resources = request.getfixturevalue(tree)
    env = _env_config(resources)
    drain = float(env["SLICESCHED_DRAIN_S"])
    for name in SERVICES:
        w = _app(resources, name)
        c = _container(w)
        assert w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name
        cmd = " ".join(c["command"])
        if name == "worker":
            assert "exec python -m services.worker --device" in cmd
        else:
            assert c["command"] == ["python", "-m", f"services.{name}"]
        assert c["envFrom"] == [{"configMapRef": {"name": "slicesched-env"}}]
        port = int(env["SLICESCHED_GATEWAY_PORT"] if name == "gateway" else env["SLICESCHED_METRICS_PORT"])
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health", f"{name} {probe}"
            assert named[get["port"]] == port, f"{name} {probe}"
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + pause + 5, f"{name}: grace {grace} < drain {drain} + preStop {pause} + 5"
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == port
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/etc/slicesched", "/tmp"} <= mounts
        assert os.path.dirname(env["SLICESCHED_CLUSTER"]) == "/etc/slicesched"


def test_each_service_uses_its_own_acl_user(base):
    template = (REPO / "deploy" / "redis" / "users.acl.template").read_text()
    acl_users = set(re.findall(r"^user (\S+)", template, re.M))
    secret_keys = set(find(base, "Secret", "slicesched-redis-passwords")["stringData"])
    users = []
    for name in SERVICES:
        env = {e["name"]: e for e in _container(_app(base, name))["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "slicesched-redis-passwords",
                                                                       "key": name}
        url = env["REDIS_URL"]["value"]
        m = re.fullmatch(r"redis://([a-z]+):\$\(REDIS_PASSWORD\)@slicesched-redis:6379/0", url)
        assert m, url
        users.append(m.group(1))
        names = [e["name"] for e in _container(_app(base, name))["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), "$(VAR) expands only earlier vars"
    assert users == list(SERVICES)
    assert set(users) <= acl_users and set(users) <= secret_keys


def test_redis_statefulset_persists_with_aof_and_loads_acl_from_the_secret(base):
    sts = find(base, "StatefulSet", "slicesched-redis")
    spec = sts["spec"]["template"]["spec"]
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    redis = spec["containers"][0]
    assert {m["mountPath"]: m["name"] for m in redis["volumeMounts"]}["/data"] in claims
    cm = find(base, "ConfigMap", "slicesched-redis-config")["data"]
    for fname in ("redis.conf", "users.acl.template", "render-acl.sh"):
        assert cm[fname] == (REPO / "deploy" / "redis" / fname).read_text(), \
            f"k8s/base/redis.yaml ConfigMap {fname} differs from deploy/redis/{fname}: copy it over"
    conf = dict(line.split(" ", 1) for line in cm["redis.conf"].splitlines() if line and not line.startswith("#"))
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "everysec" and conf["dir"] == "/data"
    assert redis["command"][:2] == ["redis-server", "/etc/redis/redis.conf"]
    init = spec["initContainers"][0]
    assert init["command"][-1] == conf["aclfile"]
    needed = set(re.findall(r"\$\{([A-Z_]+):sha256\}", cm["users.acl.template"]))
    refs = {e["name"]: e["valueFrom"] for e in init["env"]}
    assert needed <= set(refs)
    secret = find(base, "Secret", "slicesched-redis-passwords")["stringData"]
    for var in needed:
        ref = refs[var]["secretKeyRef"]
        assert ref["name"] == "slicesched-redis-passwords" and ref["key"] in secret
        assert secret[ref["key"]].startswith("REPLACE_ME"), "the base ships placeholders only"
    acl_vol = next(v for v in spec["volumes"] if v["name"] == "acl")
    assert acl_vol["emptyDir"]["medium"] == "Memory"
    probe = " ".join(redis["readinessProbe"]["exec"]["command"])
    assert "--user probe" in probe and "PONG" in probe
    svc = find(base, "Service", "slicesched-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379 and sts["spec"]["serviceName"] == "slicesched-redis"


@pytest.mark.parametrize("tree,prefix,backend", [("base", "cpu", "cpu"), ("gpu", "cuda", "cuda")])
def test_one_worker_pod_per_device(tree, prefix, backend, request):
    resources = request.getfixturevalue(tree)
    sts = _app(resources, "worker")
    cluster = _cluster(resources)
    assert sts["spec"]["replicas"] == len(cluster.devices)
    env = {e["name"]: e.get("value") for e in _container(sts)["env"]}
    assert env["SLICESCHED_DEVICE_PREFIX"] == prefix
    for i, d in enumerate(cluster.devices):
        assert d.id == f"{prefix}{i}" and d.backend == backend
        assert d.host == f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"
    headless = find(resources, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    tenants = parse_tenants(_tenants_raw(resources), "k8s:slicesched-tenants", cluster)
    for d in cluster.devices:  # the worker refuses a device that is not home to exactly one tenant
        assert sum(d.id in t.home_devices for t in tenants.tenants) == 1, d.id


def test_worker_command_derives_the_device_from_the_pod_ordinal(base, tmp_path):
    """Run the worker's real shell command with a stand-in `python` that prints what it was given."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$SLICESCHED_DEVICE|$*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    c = _container(_app(base, "worker"))
    for ordinal in (0, 1, 12):
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": f"slicesched-worker-{ordinal}",
               "SLICESCHED_DEVICE_PREFIX": "cpu"}
        out = subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=10, check=True).stdout
        assert out.strip() == f"cpu{ordinal}|-m services.worker --device cpu{ordinal}"


def test_no_plain_api_keys_in_kubernetes(base, gpu):
    for resources in (base, gpu):
        for t in _tenants_raw(resources)["tenants"]:
            assert "api_keys" not in t
            assert all(h.startswith("sha256:") for h in t.get("api_key_hashes", []))
    for path in REPO.joinpath("k8s").rglob("*.yaml"):
        assert "sk-" not in path.read_text(), path


def test_gpu_overlay_requests_gpus_on_gpu_nodes(base, gpu):
    sts = _app(gpu, "worker")
    spec = sts["spec"]["template"]["spec"]
    c = _container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert c["image"] != _container(_app(base, "worker"))["image"]
    assert all(d.backend == "cuda" for d in _cluster(gpu).devices)
    # the rest of the worker is still the base's
    assert c["command"] == _container(_app(base, "worker"))["command"]
    assert [e["name"] for e in c["env"]] == [e["name"] for e in _container(_app(base, "worker"))["env"]]
    for name in ("gateway", "gmg", "simulator", "scheduler"):
        assert _app(gpu, name) == _app(base, name)


# ------------------------------------------------------------------ network policy
def _pod(name: str, ns: str = NAMESPACE) -> dict:
    labels = {"app.kubernetes.io/part-of": "slicesched", "app.kubernetes.io/name": name}
    if name in SERVICES:
        labels["slicesched.io/redis-client"] = "true"
    return {"namespace": ns, "labels": labels}


def _pod_labels_from(resources, name):
    if name == "redis":
        return find(resources, "StatefulSet", "slicesched-redis")["spec"]["template"]["metadata"]["labels"]
    return _app(resources, name)["spec"]["template"]["metadata"]["labels"]


INGRESS = {"namespace": "ingress-nginx", "labels": {"app.kubernetes.io/name": "ingress-nginx"}}
PROMETHEUS = {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}
DNS = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
OUTSIDE = {"namespace": "default", "labels": {"app": "curl"}}


@pytest.mark.parametrize("tree", ["base", "gpu"])
def test_network_policy_allows_exactly_the_needed_flows(tree, request):
    resources = request.getfixturevalue(tree)
    for name in (*SERVICES, "redis"):  # the labels the policies select on are the pods' real labels
        assert _pod_labels_from(resources, name) == _pod(name)["labels"]
    deny = find(resources, "NetworkPolicy", "slicesched-default-deny")["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert not deny.get("ingress") and not deny.get("egress")
    p = _pod
    allowed = [(INGRESS, p("gateway"), 8000), (p("worker"), p("worker"), 29500), (p("worker"), p("worker"), 29999),
               (PROMETHEUS, p("gateway"), 8000), *[(p(s), p("redis"), 6379) for s in SERVICES],
               *[(PROMETHEUS, p(s), 9100) for s in SERVICES if s != "gateway"],
               *[(p(s), DNS, 53) for s in (*SERVICES, "redis")]]
    denied = [(OUTSIDE, p("gateway"), 8000), (OUTSIDE, p("redis"), 6379), (INGRESS, p("redis"), 6379),
              (PROMETHEUS, p("redis"), 6379), (p("gateway"), p("worker"), 29500), (p("worker"), p("gateway"), 8000),
              (p("redis"), p("gateway"), 8000), (p("gateway"), OUTSIDE, 443), (p("worker"), OUTSIDE, 443),
              (p("scheduler"), p("simulator"), 9100), (INGRESS, p("scheduler"), 9100)]
    for src, dst, port in allowed:
        assert flow_allowed(resources, src, dst, port), f"needed flow blocked: {src} -> {dst}:{port}"
    for src, dst, port in denied:
        assert not flow_allowed(resources, src, dst, port), f"unneeded flow open: {src} -> {dst}:{port}"
    worker_ok = flow_allowed(resources, p("worker"), p("worker"), 40000)
    assert worker_ok is (tree == "gpu"), "only NCCL on GPUs needs ephemeral ports between workers"


def test_gateway_service_targets_the_http_port(base):
    svc = find(base, "Service", "slicesched-gateway")["spec"]
    assert svc["type"] == "ClusterIP" and svc["ports"][0]["port"] == 8000
    assert svc["selector"] == {k: v for k, v in _pod("gateway")["labels"].items() if k.startswith("app.")}


def test_kustomizations_only_reference_existing_files():
    for k in (BASE, GPU):
        data = yaml.safe_load((k / "kustomization.yaml").read_text())
        listed = [*data.get("resources", []), *(p["path"] for p in data.get("patches", []))]
        for entry in listed:
            assert (k / entry).exists(), f"{k}/{entry}"
        local = {p.name for p in k.glob("*.yaml")} - {"kustomization.yaml"}
        assert local == {Path(e).name for e in listed if not e.startswith("..")}, "unlisted manifest in " + str(k)
