"""No pickle anywhere in the project's code: no pickle-family imports, no pickling multiprocessing channels, no
``torch.load`` without ``weights_only=True``, no ``numpy.load(allow_pickle=True)``.

The scan walks the syntax tree of every Python file under shared/, services/, loadgen/ and deploy/, so prose that
says "no pickle" in a docstring does not count, while an import or a call does, however it is spelled.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROOTS = ("shared", "services", "loadgen", "deploy")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "copyreg", "marshal"}
# multiprocessing objects that move Python objects by pickling them
PICKLING_MP = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Pool", "Manager", "ProcessPoolExecutor"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _kw_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def scan_source(source: str, where: str = "<string>") -> list[str]:
    """Problems in one module's source, as ``where:line: what``."""
    tree = ast.parse(source, filename=where)
    out: list[str] = []
    mp_aliases = {"multiprocessing", "mp", "torch.multiprocessing"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    out.append(f"{where}:{node.lineno}: imports {a.name}")
                if a.name in ("multiprocessing", "torch.multiprocessing") and a.asname:
                    mp_aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in PICKLE_MODULES:
                out.append(f"{where}:{node.lineno}: imports from {mod}")
            for a in node.names:
                if a.name in PICKLE_MODULES:
                    out.append(f"{where}:{node.lineno}: imports {a.name} from {mod}")
                if mod in ("multiprocessing", "torch.multiprocessing", "concurrent.futures") and a.name in PICKLING_MP:
                    out.append(f"{where}:{node.lineno}: imports {mod}.{a.name} (pickles what it carries)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, last = name.rpartition(".")
            if last == "load" and head in ("torch", "th") and not _kw_true(node, "weights_only"):
                out.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
            if last == "save" and head in ("torch", "th"):
                out.append(f"{where}:{node.lineno}: torch.save writes a pickle (use safetensors)")
            if last in ("load", "loads") and head in ("np", "numpy") and _kw_true(node, "allow_pickle"):
                out.append(f"{where}:{node.lineno}: numpy load with allow_pickle=True")
            if last == "read_pickle" or last == "to_pickle":
                out.append(f"{where}:{node.lineno}: {name}")
            if last in PICKLING_MP and (head in mp_aliases or head.endswith("futures")):
                out.append(f"{where}:{node.lineno}: {name} (pickles what it carries)")
        elif isinstance(node, ast.FunctionDef) and node.name in ("__reduce__", "__reduce_ex__", "__getstate__"):
            out.append(f"{where}:{node.lineno}: defines {node.name} (pickle protocol)")
    return out


def project_files() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_scan_covers_the_code():
    files = project_files()
    assert len(files) > 50, "the scan should see the project's modules"
    assert any(p.parts[-2:] == ("gateway", "service.py") for p in files)


@pytest.mark.parametrize("source", [
    # written in pieces so that a plain grep of the source for pickle use does not flag the fixtures themselves
    "import " "pickle\n", "import cloudpickle as cp\n", "from pickle import loads\n", "import dill\n",
    "import torch\ntorch." "load('w.pt')\n", "import torch\ntorch." "load('w.pt', weights_only=False)\n",
    "import torch\ntorch.save(x, 'w.pt')\n", "import numpy as np\nnp.load('a.npy', allow_pickle=True)\n",
    "import multiprocessing as m\nq = m.Queue()\n", "from multiprocessing import Pipe\n",
    "from concurrent.futures import ProcessPoolExecutor\n", "import pandas as pd\npd.read_pickle('x')\n",
    "class A:\n    def __reduce__(self):\n        return (A, ())\n",
])
def test_scanner_flags_pickle_uses(source):
    assert scan_source(source), source


@pytest.mark.parametrize("source", [
    '"""Frames on the wire: no pickle."""\n', "# never pickle\nx = 1\n",
    "import torch\ntorch.load('w.pt', weights_only=True)\n", "import numpy as np\nnp.load('a.npy')\n",
    "from torch.multiprocessing.reductions import rebuild_cuda_tensor\n", "import asyncio\nq = asyncio.Queue()\n",
])
def test_scanner_accepts_safe_code(source):
    assert scan_source(source) == []


def test_no_pickle_in_shared_services_loadgen_deploy():
    problems = [p for f in project_files() for p in scan_source(f.read_text(), str(f.relative_to(REPO)))]
    assert problems == []
