"""pitstop.train: the reference trainer, YAML runs, and the built-in tiny task.

::

    from pitstop.train import Trainer, TrainConfig, train_from_config

    state = trainer.train(TrainConfig(epochs=100), checkpoint_dir=run_dir / "checkpoints",
                          resume_from=run_dir / "checkpoints" / "last")
    result = train_from_config("configs/smoke.yaml", resume=True)   # result.steps: absolute

Importing ``pitstop.train`` does not import torch; the names that need it load on first use,
so the CLI can reject a bad configuration before paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pitstop.train.config import RunConfig, load_config

if TYPE_CHECKING:
    from pitstop.train.records import TrainConfig, TrainState
    from pitstop.train.report import PlainReporter, Reporter, RichReporter
    from pitstop.train.run import TrainResult, train_from_config
    from pitstop.train.trainer import Trainer

_LAZY = {
    "PlainReporter": "pitstop.train.report",
    "Reporter": "pitstop.train.report",
    "RichReporter": "pitstop.train.report",
    "TrainConfig": "pitstop.train.records",
    "TrainResult": "pitstop.train.run",
    "TrainState": "pitstop.train.records",
    "Trainer": "pitstop.train.trainer",
    "train_from_config": "pitstop.train.run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pitstop.train' has no attribute {name!r}")


__all__ = [
    "PlainReporter",
    "Reporter",
    "RichReporter",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "Trainer",
    "load_config",
    "train_from_config",
]
