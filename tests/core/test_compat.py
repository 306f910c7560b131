"""Compatibility checks: every difference between a checkpoint and the live run, each once."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pitstop.core.compat import (
    Difference,
    Kind,
    TensorSpec,
    compare_config,
    diff_components,
    diff_config,
    diff_param_groups,
    diff_tensors,
    diff_world_size,
    flatten,
    may_change_patterns,
    may_change_rule,
)
from pitstop.errors import ConfigError

# --- strategies -------------------------------------------------------------------------------

# Names without quotes, so "'name'" in a message is that name and no other.
names = st.text("abcdefghij._0123", min_size=1, max_size=6)
# Config keys that cannot be confused with the key-path syntax ("a.b[0]").
keys = st.text("abcdefgh_", min_size=1, max_size=4)
dtypes = st.sampled_from(["float32", "float64", "bfloat16", "int64", "bool"])
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
specs = st.builds(TensorSpec, dtype=dtypes, shape=shapes)
spec_maps = st.dictionaries(names, specs, max_size=8)

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text("xyz", max_size=2)
)
configs = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=12,
)
config_maps = st.dictionaries(keys, configs, max_size=4)


def mentions(difference: Difference, name: str) -> bool:
    return repr(name) in difference.message


def spec_pairs() -> st.SearchStrategy[tuple[dict[str, TensorSpec], dict[str, TensorSpec]]]:
    """A stored and a live description that share some names (sometimes with equal specs)."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
        stored = draw(spec_maps)
        live = {
            name: draw(st.just(spec) | specs)
            for name, spec in stored.items()
            if draw(st.booleans())
        }
        live.update(draw(spec_maps))
        return stored, live

    return build()


# --- diff_tensors -----------------------------------------------------------------------------


@given(spec_pairs())
def test_diff_tensors_finds_every_difference_exactly_once(
    pair: tuple[dict[str, TensorSpec], dict[str, TensorSpec]],
) -> None:
    stored, live = pair
    found = diff_tensors("model", stored, live)
    expected: Counter[tuple[Kind, str]] = Counter()
    for name in live.keys() - stored.keys():
        expected[Kind.MISSING, name] += 1
    for name in stored.keys() - live.keys():
        expected[Kind.UNEXPECTED, name] += 1
    for name in stored.keys() & live.keys():
        if stored[name].shape != live[name].shape:
            expected[Kind.SHAPE, name] += 1
        if stored[name].dtype != live[name].dtype:
            expected[Kind.DTYPE, name] += 1
    assert len(found) == sum(expected.values())
    actual: Counter[tuple[Kind, str]] = Counter()
    for difference in found:
        assert difference.message.startswith("model: ")
        assert not difference.soft  # tensor differences are always hard
        named = [n for n in stored.keys() | live.keys() if mentions(difference, n)]
        assert len(named) == 1, (difference, named)
        actual[difference.kind, named[0]] += 1
    assert actual == expected


@given(spec_maps)
def test_identical_specs_have_no_differences(specs_: dict[str, TensorSpec]) -> None:
    assert diff_tensors("model", specs_, dict(specs_)) == []
    # Insertion order is not a difference.
    assert diff_tensors("model", specs_, dict(reversed(list(specs_.items())))) == []


@given(spec_pairs())
def test_diff_tensors_is_symmetric(
    pair: tuple[dict[str, TensorSpec], dict[str, TensorSpec]],
) -> None:
    stored, live = pair
    forward = Counter(d.kind for d in diff_tensors("x", stored, live))
    backward = Counter(d.kind for d in diff_tensors("x", live, stored))
    assert forward[Kind.MISSING] == backward[Kind.UNEXPECTED]
    assert forward[Kind.UNEXPECTED] == backward[Kind.MISSING]
    assert forward[Kind.SHAPE] == backward[Kind.SHAPE]
    assert forward[Kind.DTYPE] == backward[Kind.DTYPE]


def test_diff_tensors_messages() -> None:
    stored = {
        "fc.weight": TensorSpec(dtype="float32", shape=(4, 3)),
        "fc.bias": TensorSpec(dtype="float32", shape=(4,)),
        "old": TensorSpec(dtype="float32", shape=()),
    }
    live = {
        "fc.weight": TensorSpec(dtype="float64", shape=(4, 5)),
        "fc.bias": TensorSpec(dtype="float32", shape=(4,)),
        "new": TensorSpec(dtype="int64", shape=(1,)),
    }
    messages = sorted(str(d) for d in diff_tensors("ema", stored, live))
    assert messages == [
        "ema: 'fc.weight' has dtype float32 in the checkpoint, float64 in the run",
        "ema: 'fc.weight' has shape [4, 3] in the checkpoint, [4, 5] in the run",
        "ema: 'new' is in the run but not in the checkpoint",
        "ema: 'old' is in the checkpoint but not in the run",
    ]
    assert str(TensorSpec(dtype="float32", shape=(2, 3))) == "float32[2, 3]"


# --- diff_param_groups ------------------------------------------------------------------------

groups = st.lists(st.lists(names, max_size=6), max_size=4)


@given(groups)
def test_identical_param_groups_have_no_differences(layout: list[list[str]]) -> None:
    assert diff_param_groups("optimizer 'opt'", layout, [list(g) for g in layout]) == []
    # Tuples and lists describe the same groups.
    assert diff_param_groups("optimizer 'opt'", [tuple(g) for g in layout], layout) == []


@given(groups, groups)
def test_param_groups_every_differing_group_once(
    stored: list[list[str]], live: list[list[str]]
) -> None:
    found = diff_param_groups("optimizer 'opt'", stored, live)
    assert all(d.kind is Kind.GROUPS and not d.soft for d in found)
    assert all(d.message.startswith("optimizer 'opt': ") for d in found)
    if len(stored) != len(live):
        assert len(found) == 1
        assert f"{len(stored)} parameter group(s) in the checkpoint, {len(live)} in the run" in (
            found[0].message
        )
        return
    differing = [i for i, (a, b) in enumerate(zip(stored, live, strict=True)) if a != b]
    assert len(found) == len(differing)
    for index, difference in zip(differing, found, strict=True):
        assert f"parameter group {index} " in difference.message
        if len(stored[index]) != len(live[index]):
            assert (
                f"holds {len(stored[index])} parameter(s) in the checkpoint, "
                f"{len(live[index])} in the run" in difference.message
            )
        else:
            assert "holds other parameters" in difference.message


def test_param_groups_name_the_changed_parameters() -> None:
    [difference] = diff_param_groups("optimizer 'opt'", [["a", "b", "c"]], [["a", "x", "c"]])
    assert (
        difference.message
        == "optimizer 'opt': parameter group 0 holds other parameters: 'b' -> 'x'"
    )
    many_was = [f"p{i}" for i in range(8)]
    many_now = [f"q{i}" for i in range(8)]
    [difference] = diff_param_groups("o", [many_was], [many_now])
    assert "'p0' -> 'q0'" in difference.message
    assert "'p4' -> 'q4'" in difference.message
    assert "'p5'" not in difference.message
    assert difference.message.endswith(" and 3 more")
    # Reordering within a group changes membership by position: a difference.
    assert len(diff_param_groups("o", [["a", "b"]], [["b", "a"]])) == 1


@given(groups, groups)
def test_positional_groups_are_compared_by_size_only(
    live: list[list[str]], other: list[list[str]]
) -> None:
    """An imported optimizer's groups are positions (its parameters were never named)."""
    positional = [list(range(len(g))) for g in live]
    assert diff_param_groups("o", positional, live) == []
    found = diff_param_groups("o", [list(range(len(g))) for g in other], live)
    sizes = [len(g) for g in other] != [len(g) for g in live]
    assert bool(found) is sizes
    assert all("holds other parameters" not in d.message for d in found)


def test_param_group_count() -> None:
    [difference] = diff_param_groups("optimizer 'opt'", [["a", "b"]], [["a"], ["b"]])
    assert "1 parameter group(s) in the checkpoint, 2 in the run" in difference.message


# --- diff_components --------------------------------------------------------------------------


@given(st.sets(names, max_size=6), st.sets(names, max_size=6))
def test_components_missing_are_soft_and_deferred_are_stored_minus_live(
    stored: set[str], live: set[str]
) -> None:
    missing, deferred = diff_components(stored, live)
    assert deferred == frozenset(stored - live)
    assert len(missing) == len(live - stored)
    for difference in missing:
        assert difference.soft
        assert difference.kind is Kind.COMPONENT
        named = [n for n in live - stored if mentions(difference, n)]
        assert len(named) == 1
        assert "start fresh" in difference.message
    covered = {n for d in missing for n in live - stored if mentions(d, n)}
    assert covered == live - stored


def test_components_accept_any_iterables() -> None:
    missing, deferred = diff_components(iter(["opt", "sched"]), {"opt": 1, "extra": 2})
    assert [d.message for d in missing] == [
        "component 'extra' is not in the checkpoint; it would start fresh"
    ]
    assert deferred == {"sched"}


# --- diff_world_size --------------------------------------------------------------------------


@given(
    st.integers(1, 1024),
    st.integers(1, 1024),
    st.lists(st.text(alphabet="abcxyz_", min_size=1, max_size=8), max_size=3, unique=True),
)
def test_world_size(stored: int, live: int, per_rank: list[str]) -> None:
    found = diff_world_size(stored, live, per_rank)
    if stored == live:
        assert found == []
        return
    [difference] = found
    assert difference.kind is Kind.WORLD_SIZE
    assert difference.soft  # strict=False loads the replicated state, per-rank starts fresh
    assert f"world size is {stored} in the checkpoint, {live} in the run" in difference.message
    assert "RNG streams" in difference.message
    assert all(f"component {name!r}" in difference.message for name in per_rank)


# --- flatten ----------------------------------------------------------------------------------

_TOKEN = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def _segments(path: str) -> list[str | int]:
    """Split a key path ("a.b[0].c") into keys and indices (keys hold no '.', '[' or digits)."""
    segments: list[str | int] = [
        int(index) if index else key for index, key in _TOKEN.findall(path)
    ]
    rebuilt = "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in segments)
    assert rebuilt.removeprefix(".") == path
    return segments


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Rebuild the nested mapping that flatten() turned into ``flat``."""
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        segments = _segments(path)
        node: Any = root
        for depth, here in enumerate(segments):
            last = depth == len(segments) - 1
            value: Any = leaf if last else ([] if isinstance(segments[depth + 1], int) else {})
            if isinstance(node, list):
                assert isinstance(here, int)
                if here == len(node):  # flatten() walks lists in index order
                    node.append(value)
                node = node[here]
            else:
                assert isinstance(here, str)
                node = node.setdefault(here, value)
    return root


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _has_empty(tree: Any) -> bool:
    if isinstance(tree, dict):
        return not tree or any(_has_empty(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return not tree or any(_has_empty(v) for v in tree)
    return False


@given(config_maps)
def test_flatten_round_trips_key_paths(config: dict[str, Any]) -> None:
    flat = flatten(config)
    assert all(not isinstance(v, (dict, list, tuple)) for v in flat.values())  # leaves only
    if not _has_empty(config):  # empty containers vanish, so only those trees come back whole
        assert _same_tree(_unflatten(flat), config)


@given(config_maps)
def test_flatten_prefix(config: dict[str, Any]) -> None:
    plain = flatten(config)
    prefixed = flatten(config, "config")
    if not plain:
        assert prefixed == {}
        return
    assert list(prefixed) == [f"config.{path}" for path in plain]
    assert all(_same_tree(a, b) for a, b in zip(prefixed.values(), plain.values(), strict=True))


def test_flatten_examples() -> None:
    value = {"lr": 0.1, "model": {"hidden": 16, "layers": [1, {"x": None}]}, "empty": {}}
    assert flatten(value, "config") == {
        "config.lr": 0.1,
        "config.model.hidden": 16,
        "config.model.layers[0]": 1,
        "config.model.layers[1].x": None,
    }
    assert flatten([]) == {}
    assert flatten([], "c") == {}
    assert flatten(3, "c") == {"c": 3}
    assert flatten((1, 2), "t") == {"t[0]": 1, "t[1]": 2}


# --- diff_config ------------------------------------------------------------------------------


def _paths(found: list[Difference]) -> list[str]:
    return [d.message.split(": ", 1)[0] for d in found]


@given(config_maps)
def test_unchanged_config_has_no_differences(config: dict[str, Any]) -> None:
    assert diff_config(config, config) == []


@given(config_maps, config_maps)
def test_config_every_changed_path_listed_once(
    stored: dict[str, Any], live: dict[str, Any]
) -> None:
    found = diff_config(stored, live)
    was, now = flatten(stored, "config"), flatten(live, "config")
    expected = sorted(
        list(was.keys() ^ now.keys())
        + [k for k in was.keys() & now.keys() if not _equal_leaf(was[k], now[k])]
    )
    assert all(d.soft and d.kind is Kind.CONFIG for d in found)
    assert sorted(_paths(found)) == expected
    for difference in found:
        path = _paths([difference])[0]
        if path not in now:
            assert difference.message.endswith("in the checkpoint, absent now")
        elif path not in was:
            assert "absent in the checkpoint" in difference.message


def _equal_leaf(a: object, b: object) -> bool:
    numbers = (int, float)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return a == b
    return type(a) is type(b) and a == b


@given(config_maps, keys, leaves)
def test_config_one_change_one_difference(config: dict[str, Any], key: str, value: object) -> None:
    # From an empty mapping, flatten()'s empty-container marker ("config": {}) also goes away.
    assume(config and key not in config)
    changed = {**config, key: value}
    [added] = diff_config(config, changed)
    assert added.message.startswith(f"config.{key}: absent in the checkpoint")
    [removed] = diff_config(changed, config)
    assert removed.message.startswith(f"config.{key}: ")
    assert removed.message.endswith("in the checkpoint, absent now")


@pytest.mark.parametrize(
    ("was", "now"),
    [
        (1, 1.0),
        (1.0, 1),
        (0, -0.0),
        (float("nan"), float("nan")),
        (True, True),
        (None, None),
        ("a", "a"),
        ([], []),
        ({}, {}),
        ({}, []),  # empty containers vanish: an empty section equals a missing one
        ((1, 2), [1, 2]),
    ],
)
def test_config_equal_leaves(was: object, now: object) -> None:
    assert diff_config({"k": was}, {"k": now}) == []


@pytest.mark.parametrize(
    ("was", "now"),
    [
        (True, 1),
        (1, True),
        (False, 0),
        (True, 1.0),
        (0.0, False),
        ("1", 1),
        (None, 0),
        (None, False),
        (1, 2),
        (0.1, 0.2),
        (float("nan"), 1.0),
        (float("inf"), float("-inf")),
    ],
)
def test_config_different_leaves(was: object, now: object) -> None:
    [difference] = diff_config({"k": was}, {"k": now})
    assert difference.soft
    assert difference.message == f"config.k: {was!r} in the checkpoint, {now!r} now"


def test_config_messages() -> None:
    stored = {"lr": 0.1, "model": {"hidden": 16, "drop": 0.5}}
    live = {"lr": 0.2, "model": {"hidden": 16, "width": 8}}
    assert [str(d) for d in diff_config(stored, live)] == [
        "config.lr: 0.1 in the checkpoint, 0.2 now",
        "config.model.drop: 0.5 in the checkpoint, absent now",
        "config.model.width: absent in the checkpoint, 8 now",
    ]
    # No stored config at all (a checkpoint written without config=) against a config.
    assert _paths(diff_config(None, {"lr": 0.1})) == ["config", "config.lr"]
    assert diff_config(None, None) == []


# --- config_may_change --------------------------------------------------------------------------


def _changed_paths(stored: object, live: object) -> list[str]:
    was, now = flatten(stored, "config"), flatten(live, "config")
    return sorted(
        list(was.keys() ^ now.keys())
        + [k for k in was.keys() & now.keys() if not _equal_leaf(was[k], now[k])]
    )


def _note_paths(noted: tuple[str, ...]) -> list[str]:
    return [n.split(": ", 1)[0] for n in noted]


patterns = st.lists(
    st.text("abcdefgh_.*", min_size=1, max_size=6).filter(lambda p: p.strip(". ")), max_size=3
)


@given(config_maps, config_maps, patterns)
def test_may_change_splits_every_changed_path_exactly_once(
    stored: dict[str, Any], live: dict[str, Any], may_change: list[str]
) -> None:
    """Each changed key path is either a soft difference or a note, never both, never lost."""
    compared = compare_config(stored, live, may_change=may_change)
    refused = _paths(list(compared.differences))
    noted = _note_paths(compared.noted)
    assert sorted(refused + noted) == _changed_paths(stored, live)
    assert not set(refused) & set(noted)
    rule = may_change_rule(may_change_patterns(may_change))
    for path in noted:
        assert rule is not None
        assert rule.fullmatch(path.removeprefix("config."))
    for path in refused:
        assert rule is None or not rule.fullmatch(path.removeprefix("config."))
    assert diff_config(stored, live, may_change=may_change) == list(compared.differences)


@given(config_maps, config_maps)
def test_no_patterns_is_the_plain_comparison(stored: dict[str, Any], live: dict[str, Any]) -> None:
    compared = compare_config(stored, live)
    assert compared.noted == ()
    assert list(compared.differences) == diff_config(stored, live)


@given(config_maps, config_maps)
def test_double_star_lets_everything_change(stored: dict[str, Any], live: dict[str, Any]) -> None:
    assume(stored and live)  # the whole config missing is not under any key
    assert diff_config(stored, live, may_change=["**"]) == []


@given(config_maps, keys, configs, configs)
def test_a_key_pattern_covers_the_key_and_everything_beneath_it(
    config: dict[str, Any], key: str, was: object, now: object
) -> None:
    stored, live = {**config, key: was}, {**config, key: now}
    assert diff_config(stored, live, may_change=[key]) == []
    assert diff_config(stored, live, may_change=[f"config.{key}"]) == []
    noted = compare_config(stored, live, may_change=[key]).noted
    assert all(
        p == f"config.{key}" or p.startswith((f"config.{key}.", f"config.{key}["))
        for p in _note_paths(noted)
    )


def test_may_change_examples() -> None:
    stored = {"max_iters": 100, "out_dir": "a", "run": {"seed": 0, "name": "x"}, "lr": 0.1}
    live = {"max_iters": 200, "out_dir": "b", "run": {"seed": 1, "name": "y"}, "lr": 0.2}
    compared = compare_config(stored, live, may_change=["max_iters", "out_dir", "run.*"])
    assert [str(d) for d in compared.differences] == ["config.lr: 0.1 in the checkpoint, 0.2 now"]
    assert compared.noted == (
        "config.max_iters: 100 in the checkpoint, 200 now",
        "config.out_dir: 'a' in the checkpoint, 'b' now",
        "config.run.name: 'x' in the checkpoint, 'y' now",
        "config.run.seed: 0 in the checkpoint, 1 now",
    )


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("run.max_steps", "run.max_steps", True),
        ("run", "run.max_steps", True),
        ("run", "runner", False),
        ("run.*", "run.max_steps", True),
        ("run.*", "run.a.b", True),  # beneath run.a
        ("run.*", "run", False),
        ("*.max_steps", "scheduler.max_steps", True),
        ("*.max_steps", "a.b.max_steps", False),  # * stays within one key
        ("**.max_steps", "a.b.max_steps", True),
        ("max_?ters", "max_iters", True),
        ("max_?ters", "max_.ters", False),
        ("layers[0]", "layers[0].size", True),  # brackets are literal
        ("layers[0]", "layers[1]", False),
        ("layers", "layers[1].size", True),
        ("a+b", "a+b", True),  # nothing else is special
        ("a+b", "aab", False),
    ],
)
def test_may_change_rule(pattern: str, path: str, matches: bool) -> None:
    rule = may_change_rule([pattern])
    assert rule is not None
    assert bool(rule.fullmatch(path)) is matches


@pytest.mark.parametrize("bad", ["max_iters", b"x", 3, None, [""], ["."], [3], ["ok", None]])
def test_may_change_refuses_what_is_not_a_list_of_patterns(bad: Any) -> None:
    with pytest.raises(ConfigError, match="config_may_change"):
        may_change_patterns(bad)


def test_may_change_accepts_any_iterable_and_drops_the_root() -> None:
    assert may_change_patterns(("a", "config.b")) == ("a", "b")
    assert may_change_patterns(p for p in ["x.*"]) == ("x.*",)
    assert may_change_rule([]) is None
