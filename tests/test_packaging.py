"""pitstop as a user installs it: the wheel, in a fresh venv, run from outside the checkout.

The wheel is built with the project's own backend (hatchling, in this venv: no isolation, no
network) and installed without its dependencies into a new venv that sees this venv's
site-packages through a ``.pth`` line: torch is reused, never downloaded again, while
``pitstop`` itself comes only from the wheel (the editable install's path hook is not read
there). Every command runs in a temporary directory, away from ``configs/`` and ``src/``.
"""

from __future__ import annotations

import email.parser
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_readme import python_blocks

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
BUILD = ("wheel", "--no-deps", "--no-build-isolation", "-q")  # hatchling, from this venv
INSTALL = ("install", "-q", "--no-deps", "--no-index")  # the wheel alone; torch is reused
TRAIN = ("train", "--config", "smoke", "--output-dir", "runs/smoke", "--max-steps", "4", "--quiet")


def _run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert result.returncode == 0, f"{argv} -> {result.returncode}\n{result.stdout}{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", *BUILD, "-w", str(out), str(ROOT)], cwd=out)
    (built,) = out.glob("pitstop-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, with this venv's packages (torch) visible beneath it."""
    root = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    python = root / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=root,
    ).stdout.strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "outer.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", str(python), *INSTALL, str(wheel)], cwd=root)
    return root


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_wheel_holds_the_smoke_config_the_license_and_numpy(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(info).decode())
        shipped = archive.read("pitstop/train/configs/smoke.yaml")
    assert shipped == (ROOT / "configs" / "smoke.yaml").read_bytes()  # one file, two places
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    required = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert any(r.startswith("numpy") for r in required), required  # exact resume needs it
    assert metadata["License-Expression"] == "MIT"
    urls = metadata.get_all("Project-URL") or []
    assert {u.split(",")[0] for u in urls} >= {"Homepage", "Documentation", "Changelog", "Issues"}


def test_the_installed_wheel_trains_lists_and_runs_the_readme_loop_outside_the_checkout(
    venv: Path, tmp_path: Path
) -> None:
    env = _env(venv)
    python = str(venv / "bin" / "python")
    where = _run([python, "-c", "import pitstop; print(pitstop.__file__)"], tmp_path, env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy

    train = _run(
        [str(venv / "bin" / "pitstop"), *TRAIN],
        tmp_path,
        env,
    )
    assert "finished at step 4" in train.stdout, train.stdout
    assert "NumPy" not in train.stderr, train.stderr
    listing = _run([str(venv / "bin" / "pitstop"), "ls", "runs/smoke/checkpoints"], tmp_path, env)
    assert "last, best, final" in listing.stdout, listing.stdout

    (tmp_path / "loop.py").write_text(python_blocks()[0], encoding="utf-8")
    loop = _run([python, "loop.py"], tmp_path, env)
    assert loop.stdout.splitlines() == ["[20, 25]"]


@pytest.mark.slow
def test_the_installed_wheel_runs_the_demo_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    demo = _run([str(venv / "bin" / "pitstop"), "demo"], tmp_path, _env(venv))
    assert "bitwise equal" in demo.stdout, demo.stdout
    assert "NumPy" not in demo.stderr, demo.stderr
