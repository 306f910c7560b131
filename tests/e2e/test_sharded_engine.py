"""The sharded engine with real processes: FSDP2 on gloo, 2 ranks on the CPU (and 4, slow).

tests/e2e/sharded_loop.py trains an FSDP2 MLP with AdamW and saves it through
pitstop.shell.sharded.engine twice (write_sharded, and async_write_sharded with a stager), or
restores a checkpoint into a model built from another seed. Checked here: a save publishes a
complete directory (every DCP file listed with its writer, size and CRC-32, no temp left);
the export gathers a full state dict that an unsharded model loads with strict=True. Under
-m slow (test_sharded_checkpointer.py checks the same through the Checkpointer by default):
fresh processes restore bitwise-equal local shards and optimizer state; a load into another
world size reshards (2 -> 1, and 4 -> 2); a flipped byte in one shard file is found before
anything is loaded, on every rank. Every job is a tests/multirank.py Job: each wait is
bounded and every process it started is killed when the test ends, passing or not.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch
from torch import nn

from multirank import Finished, Job
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.errors import CheckpointCorrupt, ConfigError, IncompatibleCheckpoint, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sharded.engine import (
    delete_sharded,
    full_state_dict,
    is_sharded,
    publish_sharded,
    read_layout,
    read_sharded,
    verify_sharded,
    write_manifest,
    write_sharded,
)
from pitstop.shell.store.storage import LocalStorage
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).with_name("sharded_loop.py")
STEPS = 3
NAME = sharded_name(STEPS)
_ERROR = re.compile(r'^error (\w+) (".*")$')


@attrs.frozen
class Saved:
    """What the module's one 2-rank save left: its checkpoints and each rank's snapshot."""

    sync: Path  # written by write_sharded
    later: Path  # written by async_write_sharded
    ranks: list[dict[str, Any]]


def run(ranks: int, *args: str | Path) -> Finished:
    with Job(SCRIPT, *args, ranks=ranks) as job:
        return job.wait()


def outputs(out: Path, ranks: int) -> list[dict[str, Any]]:
    return [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(ranks)]


def load(ckpt: Path, out: Path, ranks: int) -> list[dict[str, Any]]:
    finished = run(ranks, "load", "--ckpt", ckpt, "--out", out).check()
    for rank in range(ranks):  # the FSDP2 model, and an optimizer of DTensors, are sharded
        assert "is_sharded True True" in finished.lines(rank), finished.describe()
    return outputs(out, ranks)


def errors(finished: Finished) -> dict[int, tuple[str, str]]:
    found = {}
    for rank in finished.codes:
        for line in finished.lines(rank):
            match = _ERROR.match(line.strip())
            if match:
                found[rank] = (match.group(1), json.loads(match.group(2)))
    return found


def save(directory: Path, ranks: int) -> Saved:
    directory.mkdir()
    out = directory / "out"
    run(ranks, "save", "--dir", directory, "--out", out, "--steps", str(STEPS)).check()
    return Saved(sync=directory / NAME, later=directory / "async" / NAME, ranks=outputs(out, ranks))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save(tmp_path_factory.mktemp("sharded") / "run", ranks=2)


def plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))


# --- what a save leaves -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["sync", "later"])
def test_a_save_publishes_every_file_with_its_writer_and_checksum(saved: Saved, which: str) -> None:
    directory: Path = getattr(saved, which)
    layout, meta = read_layout(directory)
    assert meta["step"] == STEPS
    assert layout.world_size == 2
    on_disk = sorted(p.name for p in directory.iterdir())
    assert on_disk == sorted([f.name for f in layout.files] + [MANIFEST_NAME])
    writers = {f.name: f.rank for f in layout.files}
    assert writers == {".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}
    for file in layout.files:
        assert (directory / file.name).stat().st_size == file.size
    verify_sharded(directory, layout)  # every CRC-32 matches
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".tmp-")]


# --- loading ------------------------------------------------------------------------------------


@pytest.mark.slow  # test_sharded_checkpointer.py does the same through the Checkpointer
def test_fresh_processes_restore_bitwise_equal_shards_and_optimizer(
    saved: Saved, tmp_path: Path
) -> None:
    restored = load(saved.sync, tmp_path / "out", ranks=2)
    for rank in range(2):
        assert_same(restored[rank]["local"], saved.ranks[rank]["local"], f"rank {rank}")
        assert_same(restored[rank]["param_groups"], saved.ranks[rank]["param_groups"])
    assert_same(restored[0]["full"], saved.ranks[0]["full"])


@pytest.mark.slow  # test_sharded_checkpointer.py does the same through the Checkpointer
def test_one_rank_reshards_a_two_rank_async_save_to_the_full_tensors(
    saved: Saved, tmp_path: Path
) -> None:
    (restored,) = load(saved.later, tmp_path / "out", ranks=1)
    assert_same(restored["full"], saved.ranks[0]["full"])
    assert_same(restored["param_groups"], saved.ranks[0]["param_groups"])
    assert_same(restored["local"], saved.ranks[0]["full"])  # one rank holds everything


def test_an_unsharded_model_in_this_process_restores_it_too(saved: Saved) -> None:
    model = plain_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    assert not is_sharded(model, {"optimizer": optimizer})
    read_sharded(saved.sync, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    assert_same(dict(model.state_dict()), saved.ranks[0]["full"]["model"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert_same(groups, saved.ranks[0]["param_groups"])


def test_a_model_that_does_not_fit_is_refused_before_anything_is_loaded(saved: Saved) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IncompatibleCheckpoint) as raised:
        read_sharded(saved.sync, model, {}, ranks=Ranks(0, 1))
    assert sorted(d.split(": ")[1] for d in raised.value.differences) == [
        "model.2.bias",
        "model.2.weight",
    ]
    assert_same(dict(model.state_dict()), before)


# --- a failure while DCP reads: every tensor put back --------------------------------------------


def trained(lr: float = 5e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain model and an AdamW with state of its own (one step taken)."""
    torch.manual_seed(7)
    model = plain_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def held(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of everything a restore may change: weights, optimizer state and groups."""
    state = optimizer.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in state["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
    }


def tear_after_verify(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """The checkpoint's ``victim`` file loses its second half once every file has verified,
    before DCP reads it (as a disk failing, or a file cut, between the check and the read)."""
    from pitstop.shell.sharded import engine as sharded

    real = sharded.verify_sharded

    def verify_then_tear(root: Path, *args: Any, **kwargs: Any) -> None:
        real(root, *args, **kwargs)
        path = Path(root) / victim
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    monkeypatch.setattr(sharded, "verify_sharded", verify_then_tear)


def test_a_read_that_fails_halfway_leaves_the_model_and_optimizer_as_they_were(
    saved: Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torn = tmp_path / NAME
    shutil.copytree(saved.sync, torn)
    tear_after_verify(monkeypatch, "__1_0.distcp")  # DCP has read __0_0 into the model by then
    model, optimizer = trained()
    before = held(model, optimizer)
    with pytest.raises(CheckpointCorrupt) as raised:
        read_sharded(torn, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    assert f"{torn}: DCP could not read it: rank 0: __1_0.distcp could not be read: " in str(
        raised.value
    )
    assert "Traceback" not in str(raised.value)
    assert_same(held(model, optimizer), before)


def test_a_fresh_optimizer_has_no_state_after_a_failed_read(
    saved: Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torn = tmp_path / NAME
    shutil.copytree(saved.sync, torn)
    tear_after_verify(monkeypatch, "__1_0.distcp")
    model = plain_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    with pytest.raises(CheckpointCorrupt):
        read_sharded(torn, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    assert not optimizer.state  # not DCP's zeroed state: its first step is still step 1
    assert all(p.grad is None for p in model.parameters())


def test_a_failure_while_the_state_is_applied_puts_back_what_dcp_read(
    saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pitstop.shell.sharded import dcpstate

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("optimizer refused its state")

    monkeypatch.setattr(dcpstate, "set_optimizer_state_dict", refuse)
    model, optimizer = trained()
    before = held(model, optimizer)
    with pytest.raises(RuntimeError, match="optimizer refused"):
        read_sharded(saved.sync, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    assert_same(held(model, optimizer), before)


def test_an_apply_refused_on_one_rank_puts_every_rank_back(saved: Saved, tmp_path: Path) -> None:
    """Every rank's DCP read succeeds, then rank 1's optimizer refuses its state: rank 0, whose
    apply went through, raises the same error and is put back too."""
    out = tmp_path / "out"
    finished = run(2, "load", "--ckpt", saved.sync, "--out", out, "--refuse-apply-on-rank", "1")
    assert finished.codes == {0: 3, 1: 3}, finished.describe()
    found = errors(finished)
    assert sorted(found) == [0, 1], finished.describe()
    for rank, (kind, message) in found.items():
        assert kind == "CheckpointCorrupt", (rank, message)
        assert "optimizer refused its state on rank 1" in message, (rank, message)
        assert "untouched True" in finished.lines(rank), finished.describe()


# --- corruption ---------------------------------------------------------------------------------


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow  # test_sharded_checkpointer.py does the same through the Checkpointer
def test_a_flipped_byte_in_one_shard_is_found_on_every_rank_before_loading(
    saved: Saved, tmp_path: Path
) -> None:
    torn = tmp_path / NAME
    shutil.copytree(saved.sync, torn)
    flip_byte(torn / "__0_0.distcp")
    finished = run(2, "load", "--ckpt", torn, "--out", tmp_path / "out")
    assert finished.codes == {0: 3, 1: 3}, finished.describe()
    found = errors(finished)
    assert sorted(found) == [0, 1], finished.describe()
    for rank, (kind, message) in found.items():
        assert kind == "CheckpointCorrupt", (rank, message)
        assert "__0_0.distcp fails its checksum" in message, (rank, message)
        assert "untouched True" in finished.lines(rank), finished.describe()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_verify_names_the_damaged_file(saved: Saved, tmp_path: Path, damage: str) -> None:
    torn = tmp_path / NAME
    shutil.copytree(saved.sync, torn)
    target = torn / "__1_0.distcp"
    if damage == "flip":
        flip_byte(target)
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        target.unlink()
    layout, _ = read_layout(torn)
    verify_sharded(torn, layout, ["__0_0.distcp"])  # the other files still verify
    with pytest.raises(CheckpointCorrupt, match=r"__1_0\.distcp"):
        verify_sharded(torn, layout)


def test_a_directory_without_its_manifest_is_no_checkpoint(saved: Saved, tmp_path: Path) -> None:
    half = tmp_path / NAME
    shutil.copytree(saved.sync, half)
    (half / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointCorrupt, match=MANIFEST_NAME):
        read_layout(half)


# --- export -------------------------------------------------------------------------------------


def test_the_full_state_dict_loads_into_an_unsharded_model_strictly(saved: Saved) -> None:
    state = full_state_dict(saved.sync)
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
    model = plain_model()
    model.load_state_dict(state, strict=True)
    assert_same(dict(model.state_dict()), saved.ranks[0]["full"]["model"])


def test_the_full_state_dict_refuses_a_torn_file(saved: Saved, tmp_path: Path) -> None:
    torn = tmp_path / NAME
    shutil.copytree(saved.sync, torn)
    flip_byte(torn / "__1_0.distcp")
    with pytest.raises(CheckpointCorrupt, match=r"__1_0\.distcp"):
        full_state_dict(torn)


# --- one process: the write path's edges -------------------------------------------------------


def test_a_save_in_one_process_round_trips_and_publishes(tmp_path: Path) -> None:
    model = plain_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    temp = tmp_path / ".tmp-x-step_000000000001"
    layout = write_sharded(temp, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    write_manifest(temp, layout, {"step": 1})
    publish_sharded(LocalStorage(tmp_path), temp.name, "step_000000000001")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000000001"]
    assert {f.rank for f in layout.files} == {0}
    assert_same(full_state_dict(tmp_path / "step_000000000001"), dict(model.state_dict()))
    delete_sharded(LocalStorage(tmp_path), "step_000000000001")
    assert list(tmp_path.iterdir()) == []


def test_a_save_into_an_existing_directory_is_refused_and_leaves_it(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep").write_text("x")
    with pytest.raises(SaveError, match="taken"):
        write_sharded(taken, plain_model(), {}, ranks=Ranks(0, 1))
    assert [p.name for p in taken.iterdir()] == ["keep"]


def test_a_failed_save_removes_its_temp_directory(tmp_path: Path) -> None:
    model = plain_model()
    with pytest.raises(ConfigError, match="model"):  # "model" is the model's own key
        write_sharded(
            tmp_path / "t", model, {"model": torch.optim.SGD(model.parameters())}, ranks=Ranks(0, 1)
        )
    assert list(tmp_path.iterdir()) == []


def test_publishing_a_missing_directory_fails_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(SaveError, match="step_000000000001"):
        publish_sharded(LocalStorage(tmp_path), ".tmp-x-step_000000000001", "step_000000000001")
    assert list(tmp_path.iterdir()) == []


# --- heavier ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_reshard_a_four_rank_save(tmp_path: Path) -> None:
    four = save(tmp_path / "four", ranks=4)
    layout, _ = read_layout(four.sync)
    assert sorted(f.rank for f in layout.files if f.name.endswith(".distcp")) == [0, 1, 2, 3]
    restored = load(four.later, tmp_path / "out", ranks=2)
    for rank in range(2):
        assert_same(restored[rank]["full"], four.ranks[0]["full"])
