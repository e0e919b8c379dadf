"""``slicesched check-config`` checks what ``slicesched up`` checks: every configuration ``up`` refuses,
``check-config`` refuses with the same message and exit status 2, and neither starts anything. The numeric settings
are taken from the source (every ``env_number`` the services read), so a new setting a service refuses at its start
is covered, or this test fails."""
from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from services.cli.main import main as cli_main
from shared.model.config import PRESETS

REPO = Path(__file__).resolve().parents[2]
ENV_CLEAN = ("SLICESCHED_POLICY", "SLICESCHED_POLICY_PARAMS", "SLICESCHED_CLUSTER", "SLICESCHED_TENANTS")


def _numeric_settings() -> list[str]:
    """Every ``SLICESCHED_*`` number a service reads through ``env_number`` (services/ and shared/)."""
    names = set()
    for root in ("services", "shared"):
        for f in (REPO / root).rglob("*.py"):
            if f.parts[-2] == "cli":
                continue  # commands, not services
            names |= set(re.findall(r'(?:env_number|num)\(\s*"(SLICESCHED_[A-Z0-9_]+)"', f.read_text()))
    return sorted(names)


def _write(tmp: Path, cluster: dict, tenants: dict) -> tuple[str, str]:
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    return str(tmp / "cluster.yaml"), str(tmp / "tenants.yaml")


def _tenant(name: str, homes: list[str], model=None) -> dict:
    return {"name": name, "model": model or "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10}, "home_devices": homes}


CPU = {"id": "cpu0", "backend": "cpu", "memory_gb": 0.25}
CPU1 = {"id": "cpu1", "backend": "cpu", "memory_gb": 0.25}
EMU = {"id": "e0", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80}


def _files_case(name: str, tmp: Path) -> tuple[list[str], dict, str]:
    """(extra arguments, environment, expected part of the message) of one refused configuration."""
    if name == "missing cluster file":
        return ["--cluster", str(tmp / "nope.yaml")], {}, "nope.yaml: (file): file not found"
    if name == "bad yaml":
        c, t = _write(tmp, {"devices": [CPU]}, {})
        Path(t).write_text("tenants: [\n")
        return ["--cluster", c, "--tenants", t], {}, "invalid YAML"
    if name == "unknown home device":
        c, t = _write(tmp, {"devices": [CPU]}, {"tenants": [_tenant("a", ["gpu9"])]})
        return ["--cluster", c, "--tenants", t], {}, "unknown device 'gpu9'"
    if name == "device home to no tenant":  # the case check-config used to pass and up refused
        c, t = _write(tmp, {"devices": [CPU, CPU1]}, {"tenants": [_tenant("a", ["cpu0"])]})
        return ["--cluster", c, "--tenants", t], {}, "device 'cpu1' must be home to exactly one tenant, found 0"
    if name == "device home to two tenants":
        c, t = _write(tmp, {"devices": [CPU]}, {"tenants": [_tenant("a", ["cpu0"]), _tenant("b", ["cpu0"])]})
        return ["--cluster", c, "--tenants", t], {}, "device 'cpu0' must be home to exactly one tenant, found 2"
    if name == "unreadable tokenizer":
        ck = tmp / "ck"
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps(asdict(PRESETS["tiny"])))
        (ck / "tokenizer.json").write_text("{not json")
        c, t = _write(tmp, {"devices": [CPU]}, {"tenants": [_tenant("a", ["cpu0"], {"checkpoint": str(ck)})]})
        return ["--cluster", c, "--tenants", t], {}, "tenants[0].model.checkpoint: "
    if name == "unknown policy":
        return ["--policy", "nonsense"], {}, "arguments: --policy: unknown policy 'nonsense'"
    if name == "simulation-only policy":
        return ["--policy", "pooled-bound"], {}, "policy 'pooled-bound' is simulation-only"
    if name == "policy from the environment":
        return [], {"SLICESCHED_POLICY": "bogus"}, "environment: SLICESCHED_POLICY: unknown policy 'bogus'"
    if name == "policy parameters":
        return [], {"SLICESCHED_POLICY_PARAMS": "{\"nope\": 1}"}, "environment: SLICESCHED_POLICY_PARAMS: slice"
    raise AssertionError(name)


FILE_CASES = ["missing cluster file", "bad yaml", "unknown home device", "device home to no tenant",
              "device home to two tenants", "unreadable tokenizer", "unknown policy", "simulation-only policy",
              "policy from the environment", "policy parameters"]


def _run_both(argv: list[str], env: dict, monkeypatch, capsys, tmp: Path) -> list[tuple[int, str]]:
    import services.launcher

    for k in ENV_CLEAN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def started(self, *a, **kw):  # a refusal up missed would start the mesh here
        raise RuntimeError("up started the mesh")

    monkeypatch.setattr(services.launcher.Launcher, "start", started)
    out = []
    data = tmp / "data"
    for cmd in (["up", "--data-dir", str(data)], ["check-config"]):
        capsys.readouterr()
        rc = cli_main([*cmd, *argv])
        out.append((rc, capsys.readouterr().err))
    assert not data.exists() or not any(data.iterdir())  # refused before Redis or any service was started
    return out


@pytest.mark.parametrize("case", FILE_CASES)
def test_check_config_refuses_what_up_refuses(case, monkeypatch, capsys, tmp_path):
    argv, env, expected = _files_case(case, tmp_path)
    (rc_up, err_up), (rc_cc, err_cc) = _run_both(argv, env, monkeypatch, capsys, tmp_path)
    assert rc_up == 2 and err_up.startswith("slicesched: config error: ") and expected in err_up, err_up
    assert "Traceback" not in err_up and err_up.count("\n") == 1
    assert (rc_cc, err_cc) == (rc_up, err_up)


@pytest.mark.parametrize("name", _numeric_settings())
def test_every_numeric_setting_is_checked_by_both(name, monkeypatch, capsys, tmp_path):
    # a cluster with a CPU and an emulated device, so that every service of the mesh would read the setting
    c, t = _write(tmp_path, {"devices": [CPU, EMU]}, {"tenants": [_tenant("a", ["cpu0"]), _tenant("b", ["e0"])]})
    (rc_up, err_up), (rc_cc, err_cc) = _run_both(["--cluster", c, "--tenants", t], {name: "many"}, monkeypatch,
                                                 capsys, tmp_path)
    assert rc_up == 2 and f"environment: {name}: expected " in err_up, (name, err_up)
    assert (rc_cc, err_cc) == (rc_up, err_up)


def test_the_numeric_settings_are_found():
    names = _numeric_settings()
    for n in ("SLICESCHED_DRAIN_S", "SLICESCHED_MAX_RUNNING", "SLICESCHED_GUEST_CACHE_MB",
              "SLICESCHED_EMULATED_TIME_SCALE", "SLICESCHED_STREAM_EXPIRY_S", "SLICESCHED_MAX_INFLIGHT"):
        assert n in names


def test_a_good_configuration_passes_both(monkeypatch, capsys, tmp_path):
    c, t = _write(tmp_path, {"devices": [CPU, EMU]}, {"tenants": [_tenant("a", ["cpu0"]), _tenant("b", ["e0"])]})
    (rc_up, err_up), (rc_cc, err_cc) = _run_both(["--cluster", c, "--tenants", t], {}, monkeypatch, capsys, tmp_path)
    assert rc_up == 1 and "up started the mesh" in err_up  # up got past every check
    assert rc_cc == 0 and err_cc == ""
