"""benchmarks/sharded_save.py runs: 1 MiB, one repeat, a row per candidate, no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchkit import load_benchmark
from onerank import NEEDS_SHARDED


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_sharded_save_prints_a_row_per_candidate_and_cleans_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sharded_save = load_benchmark("sharded_save")
    out_json = tmp_path / "rows.json"
    args = ["--mib", "1", "--repeats", "1", "--timeout", "120", "--json", str(out_json)]
    assert sharded_save.main([*args, "--dir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    for candidate in sharded_save.CANDIDATES:
        assert f"| {candidate} |" in out, out
    rows = json.loads(out_json.read_text())
    assert [r["candidate"] for r in rows] == list(sharded_save.CANDIDATES)
    assert list((tmp_path / "w").iterdir()) == []  # every save removed after its run


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_sharded_resume_prints_a_row_per_candidate_and_cleans_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sharded_save = load_benchmark("sharded_save")
    args = ["--mib", "1", "--repeats", "1", "--timeout", "120", "--resume"]
    assert sharded_save.main([*args, "--dir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    for candidate in sharded_save.RESUME_CANDIDATES:
        assert f"| {candidate} |" in out, out
    assert list((tmp_path / "w").iterdir()) == []  # the checkpoint read back is removed


def _phases(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/sharded_phases.py, 1 MiB, one repeat, writing under ``tmp_path``; it must
    succeed."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_phases.py"
    tiny = ["--mib", "1", "--repeats", "1", "--timeout", "120"]
    run = subprocess.run(
        [sys.executable, str(script), *tiny, *args, "--dir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_sharded_phases_names_each_phase_under_the_call_it_is_part_of(tmp_path: Path) -> None:
    """benchmarks/sharded_phases.py, tiny: the benchmark's rows for the candidates chosen, then
    each rank's clocks, every phase under its call (rank 0's writer finishes DCP's save)."""
    chosen = "dcp save,dcp async_save,Checkpointer.save sync,Checkpointer.save async"
    run = _phases(tmp_path, "--candidates", chosen)
    rows = [line.split(" | ")[0].strip("| ") for line in run.stdout.splitlines() if "| 0." in line]
    assert rows == chosen.split(","), run.stdout
    rank0, rank1 = run.stdout.split("\nrank0: ")[1].split("\nrank1: ")
    for phase in ("shardwrite.write_shards", "Writer.write_data", "Ranks.lead"):
        assert f"  Checkpointer.save[sync] / {phase}\n" in rank0 + "\n", rank0
        assert f"  Checkpointer.save[sync] / {phase}\n" in rank1 + "\n", rank1
    assert "  Checkpointer.save[sync] / Writer.finish\n" in rank0
    assert "Writer.finish" not in rank1  # DCP finishes its save on rank 0 only
    assert "  Checkpointer.save[async] / shardstage.stage_sharded\n" in rank0
    assert "  Checkpointer.wait[async] / PendingShardedWrite.written\n" in rank0
    assert list((tmp_path / "w").iterdir()) == []


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_sharded_phases_clocks_a_resume_phase_by_phase(tmp_path: Path) -> None:
    """benchmarks/sharded_phases.py --resume, tiny: the resume rows, then each rank's clocks:
    the choice's checked read, the apply and the copy, DCP's own load beside them."""
    run = _phases(tmp_path, "--resume")
    for candidate in ("dcp load", "pitstop read_sharded", "Checkpointer.resume"):
        assert f"| {candidate} |" in run.stdout, run.stdout
    rank0, rank1 = run.stdout.split("\nrank0: ")[1].split("\nrank1: ")
    for clocks in (rank0, rank1):
        for phase in ("rawread.check_read", "Checked.copy", "engine._apply_checked"):
            assert f"  Checkpointer.resume[sync] / {phase}\n" in clocks + "\n", clocks
        assert "  state_dict_loader.load / FileSystemReader.read_data\n" in clocks + "\n"
    assert "  thread pitstop-manifest / ResumeRead.verify\n" in rank0 + "\n"  # rank 0 checks it
    assert list((tmp_path / "w").iterdir()) == []
