"""The stream protocol check: a WorkerRNG stream without state is refused on a strict resume."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

import pitstop
from pitstop.errors import IncompatibleCheckpoint, ResumeWarning

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
# torchdata's StatefulDataLoader calls torch.set_vital, which this torch deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Counting(IterableDataset[torch.Tensor]):
    """Endless 0, 1, 2, ... with no state: a resumed iterator starts again at 0."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = 0
        while True:
            yield torch.tensor(float(n))
            n += 1


class Positioned(Counting):
    """The same stream, with the protocol: its state is its position, where __iter__ starts."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1  # counted when handed out: the state is the next sample
            yield torch.tensor(float(self.position - 1))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def run(directory: Path, stream: IterableDataset[torch.Tensor], *, strict: bool = True) -> float:
    """Resume (or start) with the loader in state=, read one batch, save at step 1; its first."""
    loader = stateful_dataloader.StatefulDataLoader(pitstop.WorkerRNG(stream), batch_size=2)
    with pitstop.Checkpointer(directory, model=nn.Linear(1, 1), state={"loader": loader}) as ckpt:
        progress = ckpt.resume(strict=strict)
        first = float(next(iter(loader))[0])
        ckpt.save(progress.advance())
    return first


def test_a_stream_without_state_is_refused_naming_what_to_add(tmp_path: Path) -> None:
    assert run(tmp_path, Counting()) == 0.0  # a fresh start: nothing to refuse
    with pytest.raises(IncompatibleCheckpoint) as caught:
        run(tmp_path, Counting())
    message = str(caught.value)
    assert "component 'loader'" in message
    assert "WorkerRNG(Counting)" in message
    assert "add to Counting a state_dict() returning its position" in message
    assert "load_state_dict(state)" in message


def test_strict_false_resumes_a_stream_without_state_with_a_warning(tmp_path: Path) -> None:
    run(tmp_path, Counting())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run(tmp_path, Counting(), strict=False)
    assert first == 0.0  # the stream restarted from its beginning: what the warning says
    notes = [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]
    assert len(notes) == 1
    assert "component 'loader' resumes inexactly" in notes[0]


def test_a_stream_with_state_resumes_at_its_next_sample(tmp_path: Path) -> None:
    assert run(tmp_path, Positioned()) == 0.0
    assert run(tmp_path, Positioned()) == 2.0
