"""API keys: a config with ``api_key_hashes`` only authenticates; plain keys never survive config parsing; every
stored hash is compared with ``hmac.compare_digest`` (no early exit, no ``==`` on secrets)."""
from __future__ import annotations

import ast
import hmac
import inspect
import textwrap

import pytest

import services.gateway.core as gw_core
from services.gateway.core import ApiError, KeyIndex
from shared.config import ConfigError, hash_api_key, parse_tenants

KEY_A, KEY_B, KEY_C = "sk-unit-hash-only-a-1", "sk-unit-hash-only-b-2", "sk-unit-plain-c-3"


def _tenants(**extra):
    def t(name, dev, **kw):
        return {"name": name, "model": "tiny", "sla": {"ttft_ms": 1000, "tpot_ms": 100}, "home_devices": [dev]} | kw

    return parse_tenants({"tenants": [
        t("a", "d0", api_key_hashes=[hash_api_key(KEY_A)]),
        t("b", "d1", api_key_hashes=[hash_api_key(KEY_B).upper().replace("SHA256:", "sha256:")]),
        t("c", "d2", api_keys=[KEY_C], **extra),
    ]})


def test_hash_only_config_authenticates_and_keeps_no_plain_key():
    tenants = _tenants()
    keys = KeyIndex(tenants)
    assert keys.authenticate(f"Bearer {KEY_A}").name == "a"
    assert keys.authenticate(f"Bearer {KEY_B}").name == "b"  # upper-case hex digests are normalised
    assert keys.authenticate(f"Bearer {KEY_C}").name == "c"
    held = repr(tenants) + repr(keys.__dict__)
    assert KEY_C not in held and hash_api_key(KEY_C) in held  # a dev key is hashed at parse time
    with pytest.raises(ApiError) as e:
        keys.authenticate(f"Bearer {hash_api_key(KEY_A)}")  # the hash itself is not a key
    assert e.value.status == 401


@pytest.mark.parametrize("bad", ["sha256:abc", "md5:" + "0" * 64, "sha256:" + "0" * 65, 7])
def test_malformed_hashes_are_config_errors(bad):
    with pytest.raises(ConfigError, match=r"api_key_hashes\[0\]"):
        parse_tenants({"tenants": [{"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1},
                                    "home_devices": ["d"], "api_key_hashes": [bad]}]})


@pytest.mark.parametrize("key, tenant", [(KEY_A, "a"), (KEY_C, "c"), ("sk-nobody-at-all", None)])
def test_every_stored_hash_is_compared_in_constant_time(monkeypatch, key, tenant):
    keys = KeyIndex(_tenants())
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(gw_core.hmac, "compare_digest", spy)
    if tenant is None:
        with pytest.raises(ApiError):
            keys.authenticate(f"Bearer {key}")
    else:
        assert keys.authenticate(f"Bearer {key}").name == tenant
    assert len(calls) == 3  # one per stored hash, wherever the match is
    assert all(b == hash_api_key(key).encode() for _a, b in calls)


def test_authenticate_compares_secrets_only_through_compare_digest():
    tree = ast.parse(textwrap.dedent(inspect.getsource(KeyIndex.authenticate)))
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in n.ops)]
    assert not any("digest" in c or "key" in c or "_entries" in c for c in compared), compared
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "hmac.compare_digest" in calls
