"""`pitstop train` and `pitstop export` as real processes: the seed's tables and examples."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from trainkit import SMOKE, cli, last, smoke_config, steps_on_disk, train, tree

from pitstop.shell.format import fileformat


def summary(stdout: str) -> tuple[int, int, int, int]:
    """(restored step, target step, new updates, final step) as `pitstop train` printed them."""
    restored = re.search(
        r"^(?:resumed from \S+ at step|starting fresh at step) (\d+)", stdout, re.M
    )
    target = re.search(r"^target: step (\d+) \((\d+) new updates?\)", stdout, re.M)
    final = re.search(r"^finished at step (\d+) \(epoch \d+, (\d+) new updates?\)", stdout, re.M)
    assert restored, stdout
    assert target, stdout
    assert final, stdout
    assert target[2] == final[2]
    return int(restored[1]), int(target[1]), int(final[2]), int(final[1])


# --- the two-step resume demonstration --------------------------------------------------------


def test_two_step_resume_demonstration(resume_demo: tuple[Path, list[str]]) -> None:
    work, (first, second) = resume_demo
    checkpoints = work / "runs" / "resume-demo" / "checkpoints"
    assert (checkpoints / "step_000000000002.pitstop").is_file()
    assert (checkpoints / "step_000000000004.pitstop").is_file()
    assert summary(first) == (0, 2, 2, 2)
    assert summary(second) == (2, 4, 2, 4)
    assert "resumed from runs/resume-demo/checkpoints/step_000000000002.pitstop" in second
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 4
    # Each publication is reported: path, size and how long it held training up.
    saved = re.compile(r"^saved \S+step_000000000004\.pitstop \(\w+, [\d.]+ KiB, blocked training")
    assert any(saved.match(line) for line in second.splitlines()), second


def test_checkpoints_store_the_limits_which_may_change(
    resume_demo: tuple[Path, list[str]],
) -> None:
    """--max-steps changes run.max_steps and scheduler.max_steps between the two commands, and
    the resume still passes the compatibility check: the stored config holds them, and they are
    among the keys the trainer declares may change (config_may_change), only reported."""
    work, _ = resume_demo
    stored = fileformat.read_manifest(
        work / "runs" / "resume-demo" / "checkpoints" / "step_000000000004.pitstop"
    ).meta["config"]
    assert stored["run"]["max_steps"] == 4
    assert stored["run"]["output_dir"] == "runs/resume-demo"
    assert stored["scheduler"] == {"warmup_steps": 2, "max_steps": 4}
    assert set(stored) == {"run", "model", "data", "optimizer", "scheduler", "ema"}


# --- absolute targets -------------------------------------------------------------------------


def test_absolute_targets(
    tmp_path: Path, straight: Path, resume_demo: tuple[Path, list[str]]
) -> None:
    """The seed's table: target = max(restored, requested); the printed final step is absolute."""
    run = tmp_path / "run"
    shutil.copytree(resume_demo[0] / "runs" / "resume-demo", run, symlinks=True)  # at step 4

    def resume(requested: int) -> tuple[int, int, int, int]:
        return summary(train(SMOKE, run, "--max-steps", str(requested), "--resume").stdout)

    rows = [summary((straight / "stdout.txt").read_text())]  # fresh: restored 0
    rows.append(resume(10))  # restored 4
    rows.append(resume(10))  # restored 10
    assert resume(12) == (10, 12, 2, 12)
    on_disk = steps_on_disk(run / "checkpoints")
    rows.append(resume(10))  # restored 12
    table = [(restored, target, new) for restored, target, new, _ in rows]
    assert table == [(0, 10, 10), (4, 10, 6), (10, 10, 0), (12, 12, 0)]
    assert [final for *_, final in rows] == [10, 10, 10, 12]
    assert steps_on_disk(run / "checkpoints") == on_disk  # no updates, no new file
    assert last(run / "checkpoints").step == 12


# --- the final-step gap -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("final", "save_final", "latest"),
    [
        (3, False, 2),
        pytest.param(4, False, 4, marks=pytest.mark.slow),
        pytest.param(5, False, 4, marks=pytest.mark.slow),
        (3, True, 3),
    ],
    ids=["3-gap", "4", "5-gap", "3-save_final"],
)
def test_final_step_gap(tmp_path: Path, final: int, save_final: bool, latest: int) -> None:
    """Interval 2: with save_final false the seed's table holds; with it, nothing is lost."""
    config = smoke_config(
        tmp_path / "gap.yaml",
        checkpoint={"every_steps": 2, "save_final": save_final, "best": None},
    )
    out = train(config, tmp_path / "run", "--max-steps", str(final)).stdout
    assert summary(out)[3] == final
    checkpoints = tmp_path / "run" / "checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == latest
    assert last(checkpoints).step == latest
    assert max(steps_on_disk(checkpoints)) == latest


# --- configuration errors ---------------------------------------------------------------------


def _without_lr(path: Path) -> Path:
    data = yaml.safe_load(SMOKE.read_text())
    del data["optimizer"]["lr"]
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (
            lambda p: smoke_config(p, run={"max_stepz": 3}),
            [],
            "run.max_stepz: unknown key (did you mean max_steps?)",
        ),
        (
            lambda p: smoke_config(p, checkpoint={"keep_lst": 2}),
            [],
            "checkpoint.keep_lst: unknown key (did you mean keep_last?)",
        ),
        (
            lambda p: smoke_config(p, optimizer={"lr": "fast"}),
            [],
            "optimizer.lr: expected a number, got str 'fast'",
        ),
        (_without_lr, [], "optimizer.lr: required key missing"),
        (
            lambda p: SMOKE,
            ["--max-steps", "-1"],
            "run.max_steps: must be an int >= 0 or null, got -1",
        ),
    ],
    ids=["unknown-key", "unknown-checkpoint-key", "wrong-type", "missing-required", "flag"],
)
def test_config_errors_exit_2_and_name_the_key_path(
    tmp_path: Path, make: object, extra: list[str], message: str
) -> None:
    config = make(tmp_path / "bad.yaml")  # type: ignore[operator]
    done = cli("train", "--config", config, "--output-dir", tmp_path / "run", *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert not (tmp_path / "run").exists()  # rejected before anything ran


def test_a_missing_config_file_exits_2(tmp_path: Path) -> None:
    done = cli("train", "--config", tmp_path / "nope.yaml", "--output-dir", tmp_path)
    assert done.returncode == 2
    assert "nope.yaml: cannot read the configuration" in done.stderr


# --- export -----------------------------------------------------------------------------------


def test_export_raw_and_ema(tmp_path: Path, resume_demo: tuple[Path, list[str]]) -> None:
    checkpoints = resume_demo[0] / "runs" / "resume-demo" / "checkpoints"
    done = cli("export", checkpoints / "best", tmp_path / "raw.pt", "--weights", "raw")
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'raw.pt'}" in done.stdout
    raw = torch.load(tmp_path / "raw.pt", weights_only=True)
    assert sorted(raw) == ["0.bias", "0.weight", "3.bias", "3.weight"]  # no "module." prefix
    stored = tree(checkpoints / "best")["weights"]
    for name, tensor in raw.items():
        assert torch.equal(tensor, stored["raw"][name])

    done = cli("export", checkpoints, tmp_path / "ema.pt", "--weights", "ema", "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    ema = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert sorted(ema) == sorted(raw)
    assert {t.dtype for t in ema.values()} == {torch.bfloat16}
    stored = tree(checkpoints)["weights"]["ema"]
    for name, tensor in ema.items():
        assert torch.equal(tensor, stored[name].to(torch.bfloat16))


def test_export_usage_errors_exit_2(tmp_path: Path, resume_demo: tuple[Path, list[str]]) -> None:
    checkpoints = resume_demo[0] / "runs" / "resume-demo" / "checkpoints"
    done = cli("export", checkpoints, tmp_path / "weights.bin")
    assert done.returncode == 2
    assert "the suffix must be .pt or .safetensors" in done.stderr
