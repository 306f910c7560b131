# A dataset whose DataLoader workers' random state travels in the loader's state.
#
# Rules: WorkerRNG(dataset) keeps the dataset's kind (map-style stays map-style, an
# IterableDataset stays one), its len() (when it has one), its attributes, and its own
# state_dict()/load_state_dict() (nested under "dataset"; None when it has none). Its state
# adds, under "rng", the Python, NumPy (when installed) and torch CPU random state of the worker
# process it runs in, read when torchdata's StatefulDataLoader snapshots the worker (right
# after the worker produced a batch it was asked to snapshot) and set when the worker is
# restored (before it produces anything). In the main process (num_workers=0) "rng" is None and
# a stored one is not applied: the checkpoint's own RNG streams are restored there. A stream's
# iterator is made from the dataset after its state is loaded, so a stream whose __iter__
# starts from the position its state_dict() records resumes at the exact sample. A stream
# without state_dict()/load_state_dict() would restart from its beginning in every worker
# (WorkerRNG's own state makes torchdata take it as stateful): stateless_stream() names it, and
# the resume check refuses it under strict (a soft difference: strict=False warns).
# How: a Dataset (or IterableDataset) that delegates to the wrapped one; the iterable kind is
# its own iterator, so torchdata snapshots and restores it as the worker's dataset iterator.

"""WorkerRNG: a DataLoader worker's random state, snapshotted and restored with the loader."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from pitstop.errors import ConfigError

__all__ = ["WorkerRNG", "stateless_stream"]

_KEYS: Final = ("dataset", "rng")


def _in_worker() -> bool:
    return get_worker_info() is not None


def _capture() -> dict[str, Any]:
    numpy = sys.modules.get("numpy")
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch": torch.get_rng_state(),
    }


def _apply(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    if state["numpy"] is not None:
        import numpy

        numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class WorkerRNG(Dataset[Any]):
    """Wrap ``dataset`` so that each DataLoader worker's random state resumes exactly.

    Pass the wrapped dataset to torchdata's ``StatefulDataLoader`` (``pip install
    pitstop[data]``) and give the loader to the Checkpointer's ``state=``. The state the loader
    snapshots inside each worker then holds that worker's Python, NumPy and torch random
    state, restored inside the worker on resume: a random transform in ``__getitem__`` (or in
    a stream's ``__iter__``) draws what it would have drawn in the straight run. A map-style
    dataset stays map-style and an ``IterableDataset`` stays iterable; ``len()``, attributes
    and the dataset's own ``state_dict()``/``load_state_dict()`` are kept.
    """

    dataset: Any

    def __new__(cls, dataset: Any) -> WorkerRNG:
        if cls is WorkerRNG and isinstance(dataset, IterableDataset):
            return super().__new__(_IterableWorkerRNG)
        return super().__new__(cls)

    def __init__(self, dataset: Any) -> None:
        if isinstance(dataset, WorkerRNG):
            raise ConfigError(f"WorkerRNG: {dataset!r} is already a WorkerRNG")
        if not (isinstance(dataset, IterableDataset) or hasattr(dataset, "__getitem__")):
            raise ConfigError(
                f"WorkerRNG needs a dataset (with __getitem__, or an IterableDataset), "
                f"got {type(dataset).__qualname__}"
            )
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # Only called for names the wrapper lacks; never for dunders (pickling asks for them).
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's own state (None when it has none) and, in a worker, its random state."""
        own = getattr(self.dataset, "state_dict", None)
        return {
            "dataset": own() if callable(own) else None,
            "rng": _capture() if _in_worker() else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the dataset's own state and, in a worker, the worker's random state."""
        if not isinstance(state, Mapping) or set(state) != set(_KEYS):
            raise ValueError(
                f"WorkerRNG state must be a mapping with the keys {list(_KEYS)}, got {state!r:.80}"
            )
        if state["dataset"] is not None:
            load = getattr(self.dataset, "load_state_dict", None)
            if not callable(load):
                raise ValueError(
                    f"WorkerRNG: the state holds the dataset's own state, but "
                    f"{type(self.dataset).__qualname__} has no load_state_dict()"
                )
            load(state["dataset"])
        if state["rng"] is not None and _in_worker():
            _apply(state["rng"])

    def __reduce__(self) -> tuple[type[WorkerRNG], tuple[Any]]:
        # Pickled (to start spawned workers) as WorkerRNG(dataset): __new__ picks the kind.
        return WorkerRNG, (self.dataset,)

    def __repr__(self) -> str:
        return f"WorkerRNG({self.dataset!r})"


class _IterableWorkerRNG(WorkerRNG, IterableDataset[Any]):
    """WorkerRNG of an IterableDataset: its own iterator, made fresh after each load."""

    _iterator: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        self._iterator = None
        return self

    def __next__(self) -> Any:
        if self._iterator is None:  # after the state is loaded: the stream starts from it
            self._iterator = iter(self.dataset)
        return next(self._iterator)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._iterator = None


def stateless_stream(dataset: object) -> str | None:
    """What to add when ``dataset`` is a WorkerRNG of a stream without state, else None."""
    if not isinstance(dataset, _IterableWorkerRNG):
        return None
    inner = dataset.dataset
    if callable(getattr(inner, "state_dict", None)) and callable(
        getattr(inner, "load_state_dict", None)
    ):
        return None
    return (
        f"its dataset is WorkerRNG({type(inner).__qualname__}), a stream (IterableDataset) with "
        "no state_dict()/load_state_dict(), so each worker's stream restarts from its beginning "
        f"on resume; add to {type(inner).__qualname__} a state_dict() returning its position "
        "(a sample count, a shard cursor) and a load_state_dict(state) after which __iter__ "
        "starts there"
    )
