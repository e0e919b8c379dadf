#!/usr/bin/env python3
"""Render ``users.acl.template`` into a Redis ACL file that holds only SHA-256 password hashes.

Placeholders in the template:

* ``${PREFIX}`` — the key prefix (``SLICESCHED_PREFIX``, default ``slicesched:``);
* ``${NAME:sha256}`` — the SHA-256 hex digest of the environment variable ``NAME`` (a password).

Lines starting with ``#`` and blank lines are dropped. The container images run the POSIX-shell twin of this
script (``render-acl.sh``); a unit test checks both give the same file.

Usage (stdlib only, no project install needed)::

    python3 deploy/redis/render_acl.py [--env-file .env] [-o users.acl] [--template users.acl.template]

Exit code 2 with a one-line message naming the variable when a password is missing, a placeholder, or has
characters that do not survive a ``redis://user:password@host`` URL.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "users.acl.template"
DEFAULT_PREFIX = "slicesched:"
PLACEHOLDER_MARK = "REPLACE_ME"
MIN_PASSWORD_LEN = 12
_PASSWORD_RE = re.compile(r"^[A-Za-z0-9._~-]+$")  # RFC 3986 unreserved: safe inside a URL's userinfo
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._{}-]+:$")
_HASH_RE = re.compile(r"\$\{([A-Z][A-Z0-9_]*):sha256\}")


class AclRenderError(ValueError):
    """A missing or unusable input; the message names the variable and what is wrong."""


def password_variables(template: str) -> list[str]:
    """Names of the environment variables whose hashes the template needs, in order of appearance."""
    seen: list[str] = []
    for name in _HASH_RE.findall(template):
        if name not in seen:
            seen.append(name)
    return seen


def check_password(name: str, value: str | None) -> str:
    """Return ``value`` if it is usable as a Redis password inside a URL; raise :class:`AclRenderError`."""
    if not value:
        raise AclRenderError(f"{name}: not set (see docs/deployment.md, 'Secrets to set')")
    if value.startswith(PLACEHOLDER_MARK):
        raise AclRenderError(f"{name}: still the placeholder {value!r}; set a real password")
    if not _PASSWORD_RE.match(value):
        raise AclRenderError(f"{name}: only letters, digits and '-._~' are allowed (the password goes into a URL)")
    if len(value) < MIN_PASSWORD_LEN:
        raise AclRenderError(f"{name}: shorter than {MIN_PASSWORD_LEN} characters")
    return value


def render_acl(template: str, env: dict[str, str], prefix: str | None = None) -> str:
    """Render the template with passwords from ``env``; the result ends with a newline."""
    prefix = prefix if prefix is not None else (env.get("SLICESCHED_PREFIX") or DEFAULT_PREFIX)
    if not _PREFIX_RE.match(prefix):
        raise AclRenderError(f"SLICESCHED_PREFIX: {prefix!r} must be letters, digits, '._-{{}}' and end with ':'")
    hashes = {n: hashlib.sha256(check_password(n, env.get(n)).encode()).hexdigest()
              for n in password_variables(template)}
    out = []
    for line in template.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        line = _HASH_RE.sub(lambda m: hashes[m.group(1)], line).replace("${PREFIX}", prefix)
        if "${" in line:
            raise AclRenderError(f"template: unknown placeholder in line {line!r}")
        out.append(line)
    return "\n".join(out) + "\n"


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a compose-style ``.env`` file: ``KEY=value`` lines, ``#`` comments, optional quotes."""
    env: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise AclRenderError(f"{path}: line {n}: expected KEY=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", type=Path, default=TEMPLATE)
    ap.add_argument("--env-file", type=Path, help="read passwords from this file (the environment wins)")
    ap.add_argument("-o", "--output", type=Path, help="write here (mode 0600) instead of stdout")
    args = ap.parse_args(argv)
    try:
        env = read_env_file(args.env_file) if args.env_file else {}
        env.update(os.environ)
        text = render_acl(args.template.read_text(), env)
    except (AclRenderError, OSError) as e:
        print(f"render_acl: {e}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
