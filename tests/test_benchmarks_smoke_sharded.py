"""benchmarks/sharded_save.py runs: 1 MiB, one repeat, a row per candidate, no timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchkit import load_benchmark


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
