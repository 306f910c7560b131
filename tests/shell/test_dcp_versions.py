"""What torch 2.11's DCP does differently from this torch, reproduced here, and a sharded run
that saves and resumes through it: its ``DefaultStager`` closes its own copier after every
stage, so a kept stager fails its second stage (pytorch/pytorch#183413), and its
``FileSystemWriter.finish`` completes a copy of the metadata, so what ``dcp.save`` returns has
no files (first seen on a GPU machine's torch 2.11, then with a torch 2.11 install on the CPU).
One process as a 1-rank gloo job."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import pitstop
from onerank import NEEDS_GLOO, sharded_model
from pitstop.shell.sharded import shardstage
from pitstop.shell.store.sharddir import read_layout

pytestmark = NEEDS_GLOO

CPU = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=False,
    use_non_blocking_copy=False,
)


class SelfClosingStager(DefaultStager):
    """torch 2.11's DefaultStager: its copier is closed at the end of every stage."""

    stages = 0

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        staged = super()._stage(state_dict, **kwargs)
        SelfClosingStager.stages += 1
        self._state_dict_stager.close()
        return staged


def finish_on_a_copy(original: Any) -> Any:
    """torch 2.11's FileSystemWriter.finish: the metadata it completes and writes is a copy."""

    def finish(self: FileSystemWriter, metadata: Any, results: Any) -> None:
        original(self, dataclasses.replace(metadata), results)

    return finish


def _resumes(root: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == step
    for name, value in model.state_dict().items():
        assert torch.equal(value.to_local(), expected[name]), name


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: v.to_local().clone() for n, v in model.state_dict().items()}


def test_the_self_closing_stager_fails_a_second_stage_as_torch_2_11s_does() -> None:
    stager = SelfClosingStager(CPU)
    tree = {"w": torch.ones(3), "meta": {"lr": 0.1}}
    assert torch.equal(stager.stage(tree)["w"], tree["w"])
    with pytest.raises(KeyError, match="<class 'type'>"):
        stager.stage(tree)
    stager.close()


def test_a_kept_stager_stages_again_after_torch_2_11s_stager_closed_itself() -> None:
    made: list[DefaultStager] = []

    def make() -> DefaultStager:
        made.append(SelfClosingStager(CPU))
        return made[-1]

    kept = shardstage.KeptStager(make)
    for value in range(3):
        staged = kept.stage({"w": torch.full((4,), float(value)), "meta": {"step": value}})
        assert torch.equal(staged["w"], torch.full((4,), float(value)))
        assert staged["meta"] == {"step": value}
    assert len(made) == 3  # a new stager for each stage: each closed itself
    kept.close()


def test_a_kept_stager_keeps_a_stager_that_survives_its_stages() -> None:
    probe = DefaultStager(CPU)
    probe.stage({"w": torch.ones(1)})
    if shardstage.stager_spent(probe):
        pytest.skip("this torch's DefaultStager closes itself after each stage (torch 2.11)")
    probe.close()
    made: list[DefaultStager] = []
    kept = shardstage.KeptStager(lambda: made.append(DefaultStager(CPU)) or made[-1])
    for value in range(3):
        kept.stage({"w": torch.full((4,), float(value))})
    assert len(made) == 1  # this torch's stager is reused, with its host buffers
    kept.close()


@pytest.mark.parametrize("mode", [True, "overlap"], ids=["async", "overlap"])
def test_background_sharded_saves_go_on_with_a_stager_that_closes_itself(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str
) -> None:
    monkeypatch.setattr(shardstage, "DefaultStager", SelfClosingStager)
    SelfClosingStager.stages = 0
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save=mode
    ) as ckpt:
        for step in (1, 2, 3):
            model(torch.ones(2, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            assert ckpt.save(pitstop.Progress(step=step)) is not None
            ckpt.wait()
    assert SelfClosingStager.stages >= 3  # the saves went through the self-closing stager
    _resumes(tmp_path, 3, _local(model))


def test_a_sync_sharded_save_publishes_when_finish_completes_a_copy(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        FileSystemWriter, "finish", finish_on_a_copy(FileSystemWriter.finish), raising=True
    )
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=5))
    assert saved is not None
    layout, _ = read_layout(saved.path)
    assert layout.dcp_version not in ("", "None")
    _resumes(tmp_path, 5, _local(model))
