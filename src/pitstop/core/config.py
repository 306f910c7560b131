# The YAML `checkpoint:` section.
#
# Rules: keys and defaults follow the seed (`enabled`, `directory`, `every_steps`, `keep_last`,
# `resume`) plus pitstop's own (`every_seconds`, `keep_every`, `best`, `save_final`, `async`).
# Unknown keys and wrong types are errors; every problem is reported at once, each as a key path
# (`checkpoint.keep_lst: unknown key (did you mean keep_last?)`). Types are strict: "100" is not
# an int and 1 is not a bool. `best` is a metric name or {metric, mode}. A relative `directory`
# resolves under the run's output directory.
# How: one cattrs converter with forbid_extra_keys and strict primitive hooks; its validation
# error tree is flattened into ConfigError problems.

"""The ``checkpoint:`` configuration section and its strict converter."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal, cast, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, override

from pitstop.core.records import Best, Policy
from pitstop.core.validators import (
    fail,
    is_bool,
    is_int,
    is_real,
    positive_int_or_none,
    positive_seconds_or_none,
)
from pitstop.errors import ConfigError, InvalidValue

__all__ = [
    "AsyncMode",
    "CheckpointConfig",
    "converter",
    "parse_checkpoint_config",
    "register_record",
    "resolve_directory",
    "structure",
]

AsyncMode = bool | Literal["overlap"]


def _directory(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise fail(instance, attribute, f"must be a non-empty path, got {value!r}")


def _async_mode(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, bool) or value == "overlap"):
        raise fail(instance, attribute, f"must be true, false or 'overlap', got {value!r}")


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """The ``checkpoint:`` section of a run configuration."""

    enabled: bool = attrs.field(default=True, validator=is_bool)
    directory: str = attrs.field(default="checkpoints", validator=_directory)
    every_steps: int | None = attrs.field(default=None, validator=positive_int_or_none)
    every_seconds: float | None = attrs.field(default=None, validator=positive_seconds_or_none)
    keep_last: int | None = attrs.field(default=3, validator=positive_int_or_none)
    keep_every: int | None = attrs.field(default=None, validator=positive_int_or_none)
    best: Best | None = None
    save_final: bool = attrs.field(default=True, validator=is_bool)
    resume: bool = attrs.field(default=False, validator=is_bool)
    async_: AsyncMode = attrs.field(default=False, validator=_async_mode)

    def policy(self) -> Policy:
        """Return the save/retention policy this section describes."""
        return Policy(
            every_steps=self.every_steps,
            every_seconds=self.every_seconds,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            best=self.best,
            save_final=self.save_final,
        )


# --- the converter ----------------------------------------------------------------------------

# The records a configuration is made of, with their Python attribute → YAML key renames.
_RECORDS: dict[type, Mapping[str, str]] = {CheckpointConfig: {"async_": "async"}, Best: {}}


def register_record(cls: type, renames: Mapping[str, str] | None = None) -> None:
    """Teach :data:`converter` a configuration record: strict, renamed, validated per field.

    Each field is structured and then checked by its own validator, so every bad field is
    reported under its own key path, all at once.
    """
    _RECORDS[cls] = dict(renames or {})
    converter.register_structure_hook(cls, _record_hook(converter, cls, _RECORDS[cls]))


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _strict_int(value: object, _: type) -> int:
    if not is_int(value):
        raise TypeError(f"expected an int, got {_describe(value)}")
    return value


def _strict_float(value: object, _: type) -> float:
    if not is_real(value):
        raise TypeError(f"expected a number, got {_describe(value)}")
    return float(value)


def _strict_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {_describe(value)}")
    return value


def _strict_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_describe(value)}")
    return value


def _literal(value: object, cls: Any) -> object:
    allowed = get_args(cls)
    if value not in allowed or type(value) not in {type(a) for a in allowed}:
        choices = ", ".join(repr(a) for a in allowed)
        raise TypeError(f"expected one of {choices}, got {_describe(value)}")
    return value


def _field_hook(conv: cattrs.Converter, cls: type, field: attrs.Attribute[Any]) -> Any:
    def hook(value: object, annotation: Any) -> object:
        structured = conv.structure(value, annotation)
        if field.validator is not None:
            field.validator(cls, field, structured)
        return structured

    return hook


def _record_hook(conv: cattrs.Converter, cls: type, renames: Mapping[str, str]) -> Any:
    attrs.resolve_types(cls)
    overrides: dict[str, Any] = {
        f.name: override(rename=renames.get(f.name), struct_hook=_field_hook(conv, cls, f))
        for f in attrs.fields(cls)
        if f.init
    }
    return make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True, **overrides)


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook_func(lambda t: get_origin(t) is cast(Any, Literal), _literal)
    # The union is checked by the field's own validator.
    conv.register_structure_hook_func(lambda t: t == AsyncMode, lambda value, _: value)
    for cls, renames in _RECORDS.items():
        conv.register_structure_hook(cls, _record_hook(conv, cls, renames))

    best_from_mapping = _record_hook(conv, Best, _RECORDS[Best])

    def structure_best(value: object, cls: type) -> Best:
        if isinstance(value, str):
            return Best(value)
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a metric name or {{metric, mode}}, got {_describe(value)}")
        best: Best = best_from_mapping(value, cls)
        return best

    conv.register_structure_hook(Best, structure_best)
    return conv


converter: cattrs.Converter = _make_converter()
"""The one converter every pitstop configuration record is structured with."""


def _keys_of(cls: type | None) -> list[str]:
    if cls is None or not attrs.has(cls):
        return []
    renames = _RECORDS.get(cls, {})
    return [renames.get(a.name, a.name) for a in attrs.fields(cls) if a.init]


def _problems(exc: BaseException, path: str) -> list[str]:
    """Flatten a cattrs validation error tree into ``key.path: problem`` lines."""
    if isinstance(exc, ForbiddenExtraKeysError):
        known = _keys_of(exc.cl)
        lines = []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"{path}.{key}: unknown key ({hint})")
        return lines
    if isinstance(exc, ClassValidationError):
        renames = _RECORDS.get(exc.cl, {})
        attr_notes, rest = exc.group_exceptions()
        lines = []
        for sub, note in attr_notes:
            lines += _problems(sub, f"{path}.{renames.get(note.name, note.name)}")
        for sub in rest:
            lines += _problems(sub, path)
        return lines
    if isinstance(exc, IterableValidationError):
        index_notes, rest = exc.group_exceptions()
        lines = []
        for sub, index_note in index_notes:
            lines += _problems(sub, f"{path}[{index_note.index!r}]")
        for sub in rest:
            lines += _problems(sub, path)
        return lines
    if isinstance(exc, KeyError):
        return [f"{path}: required key missing"]
    if isinstance(exc, InvalidValue):
        return [f"{path}: {exc.requirement}"]
    if isinstance(exc, ConfigError):
        return [f"{path}: {p}" for p in exc.problems]
    return [f"{path}: {exc}"]


def structure(data: object, cls: type[Any], *, path: str) -> Any:
    """Structure ``data`` into ``cls`` with the strict converter.

    Raises :class:`~pitstop.errors.ConfigError` listing every problem as a key path under
    ``path`` (``checkpoint.keep_lst: unknown key (did you mean keep_last?)``).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_describe(data)}")
    try:
        return converter.structure(data, cls)
    except (cattrs.BaseValidationError, ConfigError, TypeError, ValueError, KeyError) as exc:
        raise ConfigError(sorted(_problems(exc, path)) or [f"{path}: {exc}"]) from None


def parse_checkpoint_config(
    data: Mapping[str, object] | None, *, path: str = "checkpoint"
) -> CheckpointConfig:
    """Parse a ``checkpoint:`` mapping (``None`` or empty: all defaults)."""
    config: CheckpointConfig = structure({} if data is None else data, CheckpointConfig, path=path)
    return config


def resolve_directory(output_dir: str, directory: str) -> str:
    """Resolve a configured checkpoint ``directory`` against the run's ``output_dir``.

    An absolute directory (starting with ``/``) stands as it is; a relative one goes under
    ``output_dir``: ``resolve_directory("runs/a", "checkpoints") == "runs/a/checkpoints"``.
    """
    if directory.startswith("/"):
        return directory
    return f"{output_dir.rstrip('/')}/{directory}" if output_dir else directory
