"""The async-save benchmarks run: tiny sizes, one repeat, a row per candidate, no timings."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from benchkit import load_benchmark
from onerank import NEEDS_SHARDED

EVERYWHERE = [
    ("floor", "copy_ (preallocated)"),
    ("floor", "write+fsync"),
    ("torch", "save (no fsync)"),
    ("torch", "save + fsync"),
    ("pitstop", "sync"),
    ("pitstop", "async"),
    ("pitstop", "overlap"),
]
DCP = [
    ("dcp", "save"),
    ("dcp", "async_save (default)"),
    ("dcp", "async_save (cached stager)"),
    ("dcp", "async_save (cached stager, staging thread)"),
]


def _row(system: str, mode: str) -> re.Pattern[str]:
    return re.compile(rf"^\| {re.escape(system)} \| {re.escape(mode)} \|", re.MULTILINE)


@pytest.fixture(scope="module")
def save_latency(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, object]]]:
    """One tiny run of save_latency.py: its output and its JSON rows."""
    module = load_benchmark("save_latency")
    tmp = tmp_path_factory.mktemp("save_latency")
    out_json = tmp / "rows.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = module.main(
            [
                "--sizes-mib",
                "1",
                "--tensors",
                "4",
                "--repeats",
                "1",
                "--dir",
                str(tmp / "work"),
                "--json",
                str(out_json),
                "--plot",
                str(tmp / "plot.png"),
            ]
        )
    assert status == 0
    return out.getvalue(), json.loads(out_json.read_text())


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_save_latency_has_a_row_per_candidate(
    save_latency: tuple[str, list[dict[str, object]]],
) -> None:
    out, rows = save_latency
    for system, mode in EVERYWHERE:
        assert _row(system, mode).search(out), f"no row for {system} {mode} in:\n{out}"
        assert {"system": system, "mode": mode}.items() <= next(
            r for r in rows if r["system"] == system and r["mode"] == mode
        ).items()
    assert "| async blocking <= 1.5x copy floor |" in out  # the targets table
    if "safetensors is not installed" not in out:
        assert _row("safetensors", "save_file + fsync").search(out)
    if "matplotlib is not installed" not in out:
        assert "plot written to" in out


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_save_latency_dcp_rows(save_latency: tuple[str, list[dict[str, object]]]) -> None:
    out, rows = save_latency
    if "DCP: skipped" in out:
        pytest.skip(out.split("DCP: skipped", 1)[1].splitlines()[0])
    for system, mode in DCP:
        assert _row(system, mode).search(out), f"no row for {system} {mode} in:\n{out}"
    assert {(r["system"], r["mode"]) for r in rows} >= set(DCP)


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_save_latency_json_rows(save_latency: tuple[str, list[dict[str, object]]]) -> None:
    _, rows = save_latency
    keys = {"system", "mode", "size_bytes", "blocking_s", "durable_s", "peak_rss_extra_bytes"}
    assert rows
    for row in rows:
        assert keys <= row.keys()
        assert row["size_bytes"] == 1 << 20
    # Only the copy floor and torch.save without fsync are never durable.
    never_durable = {(r["system"], r["mode"]) for r in rows if r["durable_s"] is None}
    assert never_durable == {("floor", "copy_ (preallocated)"), ("torch", "save (no fsync)")}


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_save_latency_replays_its_json_rows(
    save_latency: tuple[str, list[dict[str, object]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, rows = save_latency
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(rows))
    assert load_benchmark("save_latency").main(["--from-json", str(saved)]) == 0
    replayed = capsys.readouterr().out
    table = re.compile(r"^\| pitstop \| async \|.*$", re.MULTILINE)
    first, again = table.search(out), table.search(replayed)
    assert first is not None
    assert again is not None
    assert again.group(0) == first.group(0)  # the same figures, measured once


def test_save_latency_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    module = load_benchmark("save_latency")
    with pytest.raises(SystemExit):
        module.main(["--sizes-mib", "0"])
    assert "--sizes-mib" in capsys.readouterr().err


def test_train_overhead_has_a_row_per_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    module = load_benchmark("train_overhead")
    out_json = tmp_path / "rows.json"
    status = module.main(
        [
            "--hidden",
            "32",
            "--layers",
            "2",
            "--batch",
            "4",
            "--steps",
            "12",
            "--every",
            "4",
            "--repeats",
            "1",
            "--dir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    modes = ("none", "none (control)", "sync", "async", "overlap")
    for mode in modes:
        row = re.compile(rf"^\| {re.escape(mode)} \|", re.MULTILINE)
        assert row.search(out), f"no row for {mode} in:\n{out}"
    rows = {row["mode"]: row for row in json.loads(out_json.read_text())}
    assert set(rows) == set(modes)
    # Saves at steps 4 and 8 (not at the last step, 12).
    assert [rows[m]["saves"] for m in modes] == [0, 0, 2, 2, 2]
    # A save's CPU time is measured per checkpointing mode (with the loop idle), and only there.
    assert [rows[m]["cpu_per_save_s"] is None for m in modes] == [True, True, False, False, False]
    assert all(rows[m]["cpu_per_save_s"] > 0 for m in ("sync", "async", "overlap"))
    assert "| async overhead <= 3% (control:" in out
