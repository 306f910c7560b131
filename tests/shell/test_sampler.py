"""ResumableSampler: epoch-addressed order, sharding, resuming mid-epoch, identity checks."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from pitstop.core.records import Progress
from pitstop.errors import ConfigError, IncompatibleCheckpoint
from pitstop.shell.sampler import ResumableSampler, _epoch_seed

lengths = st.integers(min_value=1, max_value=120)
batch_sizes = st.integers(min_value=1, max_value=13)
world_sizes = st.integers(min_value=1, max_value=5)
seeds = st.integers(min_value=-(2**63), max_value=2**64 - 1)
epochs = st.integers(min_value=0, max_value=10**9)


def _has_batches(length: int, batch_size: int, world_size: int, drop_last: bool) -> bool:
    return not drop_last or (length // world_size) // batch_size > 0


def _all_ranks(
    length: int, batch_size: int, world_size: int, **kwargs: bool | int
) -> list[ResumableSampler]:
    return [
        ResumableSampler(length, batch_size, rank=r, world_size=world_size, **kwargs)  # type: ignore[arg-type]
        for r in range(world_size)
    ]


def _permutation(length: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's unsharded order, read from a one-rank sampler with one batch."""
    (batch,) = ResumableSampler(length, length, seed=seed, shuffle=shuffle).epoch_batches(epoch)
    return batch


# --- the order of one epoch ---------------------------------------------------------------------


@given(
    length=lengths,
    batch_size=batch_sizes,
    world_size=world_sizes,
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=seeds,
    epoch=epochs,
)
def test_an_epoch_is_the_sharded_permutation_cut_into_batches(
    length: int,
    batch_size: int,
    world_size: int,
    drop_last: bool,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> None:
    if not _has_batches(length, batch_size, world_size, drop_last):
        with pytest.raises(ConfigError, match="no full batch"):
            ResumableSampler(length, batch_size, world_size=world_size, drop_last=drop_last)
        return
    samplers = _all_ranks(
        length, batch_size, world_size, drop_last=drop_last, shuffle=shuffle, seed=seed
    )
    permutation = _permutation(length, seed=seed, epoch=epoch, shuffle=shuffle)
    assert sorted(permutation) == list(range(length))
    if not shuffle:
        assert permutation == list(range(length))

    per_rank = length // world_size if drop_last else math.ceil(length / world_size)
    total = per_rank * world_size
    padded = (permutation * math.ceil(total / length))[:total]
    expected_batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)

    seen: Counter[int] = Counter()
    for rank, sampler in enumerate(samplers):
        batches = sampler.epoch_batches(epoch)
        assert len(batches) == len(sampler) == sampler.batches_per_epoch == expected_batches
        assert all(len(b) == batch_size for b in batches[:-1])
        assert len(batches[-1]) == (
            batch_size if drop_last else per_rank - (len(batches) - 1) * batch_size
        )
        flat = [i for b in batches for i in b]
        assert flat == padded[rank::world_size][: len(flat)]
        seen.update(flat)

    if drop_last:
        assert max(seen.values()) == 1  # nothing repeats, the tail is dropped
    else:
        assert set(seen) == set(range(length))  # every index, padding repeats spread evenly
        assert sum(seen.values()) == total
        assert max(seen.values()) - min(seen.values()) <= 1
    if length % world_size == 0 and not drop_last:
        shards = [{i for b in s.epoch_batches(epoch) for i in b} for s in samplers]
        assert sum(len(s) for s in shards) == length  # disjoint ranks


@given(length=lengths, batch_size=batch_sizes, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_the_order_depends_only_on_seed_epoch_and_length(
    length: int, batch_size: int, seed: int, epoch: int, shuffle: bool
) -> None:
    a = ResumableSampler(length, batch_size, seed=seed, shuffle=shuffle)
    b = ResumableSampler(list(range(length)), batch_size, seed=seed, shuffle=shuffle)
    b.epoch_batches(epoch + 1)  # what another instance did before does not matter
    b.set_position(epoch=epoch + 7, batch_in_epoch=0)
    assert a.epoch_batches(epoch) == b.epoch_batches(epoch)
    a.set_epoch(epoch)
    assert list(a) == a.epoch_batches(epoch)


@given(length=st.integers(min_value=10, max_value=200), seed=seeds, epoch=epochs)
def test_different_epochs_and_seeds_give_different_orders(
    length: int, seed: int, epoch: int
) -> None:
    order = _permutation(length, seed=seed, epoch=epoch)
    assert order != _permutation(length, seed=seed, epoch=epoch + 1)
    other_seed = seed + 1 if seed < 2**64 - 1 else seed - 1
    assert order != _permutation(length, seed=other_seed, epoch=epoch)


@given(length=lengths, world_size=world_sizes, epoch=epochs)
def test_without_shuffle_each_rank_reads_sequentially(
    length: int, world_size: int, epoch: int
) -> None:
    for rank, sampler in enumerate(_all_ranks(length, 1, world_size, shuffle=False)):
        flat = [i for b in sampler.epoch_batches(epoch) for i in b]
        padded = [i % length for i in range(math.ceil(length / world_size) * world_size)]
        assert flat == padded[rank::world_size]


def test_epoch_seed_derivation_never_changes() -> None:
    # Part of the data format: a change here changes what every resumed run reads.
    assert [_epoch_seed(0, e) for e in range(3)] == [
        12035550249420947055,
        3069472533636442495,
        9405607414650848140,
    ]
    assert _epoch_seed(-1, 0) == _epoch_seed(2**64 - 1, 0) == 6755974106381971767


def test_epoch_order_is_pinned_for_this_torch() -> None:
    # If this fails, torch.randperm changed: runs resumed across the upgrade read another order.
    sampler = ResumableSampler(10, 4, seed=0)
    assert sampler.epoch_batches(0) == [[1, 5, 0, 4], [9, 7, 8, 3], [6, 2]]
    assert sampler.epoch_batches(1) == [[7, 9, 8, 0], [3, 6, 1, 5], [2, 4]]


# --- position -----------------------------------------------------------------------------------


@given(
    length=lengths,
    batch_size=batch_sizes,
    world_size=world_sizes,
    drop_last=st.booleans(),
    seed=seeds,
    epoch=st.integers(min_value=0, max_value=1000),
    data=st.data(),
)
def test_positioned_at_any_batch_it_yields_the_rest_of_the_epoch(
    length: int,
    batch_size: int,
    world_size: int,
    drop_last: bool,
    seed: int,
    epoch: int,
    data: st.DataObject,
) -> None:
    if not _has_batches(length, batch_size, world_size, drop_last):
        return
    rank = data.draw(st.integers(min_value=0, max_value=world_size - 1))
    kwargs = {"seed": seed, "drop_last": drop_last, "rank": rank, "world_size": world_size}
    full = ResumableSampler(length, batch_size, **kwargs).epoch_batches(epoch)  # type: ignore[arg-type]
    for k in range(len(full) + 1):
        resumed = ResumableSampler(length, batch_size, **kwargs)  # type: ignore[arg-type]
        resumed.set_position(Progress(step=123, epoch=epoch, batch_in_epoch=k))
        assert list(resumed) == full[k:]
        resumed.set_position(epoch=epoch, batch_in_epoch=k)
        assert list(resumed) == full[k:]


@given(st.integers(1, 60), st.integers(1, 5), st.integers(1, 6), st.integers(0, 5), st.data())
def test_under_accumulation_a_resume_starts_at_the_next_window(
    length: int, batch_size: int, accumulate: int, epoch: int, data: st.DataObject
) -> None:
    straight = ResumableSampler(length, batch_size, seed=9)
    full = straight.epoch_batches(epoch)
    updates = data.draw(st.integers(0, len(full) // accumulate))
    # The straight run: `updates` windows of `accumulate` micro-batches, then the next batches.
    rest = full[updates * accumulate :]
    resumed = ResumableSampler(length, batch_size, seed=9)
    resumed.set_position(
        Progress(step=77, epoch=epoch, batch_in_epoch=updates), accumulate=accumulate
    )
    assert list(resumed) == rest
    resumed.set_position(epoch=epoch, batch_in_epoch=updates, accumulate=accumulate)
    assert list(resumed) == rest
    assert (resumed.epoch, resumed.batch_in_epoch) == (epoch, updates * accumulate)


def test_under_accumulation_a_position_past_the_epoch_names_the_numbers() -> None:
    sampler = ResumableSampler(30, 4)  # 8 batches: 2 windows of 3
    sampler.set_position(Progress(epoch=1, batch_in_epoch=2), accumulate=3)
    assert list(sampler) == sampler.epoch_batches(1)[6:]
    match = r"batches_per_epoch=8 // accumulate=3 = 2\], got 3 \(epoch 1\)"
    with pytest.raises(ConfigError, match=match):
        sampler.set_position(Progress(epoch=1, batch_in_epoch=3), accumulate=3)
    with pytest.raises(ConfigError, match="accumulate must be an int >= 1, got 0"):
        sampler.set_position(epoch=1, batch_in_epoch=0, accumulate=0)
    assert (sampler.epoch, sampler.batch_in_epoch) == (1, 6)


def test_iterating_does_not_move_the_position() -> None:
    sampler = ResumableSampler(30, 4, seed=3)
    sampler.set_position(Progress(epoch=2, batch_in_epoch=5))
    first = list(sampler)
    assert list(sampler) == first
    assert (sampler.epoch, sampler.batch_in_epoch) == (2, 5)


def test_the_position_is_read_when_iteration_starts() -> None:
    sampler = ResumableSampler(30, 4, seed=3)
    sampler.set_position(epoch=1, batch_in_epoch=2)
    batches = iter(sampler)
    sampler.set_position(epoch=4, batch_in_epoch=0)
    assert list(batches) == sampler.epoch_batches(1)[2:]


def test_set_epoch_starts_the_epoch_from_its_first_batch() -> None:
    sampler = ResumableSampler(30, 4)
    sampler.set_position(epoch=1, batch_in_epoch=3)
    sampler.set_epoch(5)
    assert (sampler.epoch, sampler.batch_in_epoch) == (5, 0)
    assert list(sampler) == sampler.epoch_batches(5)


def test_a_finished_epoch_yields_nothing() -> None:
    sampler = ResumableSampler(30, 4)
    sampler.set_position(epoch=0, batch_in_epoch=len(sampler))
    assert list(sampler) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"epoch": 0, "batch_in_epoch": 9},
            r"batch_in_epoch must be .*\[0, batches_per_epoch=8\], got 9",
        ),
        ({"epoch": -1}, "epoch must be an int >= 0, got -1"),
        ({"epoch": 1.0}, "epoch must be an int >= 0, got 1.0"),
        ({"epoch": 0, "batch_in_epoch": -2}, "got -2"),
        ({"progress": Progress(), "epoch": 1}, "not both"),
        ({}, "needs a Progress or epoch="),
        ({"progress": (0, 1)}, r"needs a pitstop Progress, got \(0, 1\)"),
    ],
)
def test_invalid_positions_raise(kwargs: dict[str, object], match: str) -> None:
    sampler = ResumableSampler(30, 4)
    with pytest.raises(ConfigError, match=match):
        sampler.set_position(**kwargs)  # type: ignore[call-overload]
    assert (sampler.epoch, sampler.batch_in_epoch) == (0, 0)


def test_a_progress_past_the_end_of_the_epoch_names_both_numbers() -> None:
    sampler = ResumableSampler(30, 4)
    with pytest.raises(ConfigError, match="batches_per_epoch=8], got 12 \\(epoch 3\\)"):
        sampler.set_position(Progress(epoch=3, batch_in_epoch=12))


# --- the global RNG -----------------------------------------------------------------------------


def test_sampling_never_touches_the_global_rngs() -> None:
    torch.manual_seed(1234)
    random.seed(1234)
    torch_state, python_state = torch.get_rng_state(), random.getstate()

    sampler = ResumableSampler(100, 7, seed=5)
    for epoch in range(3):
        sampler.set_position(Progress(epoch=epoch, batch_in_epoch=epoch))
        list(sampler)
        sampler.epoch_batches(epoch + 10)

    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def test_a_dataloader_with_its_own_generator_leaves_the_global_rng_alone() -> None:
    # DataLoader draws a base seed per iter(); with generator= it comes from there (docs/data.md).
    dataset = TensorDataset(torch.arange(20))
    sampler = ResumableSampler(dataset, 4, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler, generator=torch.Generator())
    state = torch.get_rng_state()
    assert [b.tolist() for (b,) in loader] == sampler.epoch_batches(0)
    assert torch.equal(torch.get_rng_state(), state)


# --- through a real DataLoader ------------------------------------------------------------------


EPOCHS = 2
LENGTH = 22
BATCH = 4


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(LENGTH) * 10)


def _run(progress: Progress, *, stop_at: tuple[int, int] | None = None) -> Iterator[list[int]]:
    """A training loop over a fresh sampler and DataLoader, from ``progress`` on.

    Stops (without finishing the epoch) once the progress reaches ``stop_at``.
    """
    dataset = _dataset()
    sampler = ResumableSampler(dataset, BATCH, seed=42)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, generator=torch.Generator())
    while progress.epoch < EPOCHS:
        sampler.set_position(progress)
        for (batch,) in loader:
            yield batch.tolist()
            progress = progress.advance(samples=len(batch))
            if (progress.epoch, progress.batch_in_epoch) == stop_at:
                return
        progress = progress.next_epoch()


def test_stop_and_resume_through_a_dataloader_reads_the_straight_order() -> None:
    straight = list(_run(Progress()))
    assert len(straight) == EPOCHS * math.ceil(LENGTH / BATCH)
    first = list(_run(Progress(), stop_at=(0, 3)))
    rest = list(_run(Progress(step=3, epoch=0, batch_in_epoch=3, samples=3 * BATCH)))
    assert len(first) == 3
    assert first + rest == straight
    # and the straight run read each epoch's permutation of the dataset
    sampler = ResumableSampler(LENGTH, BATCH, seed=42)
    expected = [[10 * i for i in b] for e in range(EPOCHS) for b in sampler.epoch_batches(e)]
    assert straight == expected


# --- identity -----------------------------------------------------------------------------------


def test_state_dict_is_the_identity_without_the_position() -> None:
    sampler = ResumableSampler(
        list(range(50)), 8, seed=7, shuffle=False, drop_last=True, rank=1, world_size=2
    )
    sampler.set_position(epoch=3, batch_in_epoch=1)
    assert sampler.state_dict() == {
        "seed": 7,
        "batch_size": 8,
        "num_samples": 50,
        "shuffle": False,
        "drop_last": True,
        "world_size": 2,
        "rank": 1,
    }
    other = ResumableSampler(50, 8, seed=7, shuffle=False, drop_last=True, rank=1, world_size=2)
    other.load_state_dict(sampler.state_dict())
    assert (other.epoch, other.batch_in_epoch) == (0, 0)  # loading never positions
    assert other.state_differences(sampler.state_dict()) == []


def test_loading_another_identity_lists_every_difference() -> None:
    saved = ResumableSampler(50, 8, seed=7).state_dict()
    live = ResumableSampler(60, 4, seed=8, shuffle=False, drop_last=True, rank=2, world_size=3)
    with pytest.raises(IncompatibleCheckpoint) as info:
        live.load_state_dict(saved)
    assert info.value.differences == (
        "ResumableSampler.seed: checkpoint has 7, this run has 8",
        "ResumableSampler.batch_size: checkpoint has 8, this run has 4",
        "ResumableSampler.num_samples: checkpoint has 50, this run has 60",
        "ResumableSampler.shuffle: checkpoint has True, this run has False",
        "ResumableSampler.drop_last: checkpoint has False, this run has True",
        "ResumableSampler.world_size: checkpoint has 1, this run has 3",
        "ResumableSampler.rank: checkpoint has 0, this run has 2",
    )


def test_missing_extra_and_mistyped_fields_are_differences() -> None:
    sampler = ResumableSampler(50, 8)
    state = sampler.state_dict()
    del state["seed"]
    state["shuffle"] = 1
    state["epoch"] = 3
    with pytest.raises(IncompatibleCheckpoint) as info:
        sampler.load_state_dict(state)
    assert info.value.differences == (
        "ResumableSampler.seed: missing from the checkpoint",
        "ResumableSampler.shuffle: checkpoint has 1, this run has True",
        "ResumableSampler: unexpected field 'epoch' in the checkpoint",
    )
    with pytest.raises(IncompatibleCheckpoint, match="must be a mapping, got 3"):
        sampler.load_state_dict(3)  # type: ignore[arg-type]


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 4), {}, "data_source_or_length must have at least one sample, got length 0"),
        (([], 4), {}, "got length 0"),
        ((object(), 4), {}, "data_source_or_length must be a map-style dataset"),
        ((True, 4), {}, "data_source_or_length must be a map-style dataset .* got True"),
        ((10, 0), {}, "batch_size must be an int >= 1, got 0"),
        ((10, 2.0), {}, "batch_size must be an int >= 1, got 2.0"),
        ((10, True), {}, "batch_size must be an int >= 1, got True"),
        ((10, 2), {"shuffle": "yes"}, "shuffle must be a bool, got 'yes'"),
        ((10, 2), {"drop_last": 1}, "drop_last must be a bool, got 1"),
        ((10, 2), {"seed": 1.5}, r"seed must be an int in \[-2\*\*63, 2\*\*64 - 1\], got 1.5"),
        ((10, 2), {"seed": 2**64}, f"seed must be .* got {2**64}"),
        ((10, 2), {"seed": -(2**63) - 1}, f"seed must be .* got {-(2**63) - 1}"),
        ((10, 2), {"world_size": 0}, "world_size must be an int >= 1, got 0"),
        (
            (10, 2),
            {"rank": 2, "world_size": 2},
            r"rank must be an int in \[0, world_size=2\), got 2",
        ),
        ((10, 2), {"rank": -1, "world_size": 2}, "rank must be .* got -1"),
        ((10, 2), {"rank": 1}, r"rank must be an int in \[0, world_size=1\), got 1"),
        ((3, 1), {"world_size": 4, "drop_last": True}, "3 sample.* world_size=4.* no full batch"),
        ((9, 4), {"world_size": 3, "drop_last": True}, "rank 0 no full batch"),
    ],
)
def test_invalid_arguments_raise_config_error_naming_them(
    args: tuple[object, ...], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ResumableSampler(*args, **kwargs)  # type: ignore[arg-type]


def test_every_invalid_argument_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        ResumableSampler(0, 0, shuffle=None, seed="x", world_size=0)  # type: ignore[arg-type]
    assert [p.split(" ")[0] for p in info.value.problems] == [
        "ResumableSampler.data_source_or_length",
        "ResumableSampler.batch_size",
        "ResumableSampler.shuffle",
        "ResumableSampler.seed",
        "ResumableSampler.world_size",
    ]


def test_rank_and_world_size_default_to_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ResumableSampler(10, 2).rank, ResumableSampler(10, 2).world_size) == (0, 1)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    sampler = ResumableSampler(10, 2)
    assert (sampler.rank, sampler.world_size) == (2, 4)
    assert ResumableSampler(10, 2, rank=1).world_size == 4
    assert ResumableSampler(10, 2, rank=0, world_size=1).world_size == 1
