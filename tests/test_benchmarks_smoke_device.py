"""benchmarks/device_check.sh, tiny, on this machine: a GPU machine is lent for minutes, so the
script it runs must not first fail on something a CPU finds (no timing assertions)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onerank import NEEDS_SHARDED

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
PARTS = ("cuda_tests", "save_latency", "resume_gpu", "sharded_save", "resume_host")


@NEEDS_SHARDED  # its sharded part saves through DCP
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="the sharded part needs gloo")
def test_every_part_runs_and_keeps_its_log(tmp_path: Path) -> None:
    results = tmp_path / "results"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),  # the runtime dependencies are installed here
        "TMPDIR": str(tmp_path),
        "RESUME_MIB": "1",
        "SHARDED_MIB": "1",
        "SHARDED_RANKS": "2",
        "BENCH_REPEATS": "1",
        "SIZES": "1",
        "REPEATS": "1",
        "SAVE_S": "60",
        "TESTS_S": "300",
        "RESUME_GPU_S": "120",
        "SHARDED_S": "180",
        "RESUME_HOST_S": "180",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "torch" in (results / "machine.txt").read_text()
    for part in PARTS:
        assert (results / f"{part}.txt").is_file(), out
        assert f"== {part}: exit " in out, out
    assert "== cuda_tests: exit 0" in out, out  # skipped or passed, never failed
    assert (
        "| 1 MiB + AdamW (3 MiB file) | pitstop resume |"
        in (results / "resume_host.txt").read_text()
    )
    assert "| Checkpointer.save sync |" in (results / "sharded_save.txt").read_text()
    if not torch.cuda.is_available():
        assert "torch with CUDA is needed" in (results / "save_latency.txt").read_text()
