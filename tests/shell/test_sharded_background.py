"""A background sharded save in one process: what the call waits for, and a staging failure.

``Checkpointer(..., async_save=True)`` with FSDP2 state (a 1-rank gloo group): the call returns
once this rank's shards are staged, without waiting for the round that agrees every rank staged
nor for DCP's ``async_save`` — a thread of pitstop's starts that once the round is over — and
the save is published by a later call. A staging that fails is this rank's write failure: the
call returns a pending record, the next call that settles the save raises it as a failed
background save naming the step, and nothing of it is left. Where pitstop's thread cannot
start (at interpreter exit) the call starts DCP's write itself; a fault in starting it at all
is raised by the call, and closing does not wait for that save. The 2-rank versions (a staging
or a part failing on one rank) are in tests/e2e/test_sharded_checkpointer.py.
"""

from __future__ import annotations

import random
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

from torch.distributed.checkpoint.staging import DefaultStager

import pitstop
from onerank import NEEDS_GLOO, sharded_model
from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell import shardsave
from pitstop.shell.sharded import shardwrite

pytestmark = NEEDS_GLOO


def background(root: Path) -> pitstop.Checkpointer:
    """A Checkpointer of a new FSDP2 model and its AdamW, saving in the background in ``root``."""
    model, optimizer = sharded_model()
    return pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}, async_save=True)


def published(ckpt: pitstop.Checkpointer, step: int) -> None:
    """Save ``step`` in the background and wait: it is published, the only checkpoint there."""
    saved = ckpt.save(pitstop.Progress(step=step))
    assert saved is not None
    ckpt.wait()
    assert saved.status is pitstop.SaveStatus.PUBLISHED
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(step)]


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
    root = tmp_path / "checkpoints"
    with background(root) as ckpt:
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
    root = tmp_path / "checkpoints"
    with background(root) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=3))
        assert saved is not None
        assert saved.status is pitstop.SaveStatus.PENDING
        with pytest.raises(pitstop.SaveError, match="background save of step 3") as raised:
            ckpt.wait()
        assert "failed: OSError: no host memory for staging" in str(raised.value)
        assert saved.status is pitstop.SaveStatus.FAILED
        assert ckpt.checkpoints() == []
        assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
        published(ckpt, 4)  # the next save goes on as before


def test_with_no_new_thread_the_call_starts_dcp_s_write_itself(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When pitstop's thread cannot start (as at interpreter exit), the call waits for the round
    and calls DCP's ``async_save`` on its own thread, and the save is published as usual."""
    real = shardwrite.async_save
    callers = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        callers.append(threading.current_thread())
        return real(*args, **kwargs)

    class NoThread:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(shardwrite, "async_save", watched)
    root = tmp_path / "checkpoints"
    with background(root) as ckpt:
        with monkeypatch.context() as patched:  # pitstop's thread only: DCP starts its own
            patched.setattr(shardwrite, "threading", types.SimpleNamespace(Thread=NoThread))
            saved = ckpt.save(pitstop.Progress(step=5))
        assert callers == [threading.current_thread()]
        assert saved is not None
        ckpt.wait()
        assert saved.status is pitstop.SaveStatus.PUBLISHED
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(5)]


def test_a_fault_starting_the_write_is_raised_by_the_call_and_nothing_waits_for_it(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting the round and DCP's write fails in a way nothing foresees: the call raises it,
    closing does not wait for that save (a bounded join, first: a wait for it would hang), no
    temp directory is left, and the next Checkpointer saves there as usual."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the write could not start")

    root = tmp_path / "checkpoints"
    ckpt = background(root)
    with monkeypatch.context() as patched:
        patched.setattr(shardwrite, "start_once_agreed", broken)
        with pytest.raises(RuntimeError, match="the write could not start"):
            ckpt.save(pitstop.Progress(step=6))
    closing = threading.Thread(target=ckpt.close, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close() waited for the save that never started"
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
    with background(root) as again:
        published(again, 7)


def test_a_ctrl_c_while_close_waits_for_the_shards_leaves_the_save_for_the_next_close(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while close() waits for a background sharded save is raised at once:
    the save stays in flight (only a settle publishes it, so closing the session then would
    wait forever — a bounded join, first), DCP may still be writing, so the directory stays
    locked, and close() again publishes it and unlocks."""
    root = tmp_path / "checkpoints"
    ckpt = background(root)
    saved = ckpt.save(pitstop.Progress(step=3))
    assert saved is not None
    shards = ckpt._shards
    assert shards is not None
    real = shards.settle
    interrupts = [KeyboardInterrupt()]

    def settle(*, block: bool, done: Any = None) -> None:
        if block and interrupts:  # Ctrl-C in the wait: the save in flight is kept
            raise interrupts.pop()
        real(block=block, done=done)

    monkeypatch.setattr(shards, "settle", settle)
    raised: list[BaseException] = []

    def close() -> None:
        try:
            ckpt.close()
        except BaseException as exc:  # the KeyboardInterrupt, handed to the test
            raised.append(exc)

    closing = threading.Thread(target=close, daemon=True)
    closing.start()
    closing.join(60)
    hung = closing.is_alive()
    if hung:
        real(block=True)  # publish it, so that the waiting close() ends
        closing.join(60)
    assert not hung, "close() waited for a sharded save that only a settle can publish"
    assert [type(e) for e in raised] == [KeyboardInterrupt]
    assert ckpt._directory._lock.held
    assert saved.status is pitstop.SaveStatus.PENDING
    ckpt.close()
    assert saved.status is pitstop.SaveStatus.PUBLISHED
    assert not ckpt._directory._lock.held
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(3)]


@pytest.mark.parametrize("mode", [True, "overlap"], ids=["async", "overlap"])
def test_close_releases_the_stager_of_a_background_sharded_run(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str
) -> None:
    from pitstop.shell.sharded import shardstage

    made: list[Any] = []
    closed: list[Any] = []

    class Counted(DefaultStager):  # its host buffers (and, with CUDA, its staging thread)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def close(self) -> None:
            closed.append(self)
            super().close()

    monkeypatch.setattr(shardstage, "DefaultStager", Counted)
    model, optimizer = sharded_model()
    ckpt = pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save=mode
    )
    published(ckpt, 2)
    assert ckpt.save(pitstop.Progress(step=3)) is not None
    ckpt.wait()
    # Kept across saves: one at most still open (torch 2.11's is spent by each stage, and
    # closed then; this torch's is the same one for the whole run).
    assert len([s for s in made if s not in closed]) <= 1
    ckpt.close()
    assert [s for s in made if s not in closed] == []  # the kept one too


class Tally:
    """A per-rank component whose ``state_dict`` hands out its live tensor (as many do)."""

    def __init__(self) -> None:
        self.count = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.copy_(state["count"])


@pytest.mark.parametrize("per_rank", [False, True], ids=["rng only", "a per-rank component"])
def test_this_rank_s_part_is_the_call_s_when_it_is_packed_after_the_loop_moved_on(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_rank: bool
) -> None:
    """A background save takes this rank's own part (RNG streams, per-rank components) at the
    call. RNG streams alone are packed later, off the call (on DCP's thread, here held until
    the loop has drawn from every stream); a per-rank component, whose state may be its live
    tensors, is packed at the call. The checkpoint holds what the call took either way."""
    real = shardsave.pack_state
    moved = threading.Event()

    def pack_once_the_loop_moved_on(value: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert moved.wait(30), "the loop never moved on"
        return real(value)

    monkeypatch.setattr(shardsave, "pack_state", pack_once_the_loop_moved_on)
    root, tally = tmp_path / "checkpoints", Tally()
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(
        root, model=model, state={"optimizer": optimizer}, async_save=True
    ) as ckpt:
        if per_rank:
            ckpt.register("tally", tally, per_rank=True)
        tally.count += 5
        streams = torch.get_rng_state(), random.getstate()
        assert ckpt.save(pitstop.Progress(step=3)) is not None
        torch.rand(16), random.random()  # the loop moves on before the part is packed
        tally.count += 1
        moved.set()
        ckpt.wait()
    model, optimizer = sharded_model()
    restored = Tally()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        if per_rank:
            again.register("tally", restored, per_rank=True)
        assert again.resume().step == 3
        assert torch.equal(torch.get_rng_state(), streams[0])
        assert random.getstate() == streams[1]
    assert restored.count.item() == (5.0 if per_rank else 0.0)
