"""tests/zygote.py: a forked rank behaves as ``python script`` would, or is not forked at all."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

import zygote

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfds and /proc: Linux")

CHILD = """\
import os, signal, sys
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "path0", sys.path[0])
print("main", __name__, "parent", os.getppid(), "group", os.getpgid(0) == os.getpid())
mode = sys.argv[1]
if mode == "raise":
    raise ValueError("boom")
if mode == "exit":
    sys.exit(3)
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "atexit":
    import atexit, threading
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: print("thread joined", flush=True)).start()
if mode == "wait":
    sys.stdout.flush()
    signal.pause()
"""


def env() -> dict[str, str]:
    return {**os.environ, "ZYGOTE_TEST": "yes", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


@pytest.mark.parametrize(
    ("mode", "code", "shows"),
    [
        ("plain", 0, ""),
        ("raise", 1, "ValueError: boom"),
        ("exit", 3, ""),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
        ("atexit", 0, "thread joined\natexit ran"),
    ],
)
def test_a_forked_child_exits_as_the_interpreter_would(
    script: Path, tmp_path: Path, mode: str, code: int, shows: str
) -> None:
    process = zygote.spawn([str(script), mode], env(), tmp_path)
    assert process is not None, "the zygote did not fork it"
    assert process.stdout is not None
    with process.stdout:
        output = process.stdout.read()
    assert process.wait(timeout=120) == code, output
    assert f"argv ['{mode}'] env yes path0 {tmp_path}" in output
    assert "main __main__" in output
    assert f"parent {os.getpid()} " not in output, "forked by the zygote, not started by us"
    assert "group True" in output, "a session of its own: killed as one group"
    assert shows in output


def test_a_signalled_child_reports_the_signal(script: Path, tmp_path: Path) -> None:
    process = zygote.spawn([str(script), "wait"], env(), tmp_path)
    assert process is not None
    assert process.stdout is not None
    try:
        with process.stdout:
            assert process.stdout.readline().startswith("argv")
            assert process.stdout.readline().startswith("main")
            os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=120) == -signal.SIGTERM
    finally:  # ended whatever happened above (it waits for a signal)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=120)


def test_a_module_runs_as_python_dash_m(tmp_path: Path) -> None:
    done = zygote.run([sys.executable, "-m", "pitstop", "--help"], env=env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pitstop"), done.stdout


def test_a_child_whose_interpreter_would_start_differently_is_not_forked(
    script: Path, tmp_path: Path
) -> None:
    assert zygote.spawn([str(script)], {**env(), "PYTHONHASHSEED": "7"}, tmp_path) is None
    done = zygote.run(
        [sys.executable, str(script), "plain"],
        env={**env(), "PYTHONHASHSEED": "7"},
        timeout=120,
    )
    assert done.returncode == 0
    assert f"parent {os.getpid()} " in done.stdout, "started as a plain process"
