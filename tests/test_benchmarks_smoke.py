"""The benchmarks run: tiny sizes, one repeat, no timing assertions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchkit import load_benchmark
from onerank import NEEDS_SHARDED


def test_plan_scale_prints_a_row_per_plan_and_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan_scale = load_benchmark("plan_scale")
    out_json = tmp_path / "plan_scale.json"

    status = plan_scale.main(["--sizes", "10,100", "--repeats", "1", "--json", str(out_json)])

    assert status == 0
    out = capsys.readouterr().out
    plans = (
        "plan_retention",
        "resume_order(last)",
        "resume_order(best)",
        "resume_order(final)",
        "reconcile_pointers",
        "plan_save",
    )
    for plan in plans:
        for size in (10, 100):
            row = re.compile(rf"^\| {re.escape(plan)} \| {size} \|", re.MULTILINE)
            assert row.search(out), f"no row for {plan} at n={size} in:\n{out}"
    # The smallest size is the reference of the normalised ratio.
    assert re.search(r"^\| plan_save \| 10 \|.*\| 1\.00 \|$", out, re.MULTILINE)
    assert out_json.read_text().count('"plan"') == len(plans) * 2


def test_plan_scale_rejects_sizes_below_two(capsys: pytest.CaptureFixture[str]) -> None:
    plan_scale = load_benchmark("plan_scale")
    with pytest.raises(SystemExit):
        plan_scale.main(["--sizes", "1"])
    assert "--sizes" in capsys.readouterr().err


def test_save_load_prints_every_operation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    save_load = load_benchmark("save_load")
    args = ["--size-mib", "1", "--tensors", "4", "--repeats", "1", "--dir", str(tmp_path)]
    assert save_load.main([*args, "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    for operation in ("write+fsync (limit)", "pitstop save (durable)", "readinto (limit)"):
        assert f"| {operation} |" in out, out
    assert "pitstop.load" in out


def test_checksum_speed_prints_every_candidate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    checksum_speed = load_benchmark("checksum_speed")
    out_json = tmp_path / "rates.json"
    assert checksum_speed.main(["--mib", "1", "--repeats", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for name in (
        "zlib.crc32 (one call)",
        "pitstop crc32_update (",
        "pitstop crc32 (",
        "write, then crc32 on the pool",
        "fileformat verify",
    ):
        assert name in out, out
    assert '"write, then crc32 on the pool"' in out_json.read_text()


def test_write_strategies_prints_every_strategy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_strategies = load_benchmark("write_strategies")
    args = ["--mib", "20", "--repeats", "1", "--threads", "1,2", "--dir", str(tmp_path)]
    assert write_strategies.main(args) == 0
    out = capsys.readouterr().out
    for name in (
        "write+fsync",
        "crc before each write",
        "crc beside each write",
        "crc during fsync, 1 thread(s)",
        "crc during fsync, 2 thread(s)",
        "pwrite, 2 threads",
    ):
        assert f"| {name} |" in out, out
    assert "pwrite, 1 threads" not in out
    assert list(tmp_path.iterdir()) == []  # every file removed


def test_write_strategies_rejects_zero_threads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_benchmark("write_strategies").main(["--threads", "0"])
    assert "--threads" in capsys.readouterr().err


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_multirank_save_prints_every_candidate_and_ends_its_workers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    multirank_save = load_benchmark("multirank_save")
    out_json = tmp_path / "rows.json"
    args = ["--size-mib", "1", "--tensors", "4", "--repeats", "1", "--timeout", "120"]
    assert multirank_save.main([*args, "--dir", str(tmp_path / "w"), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for system, mode, ranks in multirank_save.CANDIDATES:
        assert re.search(rf"^\| {re.escape(f'{system} {mode}')} \| {ranks} \|", out, re.M), out
    rows = json.loads(out_json.read_text())
    assert len(rows) == len(multirank_save.CANDIDATES)
    assert all(row["durable_s"] >= row["worst_blocking_s"] > 0 for row in rows), rows
    # pitstop's rank 0 wrote whole files; DCP wrote one file per rank.
    written = tmp_path / "w"
    assert list((written / "pitstop_2-rank_sync").glob("step_*.pitstop"))
    assert sorted(p.name for p in (written / "dcp_2-rank_save").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


@NEEDS_SHARDED  # it measures DCP's own staging and writes too
def test_resume_speed_prints_every_candidate_and_phase(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    resume_speed = load_benchmark("resume_speed")
    out_json = tmp_path / "rows.json"
    args = ["--sizes-mib", "1", "--tensors", "2", "--repeats", "1", "--warmups", "0"]
    args += ["--phases", "--dir", str(tmp_path), "--json", str(out_json)]
    placed = resume_speed.READ_PLACED.format(4)  # one of --read-strategies' passes
    named = ["torch.load + load_state_dict", "dcp.load", "pitstop resume", placed]
    named.append(resume_speed.NEW_FLOOR)
    args += ["--candidates", ",".join(named)]
    assert resume_speed.main(args) == 0
    out = capsys.readouterr().out
    names = ("readinto (floor)", *named)
    for name in names:
        assert f"| {name} |" in out, out
    assert "| commit: copy into the model |" in out, out
    rows = json.loads(out_json.read_text())
    assert {row["candidate"] for row in rows} >= set(names)
    assert all(row["x_floor"] > 0 and row["runs"] == 1 for row in rows)
    assert all(row["x_new_floor"] > 0 for row in rows)  # every row's ratio to the second floor
    assert "| x new-mem floor (max) |" in out, out
    assert list(tmp_path.iterdir()) == [out_json]  # every file removed


def test_cli_startup_times_ls_and_help_and_says_whether_ls_imports_torch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cli_startup = load_benchmark("cli_startup")
    assert cli_startup.main(["--repeats", "1", "--json", str(tmp_path / "cli.json")]) == 0
    out = capsys.readouterr().out
    assert "pitstop --help   median" in out
    assert "pitstop ls DIR   median" in out
    record = json.loads((tmp_path / "cli.json").read_text())
    assert set(record["medians_s"]) == {"--help", "ls DIR"}
    assert record["ls_imports_torch"] is False  # reading manifests needs no torch


def test_step_cost_prints_every_candidate_and_ends_its_workers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step_cost = load_benchmark("step_cost")
    out_json = tmp_path / "step_cost.json"
    args = ["--ranks", "2", "--steps", "20", "--batch", "10", "--warmup", "2"]
    assert step_cost.main([*args, "--timeout", "120", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for candidate in step_cost.CANDIDATES:
        assert re.search(rf"^\| 2 \| {re.escape(candidate)} \|", out, re.MULTILINE), out
    rows = json.loads(out_json.read_text())
    assert [r["candidate"] for r in rows] == list(step_cost.CANDIDATES)
    assert rows[0]["x_floor"] == 1.0


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's call
def test_data_state_prints_both_candidates_per_worker_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("torchdata")
    data_state = load_benchmark("data_state")
    out_json = tmp_path / "data_state.json"
    args = ["--workers", "1,2", "--steps", "6", "--batch", "3", "--warmup", "1"]
    args += ["--batch-size", "2", "--sample", "4", "--work-ms", "0"]
    assert data_state.main([*args, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for workers in (1, 2):
        for candidate in data_state.CANDIDATES:
            row = rf"^\| {workers} \| {re.escape(candidate)} \|"
            assert re.search(row, out, re.MULTILINE), out
    rows = json.loads(out_json.read_text())
    assert [r["candidate"] for r in rows] == list(data_state.CANDIDATES) * 2
    bare, wrapped = rows[0], rows[1]
    assert bare["added_us"] == 0
    assert wrapped["state_bytes"] > bare["state_bytes"]  # the workers' random state is in it


def test_manifest_bounds_prints_a_row_per_reader(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bounds = load_benchmark("manifest_bounds")
    args = ["--lists", "1000", "--values", "50", "--skip-legal", "--dir", str(tmp_path)]
    assert bounds.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 5  # the header, then two readers on two manifests and one verify
    assert all(row.endswith("| ok |") for row in rows[1:]), rows
