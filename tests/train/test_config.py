"""The YAML run configuration: sections, defaults, key-path errors, overrides, the recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from trainkit import SMOKE

from pitstop.core.compat import diff_config, flatten, may_change_rule
from pitstop.core.records import Best
from pitstop.core.settings.config import CheckpointConfig
from pitstop.errors import ConfigError
from pitstop.train.config import (
    MAY_CHANGE,
    EmaSection,
    OptimizerSection,
    RunConfig,
    RunSection,
    load_config,
    override,
    read_yaml,
)

MINIMAL: dict[str, Any] = {
    "run": {"output_dir": "runs/x", "max_steps": 3},
    "optimizer": {"lr": 0.1},
}


def test_smoke_yaml_parses() -> None:
    config = load_config(SMOKE)
    assert config.run.device == "cpu"
    assert config.run.accumulate == 2
    assert config.ema == EmaSection(enabled=True, decay=0.9)
    assert config.checkpoint.best == Best("val_loss")
    assert config.checkpoint.every_steps == 2
    assert config.checkpoint.keep_last is not None
    assert config.checkpoint.keep_last >= 2  # the two-step demonstration keeps both files


def test_defaults_fill_every_optional_section() -> None:
    config = load_config(MINIMAL)
    assert config == RunConfig(
        run=RunSection(output_dir="runs/x", max_steps=3),
        optimizer=OptimizerSection(lr=0.1),
    )
    assert config.checkpoint == CheckpointConfig()
    assert load_config({**MINIMAL, "ema": None}).ema == EmaSection()  # an empty section


@pytest.mark.parametrize(
    ("changes", "problems"),
    [
        ({"run": {"output_dir": "x", "max_stepz": 3}}, ["run.max_stepz: unknown key (did you"]),
        ({"modle": {}}, ["modle: unknown key (did you mean model?)"]),
        ({"zzz": {}}, ["zzz: unknown key (known sections: run, model, data, optimizer"]),
        ({"data": {"batch_size": "16"}}, ["data.batch_size: expected an int, got str '16'"]),
        ({"data": {"batch_size": 0}}, ["data.batch_size: must be an int >= 1, got 0"]),
        ({"model": {"dropout": 1.5}}, ["model.dropout: must be a number in [0, 1), got 1.5"]),
        ({"ema": {"enabled": 1}}, ["ema.enabled: expected true or false, got int 1"]),
        ({"run": {"output_dir": "x", "max_steps": 3, "device": "tpu"}}, ["run.device: expected"]),
        ({"optimizer": {}}, ["optimizer.lr: required key missing"]),
        ({"optimizer": {"lr": "1e-3"}}, ["optimizer.lr: expected a number, got str '1e-3'"]),
        ({"run": {"max_steps": 3}}, ["run.output_dir: required key missing"]),
        ({"run": None}, ["run: expected a mapping"]),
        ({"checkpoint": {"keep_lst": 1}}, ["checkpoint.keep_lst: unknown key (did you mean"]),
        ({"run": {"output_dir": "x"}}, ["run: set run.max_steps or run.epochs"]),
    ],
)
def test_errors_name_the_key_path(changes: dict[str, Any], problems: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**MINIMAL, **changes})
    assert len(info.value.problems) == len(problems), info.value.problems
    for got, want in zip(info.value.problems, problems, strict=True):
        assert got.startswith(want)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"run": {"max_stepz": 1}, "data": {"seed": -1}, "optimizer": {}})
    assert len(info.value.problems) == 4, info.value.problems


def test_required_sections() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({})
    assert info.value.problems == (
        "run: required section missing",
        "optimizer: required section missing",
    )


def test_max_steps_overrides_both_limits() -> None:
    data = override(MINIMAL, output_dir=Path("out"), max_steps=7, device="cpu", resume=True)
    config = load_config(data)
    assert (config.run.max_steps, config.scheduler.max_steps) == (7, 7)
    assert config.run.output_dir == "out"
    assert config.checkpoint.resume is True
    assert override(MINIMAL) == MINIMAL
    assert MINIMAL["run"] == {"output_dir": "runs/x", "max_steps": 3}  # not modified


def test_checkpoint_directory_resolves_under_output_dir() -> None:
    config = load_config(MINIMAL)
    assert config.checkpoint_dir == Path("runs/x/checkpoints")
    assert load_config(
        {**MINIMAL, "checkpoint": {"directory": "/abs/ckpt"}}
    ).checkpoint_dir == Path("/abs/ckpt")
    assert load_config({**MINIMAL, "checkpoint": {"enabled": False}}).checkpoint_dir is None


def test_the_recipe_leaves_out_what_may_change_between_runs() -> None:
    base = load_config(SMOKE)
    changed = load_config(
        override(
            yaml.safe_load(SMOKE.read_text()),
            output_dir="elsewhere",
            max_steps=1000,
            device="cuda",
        )
    )
    assert base.recipe() == changed.recipe()
    recipe = base.recipe()
    assert "max_steps" not in recipe["run"]
    assert "epochs" not in recipe["run"]
    assert "max_steps" not in recipe["scheduler"]
    assert recipe["optimizer"] == {"lr": 0.03, "weight_decay": 0.01}
    more_lr = load_config({**MINIMAL, "optimizer": {"lr": 0.2}})
    assert more_lr.recipe() != load_config(MINIMAL).recipe()


def test_checkpoints_store_the_recipe_and_what_may_change() -> None:
    """stored() is the recipe plus exactly the keys MAY_CHANGE names (the seeds' cumulative
    limits, the output directory, the device and the reporting intervals)."""
    config = load_config(SMOKE)
    stored = flatten(config.stored())
    rule = may_change_rule(MAY_CHANGE)
    assert rule is not None
    assert {k: v for k, v in stored.items() if not rule.fullmatch(k)} == flatten(config.recipe())
    assert {k for k in stored if rule.fullmatch(k)} == set(MAY_CHANGE)
    changed = load_config(
        override(yaml.safe_load(SMOKE.read_text()), output_dir="elsewhere", max_steps=1000)
    )
    assert diff_config(config.stored(), changed.stored(), may_change=MAY_CHANGE) == []
    assert diff_config(config.stored(), changed.stored()) != []


def test_yaml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: cannot read the configuration"):
        read_yaml(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list.yaml: expected a mapping of sections, got list"):
        read_yaml(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("run: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML"):
        read_yaml(tmp_path / "broken.yaml")
