"""Dockerfile and .dockerignore, checked as text (no image is built here: there is no container engine)."""
from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import shlex
import sys
import tomllib

from deploy_support import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
IGNORE = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
          if line.strip() and not line.startswith("#")]


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pat.removeprefix("**/")) or path.split("/")[0] == pat for pat in IGNORE)


def test_base_image_and_pinned_cpu_torch():
    ins = _instructions()
    args = dict(re.match(r"(\w+)=(\S+)", rest).groups() for op, rest in ins if op == "ARG" and "=" in rest)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert ("FROM", "${PYTHON_IMAGE}") in ins
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [rest for op, rest in ins if op == "RUN"]
    torch_i = next(i for i, r in enumerate(runs) if "torch==" in r)
    pkg_i = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_i < pkg_i, "torch must be installed (pinned, from the chosen index) before the package"
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_i] and '"torch==${TORCH_VERSION}"' in runs[torch_i]


def test_runs_as_a_non_root_user_with_container_defaults():
    ins = _instructions()
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    last_user = max(i for i, (op, _) in enumerate(ins) if op == "USER")
    assert all(op != "RUN" for op, _ in ins[last_user:]), "nothing may run as root after USER"
    env = " ".join(rest for op, rest in ins if op == "ENV")
    for setting in ("SLICESCHED_GATEWAY_HOST=0.0.0.0", "SLICESCHED_METRICS_PORT=9100", "SLICESCHED_LOG_FORMAT=json",
                    "SLICESCHED_CLUSTER=/app/configs/cluster.yaml", "SLICESCHED_TENANTS=/app/configs/tenants.yaml"):
        assert setting in env
    cmd = shlex.split(next(rest for op, rest in ins if op == "CMD").strip("[]").replace(",", " "))
    assert cmd[:2] == ["python", "-m"] and cmd[2].startswith("services.")


def test_no_secrets_in_the_image():
    for op, rest in _instructions():
        if op in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_KEY|REDIS_URL)", rest, re.I), rest
    for pattern in (".env", ".git", ".venv", "**/*.acl"):
        assert pattern in IGNORE, pattern


def test_every_copied_path_exists_and_is_not_ignored():
    copies = [rest.split() for op, rest in _instructions() if op == "COPY"]
    assert copies
    sources = [s for c in copies for s in c[:-1] if not s.startswith("--")]
    for needed in ("pyproject.toml", "shared", "services", "configs"):
        assert needed in sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"
    assert _ignored("tests") and _ignored(".env") and _ignored("deploy/redis/users.acl")


def _third_party_imports() -> set[str]:
    """Top-level third-party modules imported by the packages, except optional ones (inside a try whose
    handler catches ImportError)."""
    local = {"services", "shared", "loadgen", "bench"}
    found = set()
    for root in local:
        for path in (REPO / root).rglob("*.py"):
            tree = ast.parse(path.read_text())
            optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(
                "ImportError" in ast.unparse(h.type or ast.Name("BaseException")) for h in t.handlers)
                for stmt in t.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                if id(node) in optional:
                    continue
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                found |= {n.split(".")[0] for n in names}
    return found - local - set(sys.stdlib_module_names)


def test_the_image_installs_every_module_the_services_import():
    """`pip install .` installs only pyproject's dependencies: each third-party import must come from one."""
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "redis", "aiohttp"} <= imports
    for module in sorted(imports):
        owners = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        assert owners & declared, f"services import {module!r} (from {sorted(owners) or '?'}), not in dependencies"
