"""Settings from the environment: a malformed value is a one-line error naming the variable, never a traceback;
every variable the code reads is documented in docs/configuration.md; the live default policy is a real one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.cli.main import main as cli_main
from services.worker.__main__ import engine_knobs
from services.worker.lease_agent import LeaseOptions
from shared.config import DEFAULT_POLICY, ConfigError, Settings, env_number
from shared.policies import POLICIES

REPO = Path(__file__).resolve().parents[2]
BASE = {"REDIS_URL": "redis://127.0.0.1:6379/0"}


def test_env_number_default_value_and_bounds():
    assert env_number("X", 20.0, env={}) == 20.0
    assert env_number("X", 20.0, env={"X": ""}) == 20.0
    assert env_number("X", 20.0, env={"X": " 2.5 "}) == 2.5
    assert env_number("X", 3, int, env={"X": "7"}) == 7
    for raw, kind, bounds, problem in [("abc", float, {}, "expected a number"),
                                       ("1.5", int, {}, "expected an integer"),
                                       ("nan", float, {}, "expected a finite number"),
                                       ("inf", float, {}, "expected a finite number"),
                                       ("-1", float, {"minimum": 0}, "must be >= 0"),
                                       ("0", float, {"above": 0}, "must be > 0"),
                                       ("70000", int, {"maximum": 65535}, "must be <= 65535")]:
        with pytest.raises(ConfigError) as ei:
            env_number("SLICESCHED_X", 1, kind, env={"SLICESCHED_X": raw}, **bounds)
        assert ei.value.field_path == "SLICESCHED_X" and problem in str(ei.value), (raw, str(ei.value))


@pytest.mark.parametrize("name, raw", [("SLICESCHED_GATEWAY_PORT", "http"), ("SLICESCHED_METRICS_PORT", "x"),
                                       ("SLICESCHED_METRICS_PORT", "-1"), ("SLICESCHED_DRAIN_S", "soon"),
                                       ("SLICESCHED_DEADLINE_CHUNKS", "2"), ("SLICESCHED_DEADLINE_CHUNKS", "yes"),
                                       ("SLICESCHED_STEP_CAP_S", "-0.1"), ("SLICESCHED_STEP_CAP_S", "fast")])
def test_settings_name_the_variable_that_is_wrong(name, raw):
    with pytest.raises(ConfigError) as ei:
        Settings.from_env({**BASE, name: raw})
    assert ei.value.file == "environment" and ei.value.field_path == name


def test_the_step_cap_is_off_unless_set():
    assert Settings.from_env(BASE).step_cap_s == 0.0
    assert Settings.from_env({**BASE, "SLICESCHED_STEP_CAP_S": "0.04"}).step_cap_s == 0.04


@pytest.mark.parametrize("name, raw", [("SLICESCHED_LEASE_MICRO_BATCHES", "0"), ("SLICESCHED_SEGMENT_TIMEOUT_FACTOR", "x"),
                                       ("SLICESCHED_SEGMENT_COOLDOWN_S", "-2"), ("SLICESCHED_GUEST_CACHE_MB", "lots"),
                                       ("SLICESCHED_SEGMENT_INLINE_MAX", "1e6")])
def test_lease_options_name_the_variable_that_is_wrong(name, raw):
    with pytest.raises(ConfigError) as ei:
        LeaseOptions.from_env({name: raw})
    assert ei.value.field_path == name
    assert LeaseOptions.from_env({}).cache_bytes == 0


@pytest.mark.parametrize("name, raw", [("SLICESCHED_MAX_RUNNING", "0"), ("SLICESCHED_MAX_BATCH_TOKENS", "many"),
                                       ("SLICESCHED_KV_POOL_MB", "-5")])
def test_engine_settings_name_the_variable_that_is_wrong(name, raw):
    with pytest.raises(ConfigError) as ei:
        engine_knobs({name: raw})
    assert ei.value.field_path == name
    assert engine_knobs({}) == {"kv_pool_mb": 0.0, "max_batch_tokens": 256, "max_running": 64}


@pytest.mark.parametrize("argv, env, expected", [
    (["up", "--policy", "nonsense"], {}, "arguments: --policy: unknown policy 'nonsense'"),
    (["up", "--policy", "pooled-bound"], {}, "arguments: --policy: policy 'pooled-bound' is simulation-only"),
    (["up", "--policy", "muxserve"], {}, "arguments: --policy: policy 'muxserve' is simulation-only (its co-located"),
    (["up"], {"SLICESCHED_POLICY": "bogus"}, "environment: SLICESCHED_POLICY: unknown policy 'bogus'"),
    (["up"], {"SLICESCHED_POLICY_PARAMS": "{\"nope\": 1}"}, "environment: SLICESCHED_POLICY_PARAMS: slice: unknown"),
    (["up"], {"SLICESCHED_POLICY_PARAMS": "[1"}, "environment: SLICESCHED_POLICY_PARAMS: SLICESCHED_POLICY_PARAMS is"),
    (["up"], {"SLICESCHED_GATEWAY_PORT": "eighty"}, "environment: SLICESCHED_GATEWAY_PORT: expected an integer"),
])
def test_up_refuses_bad_settings_before_starting_anything(argv, env, expected, monkeypatch, capsys, tmp_path):
    for k in ("SLICESCHED_POLICY", "SLICESCHED_POLICY_PARAMS", "SLICESCHED_GATEWAY_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli_main([*argv, "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slicesched: config error: ") and expected in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())  # refused before Redis or any service was started


def test_the_live_default_policy_is_a_registered_real_policy():
    assert DEFAULT_POLICY in POLICIES.names()
    assert not getattr(POLICIES.get(DEFAULT_POLICY), "simulation_only", False)


def _variables_read_by_the_code() -> set[str]:
    """Every ``SLICESCHED_*`` name in the services, libraries and deployment files (the test suite's own aside)."""
    files = [p for top in ("services", "shared", "loadgen") for p in (REPO / top).rglob("*.py")]
    files += [REPO / "docker-compose.yml", REPO / "Dockerfile", *(REPO / "k8s").rglob("*.yaml"),
              *(REPO / "deploy").rglob("*")]
    names: set[str] = set()
    for path in files:
        if path.is_file():
            names |= set(re.findall(r"\bSLICESCHED_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    return names


def test_every_environment_variable_the_code_reads_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`(SLICESCHED_[A-Z0-9_]+)`", doc))
    read = _variables_read_by_the_code()
    assert len(read) > 30
    assert sorted(read - documented) == []
    assert sorted(documented - read) == [], "documented but never read: the doc is stale"
