"""k8s/overlays/redis-cluster: the base with its Redis as a 6-node Redis Cluster (3 masters, one replica each),
validated offline like the base (Kubernetes 1.30/1.33 schemas, strict) plus what the cluster needs: cluster-enabled
nodes keeping their state on the volume and announcing stable names, replication authenticated without a password
in the manifests, a create Job for exactly the StatefulSet's pods, the services told they talk to a cluster, and
NetworkPolicies that open the cluster bus between Redis pods only. No cluster runs here."""
from __future__ import annotations

import pytest
import yaml
from deploy_support import REPO, find, flow_allowed, kustomize_build, workloads
from kubernetes_validate import utils as kv

from shared.config import redis_cluster_setting

OVERLAY = REPO / "k8s" / "overlays" / "redis-cluster"


@pytest.fixture(scope="module")
def rc() -> list[dict]:
    return kustomize_build(OVERLAY)


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_every_manifest_validates(rc, version):
    failures = []
    for r in rc:
        try:
            kv.validate(r, version, strict=True)
        except (kv.ValidationError, kv.SchemaNotFoundError) as e:
            failures.append(f"{r['kind']}/{r['metadata']['name']}: {getattr(e, 'message', e)}")
    assert not failures, "\n".join(failures)


def test_redis_runs_as_cluster_nodes_that_keep_their_state(rc):
    sts = find(rc, "StatefulSet", "slicesched-redis")
    assert sts["spec"]["replicas"] == 6 and sts["spec"]["podManagementPolicy"] == "Parallel"
    spec = sts["spec"]["template"]["spec"]
    cmd = spec["containers"][0]["command"]
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert cmd[:2] == ["redis-server", "/etc/redis/redis.conf"]
    assert opts["--cluster-enabled"] == "yes" and opts["--cluster-config-file"].startswith("/data/")
    data = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}["/data"]
    assert data in {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert opts["--cluster-announce-hostname"] == "$(POD_NAME).slicesched-redis"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # replication authenticates from a file the init step writes into the in-memory ACL volume
    assert opts["--include"].startswith("/acl/")
    init = {c["name"]: c for c in spec["initContainers"]}
    assert {"render-acl", "replication-auth"} <= set(init)
    assert "masterauth" in init["replication-auth"]["command"][-1]
    acl = next(v for v in spec["volumes"] if v["name"] == "acl")
    assert acl["emptyDir"]["medium"] == "Memory"
    text = "\n".join(p.read_text() for p in OVERLAY.glob("*.yaml"))
    assert "REPLACE_ME" not in text and "masterauth %s" in text  # the password comes from the Secret only


def test_the_create_job_joins_exactly_the_statefulsets_pods(rc):
    job = find(rc, "Job", "slicesched-redis-cluster-create")
    pod = job["spec"]["template"]
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert int(env["NODES"]["value"]) == find(rc, "StatefulSet", "slicesched-redis")["spec"]["replicas"]
    assert env["REPLICAS"]["value"] == "1"
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "slicesched-redis-passwords", "key": "admin"}
    script = c["command"][-1]
    assert "--cluster create" in script and "--cluster-replicas" in script and "cluster_state:ok" in script
    assert pod["metadata"]["labels"]["slicesched.io/redis-client"] == "true"
    assert pod["spec"]["restartPolicy"] == "OnFailure"


def test_pods_meet_the_restricted_standard(rc):
    for w in workloads(rc):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec.get("automountServiceAccountToken") is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            assert {"cpu", "memory"} <= set(c["resources"]["limits"])


def test_services_are_told_they_talk_to_a_cluster(rc):
    env = find(rc, "ConfigMap", "slicesched-env")["data"]
    assert redis_cluster_setting(env) is True
    gw = find(rc, "Deployment", "slicesched-gateway")["spec"]["template"]["spec"]["containers"][0]
    url = next(e["value"] for e in gw["env"] if e["name"] == "REDIS_URL")
    assert "@slicesched-redis:6379" in url  # any node: the cluster client discovers the rest


def _pod(name: str) -> dict:
    labels = {"app.kubernetes.io/part-of": "slicesched", "app.kubernetes.io/name": name}
    if name != "redis":
        labels["slicesched.io/redis-client"] = "true"
    return {"namespace": "slicesched", "labels": labels}


def test_the_cluster_bus_is_open_between_redis_pods_only(rc):
    redis, gw, job = _pod("redis"), _pod("gateway"), _pod("redis-cluster-create")
    outside = {"namespace": "default", "labels": {"app": "curl"}}
    for port in (6379, 16379):
        assert flow_allowed(rc, redis, redis, port)
    assert flow_allowed(rc, gw, redis, 6379) and flow_allowed(rc, job, redis, 6379)
    for src, port in ((gw, 16379), (job, 16379), (outside, 16379), (outside, 6379)):
        assert not flow_allowed(rc, src, redis, port), (src, port)
    assert not flow_allowed(rc, redis, gw, 8000)


def test_kustomization_lists_every_file():
    k = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    listed = {*(e for e in k["resources"] if not e.startswith("..")), *(p["path"] for p in k["patches"])}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
