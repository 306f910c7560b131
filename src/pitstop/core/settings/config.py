# The YAML `checkpoint:` section, and the strict converter every configuration record goes
# through.
#
# Rules: keys and defaults follow the seed (`enabled`, `directory`, `every_steps`, `keep_last`,
# `resume`) plus pitstop's own (`every_seconds`, `keep_every`, `best`, `save_final`, `async`).
# Unknown keys and wrong types are errors; every problem is reported at once, each as a key path
# (`checkpoint.keep_lst: unknown key (did you mean keep_last?)`). Types are strict: "100" is not
# an int and 1 is not a bool. `best` is a metric name or {metric, mode}. A relative `directory`
# resolves under the run's output directory. Only a bad configuration becomes a ConfigError: a
# missing required key, an unknown key, a wrong type, a validator's ConfigError. Any other
# exception raised while structuring is a bug and propagates as itself.
# How: a ConfigConverter is one cattrs converter (forbid_extra_keys, strict primitive hooks,
# each field checked by its own validator) built once, with every hook, for a fixed set of
# records: the core's (CheckpointConfig, Best) plus those its caller names. Nothing registers
# hooks on it afterwards. Its validation error tree gets YAML keys in its notes and one leaf per
# unknown key, then cattrs.transform_error turns it into key paths.

"""The ``checkpoint:`` configuration section and the strict configuration converter."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)
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
    "ConfigConverter",
    "converter",
    "parse_checkpoint_config",
    "resolve_directory",
]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

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
    overwrite: bool = attrs.field(default=False, validator=is_bool)
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


# --- strict hooks -----------------------------------------------------------------------------

# The core's own configuration records, with their Python attribute → YAML key renames.
_CORE_RECORDS: Mapping[type, Mapping[str, str]] = {
    CheckpointConfig: {"async_": "async"},
    Best: {},
}


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _strict_int(value: object, _: type) -> int:
    if not is_int(value):
        raise ConfigError(f"expected an int, got {_describe(value)}")
    return value


def _strict_float(value: object, _: type) -> float:
    if not is_real(value):
        raise ConfigError(f"expected a number, got {_describe(value)}")
    return float(value)


def _strict_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, got {_describe(value)}")
    return value


def _strict_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {_describe(value)}")
    return value


def _literal(value: object, cls: Any) -> object:
    allowed = get_args(cls)
    if value not in allowed or type(value) not in {type(a) for a in allowed}:
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"expected one of {choices}, got {_describe(value)}")
    return value


def _field_hook(conv: cattrs.Converter, cls: type, field: attrs.Attribute[Any]) -> Any:
    def hook(value: object, annotation: Any) -> object:
        structured = conv.structure(value, annotation)
        if field.validator is not None:
            field.validator(cls, field, structured)
        return structured

    return hook


def _record_hook(conv: cattrs.Converter, cls: type, renames: Mapping[str, str]) -> Any:
    """Structure a mapping into ``cls``: strict, renamed, each field checked by its validator,
    so every bad field is reported under its own key, all at once."""
    attrs.resolve_types(cls)
    overrides: dict[str, Any] = {
        f.name: override(rename=renames.get(f.name), struct_hook=_field_hook(conv, cls, f))
        for f in attrs.fields(cls)
        if f.init
    }
    from_mapping: Callable[[Mapping[str, Any], Any], object] = make_dict_structure_fn(
        cls, conv, _cattrs_forbid_extra_keys=True, **overrides
    )

    def hook(value: object, annotation: type) -> object:
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {_describe(value)}")
        return from_mapping(value, annotation)

    return hook


def _best_hook(from_mapping: Callable[[object, type], object]) -> Any:
    def hook(value: object, cls: type) -> object:
        if isinstance(value, str):
            return Best(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a metric name or {{metric, mode}}, got {_describe(value)}")
        return from_mapping(value, cls)

    return hook


def _build(records: Mapping[type, Mapping[str, str]]) -> cattrs.Converter:
    """The one place a configuration converter gets its hooks: all of them, before first use."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook_func(lambda t: get_origin(t) is cast(Any, Literal), _literal)
    # The union is checked by the field's own validator.
    conv.register_structure_hook_func(lambda t: t == AsyncMode, lambda value, _: value)
    for cls, renames in records.items():
        hook = _record_hook(conv, cls, renames)
        conv.register_structure_hook(cls, _best_hook(hook) if cls is Best else hook)
    return conv


# --- errors as key paths ----------------------------------------------------------------------


class _UnknownKey(Exception):
    """One key of a mapping that its record does not have (one leaf per key)."""

    def __init__(self, key: str, known: Sequence[str]) -> None:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
        self.problem = f"unknown key ({hint})"
        super().__init__(self.problem)


def _attribute_note(exc: BaseException) -> AttributeValidationNote | None:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return note
    return None


def _iterable_index(exc: BaseException) -> int | str | None:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, IterableValidationNote):
            return note.index
    return None


def _item(data: object, index: int | str | None) -> object:
    """``data[index]``, or None where there is no such item."""
    if index is None:
        return None
    try:
        return cast(Any, data)[index]
    except (KeyError, IndexError, TypeError):
        return None


def _noted(exc: E, notes: Iterable[str]) -> E:
    """``exc`` with exactly ``notes`` (cattrs reads them, also on Python 3.10)."""
    setattr(exc, "__notes__", list(notes))  # noqa: B010  # typeshed has no __notes__ on 3.10
    return exc


def _descriptions(exc: BaseException) -> tuple[str, ...]:
    """What is wrong, for a leaf that :meth:`ConfigConverter._keyed` let through."""
    if isinstance(exc, InvalidValue):
        return (exc.requirement,)  # the key path names the field; "Record.field" would repeat it
    if isinstance(exc, ConfigError):
        return exc.problems
    if isinstance(exc, _UnknownKey):
        return (exc.problem,)
    if isinstance(exc, KeyError):
        return ("required key missing",)
    raise AssertionError(f"not a configuration problem: {exc!r}")  # _keyed raised it


class ConfigConverter:
    """The strict converter for a fixed set of configuration records.

    ``records``: the caller's attrs records (the core's :class:`CheckpointConfig` and
    :class:`~pitstop.core.records.Best` are always included); ``renames``: per record, its
    Python attribute → YAML key renames (``{"async_": "async"}``). Every hook is registered
    here, once; the converter is never changed afterwards, so each module that needs more
    records builds its own from this one definition.
    """

    def __init__(
        self,
        records: Iterable[type] = (),
        *,
        renames: Mapping[type, Mapping[str, str]] | None = None,
    ) -> None:
        table = {cls: dict(keys) for cls, keys in _CORE_RECORDS.items()}
        for cls in records:
            if not attrs.has(cls):
                raise TypeError(f"a configuration record must be an attrs class, got {cls!r}")
            table[cls] = dict((renames or {}).get(cls, {}))
            unknown = set(table[cls]) - {a.name for a in attrs.fields(cls)}
            if unknown:
                raise TypeError(f"{cls.__qualname__} has no fields {sorted(unknown)} to rename")
        self._renames: Mapping[type, Mapping[str, str]] = table
        self._converter = _build(table)

    @property
    def records(self) -> tuple[type, ...]:
        """The records this converter structures."""
        return tuple(self._renames)

    def keys(self, cls: type) -> list[str]:
        """The YAML keys of the record ``cls``, in field order."""
        renames = self._renames.get(cls, {})
        return [renames.get(a.name, a.name) for a in attrs.fields(cls) if a.init]

    def structure(self, data: object, cls: type[T], *, path: str) -> T:
        """Structure the mapping ``data`` into the record ``cls``.

        Raises :class:`~pitstop.errors.ConfigError` listing every problem as a key path under
        ``path`` (``checkpoint.keep_lst: unknown key (did you mean keep_last?)``). Any other
        exception (a bug in a hook or a validator) propagates as it is.
        """
        if cls not in self._renames:
            raise TypeError(f"{cls.__qualname__} is not a record of this converter")
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(data)}")
        try:
            structured: T = self._converter.structure(data, cls)
        except BaseValidationError as exc:  # also a record's own check across its fields
            raise ConfigError(sorted(self._problems(exc, data, path))) from None
        return structured

    def _problems(self, exc: BaseValidationError, data: object, path: str) -> list[str]:
        """``key.path: problem`` lines for a validation error tree, via transform_error."""
        found: list[tuple[str, ...]] = []

        def describe(leaf: BaseException, _: object) -> str:
            found.append(_descriptions(leaf))
            return str(len(found) - 1)  # an index, so the line parses back unambiguously

        lines = []
        for line in cattrs.transform_error(self._keyed(exc, data), path, describe):
            index, _, where = line.partition(" @ ")
            lines += [f"{where}: {problem}" for problem in found[int(index)]]
        return lines

    def _keyed(self, exc: BaseValidationError, data: object) -> BaseValidationError:
        """Return ``exc``'s tree with YAML keys in its attribute notes and one leaf per unknown
        key. A leaf that is not a configuration problem is a bug: it is raised as itself.

        ``data`` is what ``exc`` was structuring: a required key is missing only if a KeyError
        names it and ``data`` lacks it.
        """
        renames = self._renames.get(exc.cl, {}) if isinstance(exc, ClassValidationError) else {}
        leaves: list[Exception] = []
        for sub in exc.exceptions:
            if isinstance(sub, ForbiddenExtraKeysError):
                known = self.keys(sub.cl) if sub.cl in self._renames else []
                leaves += [
                    _noted(_UnknownKey(key, known), [AttributeValidationNote(key, key, None)])
                    for key in sorted(sub.extra_fields)
                ]
                continue
            note = _attribute_note(sub)
            key = None if note is None else renames.get(note.name, note.name)
            index = key if key is not None else _iterable_index(sub)
            if isinstance(sub, BaseValidationError):
                sub = self._keyed(sub, _item(data, index))
            elif isinstance(sub, ConfigError):
                pass
            elif (
                isinstance(sub, KeyError)
                and key is not None
                and sub.args == (key,)
                and isinstance(data, Mapping)
                and key not in data
            ):
                pass  # cattrs looked the required key up and the mapping lacks it
            else:
                sub.__suppress_context__ = True  # the group that held it adds nothing
                raise sub  # a bug, not a bad configuration
            if note is not None and key is not None:
                notes = [n for n in getattr(sub, "__notes__", ()) if n is not note]
                _noted(sub, [*notes, AttributeValidationNote(key, key, note.type)])
            leaves.append(sub)
        return _noted(exc.derive(leaves), getattr(exc, "__notes__", ()))


converter: ConfigConverter = ConfigConverter()
"""The converter of the core's own records (the ``checkpoint:`` section and ``best``)."""


def parse_checkpoint_config(
    data: Mapping[str, object] | None, *, path: str = "checkpoint"
) -> CheckpointConfig:
    """Parse a ``checkpoint:`` mapping (``None`` or empty: all defaults)."""
    return converter.structure({} if data is None else data, CheckpointConfig, path=path)


def resolve_directory(output_dir: str, directory: str) -> str:
    """Resolve a configured checkpoint ``directory`` against the run's ``output_dir``.

    An absolute directory (starting with ``/``) stands as it is; a relative one goes under
    ``output_dir``: ``resolve_directory("runs/a", "checkpoints") == "runs/a/checkpoints"``.
    """
    if directory.startswith("/"):
        return directory
    return f"{output_dir.rstrip('/')}/{directory}" if output_dir else directory
