"""The YAML checkpoint section: defaults, strict types, and key-path errors."""

from __future__ import annotations

import pytest
import yaml

from pitstop.core.config import CheckpointConfig, parse_checkpoint_config, resolve_directory
from pitstop.core.records import Best, Policy
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
