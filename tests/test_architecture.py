"""The doors between pitstop's packages.

The import rules are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``),
run by ``make lint`` (``lint-imports``): the layers (CLI, trainer, shell, core, errors), the
shell's rooms, the pure core (no torch, no I/O, no clock, no threads, no signals, no shell),
the file format's and the store's doors, and no cycles. Here: that they are kept; that each
contract, run on a skeleton of the package with one import added, is broken by it (so a
contract that stopped matching anything would fail here); and what import-linter cannot see —
the core calls nothing impure, imports nothing relatively or by name at run time, and the
public package imports neither torch nor the shell when it is imported.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pitstop"
CORE = SRC / "core"
BANNED_CALLS = {"open", "__import__", "exec", "eval"}


def _violations(source: str, filename: str) -> list[str]:
    """What the core's ``source`` does that import-linter cannot see: relative imports, calls
    that reach files or run code (``open``, ``exec``, ...), imports by name at run time."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(f"{filename}:{node.lineno} relative import (use absolute pitstop.core.*)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in BANNED_CALLS:
                found.append(f"{filename}:{node.lineno} calls {node.func.id}()")
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            found.append(f"{filename}:{node.lineno} uses importlib.import_module")
    return found


def test_core_sources_do_nothing_impure() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    violations = [v for f in files for v in _violations(f.read_text(), f.name)]
    assert violations == []


@pytest.mark.parametrize(
    "source",
    [
        "from . import records",
        "f = open('x')",
        "exec('x = 1')",
        "importlib.import_module('pitstop.shell')",
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


# --- the import-linter contracts -----------------------------------------------------------


def test_the_import_contracts_are_kept() -> None:
    # What `make lint` runs; here too, so that a test run alone sees a broken door.
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    result = subprocess.run(
        [sys.executable, "-c", lint, "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


PROBE = "pitstop_probe"  # the skeleton's name: the real pitstop is imported already


def _contract_broken(tmp_path: Path, contract: str, module: str, source: str) -> bool:
    """Whether the contract ``contract`` of pyproject.toml is broken by ``source`` in
    ``module`` (a path under src/pitstop) of a skeleton of the package: every module of
    src/pitstop, empty but that one."""
    from importlinter import configuration
    from importlinter.application import use_cases

    configuration.configure()

    for path in SRC.rglob("*.py"):
        copy = tmp_path / PROBE / path.relative_to(SRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.touch()
    (tmp_path / PROBE / module).write_text(source.replace("pitstop", PROBE) + "\n")
    pyproject = ROOT.joinpath("pyproject.toml").read_text()
    section = re.search(
        r"^\[tool\.importlinter\]$.*?(?=^\[tool\.(?!importlinter)|\Z)", pyproject, re.M | re.S
    )
    assert section is not None
    renamed = section[0].replace('"pitstop', f'"{PROBE}').replace("-> pitstop", f"-> {PROBE}")
    (tmp_path / "contracts.toml").write_text(renamed)
    sys.path.insert(0, str(tmp_path))
    try:
        kept = use_cases.lint_imports(
            str(tmp_path / "contracts.toml"),
            limit_to_contracts=(contract,),
            cache_dir=None,
            is_debug_mode=True,  # a contract that cannot run raises, never reads as broken
            no_logo=True,
        )
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == PROBE or m.startswith(f"{PROBE}.")]:
            del sys.modules[name]
    return not kept


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "import os.path",
        "from pathlib import Path",
        "from time import monotonic",
        "import threading as t",
        "from signal import SIGTERM",
        "from pitstop.shell.store import storage",
        "from pitstop import shell",
    ],
)
def test_the_core_contract_catches_each_kind_of_import(tmp_path: Path, source: str) -> None:
    assert _contract_broken(tmp_path, "core-pure", "core/records.py", source)


@pytest.mark.parametrize(
    "source",
    [
        "import pitstop.cli",
        "import pitstop.cli.listing as listing",
        "from pitstop.cli.listing import main",
        "from pitstop import cli",
        "from .. import cli",
        "from ..cli.listing import main",
        "def f():\n    from pitstop.cli import main",
    ],
)
def test_the_trainer_contract_catches_each_kind_of_import(tmp_path: Path, source: str) -> None:
    assert _contract_broken(tmp_path, "trainer-no-cli", "train/report.py", source)


@pytest.mark.parametrize(
    "source", ["from pitstop.formatting import format_size", "from . import records"]
)
def test_the_trainer_contract_lets_other_imports_through(tmp_path: Path, source: str) -> None:
    # `from . import records` in pitstop.train.report is pitstop.train.records.
    assert not _contract_broken(tmp_path, "trainer-no-cli", "train/report.py", source)


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
    # A converter is built with every hook in pitstop.core.settings.config._build; no module (the
    # trainer's config included) adds hooks to one afterwards, at import time or later.
    found = [
        r
        for f in sorted(SRC.rglob("*.py"))
        for r in _hook_registrations(f.read_text(), str(f.relative_to(SRC)))
    ]
    assert found, "the factory registers its hooks: the checker must see them"
    assert {r.split(":")[0] for r in found} == {"core/settings/config.py"}
    assert {r.rpartition(" in ")[2] for r in found} == {"_build"}


def test_the_hook_checker_sees_registration_anywhere() -> None:
    source = (
        "converter.register_structure_hook(int, f)\n"
        "def setup():\n    conv.register_structure_hook_func(p, f)\n"
    )
    assert _hook_registrations(source, "x.py") == ["x.py:1 in <module>", "x.py:3 in setup"]
