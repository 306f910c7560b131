# Epoch-addressed, resumable batch sampling for map-style datasets.
#
# Rules: the batches of epoch e are a pure function of (seed, e, dataset length, batch_size,
# shuffle, drop_last, world_size, rank) — nothing else, and never the global RNG. The sampler holds
# a position (epoch, batch_in_epoch) that only the caller moves (set_position from the training
# loop's Progress, or set_epoch); under gradient accumulation the Progress counts updates and
# set_position(..., accumulate=k) starts at batch batch_in_epoch * k (the core's
# micro_batch_position, which refuses a position past the epoch); iterating never advances it,
# because the loop's Progress is the truth, not what a DataLoader happened to prefetch. state_dict()
# is the sampler's identity, not its position: loading a state that differs in any field raises
# IncompatibleCheckpoint listing every difference, because a resumed run with another seed, batch
# size, dataset length or world size would silently read a different order.
# How: a private torch.Generator seeded with _epoch_seed(seed, e) (splitmix64 arithmetic, no
# hashing) drives torch.randperm; the permutation is padded by repeating from its start to a
# multiple of world_size (or its tail dropped with drop_last), rank r takes indices[r::world],
# and those are cut into batches of batch_size (a final partial batch is kept unless
# drop_last). __iter__ reads the position when it is called and yields batches from there.
# The derivation of an epoch's order is part of the data format: changing it changes the order
# a resumed run reads, so it must never change silently.

"""ResumableSampler: epoch-addressed batch order, positioned from a Progress."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Final, overload

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from pitstop.core.records import Progress
from pitstop.core.saving.targets import micro_batch_position
from pitstop.core.validators import is_int as _is_int
from pitstop.errors import ConfigError, IncompatibleCheckpoint

__all__ = ["ResumableSampler"]

_MASK64: Final = (1 << 64) - 1
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN: Final = -(1 << 63)
_SEED_MAX: Final = (1 << 64) - 1

# The fields of state_dict(), in the order differences are reported.
_IDENTITY: Final = (
    "seed",
    "batch_size",
    "num_samples",
    "shuffle",
    "drop_last",
    "world_size",
    "rank",
)


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a bijection on 64-bit integers that mixes every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _epoch_seed(seed: int, epoch: int) -> int:
    """Return the generator seed of ``epoch``: distinct epochs of one seed never share it."""
    return _splitmix64((_splitmix64(seed & _MASK64) + epoch) & _MASK64)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _distributed() -> tuple[int, int]:
    """Return torch.distributed's (rank, world_size) when it is initialized, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[list[int]]):
    """A batch sampler over a map-style dataset whose order depends only on seed and epoch.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler, num_workers=...)``. Each epoch's
    order is a pure function of ``(seed, epoch, len(dataset))`` and the batching arguments; it
    uses a private ``torch.Generator`` and never touches the global RNG. Shards like
    ``DistributedSampler``: the permutation is padded (repeating from its start) to a multiple
    of ``world_size``, or its tail dropped with ``drop_last``, and rank ``r`` reads
    ``indices[r::world_size]``, cut into batches of ``batch_size`` (a final partial batch is
    kept unless ``drop_last``).

    Position it from the training loop's :class:`~pitstop.Progress` with
    :meth:`set_position` before each epoch; iterating yields the current epoch's batches from
    ``batch_in_epoch`` on and never moves the position itself.

    ``data_source_or_length`` is the dataset (only its length is read, once) or that length.
    ``rank`` and ``world_size`` default to torch.distributed's when it is initialized, else to
    0 and 1. Invalid arguments raise :class:`~pitstop.errors.ConfigError` naming them.
    """

    def __init__(
        self,
        data_source_or_length: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        problems: list[str] = []
        num_samples = self._length_of(data_source_or_length, problems)
        if not _is_int(batch_size) or batch_size < 1:
            problems.append(f"ResumableSampler.batch_size must be an int >= 1, got {batch_size!r}")
        if not _is_bool(shuffle):
            problems.append(f"ResumableSampler.shuffle must be a bool, got {shuffle!r}")
        if not _is_bool(drop_last):
            problems.append(f"ResumableSampler.drop_last must be a bool, got {drop_last!r}")
        if not _is_int(seed) or not _SEED_MIN <= seed <= _SEED_MAX:
            problems.append(
                f"ResumableSampler.seed must be an int in [-2**63, 2**64 - 1], got {seed!r}"
            )
        if rank is None or world_size is None:
            default_rank, default_world_size = _distributed()
            rank = default_rank if rank is None else rank
            world_size = default_world_size if world_size is None else world_size
        if not _is_int(world_size) or world_size < 1:
            problems.append(f"ResumableSampler.world_size must be an int >= 1, got {world_size!r}")
        elif not _is_int(rank) or not 0 <= rank < world_size:
            problems.append(
                f"ResumableSampler.rank must be an int in [0, world_size={world_size}), "
                f"got {rank!r}"
            )
        if problems:
            raise ConfigError(problems)

        self._num_samples: int = num_samples
        self._batch_size: int = batch_size
        self._shuffle: bool = shuffle
        self._seed: int = seed
        self._drop_last: bool = drop_last
        self._rank: int = rank
        self._world_size: int = world_size

        if drop_last:
            self._per_rank = num_samples // world_size
            self._batches = self._per_rank // batch_size
        else:
            self._per_rank = math.ceil(num_samples / world_size)
            self._batches = math.ceil(self._per_rank / batch_size)
        if self._batches == 0:
            raise ConfigError(
                f"ResumableSampler: {num_samples} sample(s) with world_size={world_size}, "
                f"batch_size={batch_size} and drop_last=True leave rank {rank} no full batch"
            )

        self._epoch = 0
        self._batch_in_epoch = 0
        self._cached: tuple[int, list[int]] | None = None  # (epoch, this rank's indices)

    @staticmethod
    def _length_of(data_source_or_length: object, problems: list[str]) -> int:
        if _is_int(data_source_or_length):
            length: object = data_source_or_length
        elif isinstance(data_source_or_length, Sized):
            length = len(data_source_or_length)
        else:
            problems.append(
                "ResumableSampler.data_source_or_length must be a map-style dataset with a "
                f"length, or that length, got {data_source_or_length!r}"
            )
            return 0
        if not _is_int(length) or length < 1:
            problems.append(
                "ResumableSampler.data_source_or_length must have at least one sample, "
                f"got length {length!r}"
            )
            return 0
        return length

    # --- identity ----------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """The dataset's length (all ranks together), read once at construction."""
        return self._num_samples

    @property
    def batch_size(self) -> int:
        """Samples per batch (the last batch of an epoch may be shorter unless ``drop_last``)."""
        return self._batch_size

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is a fresh permutation (``False``: ``0, 1, 2, ...`` every epoch)."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """The seed every epoch's order is derived from."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """Whether the tail that does not divide evenly (across ranks, then into batches) is
        dropped instead of padded or kept."""
        return self._drop_last

    @property
    def rank(self) -> int:
        """This process's shard."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of shards."""
        return self._world_size

    @property
    def batches_per_epoch(self) -> int:
        """The number of batches one full epoch yields on this rank."""
        return self._batches

    def __len__(self) -> int:
        """The number of batches one full epoch yields on this rank (regardless of position)."""
        return self._batches

    # --- position ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter(sampler)`` reads."""
        return self._epoch

    @property
    def batch_in_epoch(self) -> int:
        """The batch of :attr:`epoch` the next ``iter(sampler)`` starts at."""
        return self._batch_in_epoch

    @overload
    def set_position(self, progress: Progress, /, *, accumulate: int = 1) -> None: ...

    @overload
    def set_position(self, *, epoch: int, batch_in_epoch: int = 0, accumulate: int = 1) -> None: ...

    def set_position(
        self,
        progress: Progress | None = None,
        *,
        epoch: int | None = None,
        batch_in_epoch: int | None = None,
        accumulate: int = 1,
    ) -> None:
        """Position the sampler: the next iteration reads ``epoch`` from ``batch_in_epoch`` on.

        Pass the training loop's :class:`~pitstop.Progress` (its ``epoch`` and
        ``batch_in_epoch`` are used), or ``epoch=`` and ``batch_in_epoch=`` directly.
        With gradient accumulation, ``batch_in_epoch`` counts optimizer updates of
        ``accumulate`` batches each (as ``Progress`` does): the sampler starts at batch
        ``batch_in_epoch * accumulate``. That batch may equal :attr:`batches_per_epoch` (the
        epoch is finished and iterating yields nothing); beyond it raises
        :class:`~pitstop.errors.ConfigError` naming the numbers.
        """
        if progress is not None:
            if epoch is not None or batch_in_epoch is not None:
                raise ConfigError(
                    "ResumableSampler.set_position takes a Progress or epoch=/batch_in_epoch=, "
                    f"not both (got {progress!r}, epoch={epoch!r}, "
                    f"batch_in_epoch={batch_in_epoch!r})"
                )
            if not isinstance(progress, Progress):
                raise ConfigError(
                    f"ResumableSampler.set_position needs a pitstop Progress, got {progress!r}"
                )
            epoch, batch_in_epoch = progress.epoch, progress.batch_in_epoch
        elif epoch is None:
            raise ConfigError("ResumableSampler.set_position needs a Progress or epoch=")
        if batch_in_epoch is None:
            batch_in_epoch = 0
        if not _is_int(epoch) or epoch < 0:
            raise ConfigError(f"ResumableSampler epoch must be an int >= 0, got {epoch!r}")
        if not _is_int(batch_in_epoch) or batch_in_epoch < 0:
            raise ConfigError(
                "ResumableSampler batch_in_epoch must be an int in "
                f"[0, batches_per_epoch={self._batches}], got {batch_in_epoch!r} "
                f"(epoch {epoch})"
            )
        try:
            start = micro_batch_position(
                batch_in_epoch, accumulate=accumulate, batches_per_epoch=self._batches, epoch=epoch
            )
        except ConfigError as error:
            raise ConfigError(f"ResumableSampler {error}") from None
        self._epoch = epoch
        self._batch_in_epoch = start

    def set_epoch(self, epoch: int) -> None:
        """Position the sampler at the start of ``epoch`` (``DistributedSampler`` style)."""
        self.set_position(epoch=epoch, batch_in_epoch=0)

    # --- order -------------------------------------------------------------------------------

    def _rank_indices(self, epoch: int) -> list[int]:
        """Return this rank's indices of ``epoch``, in order (cached for the last epoch asked)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = self._num_samples
        if self._shuffle:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_epoch_seed(self._seed, epoch))
            order: list[int] = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        total = self._per_rank * self._world_size
        if total > n:  # pad by repeating from the start (possibly more than once)
            order = (order * math.ceil(total / n))[:total]
        else:
            del order[total:]
        indices = order[self._rank :: self._world_size]
        self._cached = (epoch, indices)
        return indices

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Return every batch of ``epoch`` on this rank, in order (for inspection)."""
        if not _is_int(epoch) or epoch < 0:
            raise ConfigError(f"ResumableSampler epoch must be an int >= 0, got {epoch!r}")
        indices = self._rank_indices(epoch)
        size = self._batch_size
        return [indices[b * size : (b + 1) * size] for b in range(self._batches)]

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the batches of :attr:`epoch` from :attr:`batch_in_epoch` on.

        The position is read when ``iter()`` is called; iterating does not change it.
        """
        indices = self._rank_indices(self._epoch)
        return self._batches_from(indices, self._batch_in_epoch)

    def _batches_from(self, indices: list[int], start: int) -> Iterator[list[int]]:
        size = self._batch_size
        for b in range(start, self._batches):
            yield indices[b * size : (b + 1) * size]

    # --- checkpoint component ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return the sampler's identity: every argument its order depends on.

        The position is not included; it comes from the checkpoint's Progress.
        """
        return {
            "seed": self._seed,
            "batch_size": self._batch_size,
            "num_samples": self._num_samples,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "world_size": self._world_size,
            "rank": self._rank,
        }

    def state_differences(self, state: object) -> list[str]:
        """Return one line per field in which ``state`` differs from this sampler's identity.

        An empty list means ``state`` would load. Checks only; changes nothing.
        """
        if not isinstance(state, Mapping):
            return [f"ResumableSampler state must be a mapping, got {state!r}"]
        live = self.state_dict()
        differences = []
        for key in _IDENTITY:
            if key not in state:
                differences.append(f"ResumableSampler.{key}: missing from the checkpoint")
                continue
            stored = state[key]
            if stored != live[key] or isinstance(stored, bool) != isinstance(live[key], bool):
                differences.append(
                    f"ResumableSampler.{key}: checkpoint has {stored!r}, this run has {live[key]!r}"
                )
        differences.extend(
            f"ResumableSampler: unexpected field {key!r} in the checkpoint"
            for key in state
            if key not in live
        )
        return differences

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that ``state`` is this sampler's identity; the sampler itself never changes.

        Raises :class:`~pitstop.errors.IncompatibleCheckpoint` listing every differing field:
        resuming with another seed, batch size, dataset length, shuffle, drop_last, world size
        or rank would silently read a different order.
        """
        differences = self.state_differences(state)
        if differences:
            raise IncompatibleCheckpoint(differences)

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(num_samples={self._num_samples}, batch_size={self._batch_size}, "
            f"shuffle={self._shuffle}, seed={self._seed}, drop_last={self._drop_last}, "
            f"rank={self._rank}, world_size={self._world_size}, epoch={self._epoch}, "
            f"batch_in_epoch={self._batch_in_epoch})"
        )
