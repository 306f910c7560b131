"""WorkerRNG keeps its dataset's kind, length, attributes and state; loaders are per rank.

Real workers and real resumes in fresh processes are tests/e2e/test_data_state.py's.
"""

from __future__ import annotations

import pickle  # noqa: TID251  # a DataLoader pickles its dataset to spawn workers; so do we
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import pitstop
from pitstop.errors import ConfigError
from pitstop.shell.data.loaders import is_stateful_loader
from pitstop.shell.format import fileformat as ff

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class Squares(Dataset[int]):
    label = "squares"

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> int:
        return index * index


class Counter(IterableDataset[int]):
    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        while self.position < 6:
            self.position += 1
            yield self.position - 1

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_a_map_style_dataset_stays_map_style_with_its_length_and_attributes() -> None:
    wrapped = pitstop.WorkerRNG(Squares())
    assert isinstance(wrapped, pitstop.WorkerRNG)
    assert not isinstance(wrapped, IterableDataset)
    assert len(wrapped) == 5
    assert wrapped[3] == 9
    assert wrapped.label == "squares"
    assert pickle.loads(pickle.dumps(wrapped))[2] == 4


def test_an_iterable_dataset_stays_iterable_and_keeps_its_own_state() -> None:
    wrapped = pitstop.WorkerRNG(Counter())
    assert isinstance(wrapped, IterableDataset)
    assert isinstance(wrapped, pitstop.WorkerRNG)
    stream = iter(wrapped)
    assert [next(stream), next(stream)] == [0, 1]
    state = wrapped.state_dict()
    assert state == {"dataset": {"position": 2}, "rng": None}  # no worker: no random state
    fresh = pitstop.WorkerRNG(Counter())
    resumed = iter(fresh)
    fresh.load_state_dict(state)
    assert list(resumed) == [2, 3, 4, 5]


def test_the_main_process_random_state_is_never_set_from_the_loader() -> None:
    wrapped = pitstop.WorkerRNG(Squares())
    stored = {"dataset": None, "rng": {"python": random.getstate(), "numpy": None, "torch": None}}
    random.random()
    now = random.getstate()
    wrapped.load_state_dict(stored)  # outside a worker: the checkpoint's own RNG rules here
    assert random.getstate() == now


def test_bad_arguments_and_states_are_refused() -> None:
    with pytest.raises(ConfigError, match="already a WorkerRNG"):
        pitstop.WorkerRNG(pitstop.WorkerRNG(Squares()))
    with pytest.raises(ConfigError, match="needs a dataset"):
        pitstop.WorkerRNG(42)
    with pytest.raises(ValueError, match="keys"):
        pitstop.WorkerRNG(Squares()).load_state_dict({"rng": None})
    with pytest.raises(ValueError, match="Squares has no load_state_dict"):
        pitstop.WorkerRNG(Squares()).load_state_dict({"dataset": {"x": 1}, "rng": None})


def test_a_stateful_dataloader_is_saved_per_rank_with_its_workers_random_state(
    tmp_path: Path,
) -> None:
    loader = torchdata.StatefulDataLoader(
        pitstop.WorkerRNG(Squares()), batch_size=2, num_workers=1, snapshot_every_n_steps=1
    )
    assert is_stateful_loader(loader)
    assert not is_stateful_loader(torch.utils.data.DataLoader(Squares()))
    next(iter(loader))
    model = torch.nn.Linear(1, 1)
    with pitstop.Checkpointer(tmp_path / "c", model=model, state={"loader": loader}) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
    manifest = ff.read_manifest(saved.path)
    assert manifest.meta["per_rank"] == ["loader"]
    stored = ff.load(saved.path)
    assert "loader" not in stored["state"]
    worker = stored["ranked"][0]["loader"]["_snapshot"]["_worker_snapshots"]["worker_0"]
    rng = worker["dataset_state"]["rng"]
    assert set(rng) == {"python", "numpy", "torch"}
    assert type(rng["numpy"][1]).__module__ == "numpy"  # NumPy's state, stored as NumPy
