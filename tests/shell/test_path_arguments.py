"""Every public call that takes a path names one that is no path (None, an int, a model, a
dict, bytes): a ConfigError naming the call, the argument and the type received, raised before
anything is read or written — not torch's or pathlib's TypeError from deep inside. Real files
in tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from pitstop import Checkpointer, ConfigError, Progress

NOT_PATHS = [None, 5, nn.Linear(2, 1), {"model": 1}, b"run/checkpoints"]
NOT_PATH_IDS = ["None", "int", "model", "dict", "bytes"]
CHECKPOINT = "(str or os.PathLike) to a checkpoint file, a pointer or a checkpoint directory"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    with Checkpointer(tmp_path / "run", model=nn.Linear(2, 1)) as ckpt:
        return ckpt.save(Progress(step=1)).path


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    path = tmp_path / "trained.pt"
    torch.save({"model": nn.Linear(2, 1).state_dict(), "step": 3}, path)
    return path


def _resume(source: Any, tmp_path: Path) -> object:
    with Checkpointer(tmp_path / "resumed", model=nn.Linear(2, 1)) as ckpt:
        return ckpt.resume(source)


# (id, the call with the bad value in the argument's place, the message's start)
CALLS: list[tuple[str, Callable[[Any, Path, Path, Path], object], str]] = [
    ("info", lambda v, c, f, t: pitstop.info(v), f"info checkpoint must be a path {CHECKPOINT}"),
    (
        "verify",
        lambda v, c, f, t: pitstop.verify(v),
        f"verify checkpoint must be a path {CHECKPOINT}",
    ),
    ("load", lambda v, c, f, t: pitstop.load(v), f"load checkpoint must be a path {CHECKPOINT}"),
    (
        "export_weights checkpoint",
        lambda v, c, f, t: pitstop.export_weights(v, t / "out.pt"),
        f"export_weights checkpoint must be a path {CHECKPOINT}",
    ),
    (
        "export_weights path",
        lambda v, c, f, t: pitstop.export_weights(c, v),
        "export_weights path must be a path (str or os.PathLike) to the .pt or .safetensors "
        "file to write",
    ),
    (
        "import_checkpoint src",
        lambda v, c, f, t: pitstop.import_checkpoint(v, t / "imported"),
        "import_checkpoint src must be a path (str or os.PathLike) to a torch.save or "
        "Lightning checkpoint file or an Accelerate save_state directory",
    ),
    (
        "import_checkpoint directory",
        lambda v, c, f, t: pitstop.import_checkpoint(f, v),
        "import_checkpoint directory must be a path (str or os.PathLike) to a checkpoint directory",
    ),
    (
        "resume source",
        lambda v, c, f, t: _resume(v, t.parent),
        f"resume source must be a path {CHECKPOINT}, or 'last', 'best' or 'final'",
    ),
    (
        "load_weights checkpoint",
        lambda v, c, f, t: pitstop.load_weights(nn.Linear(2, 1), v),
        f"load_weights checkpoint must be a path {CHECKPOINT}",
    ),
    (
        "Checkpointer directory",
        lambda v, c, f, t: Checkpointer(v, model=nn.Linear(2, 1)),
        "Checkpointer.directory must be a path (str or os.PathLike)",
    ),
]


@pytest.mark.parametrize("value", NOT_PATHS, ids=NOT_PATH_IDS)
@pytest.mark.parametrize(
    ("call", "start"), [(c[1], c[2]) for c in CALLS], ids=[c[0] for c in CALLS]
)
def test_an_argument_that_is_no_path_is_a_config_error_naming_it(
    tmp_path: Path,
    checkpoint: Path,
    foreign: Path,
    call: Callable[[Any, Path, Path, Path], object],
    start: str,
    value: object,
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ConfigError) as caught:
        call(value, checkpoint, foreign, target)
    assert type(caught.value) is ConfigError
    message = str(caught.value)
    assert message.startswith(f"{start}, got {type(value).__qualname__} "), message
    assert list(target.iterdir()) == []  # nothing exported, imported or created


def test_a_path_like_of_the_callers_own_is_a_path(checkpoint: Path) -> None:
    class Where:
        def __fspath__(self) -> str:
            return str(checkpoint)

    assert pitstop.info(Where()).step == 1  # type: ignore[arg-type]
    pitstop.verify(Where())  # type: ignore[arg-type]
