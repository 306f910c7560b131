# The YAML run configuration of the reference trainer.
#
# Rules: a run file has the sections run, model, data, optimizer, scheduler, ema and checkpoint
# (the core's CheckpointConfig). Every section is a frozen attrs record structured by this
# module's own ConfigConverter (the core's one definition of strictness, built here once with
# these sections; the core's own converter is left alone): unknown keys, wrong types (a string
# is not a number, 1 is not a bool) and missing required keys are errors, all reported at
# once, each as a key path
# (`run.max_stepz: unknown key (did you mean max_steps?)`). Required: run.output_dir and
# optimizer.lr; everything else has a default. Command-line flags are applied to the raw mapping
# before it is structured, so they are validated like the file. The part of the configuration a
# resume must match (the recipe) leaves out the cumulative limits (run.max_steps, run.epochs,
# scheduler.max_steps: a resume may raise them), where the run lives and runs (output_dir,
# device) and what only changes reporting or saving (eval_every, log_every, checkpoint).
# Checkpoints store every section but `checkpoint` (stored()), and a resume is told that the
# keys outside the recipe may change (MAY_CHANGE, the Checkpointer's config_may_change): they
# are compared and reported, never refused.
# How: pure Python (no torch): yaml.safe_load, the converter's structure() per section, and
# plain dict building for the recipe.

"""The YAML run configuration: sections, strict parsing, and command-line overrides."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from pitstop.core.settings.config import CheckpointConfig, ConfigConverter, resolve_directory
from pitstop.core.validators import (
    count,
    count_or_none,
    fail,
    is_bool,
    is_real,
    positive_int,
    positive_int_or_none,
)
from pitstop.errors import ConfigError

__all__ = [
    "MAY_CHANGE",
    "DataSection",
    "EmaSection",
    "ModelSection",
    "OptimizerSection",
    "RunConfig",
    "RunSection",
    "SchedulerSection",
    "load_config",
    "override",
    "read_yaml",
]


# --- validators -------------------------------------------------------------------------------


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_real(value) or not 0 <= value < float("inf"):
        raise fail(instance, attribute, f"must be a finite number >= 0, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_real(value) or not 0 < value < float("inf"):
        raise fail(instance, attribute, f"must be a finite number > 0, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_real(value) or not 0 <= value < 1:
        raise fail(instance, attribute, f"must be a number in [0, 1), got {value!r}")


def _path(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise fail(instance, attribute, f"must be a non-empty path, got {value!r}")


def _device(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("cpu", "cuda"):
        raise fail(instance, attribute, f"must be 'cpu' or 'cuda', got {value!r}")


# --- sections ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunSection:
    """``run:`` where the run lives, how long it goes, and how it is seeded.

    ``max_steps`` and ``epochs`` are cumulative, absolute limits (a resume continues to them);
    at least one must be set. ``accumulate`` micro-batches make one optimizer update.
    ``eval_every`` evaluates (and may move ``best``) every N updates; ``log_every`` prints a
    plain progress line every N updates.
    """

    output_dir: str = attrs.field(validator=_path)
    max_steps: int | None = attrs.field(default=None, validator=count_or_none)
    epochs: int | None = attrs.field(default=None, validator=count_or_none)
    seed: int = attrs.field(default=0, validator=count)
    device: Literal["cpu", "cuda"] = attrs.field(default="cpu", validator=_device)
    accumulate: int = attrs.field(default=1, validator=positive_int)
    eval_every: int | None = attrs.field(default=None, validator=positive_int_or_none)
    log_every: int = attrs.field(default=1, validator=positive_int)


@attrs.frozen(kw_only=True)
class ModelSection:
    """``model:`` the built-in MLP: Linear → ReLU → Dropout → Linear."""

    hidden: int = attrs.field(default=32, validator=positive_int)
    dropout: float = attrs.field(default=0.0, validator=_fraction)


@attrs.frozen(kw_only=True)
class DataSection:
    """``data:`` the built-in synthetic task: noisy linear regression, generated from ``seed``.

    ``seed`` also shuffles the training set (a new order every epoch).
    """

    samples: int = attrs.field(default=256, validator=positive_int)
    val_samples: int = attrs.field(default=64, validator=positive_int)
    features: int = attrs.field(default=8, validator=positive_int)
    noise: float = attrs.field(default=0.1, validator=_non_negative)
    batch_size: int = attrs.field(default=16, validator=positive_int)
    seed: int = attrs.field(default=0, validator=count)


@attrs.frozen(kw_only=True)
class OptimizerSection:
    """``optimizer:`` AdamW."""

    lr: float = attrs.field(validator=_positive)
    weight_decay: float = attrs.field(default=0.01, validator=_non_negative)


@attrs.frozen(kw_only=True)
class SchedulerSection:
    """``scheduler:`` linear warm-up over ``warmup_steps``, then cosine decay to 0 at
    ``max_steps`` (``null``: constant after the warm-up)."""

    warmup_steps: int = attrs.field(default=0, validator=count)
    max_steps: int | None = attrs.field(default=None, validator=count_or_none)


@attrs.frozen(kw_only=True)
class EmaSection:
    """``ema:`` an exponential moving average of the weights (AveragedModel)."""

    enabled: bool = attrs.field(default=False, validator=is_bool)
    decay: float = attrs.field(default=0.999, validator=_fraction)


MAY_CHANGE: tuple[str, ...] = (
    "run.max_steps",
    "run.epochs",
    "scheduler.max_steps",
    "run.output_dir",
    "run.device",
    "run.eval_every",
    "run.log_every",
)
"""The stored keys a resumed run may change (the Checkpointer's ``config_may_change``): the
cumulative limits, where the run lives and runs, and how often it evaluates and logs."""

# The one converter of a run file: the core's records (checkpoint, best) and these sections.
_CONVERTER = ConfigConverter(
    (RunSection, ModelSection, DataSection, OptimizerSection, SchedulerSection, EmaSection)
)

# Section name → (record, whether the section may be left out).
_SECTIONS: dict[str, tuple[type, bool]] = {
    "run": (RunSection, False),
    "model": (ModelSection, True),
    "data": (DataSection, True),
    "optimizer": (OptimizerSection, False),
    "scheduler": (SchedulerSection, True),
    "ema": (EmaSection, True),
    "checkpoint": (CheckpointConfig, True),
}


@attrs.frozen(kw_only=True)
class RunConfig:
    """A whole run: every section, parsed and validated."""

    run: RunSection
    model: ModelSection = attrs.field(factory=ModelSection)
    data: DataSection = attrs.field(factory=DataSection)
    optimizer: OptimizerSection
    scheduler: SchedulerSection = attrs.field(factory=SchedulerSection)
    ema: EmaSection = attrs.field(factory=EmaSection)
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)

    @property
    def checkpoint_dir(self) -> Path | None:
        """Where checkpoints go (a relative ``checkpoint.directory`` is under
        ``run.output_dir``); ``None`` when ``checkpoint.enabled`` is false."""
        if not self.checkpoint.enabled:
            return None
        return Path(resolve_directory(self.run.output_dir, self.checkpoint.directory))

    def stored(self) -> dict[str, Any]:
        """The configuration every checkpoint stores: each section but ``checkpoint``.

        Of it, the keys :data:`MAY_CHANGE` names are compared on resume but only reported;
        the rest is the :meth:`recipe`.
        """
        return {
            "run": attrs.asdict(self.run),
            "model": attrs.asdict(self.model),
            "data": attrs.asdict(self.data),
            "optimizer": attrs.asdict(self.optimizer),
            "scheduler": attrs.asdict(self.scheduler),
            "ema": attrs.asdict(self.ema),
        }

    def recipe(self) -> dict[str, Any]:
        """The part of the configuration a resumed run must match, stored in checkpoints.

        Left out: the cumulative limits (``run.max_steps``, ``run.epochs``,
        ``scheduler.max_steps``), which a resume may raise; ``run.output_dir`` and
        ``run.device``, which say where the run lives and runs, not what it computes;
        ``run.eval_every``, ``run.log_every`` and ``checkpoint``, which change only what is
        reported and saved.
        """
        return {
            "run": {"seed": self.run.seed, "accumulate": self.run.accumulate},
            "model": attrs.asdict(self.model),
            "data": attrs.asdict(self.data),
            "optimizer": attrs.asdict(self.optimizer),
            "scheduler": {"warmup_steps": self.scheduler.warmup_steps},
            "ema": attrs.asdict(self.ema),
        }


BUILTIN_CONFIGS = ("smoke",)
"""Run files shipped inside the package (``pitstop train --config smoke``): no checkout needed."""


def builtin_config(name: str) -> Path:
    """The path of the run file shipped with pitstop as ``name`` (``"smoke"``).

    ``configs/smoke.yaml`` in a checkout is the same file; an installed wheel has only this one.
    """
    if name not in BUILTIN_CONFIGS:
        known = ", ".join(BUILTIN_CONFIGS)
        raise ConfigError(f"{name}: no built-in configuration of that name (known: {known})")
    return Path(__file__).resolve().parent / "configs" / f"{name}.yaml"


def config_file(path: str | os.PathLike[str]) -> Path:
    """The run file ``path`` names: the file itself, else a built-in name (``smoke``)."""
    file = Path(path)
    name = os.fspath(path)
    if not file.exists() and name in BUILTIN_CONFIGS:
        return builtin_config(name)
    return file


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a run file (or a built-in one by name); raise :class:`ConfigError` naming the file.

    A YAML error names the file, its line and column (``configs/x.yaml", line 3, column 5``).
    """
    file = config_file(path)
    try:
        with file.open(encoding="utf-8") as stream:  # its name is what a YAML error shows
            data = yaml.safe_load(stream)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from None
    except OSError as exc:
        hint = ""
        if isinstance(exc, FileNotFoundError) and os.sep not in os.fspath(path):
            hint = f" (built-in configurations, by name: {', '.join(BUILTIN_CONFIGS)})"
        raise ConfigError(f"{file}: cannot read the configuration: {exc.strerror}{hint}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping of sections, got {type(data).__name__}")
    return data


def override(
    data: Mapping[str, Any],
    *,
    output_dir: str | os.PathLike[str] | None = None,
    max_steps: int | None = None,
    device: str | None = None,
    resume: bool | None = None,
    overwrite: bool | None = None,
) -> dict[str, Any]:
    """Return ``data`` with command-line values applied (``None``: leave as is).

    ``max_steps`` sets both ``run.max_steps`` and ``scheduler.max_steps``, as the seed's CLI
    does: the schedule always ends where the run does.
    """
    out = dict(data)

    def set_key(section: str, key: str, value: object) -> None:
        current = out.get(section)
        merged = dict(current) if isinstance(current, Mapping) else {}
        merged[key] = value
        out[section] = merged

    if output_dir is not None:
        set_key("run", "output_dir", os.fspath(output_dir))
    if max_steps is not None:
        set_key("run", "max_steps", max_steps)
        set_key("scheduler", "max_steps", max_steps)
    if device is not None:
        set_key("run", "device", device)
    if resume is not None:
        set_key("checkpoint", "resume", resume)
    if overwrite is not None:
        set_key("checkpoint", "overwrite", overwrite)
    return out


def load_config(source: RunConfig | Mapping[str, Any] | str | os.PathLike[str]) -> RunConfig:
    """Parse a run configuration: a :class:`RunConfig`, a mapping, or a YAML file's path.

    Raises :class:`~pitstop.errors.ConfigError` listing every problem as a key path.
    """
    if isinstance(source, RunConfig):
        return source
    data = source if isinstance(source, Mapping) else read_yaml(source)
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for key in data:
        if key not in _SECTIONS:
            close = difflib.get_close_matches(str(key), list(_SECTIONS), n=1)
            known = ", ".join(_SECTIONS)
            hint = f"did you mean {close[0]}?" if close else f"known sections: {known}"
            problems.append(f"{key}: unknown key ({hint})")
    for name, (cls, optional) in _SECTIONS.items():
        if name not in data:
            if not optional:
                problems.append(f"{name}: required section missing")
            continue
        value = data[name]
        if value is None and optional:
            continue  # an empty section: all defaults
        try:
            sections[name] = _CONVERTER.structure(value, cls, path=name)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    config = RunConfig(**sections)
    if config.run.max_steps is None and config.run.epochs is None:
        raise ConfigError("run: set run.max_steps or run.epochs (or both); the run needs an end")
    return config
