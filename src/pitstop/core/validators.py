# Field validators for the core's records and config.
#
# Rules: a validator accepts exactly the documented type (a bool is not an int here) and raises
# ConfigError naming the record, the field and the value, e.g.
# "Policy.keep_last must be a positive int or None, got 0". A record that stands for a call's
# arguments names itself after the call (its `error_name`: "Checkpointer.timeout_s ...").
# How: attrs validator signature (instance, attribute, value); the name comes from both.

"""attrs field validators that raise ConfigError with the field's full name."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import attrs

from pitstop.errors import InvalidValue

__all__ = [
    "count",
    "count_or_none",
    "fail",
    "is_bool",
    "is_int",
    "is_real",
    "mode",
    "non_empty_str",
    "positive_int",
    "positive_int_or_none",
    "positive_seconds",
    "positive_seconds_or_none",
    "where",
]


def where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    """Return ``Record.field`` for error messages (``instance`` may be the class itself).

    A record with an ``error_name`` class attribute is called that instead of its class name.
    """
    cls = instance if isinstance(instance, type) else type(instance)
    name = getattr(cls, "error_name", None)
    return f"{name if isinstance(name, str) else cls.__name__}.{attribute.name}"


def fail(instance: object, attribute: attrs.Attribute[Any], requirement: str) -> InvalidValue:
    """Return the error for ``attribute`` of ``instance``: ``Policy.keep_last must be ...``."""
    return InvalidValue(where(instance, attribute), requirement)


def is_int(value: object) -> TypeGuard[int]:
    """Return whether ``value`` is an int (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """Return whether ``value`` is an int or a float (and not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require an int >= 0."""
    if not is_int(value) or value < 0:
        raise fail(instance, attribute, f"must be an int >= 0, got {value!r}")


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require an int >= 1."""
    if not is_int(value) or value < 1:
        raise fail(instance, attribute, f"must be an int >= 1, got {value!r}")


def count_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require an int >= 0 or None."""
    if value is not None and (not is_int(value) or value < 0):
        raise fail(instance, attribute, f"must be an int >= 0 or null, got {value!r}")


def positive_int_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require a positive int or None."""
    if value is not None and (not is_int(value) or value < 1):
        raise fail(instance, attribute, f"must be a positive int or None, got {value!r}")


def positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require a positive, finite number of seconds (an int or a float, not a bool)."""
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise fail(
            instance, attribute, f"must be a positive, finite number of seconds, got {value!r}"
        )


def positive_seconds_or_none(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    """Require a positive, finite number of seconds or None."""
    if value is not None and (not is_real(value) or not math.isfinite(value) or value <= 0):
        raise fail(
            instance, attribute, f"must be a positive number of seconds or None, got {value!r}"
        )


def is_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require a bool."""
    if not isinstance(value, bool):
        raise fail(instance, attribute, f"must be a bool, got {value!r}")


def non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require a non-empty str."""
    if not isinstance(value, str) or not value:
        raise fail(instance, attribute, f"must be a non-empty str, got {value!r}")


def mode(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Require 'min' or 'max'."""
    if value not in ("min", "max"):
        raise fail(instance, attribute, f"must be 'min' or 'max', got {value!r}")
