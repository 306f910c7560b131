"""A plain torch DataLoader given in state=: kept without state, and its resume warns once."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pitstop
from pitstop.errors import ResumeWarning

DATA = TensorDataset(torch.arange(12.0).reshape(6, 2))


def save_then_resume(directory: Path, make_loader: object) -> list[warnings.WarningMessage]:
    """Save step 1 with the loader as a component, resume in a new Checkpointer; the warnings."""
    for phase in ("save", "resume"):
        loader = make_loader()  # type: ignore[operator]
        with pitstop.Checkpointer(directory, model=nn.Linear(2, 1), state={"data": loader}) as ckpt:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                progress = ckpt.resume()
            if phase == "save":
                assert not caught
                ckpt.save(progress.advance())
    return [w for w in caught if issubclass(w.category, ResumeWarning)]


def test_a_loader_with_workers_warns_once_naming_the_fix(tmp_path: Path) -> None:
    sampler = pitstop.ResumableSampler(DATA, 2, seed=0, rank=0, world_size=1)
    caught = save_then_resume(
        tmp_path, lambda: DataLoader(DATA, batch_sampler=sampler, num_workers=2)
    )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "component 'data' is a plain torch DataLoader" in message
    assert "2 worker(s)' random state" in message
    assert "StatefulDataLoader" in message
    assert "pitstop.WorkerRNG" in message
    assert "order" not in message  # a ResumableSampler orders it


def test_a_loader_without_a_resumable_sampler_warns_about_the_order(tmp_path: Path) -> None:
    caught = save_then_resume(tmp_path, lambda: DataLoader(DATA, batch_size=2, shuffle=True))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "data order is exact only through pitstop.ResumableSampler" in message
    assert "worker" not in message


def test_an_exact_plain_loader_resumes_without_a_warning(tmp_path: Path) -> None:
    sampler = pitstop.ResumableSampler(DATA, 2, seed=0, rank=0, world_size=1)
    assert save_then_resume(tmp_path, lambda: DataLoader(DATA, batch_sampler=sampler)) == []


def test_an_object_without_state_is_still_refused(tmp_path: Path) -> None:
    with pytest.raises(pitstop.ConfigError, match=r"component 'data' \(list\) has no state_dict"):
        pitstop.Checkpointer(tmp_path, model=nn.Linear(2, 1), state={"data": [1, 2]})
