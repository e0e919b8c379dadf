"""The Redis ACL template and its two renderers (Python for people and tests, POSIX sh for the redis image)."""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys

import pytest
from deploy_support import REPO, SERVICES, load_module

ACL_DIR = REPO / "deploy" / "redis"
TEMPLATE = (ACL_DIR / "users.acl.template").read_text()
render_acl = load_module(ACL_DIR / "render_acl.py", "render_acl")
USERS = ("admin", "probe", *SERVICES)
NEEDS_SH = pytest.mark.skipif(not all(shutil.which(t) for t in ("sh", "sha256sum", "sed", "grep")),
                              reason="needs sh, sha256sum, sed and grep")


def _env(**over: str) -> dict[str, str]:
    env = {f"REDIS_PASSWORD_{u.upper()}": f"{u}-secret-{i:04d}-x" for i, u in enumerate(USERS)}
    env.update(over)
    return env


def _users(text: str) -> dict[str, list[str]]:
    return {line.split()[1]: line.split()[2:] for line in text.splitlines() if line.startswith("user ")}


def test_template_needs_one_password_per_user():
    assert render_acl.password_variables(TEMPLATE) == [f"REDIS_PASSWORD_{u.upper()}" for u in USERS]


def test_rendered_file_holds_hashes_and_the_intended_rules():
    env = _env()
    text = render_acl.render_acl(TEMPLATE, env)
    users = _users(text)
    assert list(users) == ["default", *USERS]
    assert "off" in users["default"] and "-@all" in users["default"] and "nopass" not in users["default"]
    for u in USERS:
        rules = users[u]
        pw = env[f"REDIS_PASSWORD_{u.upper()}"]
        assert pw not in text
        assert f"#{hashlib.sha256(pw.encode()).hexdigest()}" in rules
        assert rules[0] == "on"
    for u in SERVICES:
        rules = users[u]
        assert "~slicesched:*" in rules and "&slicesched:*" in rules
        assert "-@dangerous" in rules and "-@all" in rules
        assert rules.index("-@dangerous") > max(i for i, r in enumerate(rules) if r.startswith("+@"))
        assert not {"~*", "allkeys", "&*", "allchannels", "+@all", "allcommands", "+@admin"} & set(rules)
    assert {"~*", "+@all"} <= set(users["admin"])
    assert [r for r in users["probe"] if r.startswith("+")] == ["+ping"]
    # all service users get the same rule set (only the password differs)
    strip = [[r for r in users[u] if not r.startswith("#")] for u in SERVICES]
    assert all(s == strip[0] for s in strip)


def test_custom_prefix_is_applied_and_checked():
    text = render_acl.render_acl(TEMPLATE, _env(SLICESCHED_PREFIX="team-a:"))
    assert "~team-a:*" in text and "slicesched:" not in text
    for bad in ("no-colon", "a b:", "x*:", ":"):
        with pytest.raises(render_acl.AclRenderError, match="SLICESCHED_PREFIX"):
            render_acl.render_acl(TEMPLATE, _env(SLICESCHED_PREFIX=bad))


@pytest.mark.parametrize("value,problem", [("", "not set"), ("REPLACE_ME-gateway", "placeholder"),
                                           ("has@at-sign-pw", "only letters"), ("short-pw", "shorter")])
def test_bad_passwords_are_refused_with_the_variable_named(value, problem):
    with pytest.raises(render_acl.AclRenderError, match=f"REDIS_PASSWORD_GATEWAY: .*{problem}"):
        render_acl.render_acl(TEMPLATE, _env(REDIS_PASSWORD_GATEWAY=value))


def test_cli_writes_a_private_file_and_exits_2_on_bad_input(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("# dev\n" + "".join(f'{k}="{v}"\n' for k, v in _env().items()))
    out = tmp_path / "users.acl"
    clean = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ACL_DIR / "render_acl.py"), "--env-file",
                        str(env_file), "-o", str(out)], env=clean, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == render_acl.render_acl(TEMPLATE, _env())
    assert out.stat().st_mode & 0o077 == 0
    env_file.write_text("REDIS_PASSWORD_ADMIN=REPLACE_ME\n")
    r = subprocess.run([sys.executable, str(ACL_DIR / "render_acl.py"), "--env-file",
                        str(env_file)], env=clean, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("render_acl: REDIS_PASSWORD_ADMIN:")
    assert "Traceback" not in r.stderr


def _sh(env: dict[str, str], out) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(ACL_DIR / "render-acl.sh"), str(ACL_DIR / "users.acl.template"), str(out)],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)


@NEEDS_SH
@pytest.mark.parametrize("prefix", [None, "team-a:", "{gmg}.x:"])
def test_shell_renderer_matches_the_python_one(tmp_path, prefix):
    env = _env() if prefix is None else _env(SLICESCHED_PREFIX=prefix)
    out = tmp_path / "users.acl"
    r = _sh(env, out)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == render_acl.render_acl(TEMPLATE, env)
    assert out.stat().st_mode & 0o077 == 0
    assert not list(tmp_path.glob("*.tmp.*"))


@NEEDS_SH
@pytest.mark.parametrize("value,problem", [("", "not set"), ("REPLACE_ME-worker", "placeholder"),
                                           ("pass word with space", "only letters"), ("short-pw", "shorter")])
def test_shell_renderer_refuses_bad_passwords(tmp_path, value, problem):
    env = _env(REDIS_PASSWORD_WORKER=value)
    if not value:
        del env["REDIS_PASSWORD_WORKER"]
    out = tmp_path / "users.acl"
    r = _sh(env, out)
    assert r.returncode == 2
    assert re.match(rf"render-acl: REDIS_PASSWORD_WORKER: .*{problem}", r.stderr), r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_env_example_is_refused_until_edited():
    env = render_acl.read_env_file(REPO / "deploy" / "compose" / "env.example")
    assert set(render_acl.password_variables(TEMPLATE)) <= set(env)
    with pytest.raises(render_acl.AclRenderError, match="placeholder"):
        render_acl.render_acl(TEMPLATE, env)
