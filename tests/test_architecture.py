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


# --- one way only: the CLI may use the trainer, the trainer never the CLI ----------------------

SRC = CORE.parent
TRAIN = SRC / "train"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``source`` (the module ``module``) imports, resolved
    to absolute names: ``from x import y`` counts as ``x`` and ``x.y``; relative imports are
    resolved against the module's package; ``importlib.import_module("...")`` with a literal
    name counts too."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in {"__import__", "import_module"}
                )
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _imports_the_cli(source: str, module: str, *, is_package: bool = False) -> list[str]:
    return [
        f"{module}:{line} imports {name}"
        for line, name in _imported(source, module, is_package=is_package)
        if name == "pitstop.cli" or name.startswith("pitstop.cli.")
    ]


def test_the_trainer_imports_nothing_from_the_cli() -> None:
    files = sorted(TRAIN.rglob("*.py"))
    assert len(files) >= 5
    violations = [
        v
        for f in files
        for v in _imports_the_cli(
            f.read_text(), _module_name(f), is_package=f.name == "__init__.py"
        )
    ]
    assert violations == []


@pytest.mark.parametrize(
    "source",
    [
        "import pitstop.cli",
        "import pitstop.cli.listing as listing",
        "from pitstop.cli.formatting import format_size",
        "from pitstop import cli",
        "from .. import cli",
        "from ..cli.formatting import format_size",
        "def f():\n    from pitstop.cli import main",
        "importlib.import_module('pitstop.cli.demo')",
    ],
)
def test_the_cli_checker_catches_each_kind_of_import(source: str) -> None:
    assert _imports_the_cli(source, "pitstop.train.report") != []


@pytest.mark.parametrize(
    "source",
    ["from pitstop.formatting import format_size", "import pitstop.client", "from . import cli"],
)
def test_the_cli_checker_lets_other_imports_through(source: str) -> None:
    # `from . import cli` in pitstop.train.report is pitstop.train.cli, not pitstop.cli.
    assert _imports_the_cli(source, "pitstop.train.report") == []


# --- one converter definition: hooks are registered in one place only --------------------------

HOOK_REGISTRATIONS = ("register_structure_hook", "register_unstructure_hook")


def _hook_registrations(source: str, filename: str) -> list[str]:
    """Calls that register a cattrs hook, as ``file:line in function``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef) else function
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr.startswith(HOOK_REGISTRATIONS)
            ):
                found.append(f"{filename}:{child.lineno} in {function or '<module>'}")
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def test_only_the_converter_factory_registers_hooks() -> None:
    # A converter is built with every hook in pitstop.core.config._build; no module (the
    # trainer's config included) adds hooks to one afterwards, at import time or later.
    found = [
        r
        for f in sorted(SRC.rglob("*.py"))
        for r in _hook_registrations(f.read_text(), str(f.relative_to(SRC)))
    ]
    assert found, "the factory registers its hooks: the checker must see them"
    assert {r.split(":")[0] for r in found} == {"core/config.py"}
    assert {r.rpartition(" in ")[2] for r in found} == {"_build"}


def test_the_hook_checker_sees_registration_anywhere() -> None:
    source = (
        "converter.register_structure_hook(int, f)\n"
        "def setup():\n    conv.register_structure_hook_func(p, f)\n"
    )
    assert _hook_registrations(source, "x.py") == ["x.py:1 in <module>", "x.py:3 in setup"]
