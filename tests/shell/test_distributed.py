"""Errors travel between ranks as the same pitstop error; one rank needs no collectives."""

from __future__ import annotations

import collections

import pytest
import torch

from pitstop.errors import (
    CheckpointCorrupt,
    DirectoryLocked,
    IncompatibleCheckpoint,
    PitstopError,
    SaveError,
)
from pitstop.shell.ranks.distributed import Ranks, outcome_of, raise_outcome
from pitstop.shell.ranks.packing import pack_state, unpack_state


@pytest.mark.parametrize(
    "error",
    [
        SaveError("could not write step_000000000002.pitstop: disk full"),
        CheckpointCorrupt("step_1.pitstop: bad footer"),
        DirectoryLocked("runs/x is locked by host:123"),
    ],
)
def test_another_ranks_error_is_raised_as_the_same_class(error: PitstopError) -> None:
    outcome = outcome_of(error, rank=0)
    with pytest.raises(type(error)) as raised:
        raise_outcome(outcome)
    assert str(raised.value) == f"rank 0: {error}"


def test_an_incompatibility_keeps_every_difference() -> None:
    outcome = outcome_of(IncompatibleCheckpoint(["a: shape", "b: dtype"]), rank=1)
    with pytest.raises(IncompatibleCheckpoint) as raised:
        raise_outcome(outcome)
    assert raised.value.differences == ("rank 1: a: shape", "rank 1: b: dtype")


def test_an_unexpected_error_is_a_save_error_naming_it() -> None:
    with pytest.raises(SaveError, match=r"rank 0: OSError: \[Errno 28\] No space left"):
        raise_outcome(outcome_of(OSError(28, "No space left on device"), rank=0))


def test_this_ranks_own_error_is_raised_as_itself() -> None:
    own = OSError(5, "I/O error")
    with pytest.raises(OSError, match="I/O error") as raised:
        raise_outcome(outcome_of(own, rank=0), own=own)
    assert raised.value is own


def test_one_rank_runs_everything_in_place() -> None:
    ranks = Ranks(0, 1)
    assert ranks.leader
    assert not ranks.many
    assert ranks.lead(lambda: 3) == 3
    assert ranks.each(lambda: 4) == 4
    assert ranks.all_gather(5) == [5]
    assert ranks.all_gather_each(lambda: 6) == [6]
    with pytest.raises(ValueError, match="own"):
        ranks.lead(lambda: (_ for _ in ()).throw(ValueError("own")))


def test_a_packed_tree_comes_back_equal_as_a_copy_with_storage_sharing_kept() -> None:
    base = torch.arange(12, dtype=torch.float64)
    tree = {
        "rng": (3, tuple(range(5)), None),
        "state": collections.OrderedDict(
            whole=base,
            part=base[2:6],
            transposed=base.view(3, 4).t(),
            half=torch.ones(2).half(),
            empty=torch.zeros(0, 3, dtype=torch.int64),
            scalar=torch.tensor(7),
        ),
        "names": {"a", "b"},
    }
    copy = unpack_state(pack_state(tree))
    assert copy["rng"] == tree["rng"]
    assert copy["names"] == tree["names"]
    assert type(copy["state"]) is collections.OrderedDict
    for name, tensor in tree["state"].items():
        got = copy["state"][name]
        assert got.dtype == tensor.dtype
        assert got.stride() == tensor.stride()
        assert torch.equal(got, tensor)
    shared = {
        copy["state"][n].untyped_storage().data_ptr() for n in ("whole", "part", "transposed")
    }
    assert len(shared) == 1  # one storage, as on the sender
    assert shared != {base.untyped_storage().data_ptr()}  # a copy
    copy["state"]["part"].zero_()
    assert copy["state"]["whole"][2] == 0
    assert base[2] == 2


def test_a_tree_a_checkpoint_cannot_hold_is_refused_naming_its_key_path() -> None:
    with pytest.raises(SaveError, match=r"sampler.*object"):
        pack_state({"sampler": {"hook": object()}})
