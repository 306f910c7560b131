"""The core stays pure: no torch, no I/O, no clock, no threads, no signals, no shell."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "src" / "pitstop" / "core"
BANNED = {"torch", "os", "pathlib", "time", "threading", "signal", "pitstop.shell"}
# Also kept out, for the same reason: they reach the file system, processes or the clock.
ALSO_BANNED = {"shutil", "subprocess", "tempfile", "io", "socket", "datetime", "random", "mmap"}
BANNED_CALLS = {"open", "__import__", "exec", "eval"}


def _banned(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BANNED | ALSO_BANNED)


def _violations(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [
                f"{filename}:{node.lineno} import {a.name}" for a in node.names if _banned(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(_banned(n) for n in names):
                found.append(f"{filename}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(f"{filename}:{node.lineno} relative import (use absolute pitstop.core.*)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in BANNED_CALLS:
                found.append(f"{filename}:{node.lineno} calls {node.func.id}()")
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            found.append(f"{filename}:{node.lineno} uses importlib.import_module")
    return found


def test_core_sources_import_nothing_impure() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    violations = [v for f in files for v in _violations(f.read_text(), f.name)]
    assert violations == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "import os.path",
        "from pathlib import Path",
        "from time import monotonic",
        "import threading as t",
        "from signal import SIGTERM",
        "from pitstop.shell import storage",
        "from pitstop import shell",
        "from . import records",
        "f = open('x')",
    ],
)
def test_the_checker_catches_each_kind_of_violation(source: str) -> None:
    assert _violations(source, "probe.py") != []


def test_importing_the_core_imports_neither_torch_nor_the_shell() -> None:
    probe = (
        "import sys, pitstop, pitstop.core;"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'pitstop.shell')));"
        "print(bad)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
