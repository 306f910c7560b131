"""A background sharded save in one process: what the call waits for, and a staging failure.

``Checkpointer(..., async_save=True)`` with FSDP2 state (a 1-rank gloo group): the call returns
once this rank's shards are staged, without waiting for the round that agrees every rank staged
nor for DCP's ``async_save`` — a thread of pitstop's starts that once the round is over — and
the save is published by a later call. A staging that fails is this rank's write failure: the
call returns a pending record, the next call that settles the save raises it as a failed
background save naming the step, and nothing of it is left. The 2-rank versions (a staging or
a part failing on one rank) are in tests/e2e/test_sharded_checkpointer.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.staging import DefaultStager

import pitstop
from onerank import NEEDS_GLOO, sharded_model
from pitstop.core.sharded import sharded_name
from pitstop.shell import shardwrite

pytestmark = NEEDS_GLOO


def test_the_call_returns_before_dcp_s_async_save_is_called(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shardwrite.async_save
    release, callers = threading.Event(), []

    def held(*args: Any, **kwargs: Any) -> Any:  # DCP's async_save, held until released
        callers.append(threading.current_thread())
        assert release.wait(30), "async_save was held on the thread that called save()"
        return real(*args, **kwargs)

    monkeypatch.setattr(shardwrite, "async_save", held)
    model, optimizer = sharded_model()
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(
        root, model=model, state={"optimizer": optimizer}, async_save=True
    ) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=3))
        assert saved is not None
        assert saved.status is pitstop.SaveStatus.PENDING  # returned while async_save is held
        release.set()
        ckpt.wait()
        assert saved.status is pitstop.SaveStatus.PUBLISHED
    assert callers
    assert all(c is not threading.current_thread() for c in callers)
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(3)]


def test_a_staging_that_fails_is_raised_by_the_next_call_and_leaves_nothing(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DefaultStager.stage
    failing = [True]

    def stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        if failing.pop() if failing else False:
            raise OSError("no host memory for staging")
        return real(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "stage", stage)
    model, optimizer = sharded_model()
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(
        root, model=model, state={"optimizer": optimizer}, async_save=True
    ) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=3))
        assert saved is not None
        assert saved.status is pitstop.SaveStatus.PENDING
        with pytest.raises(pitstop.SaveError, match="background save of step 3") as raised:
            ckpt.wait()
        assert "no host memory for staging" in str(raised.value)
        assert saved.status is pitstop.SaveStatus.FAILED
        assert ckpt.checkpoints() == []
        assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
        again = ckpt.save(pitstop.Progress(step=4))  # the next save goes on as before
        assert again is not None
        ckpt.wait()
        assert again.status is pitstop.SaveStatus.PUBLISHED
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(4)]
