"""The YAML checkpoint section: defaults, strict types, and key-path errors."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import yaml

import pitstop.core.settings.config as config_module
from pitstop.core.records import Best, Policy
from pitstop.core.settings.config import (
    CheckpointConfig,
    ConfigConverter,
    converter,
    parse_checkpoint_config,
    resolve_directory,
)
from pitstop.core.validators import positive_int
from pitstop.errors import ConfigError

SEED_SECTION = """
checkpoint:
  enabled: true
  directory: checkpoints
  every_steps: 100
  keep_last: 3
  resume: false
"""


def test_the_seed_section_parses() -> None:
    config = parse_checkpoint_config(yaml.safe_load(SEED_SECTION)["checkpoint"])
    assert config == CheckpointConfig(every_steps=100, keep_last=3)
    assert config.policy() == Policy(every_steps=100, keep_last=3)


def test_defaults() -> None:
    assert parse_checkpoint_config(None) == CheckpointConfig()
    assert parse_checkpoint_config({}).policy() == Policy()


def test_pitstop_keys() -> None:
    config = parse_checkpoint_config(
        {
            "every_seconds": 600,
            "keep_last": None,
            "keep_every": 1000,
            "best": {"metric": "val_acc", "mode": "max"},
            "save_final": False,
            "async": "overlap",
        }
    )
    assert config.policy() == Policy(
        every_seconds=600.0,
        keep_last=None,
        keep_every=1000,
        best=Best("val_acc", mode="max"),
        save_final=False,
    )
    assert config.async_ == "overlap"
    assert parse_checkpoint_config({"best": "val_loss"}).best == Best("val_loss")


@pytest.mark.parametrize(
    ("section", "problems"),
    [
        ({"keep_lst": 3}, ["checkpoint.keep_lst: unknown key (did you mean keep_last?)"]),
        ({"every_steps": "100"}, ["checkpoint.every_steps: expected an int, got str '100'"]),
        ({"enabled": 1}, ["checkpoint.enabled: expected true or false, got int 1"]),
        ({"keep_last": 0}, ["checkpoint.keep_last: must be a positive int or None, got 0"]),
        ({"async": "later"}, ["checkpoint.async: must be true, false or 'overlap', got 'later'"]),
        ({"best": {"mode": "max"}}, ["checkpoint.best.metric: required key missing"]),
        (
            {"best": {"metric": "loss", "mode": "lowest"}},
            ["checkpoint.best.mode: expected one of 'min', 'max', got str 'lowest'"],
        ),
        ({"best": 3}, ["checkpoint.best: expected a metric name or {metric, mode}, got int 3"]),
        ({"zzz": 1}, ["checkpoint.zzz: unknown key (known keys: enabled, directory, "]),
    ],
)
def test_errors_name_the_key_path(section: dict[str, object], problems: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_checkpoint_config(section)
    assert len(info.value.problems) == len(problems)
    for got, want in zip(info.value.problems, problems, strict=True):
        assert got.startswith(want)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_checkpoint_config(
            {"keep_lst": 3, "every_steps": "100", "async": 2, "best": {"metrc": "x"}}
        )
    paths = sorted(p.split(":")[0] for p in info.value.problems)
    assert paths == [
        "checkpoint.async",
        "checkpoint.best.metrc",
        "checkpoint.best.metric",
        "checkpoint.every_steps",
        "checkpoint.keep_lst",
    ]
    assert str(info.value).startswith("5 configuration problems:")


def test_a_section_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint: expected a mapping, got list \[1\]$"):
        parse_checkpoint_config([1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("output_dir", "directory", "resolved"),
    [
        ("runs/a", "checkpoints", "runs/a/checkpoints"),
        ("runs/a/", "ckpt/x", "runs/a/ckpt/x"),
        ("runs/a", "/mnt/ckpt", "/mnt/ckpt"),
        ("", "checkpoints", "checkpoints"),
    ],
)
def test_relative_directories_resolve_under_the_output_dir(
    output_dir: str, directory: str, resolved: str
) -> None:
    assert resolve_directory(output_dir, directory) == resolved


# --- the converter: one definition, bugs are not configuration problems -----------------------


@attrs.frozen(kw_only=True)
class Section:
    """A record of the test's own, for a converter of its own."""

    size: int = attrs.field(default=1, validator=positive_int)
    name_: str = "x"
    low: int = 0
    high: int = 1

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ConfigError(f"low must not exceed high, got {self.low} > {self.high}")


SECTIONS = ConfigConverter((Section,), renames={Section: {"name_": "name"}})


def test_a_converter_of_its_own_records_keeps_the_rules_and_the_renames() -> None:
    assert SECTIONS.structure({"size": 2, "name": "y"}, Section, path="s") == Section(
        size=2, name_="y"
    )
    with pytest.raises(ConfigError) as info:
        SECTIONS.structure({"size": "2", "name_": "y", "nme": 1}, Section, path="s")
    assert info.value.problems == (
        "s.name_: unknown key (did you mean name?)",
        "s.nme: unknown key (did you mean name?)",
        "s.size: expected an int, got str '2'",
    )
    with pytest.raises(ConfigError, match=r"^s: low must not exceed high, got 3 > 1$"):
        SECTIONS.structure({"low": 3}, Section, path="s")
    # The core's records come with it; the core's own converter does not learn the new one.
    with pytest.raises(ConfigError, match=r"^c\.keep_lst: unknown key"):
        SECTIONS.structure({"keep_lst": 1}, CheckpointConfig, path="c")
    assert Section not in converter.records
    with pytest.raises(TypeError, match="Section is not a record of this converter"):
        converter.structure({}, Section, path="s")


def test_importing_the_trainer_config_leaves_the_core_converter_as_it_was() -> None:
    import pitstop.train.config as train_config

    assert set(converter.records) == {CheckpointConfig, Best}
    assert train_config.RunSection not in converter.records


def _raise(error: BaseException) -> Any:
    def hook(*_: object) -> None:
        raise error

    return hook


@pytest.mark.parametrize(
    "bug",
    [AttributeError("no attribute 'x'"), TypeError("bad call"), ValueError("bad value")],
    ids=lambda e: type(e).__name__,
)
def test_a_bug_in_a_hook_propagates_as_itself(
    monkeypatch: pytest.MonkeyPatch, bug: Exception
) -> None:
    monkeypatch.setattr(config_module, "is_int", _raise(bug))  # the strict int hook calls it
    with pytest.raises(type(bug)) as info:
        parse_checkpoint_config({"every_steps": 5})
    assert info.value is bug
    assert not isinstance(info.value, ConfigError)


def test_a_key_error_from_a_validator_is_a_bug_not_a_missing_key() -> None:
    @attrs.frozen(kw_only=True)
    class Lookup:
        key: str = attrs.field(validator=_raise(KeyError("key")))

    with pytest.raises(KeyError, match="'key'"):
        ConfigConverter((Lookup,)).structure({"key": "present"}, Lookup, path="l")
    with pytest.raises(ConfigError, match=r"^l\.key: required key missing$"):
        ConfigConverter((Lookup,)).structure({}, Lookup, path="l")
