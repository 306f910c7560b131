"""Smoke test of benchmarks/multinode.py at a tiny size: it runs, ends its workers and prints
both rows and the per-phase table (the figures themselves are for docs/performance.md, never
asserted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from benchkit import load_benchmark

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs gloo",
)


def test_multinode_prints_save_and_catch_up_rows_and_ends_its_workers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    multinode = load_benchmark("multinode")
    out_json = tmp_path / "rows.json"
    args = ["--size-mib", "1", "--tensors", "2", "--repeats", "1", "--timeout", "240"]
    assert multinode.main([*args, "--dir", str(tmp_path), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for label in ("save (sync), blocking", "save, `async_save=True`: blocking", "resume"):
        assert re.search(rf"^\| {re.escape(label)} \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", out, re.M), (
            out
        )
    rows = json.loads(out_json.read_text())
    assert [(r["call"], r["case"]) for r in rows if r["call"] != "phase"] == [
        ("save", "1 node"),
        ("save", "2 nodes"),
        ("own share", "1 node"),
        ("own share", "2 nodes"),
        ("async save", "1 node"),
        ("async save", "2 nodes"),
        ("async own share", "1 node"),
        ("async own share", "2 nodes"),
        ("resume", "local"),
        ("resume", "catch-up"),
        ("resume", "catch-up, group"),
        ("floor", "write"),
        ("floor", "gloo"),
        ("parallel floor", "one"),
        ("parallel floor", "both"),
    ]
    phases = {(r["case"], r["phase"], r["rank"]) for r in rows if r["call"] == "phase"}
    assert ("2 nodes", "write a copy", 1) in phases, phases  # node 1's writer writes its copy
    assert ("catch-up", "transfer: send", 0) in phases, phases
    assert ("catch-up", "transfer: receive + check + write", 1) in phases, phases
    assert ("1 node", "collectives (waits included)", 1) in phases, phases
    assert all(r["median_s"] >= 0 and r["bytes"] > 1 << 20 for r in rows), rows
    assert "floors of the catch-up" in out, out
    assert "gloo alone" in out, out
    assert "over pitstop's gloo group (streams off)" in out, out
    cell = r" [\d.]+ / [\d.]+ \|"
    assert re.search(rf"^\| transfer: send \|{cell}{cell}{cell}$", out, re.M), out
    assert list(tmp_path.iterdir()) == [out_json]  # the nodes' files are removed
