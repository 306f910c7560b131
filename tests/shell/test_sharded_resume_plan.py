"""A sharded resume plans its read once: the manifest read, the state compared and DCP's read
plan made when the checkpoint is chosen are what the read uses.

In one process (a 1-rank gloo group, FSDP2): a resume reads the chosen checkpoint's layout once
outside the directory scans and makes DCP's local read plan once before DCP's own load — and
still falls back past a torn newest checkpoint to the one before, bitwise. ``read_sharded``
refuses a plan made for another directory, or one whose state does not fit, before it touches
a tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.core.compat import Kind
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.errors import IncompatibleCheckpoint
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sharded import engine as sharded

pytestmark = [NEEDS_GLOO, NEEDS_SHARDED]


def local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def counting(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], name: str) -> None:
    """Count the calls the sharded module makes to its own ``name``."""
    original: Callable[..., Any] = getattr(sharded, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sharded, name, counted)


def resume_counting(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Counter[str], int, nn.Module]:
    """A fresh run resumed from ``root``: the layout reads and DCP read plans the sharded
    module made, the step resumed, and the model."""
    calls: Counter[str] = Counter()
    counting(monkeypatch, calls, "read_layout")
    counting(monkeypatch, calls, "_local_plan")
    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        step = ckpt.resume().step
    return calls, step, model


def save_two(root: Path) -> dict[str, torch.Tensor]:
    """Steps 1 and 2 saved; the weights of step 1."""
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        first = local(model)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        ckpt.save(pitstop.Progress(step=2))
    return first


def test_a_resume_reads_the_layout_and_plans_dcp_s_read_once(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    save_two(root)
    calls, step, _ = resume_counting(root, monkeypatch)
    assert step == 2
    assert calls == {"read_layout": 1, "_local_plan": 1}


def test_a_torn_newest_checkpoint_is_planned_then_skipped_and_the_one_before_restored(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    first = save_two(root)
    shard = next((root / sharded_name(2)).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    calls, step, model = resume_counting(root, monkeypatch)
    assert step == 1
    assert calls == {"read_layout": 2, "_local_plan": 2}  # each candidate once
    restored = local(model)
    assert restored.keys() == first.keys()
    for key, value in first.items():
        assert torch.equal(restored[key], value), key


def test_read_sharded_refuses_a_plan_for_another_directory_or_one_that_does_not_fit(
    group: Any, tmp_path: Path
) -> None:
    from torch.distributed.fsdp import fully_shard  # NEEDS_SHARDED: not on an older torch

    root = tmp_path / "checkpoints"
    save_two(root)
    model, optimizer = sharded_model(step=False)
    components = {"optimizer": optimizer}
    plan = sharded.plan_read(root / sharded_name(1), model, components, rank=0, world_size=1)
    assert plan.differences == ()
    before = local(model)
    elsewhere = root / sharded_name(2)
    with pytest.raises(ValueError, match=r"the plan is for .*step_000000000001"):
        sharded.read_sharded(elsewhere, model, components, ranks=Ranks(0, 1), chosen=plan)

    other = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 7))  # 7 outputs, not 5
    for layer in other:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(other)
    opt = torch.optim.AdamW(other.parameters())
    misfit = sharded.plan_read(
        root / sharded_name(1), other, {"optimizer": opt}, rank=0, world_size=1
    )
    assert misfit.differences, "a model with 7 outputs does not fit a checkpoint of 5"
    assert {d.kind for d in misfit.differences} == {Kind.SHAPE}
    with pytest.raises(IncompatibleCheckpoint, match=r"the live value is float32\[7, 128\]"):
        sharded.read_sharded(
            root / sharded_name(1), other, {"optimizer": opt}, ranks=Ranks(0, 1), chosen=misfit
        )
    after = local(model)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_a_damaged_replicated_tree_in_the_newest_manifest_is_found_beside_dcp_s_read(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The manifest's layout reads back, so DCP reads the shards; the check of the whole
    manifest, made on its own thread beside that read, fails it: the run resumes step 1."""
    root = tmp_path / "checkpoints"
    first = save_two(root)
    manifest = root / sharded_name(2) / MANIFEST_NAME
    data = bytearray(manifest.read_bytes())
    data[len(data) // 4] ^= 0xFF  # in the replicated tree, not the meta that holds the layout
    manifest.write_bytes(bytes(data))
    sharded.read_layout(root / sharded_name(2))  # still plans
    calls, step, model = resume_counting(root, monkeypatch)
    assert step == 1
    assert calls["_local_plan"] == 2  # DCP's read of step 2 was planned (and made)
    (warned,) = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert f"{sharded_name(2)}/{MANIFEST_NAME}" in warned, warned
    restored = local(model)
    for key, value in first.items():
        assert torch.equal(restored[key], value), key


def test_a_start_on_the_checkpoint_last_links_to_serves_that_candidate_alone(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank starts on the checkpoint its pointer links to before rank 0's order comes;
    ``last`` left on step 1 while step 2 is newest: the start is dropped (its check stopped,
    its files closed) and step 2 is read as if nothing had been guessed."""
    from pitstop.shell.sharded import filecheck

    root = tmp_path / "checkpoints"
    save_two(root)
    (root / "last").unlink()
    (root / "last").symlink_to(sharded_name(1))
    begun: list[Any] = []
    original = filecheck.Started

    def kept(*args: Any) -> Any:
        begun.append(original(*args))
        return begun[-1]

    monkeypatch.setattr(filecheck, "Started", kept)
    calls, step, _ = resume_counting(root, monkeypatch)
    assert step == 2
    assert calls == {"read_layout": 2, "_local_plan": 1}  # the guess's manifest, then step 2's
    assert [b._directory.name for b in begun] == [sharded_name(1), sharded_name(2)]
    guessed = begun[0]
    assert guessed._stopped.is_set()  # closed
    assert not guessed._thread.is_alive()


def test_a_start_whose_manifest_changed_since_it_was_read_is_read_again(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guessed checkpoint's manifest is not the one the start read (another inode, size or
    time): the start is dropped and the candidate read again, restored as before."""
    from pitstop.shell.sharded import candidate

    root = tmp_path / "checkpoints"
    save_two(root)
    seen = iter([(1,), (2,)])
    monkeypatch.setattr(candidate, "_seen", lambda path: next(seen))
    calls, step, _ = resume_counting(root, monkeypatch)
    assert step == 2
    assert calls == {"read_layout": 2, "_local_plan": 1}
