"""docker-compose.yml: valid against the Compose Specification schema, and wired the way SliceScheduler needs.

No container engine runs here, so nothing is started: the file is checked as data. If a Compose CLI is on PATH
(`docker compose` or `docker-compose`), it also parses the file.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from deploy_support import REPO, SERVICES, interpolate, parse_duration_s

from shared.config import load_cluster, load_tenants

COMPOSE = REPO / "docker-compose.yml"
SCHEMA = Path(__file__).resolve().parent / "compose-spec.json"
REDIS_CONF = REPO / "deploy" / "redis" / "redis.conf"
APP_SERVICES = {"gateway", "gmg", "simulator", "scheduler", "worker-cpu0", "worker-cpu1", "worker-cuda0"}


def _raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _compose(env: dict[str, str] | None = None) -> dict:
    return interpolate(_raw(), env or {})


def _kind(svc: str) -> str:
    return "worker" if svc.startswith("worker-") else svc


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "environment must be a mapping here"
    return {k: str(v) for k, v in env.items()}


def _redis_conf() -> dict[str, str]:
    out = {}
    for line in REDIS_CONF.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


def test_valid_against_compose_specification_schema():
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_file():
    """The schema check has teeth: an unknown key and a wrong type are both reported."""
    bad = _compose()
    bad["services"]["gateway"]["helthcheck"] = {}
    bad["services"]["redis"]["stop_grace_period"] = 30
    errors = list(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(bad))
    assert len(errors) >= 2


def test_services_run_the_entry_points():
    services = _compose()["services"]
    assert APP_SERVICES | {"redis", "redis-acl"} == set(services)
    for name in APP_SERVICES:
        cmd = services[name]["command"]
        kind = _kind(name)
        assert kind in SERVICES
        assert cmd[:3] == ["python", "-m", f"services.{kind}"], name
        if kind == "worker":
            device = name.removeprefix("worker-")
            assert cmd[3:] == ["--device", device]
            assert _env(services[name])["SLICESCHED_DEVICE"] == device
            assert services[name]["hostname"] == name
        else:
            assert len(cmd) == 3


def _config_dir(svc: dict) -> Path:
    """The host directory a service mounts at /etc/slicesched (where SLICESCHED_CLUSTER/TENANTS point)."""
    env = _env(svc)
    assert env["SLICESCHED_CLUSTER"] == "/etc/slicesched/cluster.yaml"
    assert env["SLICESCHED_TENANTS"] == "/etc/slicesched/tenants.yaml"
    mounts = [v for v in svc["volumes"] if v.endswith(":/etc/slicesched:ro")]
    assert len(mounts) == 1
    return REPO / mounts[0].split(":")[0]


def _check_homes(cluster, tenants) -> None:
    """The worker refuses a device that is not home to exactly one tenant."""
    for d in cluster.devices:
        assert sum(d.id in t.home_devices for t in tenants.tenants) == 1, d.id


def test_one_cpu_worker_per_device_of_the_cluster_config():
    services = _compose()["services"]
    repo_cluster = load_cluster(REPO / "configs" / "cluster-tiny.yaml")
    cpu_workers = sorted(n.removeprefix("worker-") for n in services
                         if n.startswith("worker-") and "profiles" not in services[n])
    assert cpu_workers == sorted(d.id for d in repo_cluster.devices)
    dirs = {_config_dir(services[n]) for n in APP_SERVICES}
    assert dirs == {REPO / "deploy" / "compose" / "cpu"}, "every service reads the same config"
    cluster = load_cluster(REPO / "deploy" / "compose" / "cpu" / "cluster.yaml")
    # the compose config is configs/ with each device hosted by its own worker container
    for mine, repo in zip(cluster.devices, repo_cluster.devices, strict=True):
        assert mine.host == f"worker-{mine.id}"
        assert dataclasses.replace(mine, host=repo.host) == repo
    tenants = load_tenants(REPO / "deploy" / "compose" / "cpu" / "tenants.yaml", cluster)
    assert tenants.tenants == load_tenants(REPO / "configs" / "tenants-tiny.yaml", repo_cluster).tenants
    _check_homes(cluster, tenants)


def test_gpu_profile_reserves_an_nvidia_gpu():
    services = _compose({"SLICESCHED_COMPOSE_VARIANT": "gpu"})["services"]
    gpu = [n for n, s in services.items() if "gpu" in (s.get("profiles") or [])]
    assert gpu == ["worker-cuda0"]
    assert all("profiles" not in s for n, s in services.items() if n != "worker-cuda0")
    devices = services["worker-cuda0"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert re.search(r"/whl/cu\d+$", services["worker-cuda0"]["build"]["args"]["TORCH_INDEX_URL"])
    assert services["worker-cuda0"]["image"] != services["worker-cpu0"]["image"]
    dirs = {_config_dir(services[n]) for n in APP_SERVICES}
    assert dirs == {REPO / "deploy" / "compose" / "gpu"}
    cluster = load_cluster(REPO / "deploy" / "compose" / "gpu" / "cluster.yaml")
    cuda = cluster.device("cuda0")
    assert cuda.backend == "cuda" and cuda.host == "worker-cuda0"
    assert sorted(n.removeprefix("worker-") for n in services if n.startswith("worker-")) == \
        sorted(d.id for d in cluster.devices)
    _check_homes(cluster, load_tenants(REPO / "deploy" / "compose" / "gpu" / "tenants.yaml", cluster))


def test_each_service_kind_has_its_own_acl_user_and_matching_password():
    """REDIS_URL user = the service kind; its password is the one the ACL renderer hashes for that user."""
    for env in ({}, {f"REDIS_PASSWORD_{k.upper()}": f"pw-{k}-0123456789" for k in SERVICES}):
        services = _compose(env)["services"]
        acl_env = _env(services["redis-acl"])
        users = {}
        for name in APP_SERVICES:
            url = urlsplit(_env(services[name])["REDIS_URL"])
            assert url.scheme == "redis" and url.hostname == "redis" and url.port == 6379 and url.path == "/0"
            assert url.username == _kind(name), name
            assert url.password == acl_env[f"REDIS_PASSWORD_{_kind(name).upper()}"], name
            if env:
                assert url.password == env[f"REDIS_PASSWORD_{_kind(name).upper()}"]
            users.setdefault(url.username, set()).add(url.password)
        assert set(users) == set(SERVICES)
        assert all(len(p) == 1 for p in users.values())
        assert len({next(iter(p)) for p in users.values()}) == len(SERVICES), "passwords must differ per user"


def test_redis_has_aof_acl_volume_and_authenticated_healthcheck():
    services = _compose()["services"]
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    conf = _redis_conf()
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "everysec"
    assert conf["protected-mode"] == "yes" and conf["dir"] == "/data"
    assert redis["command"] == ["redis-server", "/usr/local/etc/redis/redis.conf"]
    vols = redis["volumes"]
    assert "./deploy/redis/redis.conf:/usr/local/etc/redis/redis.conf:ro" in vols
    assert "redis-data:/data" in vols and "redis-data" in _raw()["volumes"]
    acl_dir = str(Path(conf["aclfile"]).parent)
    assert f"redis-acl:{acl_dir}:ro" in vols
    assert services["redis-acl"]["entrypoint"][-1] == conf["aclfile"]
    assert redis["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
    assert "ports" not in redis, "Redis must not be published"
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli" in test and "--user probe" in test and "ping" in test and "PONG" in test
    assert _env(redis)["REDISCLI_AUTH"] == _env(services["redis-acl"])["REDIS_PASSWORD_PROBE"]


def test_healthchecks_and_startup_order():
    services = _compose()["services"]
    for name in APP_SERVICES:
        svc = services[name]
        port = "8000" if name == "gateway" else _env(svc)["SLICESCHED_METRICS_PORT"]
        # compose healthchecks gate depends_on: readiness (/ready; the gateway's needs a live worker per tenant)
        assert f"http://127.0.0.1:{port}/ready" in " ".join(svc["healthcheck"]["test"]), name
        deps = svc["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy", name
        for dep, cond in deps.items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"


def test_only_the_gateway_is_published_and_on_loopback():
    services = _compose()["services"]
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert published == {"gateway": ["127.0.0.1:8000:8000"]}
    assert _env(services["gateway"])["SLICESCHED_GATEWAY_HOST"] == "0.0.0.0"  # inside its own container only
    assert _compose()["networks"]["backend"]["internal"] is True


def test_graceful_stop_covers_the_drain_time():
    services = _compose()["services"]
    for name in APP_SERVICES:
        svc = services[name]
        drain = float(_env(svc)["SLICESCHED_DRAIN_S"])
        assert parse_duration_s(svc["stop_grace_period"]) > drain, name
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"


def test_containers_are_hardened():
    services = _compose()["services"]
    for name in APP_SERVICES:
        svc = services[name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert _env(svc)["SLICESCHED_LOG_FORMAT"] == "json"
    assert services["redis"]["user"] == "999:999"


def test_env_example_lists_every_password_variable():
    example = (REPO / "deploy" / "compose" / "env.example").read_text()
    acl_vars = set(_raw()["services"]["redis-acl"]["environment"]) - {"SLICESCHED_PREFIX"}
    assert acl_vars == {f"REDIS_PASSWORD_{k.upper()}" for k in (*SERVICES, "admin", "probe")}
    for var in acl_vars:
        assert f"\n{var}=" in example


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="no Compose CLI on this machine")
def test_compose_cli_parses_the_file():
    for args in ([], ["--profile", "gpu"]):
        r = subprocess.run([*_compose_cli(), "-f", str(COMPOSE), *args, "config", "-q"], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0, r.stderr
