"""Saving in the background: same bytes as a synchronous save, no leaks, no lost errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import pitstop
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.state.capture import deferrable
from pitstop.shell.state.staging import StagingPool, storage_keys
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage


def _run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer)
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _clone(tree: object) -> object:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_a_background_save_writes_the_same_file_as_a_synchronous_one(
    tmp_path: Path, mode: bool | str
) -> None:
    files = []
    for name, async_save in (("sync", False), ("async", mode)):
        model, optimizer = _run()
        torch.manual_seed(7)  # the RNG state is part of the checkpoint
        with pitstop.Checkpointer(
            tmp_path / name, model=model, state={"optimizer": optimizer}, async_save=async_save
        ) as ckpt:
            saved = ckpt.save(pitstop.Progress(step=3))
        files.append(saved.path.read_bytes())
    assert files[0] == files[1]


def test_changing_the_state_right_after_the_call_does_not_change_what_is_saved(
    tmp_path: Path,
) -> None:
    model, optimizer = _run()
    expected = _clone({"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]})
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save=True
    ) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.add_(100)
        for per_param in optimizer.state.values():
            per_param["exp_avg"].mul_(-3)
        ckpt.wait()
    stored = pitstop.load(saved.path)
    assert _same(stored["weights"]["raw"], expected["model"])  # type: ignore[index]
    assert _same(stored["state"]["optimizer"]["state"], expected["optimizer"])


def test_overlap_mode_waits_for_the_copy_before_the_optimizer_steps(tmp_path: Path) -> None:
    model, optimizer = _run()
    expected = _clone(model.state_dict())
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap"
    ) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
        _step(model, optimizer)  # forward mutates BatchNorm statistics; step() changes weights
        ckpt.wait()
    assert not _same(model.state_dict(), expected)
    assert _same(pitstop.load(saved.path)["weights"]["raw"], expected)


def test_a_background_error_is_raised_by_the_next_call_and_the_save_can_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _run()
    policy = pitstop.Policy(every_steps=2)
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, policy=policy, async_save=True
    ) as ckpt:
        real = ckpt._directory.execute
        failures = iter([SaveError("injected: disk full")])

        def failing(plan, write):  # type: ignore[no-untyped-def]
            for failure in failures:
                raise failure
            return real(plan, write)

        monkeypatch.setattr(ckpt._directory, "execute", failing)
        assert ckpt.maybe_save(pitstop.Progress(step=2)) is not None
        with pytest.raises(SaveError, match="disk full"):
            ckpt.wait()
        ckpt.wait()  # raised once, not twice
        # The failed step is not considered saved: the policy saves it again.
        assert ckpt.maybe_save(pitstop.Progress(step=2)) is not None
        ckpt.wait()
    assert [c.step for c in scan(LocalStorage(tmp_path)).catalog] == [2]


def test_finish_publishes_the_save_in_flight(tmp_path: Path) -> None:
    model, optimizer = _run()
    ckpt = pitstop.Checkpointer(
        tmp_path,
        model=model,
        state={"optimizer": optimizer},
        async_save=True,
        policy=pitstop.Policy(every_steps=1),
    )
    ckpt.maybe_save(pitstop.Progress(step=1))
    final = ckpt.finish(pitstop.Progress(step=2))
    ckpt.close()
    assert final is not None
    found = scan(LocalStorage(tmp_path))
    assert [e.step for e in found.catalog] == [1, 2]
    assert found.pointers.final == found.pointers.last == final.path.name
    fileformat.verify(final.path)


CHILD = textwrap.dedent(
    """
    import sys, threading
    import torch
    import pitstop
    from pitstop.shell.store.storage import LocalStorage

    directory = sys.argv[1]
    real_create, real_sync = LocalStorage.create_exclusive, LocalStorage.sync_file
    created = []

    def create_exclusive(self, name):
        created.append(name)
        return real_create(self, name)

    def sync_file(self, file):
        if "step_000000000002" in created[-1]:  # the second checkpoint, before it is durable
            print("in flight", flush=True)
            threading.Event().wait()  # block until killed
        real_sync(self, file)

    LocalStorage.create_exclusive = create_exclusive
    LocalStorage.sync_file = sync_file
    model = torch.nn.Linear(256, 256)
    with pitstop.Checkpointer(directory, model=model, async_save=True) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        ckpt.wait()
        with torch.no_grad():
            model.weight.add_(1)
        ckpt.save(pitstop.Progress(step=2))
        sys.stdin.read()
    """
)


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "in flight"
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=60)
    leftovers = [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    assert leftovers, "the kill should have caught the write in flight"
    assert [e.step for e in scan(LocalStorage(directory)).catalog] == [1]
    model = torch.nn.Linear(256, 256)
    with pitstop.Checkpointer(directory, model=model) as ckpt:
        assert ckpt.resume().step == 1
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def test_a_checkpointer_left_open_at_exit_still_publishes_its_last_save(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, torch, pitstop
        ckpt = pitstop.Checkpointer(sys.argv[1], model=torch.nn.Linear(512, 512), async_save=True)
        ckpt.save(pitstop.Progress(step=1))
        # no wait(), no close(): the interpreter exits with the save in flight
        """
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=300)
    found = scan(LocalStorage(tmp_path))
    assert [e.step for e in found.catalog] == [1]
    fileformat.verify(tmp_path / "step_000000000001.pitstop")
    assert not (tmp_path / ".lock").exists()


def test_overlap_copies_the_ema_before_returning(tmp_path: Path) -> None:
    # A GradScaler that finds inf/nan gradients skips optimizer.step() — and with it the hook
    # that waits for the copy — but the loop still updates the EMA right after.
    model, optimizer = _run()
    ema = torch.optim.swa_utils.AveragedModel(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(1)
    expected = _clone(ema.module.state_dict())
    with pitstop.Checkpointer(
        tmp_path, model=model, ema=ema, state={"optimizer": optimizer}, async_save="overlap"
    ) as ckpt:
        # Deterministically: the EMA is not among what is copied later.
        assert storage_keys(ema.parameters()).isdisjoint(deferrable(ckpt._live))
        assert storage_keys(model.parameters()) <= deferrable(ckpt._live)
        saved = ckpt.save(pitstop.Progress(step=1))
        ema.update_parameters(model)  # no optimizer.step() in between
        ckpt.wait()
    assert not _same(ema.module.state_dict(), expected)
    assert _same(pitstop.load(saved.path)["weights"]["ema"], expected)


def test_a_deferred_copy_that_fails_is_raised_and_the_next_save_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _run()
    real = StagingPool._copy
    calls: list[bool] = []

    def copy(
        self: StagingPool, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, guard: bool = True
    ) -> None:
        calls.append(guard)
        if len(calls) == 2:  # the first snapshot's deferred copies (its first call copies the rest)
            raise RuntimeError("injected: the copy failed")
        real(self, pairs, guard=guard)

    monkeypatch.setattr(StagingPool, "_copy", copy)
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap"
    ) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        _step(model, optimizer)  # the step's pre-hook or the writer takes the copies: they fail
        with pytest.raises(SaveError, match="injected: the copy failed"):
            ckpt.wait()
        expected = _clone(model.state_dict())
        saved = ckpt.save(pitstop.Progress(step=2))  # its buffers are free again
        _step(model, optimizer)
        ckpt.wait()
    assert len(calls) == 4
    assert [c.step for c in scan(LocalStorage(tmp_path)).catalog] == [2]
    assert _same(pitstop.load(saved.path)["weights"]["raw"], expected)
