"""A sharded save call that raises from a step that does not end its save itself (a fault
between the plan and the write) ends that save: the call raises the error, nothing waits for
the save — ``close`` included, which otherwise waited for ever (first seen with FSDP2 on
NCCL, where the hang hid the error) — no temp directory is left, and the next save is
written. One process as a 1-rank gloo job."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.core.session import Event, left_by_raise
from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell import shardsave
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage

pytestmark = [NEEDS_GLOO, NEEDS_SHARDED]


def _broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a fault nothing foresees")


FAULTS = {
    "fresh optimizers": (shardsave.FreshOptimizers, "__enter__"),
    "unpacking a rank's part": (shardsave, "unpack_state"),
}


CASES = [
    *((mode, "fresh optimizers") for mode in (False, True, "overlap")),
    (False, "unpacking a rank's part"),  # a background save unpacks them when it publishes
]


@pytest.mark.parametrize(("mode", "fault"), CASES, ids=lambda c: str(c).replace(" ", "-"))
def test_a_fault_between_the_plan_and_the_write_ends_the_save(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str, fault: str
) -> None:
    root = tmp_path / "checkpoints"
    model, optimizer = sharded_model()
    ckpt = pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}, async_save=mode)
    with monkeypatch.context() as patched:
        patched.setattr(*FAULTS[fault], _broken)
        with pytest.raises(RuntimeError, match="a fault nothing foresees"):
            ckpt.save(pitstop.Progress(step=3))
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []

    def save_again_and_close() -> None:  # the same Checkpointer saves again, then closes
        assert ckpt.save(pitstop.Progress(step=4)) is not None
        ckpt.wait()
        ckpt.close()

    bounded(save_again_and_close, rescue=lambda: unstick(ckpt))
    assert [e.name for e in scan(LocalStorage(root)).catalog] == [sharded_name(4)]
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        assert again.resume().step == 4


def unstick(ckpt: pitstop.Checkpointer) -> None:
    """End the save a broken Checkpointer waits for, so that the test fails instead of hanging
    (its stuck thread, then its finalizer at exit, would wait for ever)."""
    session = ckpt._session
    if left_by_raise(session.state):
        session.event(Event.ABORTED)


def bounded(work: Any, *, rescue: Any) -> None:
    """Run ``work`` on a thread, 60 s at most (a wait for the ended save never returns); past
    that, ``rescue`` frees it and the test fails."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # raised below, on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        rescue()
        thread.join(60)
        pytest.fail("a call waited for the save that raised")
    if errors:
        raise errors[0]
