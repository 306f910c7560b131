"""What the command line says when a user gets something wrong: the problem, and the way out.

One test per message, each running ``pitstop.cli.main`` in this process on real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pitstop.cli import main

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "configs" / "smoke.yaml"


def pitstop(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    """``pitstop ARGS``: (exit status, stdout and stderr together, on one line each message)."""
    code = main([os.fspath(a) for a in args])
    out, err = capsys.readouterr()
    return code, out + err


def _train(capsys: pytest.CaptureFixture[str], output: Path, *more: str) -> tuple[int, str]:
    return pitstop(
        capsys, "train", "--config", SMOKE, "--output-dir", output, "--max-steps", "2", *more
    )


def test_train_into_a_file_says_a_directory_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    code, said = _train(capsys, file, "--quiet")
    assert code == 2, said
    assert f"{file} is a file" in said
    assert "run needs a directory" in said
    assert "--output-dir" in said
    assert "File exists" not in said
    assert file.read_text() == "mine\n"  # untouched


def test_import_of_a_file_that_is_no_checkpoint_says_what_import_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, said = pitstop(capsys, "import", SMOKE, tmp_path / "run")
    assert code == 1, said
    assert f"{SMOKE} is not a file torch.save wrote" in said
    assert "neither a zip archive nor a pickle stream" in said
    assert "Lightning .ckpt" in said
    assert "Accelerate" in said
    assert "unpickling" not in said
    assert "(torch: )" not in said
    assert not (tmp_path / "run").exists()


def test_a_fresh_run_over_checkpoints_names_them_once_and_both_ways_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(capsys, tmp_path / "x", "--quiet")[0] == 0
    code, said = _train(capsys, tmp_path / "x", "--quiet")
    assert code == 2, said
    error = " ".join(line for line in said.splitlines() if line)
    assert f"{tmp_path / 'x' / 'checkpoints'} already holds 1 checkpoint(s)" in error
    assert "step_000000000002.pitstop" in error
    assert "another run" not in error
    assert error.count("replace them") == 2  # what saving would do; what --overwrite does
    assert "pass --resume" in error
    assert "pass --overwrite" in error


def test_ls_of_one_checkpoint_points_to_inspect_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(capsys, tmp_path / "x", "--quiet")[0] == 0
    checkpoint = tmp_path / "x" / "checkpoints" / "step_000000000002.pitstop"
    for path in (checkpoint, checkpoint.parent / "last"):
        code, said = pitstop(capsys, "ls", path)
        assert code == 1, said
        assert f"{path} is one checkpoint, not a directory" in said
        assert f"pitstop inspect {path}" in said
        assert f"pitstop verify {path}" in said
        assert f"(such as {checkpoint.parent})" in said


def test_broken_yaml_names_the_file_and_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("run:\n  output_dir: [runs/x\n", encoding="utf-8")
    code, said = pitstop(capsys, "train", "--config", broken)
    assert code == 2, said
    assert f'in "{broken}", line 2' in said
    assert "<unicode string>" not in said


def test_the_built_in_smoke_run_is_found_by_name_anywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    code, said = pitstop(capsys, "train", "--config", "smoke", "--max-steps", "2", "--quiet")
    assert code == 0, said
    assert (tmp_path / "runs" / "smoke" / "checkpoints" / "last").exists()
    code, said = pitstop(capsys, "train", "--config", "smok")
    assert code == 2, said
    assert "smok: cannot read the configuration" in said
    assert "built-in configurations, by name: smoke" in said


def test_the_built_in_smoke_run_is_the_checkouts_configs_smoke_yaml() -> None:
    from pitstop.train.config import builtin_config

    assert builtin_config("smoke").read_bytes() == SMOKE.read_bytes()
    assert yaml.safe_load(SMOKE.read_text())["run"]["output_dir"] == "runs/smoke"


@pytest.mark.parametrize("command", ["ls", "prune"])
def test_help_names_the_directory_the_demo_writes(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "runs/demo/resumed/checkpoints" in said
    assert "runs/demo/checkpoints" not in said


def test_export_with_an_unknown_dtype_lists_the_names_a_command_line_can_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(capsys, tmp_path / "x", "--quiet")[0] == 0
    out = tmp_path / "model.pt"
    code, said = pitstop(capsys, "export", tmp_path / "x" / "checkpoints", out, "--dtype", "int8")
    assert code == 2, said
    assert "dtype 'int8' is not a floating-point dtype" in said
    assert "use bf16, fp16, fp32 or fp64" in said
    assert "torch.dtype" not in said
    assert not out.exists()
