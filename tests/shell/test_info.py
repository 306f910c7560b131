"""pitstop.info: a checkpoint's facts from its manifest alone, as a Checkpoint record."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pitstop
from pitstop import Checkpoint, Checkpointer, Progress, SaveReason
from pitstop.shell.checkpoint import TensorInfo
from pitstop.shell.format import fileformat


def _run(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = tmp_path / "ck"
    config = {"model": {"layers": [3, 4, 2]}, "lr": 0.1}
    with Checkpointer(directory, model=model, state={"optimizer": optimizer}, config=config) as c:
        c.save(Progress(step=4, epoch=1, samples=64), metrics={"val_loss": 0.5})
        c.save(Progress(step=9, epoch=2, samples=144), reason="eval", metrics={"val_loss": 0.4})
    return directory


def test_info_reads_the_manifest_into_the_record(tmp_path: Path) -> None:
    directory = _run(tmp_path)
    record = pitstop.info(directory)  # a directory means its last
    path = directory / "step_000000000009.pitstop"
    assert isinstance(record, Checkpoint)
    assert record.path == path
    assert record.step == 9
    assert record.progress == Progress(step=9, epoch=2, samples=144)
    assert record.reason is SaveReason.MANUAL
    assert record.detail == "eval"
    assert record.metrics == {"val_loss": 0.4}
    assert record.config == {"model": {"layers": [3, 4, 2]}, "lr": 0.1}
    assert record.size_bytes == path.stat().st_size
    tensors = {t.name: t for t in record.tensors}
    assert tensors["weights.raw['0.weight']"] == TensorInfo(
        name="weights.raw['0.weight']", dtype="float32", shape=(4, 3), nbytes=48
    )
    assert tensors["weights.raw['2.bias']"].shape == (2,)
    assert pitstop.info(directory / "step_000000000004.pitstop").step == 4
    assert pitstop.info(directory / "last") == record


def test_info_reads_no_tensor_bytes(tmp_path: Path) -> None:
    directory = _run(tmp_path)
    path = directory / "step_000000000009.pitstop"
    manifest = fileformat.read_manifest(path)
    with open(path, "r+b") as file:
        for blob in manifest.blobs:
            file.seek(blob.offset)
            flipped = bytes(255 - b for b in file.read(blob.length))
            file.seek(blob.offset)
            file.write(flipped)
    assert pitstop.info(path).step == 9  # the damage is only in tensor bytes
    with pytest.raises(pitstop.CheckpointCorrupt):
        pitstop.verify(path)


def test_a_renamed_file_is_named_by_its_step(tmp_path: Path) -> None:
    directory = _run(tmp_path)
    renamed = tmp_path / "model-for-sampling.pitstop"
    shutil.copy(directory / "step_000000000004.pitstop", renamed)
    record = pitstop.info(renamed)
    assert record.path == renamed
    assert record.step == 4


def test_records_without_the_manifest_facts_keep_working(tmp_path: Path) -> None:
    record = Checkpoint(
        path=tmp_path / "x",
        progress=Progress(step=1),
        reason=SaveReason.MANUAL,
        seq=1,
        metrics={},
    )
    assert (record.config, record.size_bytes, record.tensors) == (None, None, ())
    hash(record)  # still hashable: the config mapping is left out of the hash
    directory = _run(tmp_path)
    with Checkpointer(directory, model=nn.Linear(1, 1)) as ckpt:
        listed = ckpt.checkpoints()
    assert [c.step for c in listed] == [4, 9]


def test_info_is_public_and_lazy() -> None:
    assert "info" in pitstop.__all__
    assert "import_checkpoint" in pitstop.__all__
    code = (
        "import sys, pitstop; pitstop.info; "
        "print('pitstop.shell.portable.info' in sys.modules, 'torch' in sys.modules, end=' '); "
        "pitstop.load; print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import sys, pitstop; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # info is loaded when used and reads manifests without torch; loading tensors needs torch
    assert done.stdout.strip() == "True False True"
