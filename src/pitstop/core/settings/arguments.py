# The public calls' plain arguments, checked before anything is touched.
#
# Rules: a Checkpointer's settings are one frozen record whose validators name the argument as
# the caller wrote it (`Checkpointer.timeout_s must be ...`): a policy is a Policy (None: the
# default), the collectives' timeout a positive, finite number of seconds, async_save False,
# True or "overlap", overwrite a bool, per_rank component names (one str is one name). A save
# call's metrics are a mapping of non-empty str names to real numbers (never str, bytes, bool
# or None; NaN and infinities pass, as Best treats them), and a bad one names the call, the
# step and the metric. (A Best metric missing from a call's metrics is no error: that call is
# no candidate for best — pitstop.core.saving.schedule.) A device a load places tensors on must
# exist and hold data: "meta" never does; "cpu" always exists; any other type needs a device of that
# type, and an index below how many this process has. A path argument (a checkpoint, a
# directory, a file to write) is a str or an os.PathLike (bytes are not); anything else names
# the call, the argument and the type received (`verify checkpoint must be a path ..., got int
# 5`) — one check for every public call that takes a path.
# How: attrs validators (pitstop.core.validators) and small functions that return or raise;
# the shell turns tensors into Python numbers and counts devices first, the core only judges.

"""Argument checks of the public calls: the Checkpointer's settings, a save's metrics, the
device a load places tensors on, and path arguments."""

from __future__ import annotations

import decimal
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

import attrs

from pitstop.core.records import Policy
from pitstop.core.validators import fail, is_bool, positive_seconds
from pitstop.errors import ConfigError, InvalidValue

__all__ = [
    "CHECKPOINT_PATH",
    "CheckpointerOptions",
    "call_metrics",
    "check_path",
    "describe_value",
    "device_problem",
]

CHECKPOINT_PATH = "a checkpoint file, a pointer or a checkpoint directory"
"""What a ``checkpoint`` argument names (for :func:`check_path`'s ``to``)."""


def describe_value(value: object, limit: int = 60) -> str:
    """``value`` for a message: its type's name and its repr (cut to ``limit`` characters)."""
    text = repr(value)
    if len(text) > limit:
        text = f"{text[: limit - 3]}..."
    return f"{type(value).__qualname__} {text}"


def check_path(value: object, *, argument: str, to: str = "") -> None:
    """Raise a :class:`~pitstop.errors.ConfigError` unless ``value`` is a path.

    A path is a str or an ``os.PathLike`` (an object whose type has ``__fspath__``: the core
    imports no ``os``); bytes are not. ``argument`` names the call and the argument as the
    message starts them (``"verify checkpoint"``, ``"Checkpointer.directory"``); ``to`` says
    what the path names (``CHECKPOINT_PATH``). The message ends with the type and value
    received: ``verify checkpoint must be a path (str or os.PathLike) to a checkpoint file, a
    pointer or a checkpoint directory, got int 5``.
    """
    if isinstance(value, str) or getattr(type(value), "__fspath__", None) is not None:
        return
    names = f" to {to}" if to else ""
    raise ConfigError(
        f"{argument} must be a path (str or os.PathLike){names}, got {describe_value(value)}"
    )


def _policy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Policy):
        raise fail(
            instance,
            attribute,
            f"must be a pitstop.Policy (e.g. Policy(every_steps=100, keep_last=3)) or None, "
            f"got {describe_value(value)}",
        )


def _async_save(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "overlap")):
        raise fail(instance, attribute, f"must be False, True or 'overlap', got {value!r}")


def _default_policy(value: Policy | None) -> Policy:
    return Policy() if value is None else value


def _per_rank(value: object) -> tuple[str, ...]:
    """``per_rank`` as names: one str is one name, any other iterable its items."""
    names: object = (value,) if isinstance(value, str) else value
    if isinstance(names, Iterable) and not isinstance(names, (bytes, Mapping)):
        names = tuple(names)
        if all(isinstance(n, str) and n for n in names):
            return names
    raise InvalidValue(
        f"{CheckpointerOptions.error_name}.per_rank", f"must be component names, got {value!r}"
    )


@attrs.frozen(kw_only=True)
class CheckpointerOptions:
    """The Checkpointer's plain settings, checked at construction.

    A bad value raises :class:`~pitstop.errors.InvalidValue` naming the argument
    (``Checkpointer.timeout_s must be a positive, finite number of seconds, got -1``).
    """

    error_name: ClassVar[str] = "Checkpointer"
    """How messages name the record: after the call the user wrote."""

    policy: Policy = attrs.field(factory=Policy, converter=_default_policy, validator=_policy)
    timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    async_save: bool | Literal["overlap"] = attrs.field(default=False, validator=_async_save)
    overwrite: bool = attrs.field(default=False, validator=is_bool)
    per_rank: tuple[str, ...] = attrs.field(default=(), converter=_per_rank)
    """Names of components whose state differs per rank (one str is one name)."""


def _number(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):  # an int too large for a float; a signalling Decimal
        return None


def call_metrics(metrics: object, *, call: str, step: int) -> dict[str, float] | None:
    """Check the ``metrics=`` of ``call`` at ``step``; return them as floats (``None``: none).

    Raises :class:`~pitstop.errors.ConfigError` naming the call, the step and the offending
    metric: a mapping of non-empty str names to real numbers is required.
    """
    if metrics is None:
        return None
    where = f"{call}(step={step})"
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            f"{where}: metrics must be a mapping of metric names to numbers, such as "
            f"{{'val_loss': 0.25}}, got {describe_value(metrics)}"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"{where}: metric names must be non-empty str, got {describe_value(key)}"
            )
        number = _number(value)
        if number is None:
            raise ConfigError(
                f"{where}: metrics[{key!r}] must be a number (an int, a float, a one-element "
                f"tensor or a NumPy scalar), got {describe_value(value)}"
            )
        out[key] = number
    return out


def device_problem(
    argument: str, device: str, *, kind: str, index: int | None, count: int
) -> str | None:
    """Why ``device`` (of type ``kind``, number ``index``) cannot take a load's tensors.

    ``argument`` names the argument (``load_weights map_location``); ``count`` is how many
    devices of that type this process can use, as the shell counted them. ``None``: it can.
    """
    if kind == "meta":
        return (
            f"{argument}={device!r}: the meta device holds no data, so the model would be left "
            f"without its weights; pass a real device such as 'cpu' or 'cuda' (a model built on "
            f"the meta device loads with one of those)"
        )
    if kind == "cpu":
        return None
    if count <= 0:
        return (
            f"{argument}={device!r}: this process has no {kind} device (none is available or "
            f"torch was built without {kind} support); pass 'cpu' or a device it has"
        )
    if index is not None and not 0 <= index < count:
        last = f"{kind}:0" if count == 1 else f"{kind}:0 to {kind}:{count - 1}"
        return (
            f"{argument}={device!r}: there is no {kind}:{index}; this process has {count} "
            f"{kind} device(s) ({last})"
        )
    return None
