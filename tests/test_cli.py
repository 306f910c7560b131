"""The command line, run as a real process: exit codes and what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dirtools import save
from pitstop.core.records import Best, Policy
from pitstop.core.saving.schedule import Call
from pitstop.shell.store.directory import CheckpointDirectory

SMOKE = Path(__file__).resolve().parent.parent / "configs" / "smoke.yaml"


def pitstop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pitstop", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def run(tmp_path: Path) -> Path:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=2, best=Best("loss"))) as d:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.4)]:
            save(d, step, call=Call.MANUAL, metrics={"loss": loss})
        save(d, 4, call=Call.FINISH)
    return tmp_path


def test_ls_shows_every_checkpoint_and_why_it_is_kept(run: Path) -> None:
    result = pitstop("ls", str(run))
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["2", "3", "4"]
    assert "pointer:best" in rows[0]
    assert "recent" in rows[1]
    assert "newest" in rows[2]
    assert "last, final" in rows[2]


def test_ls_check_names_the_corrupt_file_and_the_resume_point(run: Path) -> None:
    newest = run / "step_000000000004.pitstop"
    with open(newest, "r+b") as f:
        f.seek(70)
        f.write(b"\x00\x01")
    result = pitstop("ls", "--check", str(run))
    assert result.returncode == 1
    assert "CORRUPT" in result.stdout
    assert "would use step_000000000003.pitstop" in result.stdout.replace("\n", " ")
    assert "after skipping step_000000000004.pitstop" in result.stdout.replace("\n", " ")


def test_verify_exit_codes(run: Path) -> None:
    ok = pitstop("verify", str(run / "best"))
    assert ok.returncode == 0
    assert "OK" in ok.stdout
    target = run / "step_000000000002.pitstop"
    with open(target, "r+b") as f:
        f.seek(64)
        f.write(b"\xde\xad")
    bad = pitstop("verify", str(target))
    assert bad.returncode == 1
    assert "CORRUPT" in bad.stdout
    assert "step_000000000002.pitstop" in bad.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert pitstop("ls").returncode == 2
    assert pitstop("frobnicate").returncode == 2
    missing = pitstop("ls", str(tmp_path / "missing"))
    assert missing.returncode == 1
    assert "missing does not exist" in missing.stdout


# --- in-process helpers ---------------------------------------------------------------------------


def main_(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``pitstop ARGS`` in this process: (exit status, stdout, stderr)."""
    from pitstop.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# --- ls: a metrics column and --json ------------------------------------------------------------


def test_ls_shows_the_metrics_of_each_checkpoint(run: Path) -> None:
    result = pitstop("ls", str(run))
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("┃"))
    assert "metrics" in header
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert "loss=0.2" in rows[0]
    assert "loss=0.4" in rows[1]
    assert "│ -" in rows[2]  # the final save carried no metrics


def test_ls_json_has_one_object_per_checkpoint(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    code, out, _ = main_(capsys, "ls", "--json", str(run))
    assert code == 0
    rows = json.loads(out)
    assert [row["step"] for row in rows] == [2, 3, 4]
    first = rows[0]
    assert set(first) >= {
        "step",
        "epoch",
        "samples",
        "tokens",
        "reason",
        "metrics",
        "size",
        "seq",
        "pointers",
        "kept_because",
    }
    assert first["metrics"] == {"loss": 0.2}
    assert first["pointers"] == ["best"]
    assert first["kept_because"] == ["pointer:best"]
    assert rows[2]["pointers"] == ["last", "final"]
    assert first["size"] == (run / first["name"]).stat().st_size
    assert "check" not in first


def test_ls_json_check_marks_corrupt_files_and_the_resume_point(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    newest = run / "step_000000000004.pitstop"
    with open(newest, "r+b") as f:
        f.seek(70)
        f.write(b"\x00\x01")
    (run / "step_000000000009.pitstop").write_bytes(b"not a checkpoint")
    code, out, err = main_(capsys, "ls", "--json", "--check", str(run))
    assert code == 1
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["step_000000000004.pitstop"]["check"] == "corrupt"
    assert "checksum" in rows["step_000000000004.pitstop"]["problem"]
    assert rows["step_000000000003.pitstop"]["check"] == "ok"
    assert rows["step_000000000003.pitstop"]["resume_from_last"] is True
    assert rows["step_000000000002.pitstop"]["resume_from_last"] is False
    assert rows["step_000000000009.pitstop"]["check"] == "unreadable"
    assert "warning: skipping" in err  # warnings go to stderr, JSON alone to stdout


# --- inspect --------------------------------------------------------------------------------------


def _checkpointer_run(tmp_path: Path) -> Path:
    """A real Checkpointer save: config, metrics, an optimizer and an EMA."""
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from pitstop import Checkpointer, Progress

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    directory = tmp_path / "ck"
    config = {"model": {"width": 2}, "lr": 0.1}
    with Checkpointer(
        directory,
        model=model,
        ema=AveragedModel(model),
        state={"optimizer": optimizer},
        config=config,
    ) as ckpt:
        ckpt.save(Progress(step=7, epoch=1, samples=28), metrics={"val_loss": 0.25})
    return directory


def test_inspect_shows_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _checkpointer_run(tmp_path)
    code, out, _ = main_(capsys, "inspect", str(directory))
    assert code == 0
    assert "step_000000000007.pitstop" in out
    assert "step 7, epoch 1" in out
    assert "28 samples" in out
    assert "manual" in out
    assert "val_loss=0.25" in out
    assert "torch " in out
    assert "python " in out
    assert "world size  1" in out
    assert "components  optimizer" in out
    assert "model.width: 2" in out
    assert "lr: 0.1" in out
    assert "weights.raw.weight" in out
    assert "float32" in out
    assert "[2, 3]" in out
    assert "weights.ema.weight" in out
    assert "state.optimizer" in out


def test_inspect_json_and_that_it_reads_no_tensor_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from pitstop.shell.format import fileformat

    directory = _checkpointer_run(tmp_path)
    path = directory / "step_000000000007.pitstop"
    manifest = fileformat.read_manifest(path)
    with open(path, "r+b") as f:  # damage every tensor byte: inspect must not notice
        for blob in manifest.blobs:
            f.seek(blob.offset)
            flipped = bytes(255 - b for b in f.read(blob.length))
            f.seek(blob.offset)
            f.write(flipped)
    code, out, _ = main_(capsys, "inspect", "--json", str(path))
    assert code == 0
    data = json.loads(out)
    assert data["progress"]["step"] == 7
    assert data["metrics"] == {"val_loss": 0.25}
    assert data["config"] == {"model": {"width": 2}, "lr": 0.1}
    assert data["world_size"] == 1
    assert set(data["versions"]) == {"pitstop", "torch", "python"}
    tensors = {t["name"]: t for t in data["tensors"]}
    assert tensors["weights.raw.weight"] == {
        "name": "weights.raw.weight",
        "dtype": "float32",
        "shape": [2, 3],
        "bytes": 24,
    }
    assert main_(capsys, "verify", str(path))[0] == 1  # the damage is real


_TORCH_AFTER = (
    "import sys, pitstop.cli\n"
    "code = pitstop.cli.main(sys.argv[1:])\n"
    "print(f'exit {code}; torch imported: {\"torch\" in sys.modules}', file=sys.stderr)\n"
)


def test_ls_inspect_and_verify_of_a_file_checkpoint_never_import_torch(tmp_path: Path) -> None:
    directory = _checkpointer_run(tmp_path)  # model, EMA, optimizer, config, metrics
    path = directory / "step_000000000007.pitstop"
    corrupt = tmp_path / "corrupt.pitstop"
    corrupt.write_bytes(path.read_bytes()[:-1] + b"\0")
    commands = [
        ("ls", str(directory)),
        ("ls", "--check", "--json", str(directory)),
        ("inspect", str(path)),
        ("inspect", "--json", str(directory)),
        ("verify", str(path)),
        ("verify", str(directory / "last")),
        ("verify", str(corrupt)),
    ]
    for args in commands:
        result = subprocess.run(
            [sys.executable, "-c", _TORCH_AFTER, *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        expected = 1 if str(corrupt) in args else 0
        last = result.stderr.splitlines()[-1] if result.stderr else result.stderr
        assert last == f"exit {expected}; torch imported: False", (args, result.stderr)


# --- prune ----------------------------------------------------------------------------------------


def _many(tmp_path: Path) -> Path:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=None, best=Best("loss"))) as d:
        for step, loss in [(1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3), (5, 0.35)]:
            save(d, step, call=Call.MANUAL, metrics={"loss": loss})
    return tmp_path


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:17]) for p in directory.glob("step_*.pitstop"))


def test_prune_keeps_the_last_n_and_every_pointer_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _many(tmp_path)
    code, out, _ = main_(capsys, "prune", str(directory), "--keep-last", "2", "--dry-run")
    assert code == 0
    assert "would delete 2 of 5 checkpoints" in out
    assert _steps(directory) == [1, 2, 3, 4, 5]  # a dry run deletes nothing
    code, out, _ = main_(capsys, "prune", str(directory), "--keep-last", "2")
    assert code == 0
    assert "deleted 2 of 5 checkpoints" in out
    assert _steps(directory) == [2, 4, 5]  # 2 is best: a pointer target is never deleted
    assert "pointer:best" in out
    assert "recent" in out
    assert pitstop("verify", str(directory / "best")).returncode == 0


def test_prune_keeps_the_resume_point_when_newer_files_are_corrupt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _many(tmp_path)
    newest = directory / "step_000000000005.pitstop"
    with open(newest, "r+b") as f:
        f.seek(70)
        f.write(b"\xff\xfe")
    code, out, _ = main_(capsys, "prune", str(directory), "--keep-last", "1")
    assert code == 0
    assert _steps(directory) == [2, 4, 5]  # 4: what a resume would use
    assert "resume point" in out


def test_prune_takes_the_directory_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _many(tmp_path)
    with CheckpointDirectory(directory, policy=Policy()):  # a live writer holds it
        code, out, _ = main_(capsys, "prune", str(directory), "--keep-last", "1")
    assert code == 1
    assert len(_error_lines(out)) == 1
    assert _steps(directory) == [1, 2, 3, 4, 5]


def test_prune_refuses_a_keep_last_below_one(tmp_path: Path) -> None:
    result = pitstop("prune", str(tmp_path), "--keep-last", "0")
    assert result.returncode == 2
    assert "--keep-last" in result.stderr


# --- verify never falls back; export says when it does --------------------------------------------


def _truncate_newest(run: Path) -> Path:
    newest = run / "step_000000000004.pitstop"
    with open(newest, "r+b") as f:
        f.truncate(1000)
    return newest


@pytest.mark.parametrize("argument", ["", "last"])
def test_verify_of_a_truncated_last_is_corrupt(
    run: Path, argument: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the scan left the truncated file out and verify said OK for step 3."""
    newest = _truncate_newest(run)
    code, out, _ = main_(capsys, "verify", str(run / argument) if argument else str(run))
    assert code == 1
    assert out.startswith(f"CORRUPT {newest} (last points to it): ")
    assert "footer" in out


def test_verify_of_a_pointer_whose_file_is_gone_is_corrupt(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = run / "step_000000000004.pitstop"
    newest.unlink()
    code, out, _ = main_(capsys, "verify", str(run / "last"))
    assert code == 1
    assert out.strip() == f"CORRUPT {newest} (last points to it): the file does not exist"


@pytest.mark.parametrize("symlinks", [True, False])
@pytest.mark.parametrize(("argument", "step"), [("", 4), ("last", 4), ("best", 2)])
def test_inspect_of_a_pointer_whose_file_is_gone_is_one_error_line_naming_both(
    run: Path, argument: str, step: int, symlinks: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a raw FileNotFoundError: `error: DIR/last: No such file or directory (...)`."""
    gone = run / f"step_{step:012d}.pitstop"
    gone.unlink()
    pointer = argument or "last"
    if not symlinks:
        (run / pointer).unlink()  # latest.json still names it
    code, out, err = main_(capsys, "inspect", str(run / argument) if argument else str(run))
    assert code == 1
    said = f"{run / pointer} points to" if symlinks else f"{run / 'latest.json'} says {pointer} is"
    assert _error_lines(out + err) == [f"error: {said} {gone}, which does not exist"]
    assert "Traceback" not in out + err


def test_verify_says_what_it_checked(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = main_(capsys, "verify", str(run / "best"))
    assert code == 0
    assert out.startswith(f"OK {run / 'step_000000000002.pitstop'} (best points to it): ")
    (run / "best").unlink()
    (run / "latest.json").unlink()
    code, out, _ = main_(capsys, "verify", str(run))
    assert code == 0
    assert "(last points to it)" in out
    (run / "last").unlink()
    code, out, _ = main_(capsys, "verify", str(run))
    assert code == 0
    assert "the most recently published readable checkpoint; no last pointer on disk" in out


def test_export_says_when_it_fell_back_and_from_what(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = _truncate_newest(run)
    out_file = tmp_path / "w.pt"
    code, out, _ = main_(capsys, "export", str(run), str(out_file))
    assert code == 0
    assert f"fell back: {run / 'last'} names {newest.name}, which was not used" in out
    assert "used step_000000000003.pitstop" in out
    assert "raw weights of step_000000000003.pitstop" in out


def test_export_refuses_to_overwrite_without_force(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "w.pt"
    out_file.write_bytes(b"precious")
    code, _, err = main_(capsys, "export", str(run), str(out_file))
    assert code == 1
    assert _error_lines(err) == [f"error: {out_file} exists; pass --force to replace it"]
    assert out_file.read_bytes() == b"precious"
    code, _out, _ = main_(capsys, "export", str(run), str(out_file), "--force")
    assert code == 0
    assert out_file.read_bytes() != b"precious"


def test_export_onto_a_directory_is_one_error_line(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out"
    target.mkdir()
    for extra in ([], ["--force"]):
        code, _, err = main_(capsys, "export", str(run), str(target), *extra)
        assert code == 1
        assert len(_error_lines(err)) == 1
        assert f"{target} is a directory" in err
    assert list(target.iterdir()) == []


# --- permission errors: one error line naming the user's path -------------------------------------
# Tests run as root here, and root ignores file modes, so each failing os call is made to fail by
# monkeypatching it (the real chmod case runs only for a user that is not root).


def _deny(monkeypatch: pytest.MonkeyPatch, match: str, error: int = 13) -> None:
    """Make os.open fail with ``error`` (EACCES) for every path containing ``match``."""
    import errno
    import os

    real_open = os.open

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if match in os.fsdecode(path):
            raise OSError(error, os.strerror(error), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    assert error in errno.errorcode
    monkeypatch.setattr(os, "open", fake_open)


def test_export_into_a_read_only_directory(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "ro" / "w.pt"
    out_file.parent.mkdir()
    _deny(monkeypatch, str(out_file.parent / ".tmp-"))  # creating the temp file fails
    code, out, err = main_(capsys, "export", str(run), str(out_file))
    assert code == 1
    [line] = _error_lines(out + err)
    assert str(out_file) in line
    assert "Permission denied" in line
    assert ".tmp-" not in line


def test_verify_of_an_unreadable_file(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = run / "step_000000000003.pitstop"
    monkeypatch.setattr("builtins.open", _denying_open(str(target)))
    _deny(monkeypatch, str(target))
    code, out, err = main_(capsys, "verify", str(target))
    assert code == 1
    [line] = _error_lines(out + err)
    assert line == f"error: {target}: Permission denied"


def _denying_open(match: str) -> Any:
    import builtins
    import os

    real = builtins.open

    def fake(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and match in os.fspath(file):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real(file, *args, **kwargs)

    return fake


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_verify_of_an_unreadable_file_for_real(run: Path) -> None:
    target = run / "step_000000000003.pitstop"
    target.chmod(0)
    result = pitstop("verify", str(target))
    assert result.returncode == 1
    assert _error_lines(result.stdout + result.stderr) == [f"error: {target}: Permission denied"]


def test_train_into_an_unwritable_output_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    output = tmp_path / "locked" / "run"
    real_mkdir = Path.mkdir

    def fake_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if str(self).startswith(str(output.parent)):
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", fake_mkdir)
    code, out, err = main_(
        capsys, "train", "--config", str(SMOKE), "--output-dir", str(output), "--quiet"
    )
    assert code == 1
    [line] = _error_lines(out + err)
    assert str(output) in line
    assert "Permission denied" in line
    assert "Traceback" not in out + err


def test_resume_on_a_read_only_checkpoint_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    output = tmp_path / "run"
    code, _, _ = main_(
        capsys,
        "train",
        "--config",
        str(SMOKE),
        "--output-dir",
        str(output),
        "--max-steps",
        "2",
        "--quiet",
    )
    assert code == 0
    _deny(monkeypatch, str(output / "checkpoints"), error=30)  # EROFS: nothing can be opened
    code, out, err = main_(
        capsys,
        "train",
        "--config",
        str(SMOKE),
        "--output-dir",
        str(output),
        "--max-steps",
        "4",
        "--resume",
        "--quiet",
    )
    assert code == 1
    [line] = _error_lines(out + err)
    assert str(output / "checkpoints") in line
    assert "Read-only file system" in line
    assert "Traceback" not in out + err


def test_train_without_resume_over_another_run_is_one_error_line_and_overwrite_replaces(
    tmp_path: Path,
) -> None:
    args = ("train", "--config", str(SMOKE), "--output-dir", str(tmp_path), "--quiet")
    assert pitstop(*args, "--max-steps", "2").returncode == 0
    refused = pitstop(*args, "--max-steps", "1")
    assert refused.returncode == 2
    [line] = _error_lines(refused.stdout + refused.stderr)
    assert str(tmp_path / "checkpoints") in line
    assert "step_000000000002.pitstop" in line
    assert "--overwrite" in line
    replaced = pitstop(*args, "--max-steps", "1", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "starting fresh at step 0" in replaced.stdout
    assert os.readlink(tmp_path / "checkpoints" / "last") == "step_000000000001.pitstop"


def test_resume_from_a_missing_directory_starts_fresh_with_one_warning(
    tmp_path: Path,
) -> None:

    output = tmp_path / "typo"
    result = pitstop(
        "train",
        "--config",
        str(SMOKE),
        "--output-dir",
        str(output),
        "--max-steps",
        "1",
        "--resume",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert warnings == [
        f"WARNING pitstop.train: resume: {output / 'checkpoints'} does not exist; the run "
        f"starts fresh"
    ]
    assert "starting fresh at step 0" in result.stdout


# --- progress bars --------------------------------------------------------------------------------


def _big_checkpoint(tmp_path: Path) -> Path:
    import torch

    from pitstop.shell.format import fileformat

    path = tmp_path / "step_000000000001.pitstop"
    from pitstop.core.metadata import entry_meta
    from pitstop.core.records import CheckpointEntry, Progress

    entry = CheckpointEntry(progress=Progress(step=1), seq=1, reason="manual")
    with open(path, "wb") as f:
        fileformat.write(
            f,
            fileformat.prepare({"weights": {"raw": {"w": torch.zeros(1 << 20)}}}),
            entry_meta(entry),
        )
    return path


def _with_env(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "pitstop", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )


def test_verify_draws_a_bar_on_a_terminal_and_nothing_when_piped(tmp_path: Path) -> None:
    path = _big_checkpoint(tmp_path)
    piped = _with_env("verify", str(path), PITSTOP_PROGRESS_DELAY="0")
    assert piped.returncode == 0
    assert piped.stdout.startswith("OK ")  # no bar: stdout is a pipe
    assert "verifying" not in piped.stdout + piped.stderr
    terminal = _with_env(
        "verify", str(path), PITSTOP_PROGRESS_DELAY="0", FORCE_COLOR="1", TTY_COMPATIBLE="1"
    )
    assert terminal.returncode == 0
    assert f"verifying {path.name}" in terminal.stdout
    assert "MiB" in terminal.stdout  # bytes done / total


def test_short_work_draws_no_bar_even_on_a_terminal(tmp_path: Path) -> None:
    path = _big_checkpoint(tmp_path)
    terminal = _with_env("verify", str(path), FORCE_COLOR="1", TTY_COMPATIBLE="1")
    assert terminal.returncode == 0
    assert "verifying" not in terminal.stdout  # well under a second


def test_train_saves_get_a_bar_on_a_terminal(tmp_path: Path) -> None:

    result = _with_env(
        "train",
        "--config",
        str(SMOKE),
        "--output-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        PITSTOP_PROGRESS_DELAY="0",
        FORCE_COLOR="1",
        TTY_COMPATIBLE="1",
    )
    assert result.returncode == 0, result.stderr
    assert "writing a checkpoint" in result.stdout
    assert "KiB" in result.stdout
