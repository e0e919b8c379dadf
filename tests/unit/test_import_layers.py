"""The import layers, read from the source: every ``import``/``from … import`` (module level, inside functions and
under ``TYPE_CHECKING``) and every ``importlib.import_module("…")`` with a literal name.

* ``shared/`` imports only ``shared/``: never ``services/``, ``bench/``, ``loadgen/`` or ``tests/``.
* ``loadgen/`` imports ``shared/`` and itself.
* A service package (``services/<name>/`` or ``services/<name>.py``) imports ``shared/`` and itself, never another
  service, ``loadgen/`` or ``bench/``. The one exception is ``services/cli``, the user-command shell: ``up`` starts
  the mesh (``services.launcher``) and checks the policy name as the scheduler will (``services.scheduler.policy``),
  ``inspect`` reads through ``services.inspect``, ``simulate`` reads workload files (``loadgen.workload``). It names
  the ``bench`` modules only as strings in ``BENCH`` and imports the chosen one when ``slicesched bench …`` runs.
* ``bench/`` (evaluation) sits on top: it may import ``shared/``, ``services/`` and ``loadgen/``.
* Nothing imports ``tests/``.
* ``shared``'s sub-packages import each other without a cycle (the simulator drives the policies; both take costs
  from ``shared.costmodel``), except the edges in :data:`ALLOWED_SHARED_EDGES`.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("shared", "services", "loadgen", "bench")
OURS = (*ROOTS, "tests")

# (importing sub-package, imported sub-package) -> why the edge may close a cycle
ALLOWED_SHARED_EDGES = {
    ("shared.model", "shared.config"): "shared/model/loader.py builds a tenant's model from shared.config.ModelSpec "
                                       "while shared/config.py checks model presets from shared.model.config; "
                                       "no module imports back, the loop exists only between the packages",
}


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file, relative to the root
    line: int
    source: str  # the importing module
    target: str  # the imported module (a submodule where ``from pkg import mod`` names one)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the project's packages in ``root``."""
    out = {}
    for top in ROOTS:
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root)
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = rel
    return out


def _absolute(module: str | None, level: int, source: str, is_package: bool) -> str:
    if not level:
        return module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports(root: Path) -> list[Import]:
    """Every import of every module under ``root``'s packages."""
    mods = modules(root)
    out = []
    for source, rel in mods.items():
        tree = ast.parse((root / rel).read_text(), filename=str(rel))
        is_package = rel.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, source, is_package)
                # ``from pkg import mod`` imports the submodule ``pkg.mod``
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and ast.unparse(node.func) in ("importlib.import_module", "import_module")):
                targets = [node.args[0].value]
            else:
                continue
            out += [Import(rel, node.lineno, source, t) for t in dict.fromkeys(targets)]
    return out


@functools.cache
def repo_imports() -> list[Import]:
    return imports(REPO)


def layer(module: str) -> str:
    """``shared``, ``loadgen``, ``bench``, ``tests``, ``services`` (the namespace itself) or ``services.<name>``."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    return parts[0]


def layer_problem(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (None when it may, or when ``target`` is not the project's)."""
    src, dst = layer(source), layer(target)
    if dst.split(".")[0] not in OURS or src == dst:
        return None
    if dst == "tests":
        return "nothing outside tests/ imports tests/"
    if src == "shared":
        return "shared/ imports only shared/"
    if src == "loadgen":
        return None if dst == "shared" else "loadgen/ imports only shared/ and loadgen/"
    if src == "bench":
        return None
    if src == "services.cli":  # the user-command shell
        return None if dst != "bench" else "services/cli names bench modules only as strings (BENCH), loaded lazily"
    if src.startswith("services"):
        if dst == "shared":
            return None
        if dst.startswith("services"):
            return "a service package does not import another service package"
        return f"a service package does not import {dst}/"
    return None


def layer_violations(found: list[Import]) -> list[str]:
    return [f"{i.path}:{i.line}: {i.source} imports {i.target} ({why})" for i in found
            if (why := layer_problem(i.source, i.target))]


def shared_cycles(root: Path, found: list[Import], allowed: dict = ALLOWED_SHARED_EDGES) -> list[str]:
    """Imports between ``shared``'s sub-packages (and top-level modules) that close a cycle."""
    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    mods = modules(root)
    edges: dict[tuple[str, str], list[Import]] = {}
    for i in found:
        if layer(i.source) == "shared" and layer(i.target) == "shared":
            target = i.target
            while target and target not in mods:  # ``from shared.x import name``: the module that defines it
                target = target.rpartition(".")[0]
            a, b = node(i.source), node(target or i.target)
            if a != b and (a, b) not in allowed:
                edges.setdefault((a, b), []).append(i)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return [f"{i.path}:{i.line}: {i.source} imports {i.target}, closing a cycle {a} -> {b} -> ... -> {a}"
            for (a, b), found in sorted(edges.items()) if reaches(b, a) for i in found]


# ---------------------------------------------------------------- the repository


def test_the_layers_hold():
    found = repo_imports()
    assert len(found) > 500 and any(i.target.startswith("services.") for i in found)  # the parser sees imports
    problems = layer_violations(found)
    assert not problems, "import layer violations:\n" + "\n".join(problems)


def test_shared_sub_packages_have_no_cycle():
    problems = shared_cycles(REPO, repo_imports())
    assert not problems, "import cycles inside shared/:\n" + "\n".join(problems)


def test_the_allowed_cycle_edges_still_exist():
    """An allowance that is no longer needed goes (so the list never hides a new edge under an old excuse)."""
    edges = {(".".join(i.source.split(".")[:2]), ".".join(i.target.split(".")[:2])) for i in repo_imports()}
    for edge in ALLOWED_SHARED_EDGES:
        assert edge in edges, f"{edge} no longer imported: remove it from ALLOWED_SHARED_EDGES"


def test_services_cli_holds_only_user_commands():
    from services.cli.main import BENCH, COMMANDS

    present = {p.stem for p in (REPO / "services" / "cli").glob("*.py")} - {"__init__", "main"}
    commands = {module.rpartition(".")[2] for module, _ in COMMANDS.values()}
    assert present == commands, f"services/cli holds {sorted(present - commands)} beyond the user commands"
    for name, (module, _) in BENCH.items():
        assert module.startswith("bench."), f"bench {name}: {module} is not in the bench package"
        assert importlib.util.find_spec(module) is not None, f"bench {name}: no module {module}"


# ---------------------------------------------------------------- the checker itself fails on a violation


def _tree(root: Path, files: dict[str, str]) -> Path:
    for top in ROOTS:
        (root / top).mkdir(parents=True, exist_ok=True)
        (root / top / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("rel, text, names", [
    ("shared/util.py", "def f():\n    from services.gateway.core import X\n", "services.gateway.core"),
    ("shared/sim/x.py", "from bench import bench_compare\n", "bench.bench_compare"),
    ("shared/y.py", "import loadgen.cli\n", "loadgen.cli"),
    ("services/simulator/synthetic.py", "from services.gmg.core import GMGCore\n", "services.gmg.core"),
    ("services/worker/a.py", "from ..gateway import core\n", "services.gateway.core"),
    ("services/gateway/b.py", "import importlib\nimportlib.import_module('loadgen.replay')\n", "loadgen.replay"),
    ("services/cli/main.py", "from bench.bench_whatif import run\n", "bench.bench_whatif"),
    ("loadgen/z.py", "from services.launcher import Launcher\n", "services.launcher"),
    ("bench/w.py", "from tests.support import mesh\n", "tests.support"),
])
def test_a_violating_import_is_reported_with_file_and_module(tmp_path, rel, text, names):
    root = _tree(tmp_path, {rel: text, "services/gateway/core.py": "", "services/gmg/core.py": "",
                            "services/launcher.py": "", "bench/bench_compare.py": "", "loadgen/cli.py": ""})
    problems = layer_violations(imports(root))
    assert len(problems) == 1 and problems[0].startswith(f"{rel}:") and names in problems[0], problems


def test_allowed_imports_are_not_reported(tmp_path):
    root = _tree(tmp_path, {
        "services/cli/up.py": "from services.launcher import Launcher\nfrom loadgen.workload import load\n",
        "services/launcher.py": "from shared.config import X\n",
        "bench/bench_x.py": "from services.gmg.core import GMGCore\nfrom loadgen import replay\n",
        "loadgen/replay.py": "from shared.workload import Workload\n",
        "services/gmg/core.py": "from .service import S\nfrom services.gmg import keys\n",
    })
    assert layer_violations(imports(root)) == []


def test_a_cycle_between_shared_packages_is_reported(tmp_path):
    root = _tree(tmp_path, {
        "shared/sim/simulator.py": "from shared.policies.base import Policy\n",
        "shared/policies/base.py": "",
        "shared/policies/slice.py": "def f():\n    from shared.sim.offload import part\n",
        "shared/sim/offload.py": "",
    })
    problems = shared_cycles(root, imports(root), allowed={})
    assert any(p.startswith("shared/policies/slice.py:2:") and "shared.sim.offload" in p for p in problems), problems
    (root / "shared/policies/slice.py").write_text("from shared.costmodel.offload import part\n")
    (root / "shared/costmodel").mkdir()
    (root / "shared/costmodel/offload.py").write_text("")
    assert shared_cycles(root, imports(root), allowed={}) == []
