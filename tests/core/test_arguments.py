"""The public calls' argument checks: the Checkpointer's settings, a save's metrics, the
device a load places tensors on, and path arguments."""

from __future__ import annotations

import math
import os
from pathlib import PurePosixPath, PureWindowsPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.records import Policy
from pitstop.core.settings.arguments import (
    CHECKPOINT_PATH,
    CheckpointerOptions,
    call_metrics,
    check_path,
    device_problem,
)
from pitstop.errors import ConfigError, InvalidValue
from strategies import policies

seconds = st.floats(min_value=1e-6, max_value=1e9) | st.integers(min_value=1, max_value=10**9)
not_seconds = (
    st.floats(max_value=0.0)
    | st.sampled_from([math.nan, math.inf, -math.inf])
    | st.integers(max_value=0)
    | st.booleans()
    | st.text(max_size=5)
    | st.none()
    | st.lists(st.integers(), max_size=2)
)


@given(seconds)
def test_a_positive_finite_timeout_is_accepted_as_given(timeout: float) -> None:
    assert CheckpointerOptions(timeout_s=timeout).timeout_s == timeout


@given(not_seconds)
def test_any_other_timeout_is_refused_naming_the_argument_and_the_value(value: object) -> None:
    with pytest.raises(InvalidValue) as caught:
        CheckpointerOptions(timeout_s=value)  # type: ignore[arg-type]
    assert caught.value.field == "Checkpointer.timeout_s"
    assert str(caught.value) == (
        f"Checkpointer.timeout_s must be a positive, finite number of seconds, got {value!r}"
    )


@given(policies)
def test_a_policy_is_kept_and_none_is_the_default(policy: Policy) -> None:
    assert CheckpointerOptions(policy=policy).policy is policy
    assert CheckpointerOptions(policy=None).policy == Policy()  # type: ignore[arg-type]


@given(
    st.dictionaries(st.sampled_from(["keep_last", "every_steps"]), st.integers(1, 5))
    | st.integers()
    | st.text(max_size=5)
)
def test_anything_but_a_policy_is_refused_with_its_type(value: object) -> None:
    with pytest.raises(InvalidValue, match=r"^Checkpointer\.policy must be a pitstop\.Policy") as e:
        CheckpointerOptions(policy=value)  # type: ignore[arg-type]
    assert f"got {type(value).__qualname__} " in str(e.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "async_save",
            "yes",
            "Checkpointer.async_save must be False, True or 'overlap', got 'yes'",
        ),
        ("async_save", None, "Checkpointer.async_save must be False, True or 'overlap', got None"),
        ("overwrite", 1, "Checkpointer.overwrite must be a bool, got 1"),
        ("per_rank", 3, "Checkpointer.per_rank must be component names, got 3"),
        ("per_rank", [""], "Checkpointer.per_rank must be component names, got ['']"),
        ("per_rank", b"ab", "Checkpointer.per_rank must be component names, got b'ab'"),
    ],
)
def test_the_other_settings_name_themselves(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidValue) as caught:
        CheckpointerOptions(**{field: value})
    assert str(caught.value) == message


@given(st.text(min_size=1, max_size=8))
def test_one_str_is_one_component_name(name: str) -> None:
    assert CheckpointerOptions(per_rank=name).per_rank == (name,)


@given(st.lists(st.text(min_size=1, max_size=8), max_size=4))
def test_an_iterable_of_names_is_its_items(names: list[str]) -> None:
    assert CheckpointerOptions(per_rank=iter(names)).per_rank == tuple(names)


# --- a save call's metrics ----------------------------------------------------------------------

calls = st.sampled_from(["maybe_save", "save", "finish"])
names = st.text(min_size=1, max_size=8)
numbers_ = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.decimals(allow_nan=False, allow_infinity=False, places=3)
)
not_numbers = (
    st.text(max_size=4)
    | st.binary(max_size=4)
    | st.booleans()
    | st.none()
    | st.lists(st.floats(), max_size=2)
    | st.complex_numbers(max_magnitude=10)
)


@given(st.dictionaries(names, numbers_, max_size=4), calls, st.integers(0, 10**6))
def test_real_numbers_come_back_as_floats_under_their_names(
    metrics: dict[str, object], call: str, step: int
) -> None:
    out = call_metrics(metrics, call=call, step=step)
    assert out is not None
    assert list(out) == list(metrics)
    for name, value in out.items():
        assert type(value) is float
        expected = float(metrics[name])  # type: ignore[arg-type]
        assert value == expected or (math.isnan(value) and math.isnan(expected))


@given(calls, st.integers(0, 10**6))
def test_no_metrics_are_none(call: str, step: int) -> None:
    assert call_metrics(None, call=call, step=step) is None


@given(
    st.dictionaries(names, numbers_, max_size=3), names, not_numbers, calls, st.integers(0, 10**6)
)
def test_a_value_that_is_no_number_names_the_call_the_step_and_the_metric(
    good: dict[str, object], name: str, bad: object, call: str, step: int
) -> None:
    metrics = {**good, name: bad}
    with pytest.raises(ConfigError) as caught:
        call_metrics(metrics, call=call, step=step)
    message = str(caught.value)
    assert message.startswith(f"{call}(step={step}): metrics[{name!r}] must be a number")
    assert f"got {type(bad).__qualname__} " in message


@given(
    st.lists(st.floats(), max_size=2) | st.text(max_size=4) | st.integers() | st.floats(),
    calls,
    st.integers(0, 10**6),
)
def test_metrics_that_are_no_mapping_are_refused_with_their_type(
    metrics: object, call: str, step: int
) -> None:
    with pytest.raises(ConfigError) as caught:
        call_metrics(metrics, call=call, step=step)
    assert str(caught.value).startswith(
        f"{call}(step={step}): metrics must be a mapping of metric names to numbers"
    )
    assert f"got {type(metrics).__qualname__} " in str(caught.value)


@given(st.integers() | st.none() | st.just(""), calls, st.integers(0, 10**6))
def test_a_metric_name_that_is_no_str_is_refused(key: object, call: str, step: int) -> None:
    with pytest.raises(ConfigError, match=r"metric names must be non-empty str, got "):
        call_metrics({key: 1.0}, call=call, step=step)


# --- the device a load places tensors on --------------------------------------------------------

kinds = st.sampled_from(["cuda", "xpu", "mps", "hpu", "privateuseone"])


@given(st.none() | st.integers(0, 16), st.integers(0, 16))
def test_the_cpu_always_takes_tensors_and_meta_never(index: int | None, count: int) -> None:
    assert device_problem("map_location", "cpu", kind="cpu", index=index, count=count) is None
    problem = device_problem("map_location", "meta", kind="meta", index=index, count=count)
    assert problem is not None
    assert problem.startswith("map_location='meta': the meta device holds no data")


@given(kinds, st.none() | st.integers(0, 16), st.integers(-1, 16))
def test_another_device_takes_tensors_exactly_when_this_process_has_it(
    kind: str, index: int | None, count: int
) -> None:
    device = kind if index is None else f"{kind}:{index}"
    problem = device_problem(
        "load_weights map_location", device, kind=kind, index=index, count=count
    )
    has_it = count > 0 and (index is None or index < count)
    assert (problem is None) == has_it
    if problem is not None:
        assert problem.startswith(f"load_weights map_location={device!r}: ")
        if count <= 0:
            assert f"this process has no {kind} device" in problem
        else:
            assert (
                f"there is no {kind}:{index}; this process has {count} {kind} device(s)" in problem
            )


# --- path arguments -------------------------------------------------------------------------


class FsPath:
    """An os.PathLike of the caller's own (the core sees only its ``__fspath__``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


class NoFsPath(FsPath):
    __fspath__ = None  # type: ignore[assignment]  # opts out, as os.PathLike honours


arguments = st.sampled_from(["verify checkpoint", "Checkpointer.directory", "export_weights path"])
paths = st.text(max_size=8).flatmap(
    lambda text: st.sampled_from([text, PurePosixPath(text), PureWindowsPath(text), FsPath(text)])
)
not_paths = (
    st.none()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.binary(max_size=8)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    | st.lists(st.text(max_size=3), max_size=2)
    | st.builds(NoFsPath, st.text(max_size=3))
)


@given(paths, arguments)
def test_a_str_or_a_path_like_is_a_path(value: object, argument: str) -> None:
    assert isinstance(value, (str, os.PathLike))
    check_path(value, argument=argument, to=CHECKPOINT_PATH)


@given(not_paths, arguments, st.sampled_from(["", CHECKPOINT_PATH]))
def test_anything_else_names_the_argument_and_the_type_received(
    value: object, argument: str, to: str
) -> None:
    assert not isinstance(value, (str, os.PathLike))
    with pytest.raises(ConfigError) as caught:
        check_path(value, argument=argument, to=to)
    assert type(caught.value) is ConfigError
    message = str(caught.value)
    names = f" to {to}" if to else ""
    assert message.startswith(f"{argument} must be a path (str or os.PathLike){names}, got ")
    assert f", got {type(value).__qualname__} " in message
