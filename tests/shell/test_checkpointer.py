"""The Checkpointer in process: incompatibility, strictness, deferred components, saving,
resuming, lifetime and wrapped models. Real files in tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
import pitstop.shell.state.restore as restore
from pitstop import (
    Best,
    Checkpointer,
    ConfigError,
    DirectoryLocked,
    IncompatibleCheckpoint,
    PitstopError,
    Policy,
    Progress,
    ResumableSampler,
    SaveReason,
    StopRequest,
)
from pitstop.shell.format import fileformat
from pitstop.shell.ranks.distributed import Ranks

CONFIG: dict[str, Any] = {"lr": 0.1, "model": {"hidden": 16}}
DATA = torch.randn(64, 4, generator=torch.Generator().manual_seed(7))
TARGET = torch.randn(64, 3, generator=torch.Generator().manual_seed(8))

# --- a run ------------------------------------------------------------------------------------


class Counter:
    """A minimal stateful component."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class Refuses(Counter):
    """A component whose load_state_dict fails after every check passed."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise RuntimeError("refusing to load")


def build_model(
    *,
    out: str = "out",
    out_features: int = 2,
    fc2: bool = True,
    extra_layer: bool = False,
    track_running_stats: bool = True,
    seed: int = 0,
) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["fc1"] = nn.Linear(4, 16)
    layers["bn"] = nn.BatchNorm1d(16, track_running_stats=track_running_stats)
    layers["act"] = nn.ReLU()
    layers["drop"] = nn.Dropout(0.25)
    if fc2:
        layers["fc2"] = nn.Linear(16, 16)
    if extra_layer:
        layers["extra"] = nn.Linear(16, 16)
    layers[out] = nn.Linear(16, out_features)
    return nn.Sequential(layers)


@dataclass
class Run:
    model: nn.Module
    ema: AveragedModel | None
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    config: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)
    ema_updates: bool = True
    progress: Progress = field(default_factory=Progress)

    def state(self, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
        state = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.sampler,
            **self.extra,
        }
        return {name: obj for name, obj in state.items() if name not in without}

    def checkpointer(
        self, directory: Path, *, without: tuple[str, ...] = (), **kwargs: Any
    ) -> Checkpointer:
        return Checkpointer(
            directory,
            model=self.model,
            ema=self.ema,
            state=self.state(without=without),
            config=self.config,
            **kwargs,
        )

    def train(self, steps: int) -> None:
        """``steps`` optimizer updates, reading batches from the sampler's position."""
        dtype = next(self.model.parameters()).dtype
        self.model.train()
        for _ in range(steps):
            self.sampler.set_position(self.progress)
            batch = next(iter(self.sampler))
            output = self.model(DATA[batch].to(dtype))
            loss = (output - TARGET[batch, : output.shape[1]].to(dtype)).pow(2).mean()
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            if self.ema is not None and self.ema_updates:
                self.ema.update_parameters(self.model)
            self.progress = self.progress.advance(samples=len(batch))


def build_run(
    *,
    model: dict[str, Any] | None = None,
    double: bool = False,
    ema: str | None = "same",
    groups: str = "one",
    optimizer: str = "adamw",
    batch_size: int = 4,
    extra: bool = False,
    config: dict[str, Any] | None = CONFIG,
    seed: int = 0,
) -> Run:
    net = build_model(seed=seed, **(model or {}))
    if double:
        net = net.double()
    named = dict(net.named_parameters())
    if groups == "one":
        params: Any = list(net.parameters())
    elif groups == "two":
        params = [
            {"params": [p for n, p in named.items() if n.startswith("fc1")]},
            {"params": [p for n, p in named.items() if not n.startswith("fc1")]},
        ]
    else:  # "leave_out": one parameter is not optimized
        params = [p for n, p in named.items() if n != "out.bias"]
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=0.1)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scheduler = LambdaLR(opt, lambda step: 0.5**step)
    averaged: AveragedModel | None = None
    if ema == "same":
        averaged = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    elif ema == "shape":
        averaged = AveragedModel(
            build_model(seed=seed, out_features=3), multi_avg_fn=get_ema_multi_avg_fn(0.9)
        )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return Run(
        model=net,
        ema=averaged,
        optimizer=opt,
        scheduler=scheduler,
        scaler=scaler,
        sampler=ResumableSampler(len(DATA), batch_size, seed=3),
        config=copy.deepcopy(config),
        extra={"extra": Counter(5)} if extra else {},
        ema_updates=ema == "same",
    )


# --- comparing state bitwise ------------------------------------------------------------------


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` are the same tree, tensors and floats bitwise."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert bitwise_equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{index}]")
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), path
        assert math.copysign(1.0, a) == math.copysign(1.0, b), path
    else:
        assert a == b, path


def capture(run: Run) -> dict[str, Any]:
    """Everything resume() could touch, copied."""
    return {
        "model": copy.deepcopy(run.model.state_dict()),
        "ema": copy.deepcopy(run.ema.state_dict()) if run.ema is not None else None,
        "state": {name: copy.deepcopy(obj.state_dict()) for name, obj in run.state().items()},
        "sampler": (run.sampler.epoch, run.sampler.batch_in_epoch),
        "python": random.getstate(),
        "torch": torch.get_rng_state().clone(),
        "numpy": np.random.get_state(),
    }


def assert_unchanged(run: Run, before: dict[str, Any]) -> None:
    assert_same(before, capture(run), "run")


# --- fixtures ---------------------------------------------------------------------------------


def _reference(directory: Path, *, ema: str | None) -> dict[str, Any]:
    run = build_run(ema=ema)
    with run.checkpointer(directory) as ckpt:
        run.train(2)
        ckpt.save(run.progress)
    return capture(run)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Two saved reference runs (with and without EMA), trained 2 steps, and their state."""
    root = tmp_path_factory.mktemp("references")
    out = {}
    for name, ema in (("full", "same"), ("no_ema", None)):
        out[name] = (root / name, _reference(root / name, ema=ema))
    return out


@pytest.fixture
def reference(references: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path) -> Path:
    """A private copy of the full reference run's checkpoint directory."""
    directory = tmp_path / "run"
    shutil.copytree(references["full"][0], directory, symlinks=True)
    return directory


@pytest.fixture
def seeded() -> Iterator[None]:
    """Known global RNG streams (and no leak of them into other tests)."""
    state = (random.getstate(), torch.get_rng_state(), np.random.get_state())
    random.seed(11)
    torch.manual_seed(11)
    np.random.seed(11)
    yield
    random.setstate(state[0])
    torch.set_rng_state(state[1])
    np.random.set_state(state[2])


# --- the incompatibility matrix ---------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    build: dict[str, Any]
    expected: tuple[str, ...]
    reference: str = "full"
    world_size: int = 1
    soft: bool = False  # only differences that strict=False lets pass


MUTATIONS: dict[str, Mutation] = {
    "renamed parameter": Mutation(
        {"model": {"out": "head"}},
        (
            "model: 'head.weight' is in the run but not in the checkpoint",
            "model: 'out.weight' is in the checkpoint but not in the run",
            "model: 'out.bias' is in the checkpoint but not in the run",
            "'out.weight' -> 'head.weight'",
        ),
    ),
    "missing parameter": Mutation(
        {"model": {"fc2": False}},
        (
            "model: 'fc2.weight' is in the checkpoint but not in the run",
            "model: 'fc2.bias' is in the checkpoint but not in the run",
            "optimizer 'optimizer': parameter group 0 holds 8 parameter(s) in the checkpoint, "
            "6 in the run",
        ),
    ),
    "extra parameter": Mutation(
        {"model": {"extra_layer": True}},
        (
            "model: 'extra.weight' is in the run but not in the checkpoint",
            "model: 'extra.bias' is in the run but not in the checkpoint",
        ),
    ),
    "shape": Mutation(
        {"model": {"out_features": 3}},
        (
            "model: 'out.weight' has shape [2, 16] in the checkpoint, [3, 16] in the run",
            "model: 'out.bias' has shape [2] in the checkpoint, [3] in the run",
            "ema: 'out.weight' has shape [2, 16] in the checkpoint, [3, 16] in the run",
        ),
    ),
    "dtype": Mutation(
        {"double": True},
        (
            "model: 'fc1.weight' has dtype float32 in the checkpoint, float64 in the run",
            "ema: 'out.bias' has dtype float32 in the checkpoint, float64 in the run",
        ),
    ),
    "missing buffer": Mutation(
        {"model": {"track_running_stats": False}},
        (
            "model: 'bn.running_mean' is in the checkpoint but not in the run",
            "model: 'bn.running_var' is in the checkpoint but not in the run",
            "model: 'bn.num_batches_tracked' is in the checkpoint but not in the run",
        ),
    ),
    "optimizer group count": Mutation(
        {"groups": "two"},
        ("optimizer 'optimizer': 1 parameter group(s) in the checkpoint, 2 in the run",),
    ),
    "optimizer group size": Mutation(
        {"groups": "leave_out"},
        (
            "optimizer 'optimizer': parameter group 0 holds 8 parameter(s) in the checkpoint, "
            "7 in the run",
        ),
    ),
    "optimizer type": Mutation(
        {"optimizer": "sgd"},
        ("optimizer 'optimizer': parameter group 0 has settings", "another optimizer type"),
    ),
    "missing component": Mutation(
        {"extra": True},
        ("component 'extra' is not in the checkpoint; it would start fresh",),
        soft=True,
    ),
    "config value": Mutation(
        {"config": {"lr": 0.2, "model": {"hidden": 16}}},
        ("config.lr: 0.1 in the checkpoint, 0.2 now",),
        soft=True,
    ),
    "config key added": Mutation(
        {"config": {"lr": 0.1, "model": {"hidden": 16, "depth": 2}}},
        ("config.model.depth: absent in the checkpoint, 2 now",),
        soft=True,
    ),
    "world size": Mutation(
        {},
        (
            "world size is 1 in the checkpoint, 2 in the run: per-rank state (RNG streams, "
            "component 'sampler') cannot continue",
        ),
        world_size=2,
        soft=True,
    ),
    "ema in run, not in checkpoint": Mutation(
        {}, ("ema: the checkpoint holds no EMA weights",), reference="no_ema"
    ),
    "ema in checkpoint, not in run": Mutation(
        {"ema": None}, ("ema: the checkpoint holds EMA weights, the run has no EMA",), soft=True
    ),
    "ema shape": Mutation(
        {"ema": "shape"},
        (
            "ema: 'out.weight' has shape [2, 16] in the checkpoint, [3, 16] in the run",
            "ema: 'out.bias' has shape [2] in the checkpoint, [3] in the run",
        ),
    ),
    "sampler batch size": Mutation(
        {"batch_size": 8},
        ("component 'sampler': ResumableSampler.batch_size: checkpoint has 4, this run has 8",),
    ),
    "everything at once": Mutation(
        {
            "model": {"out": "head", "extra_layer": True},
            "optimizer": "sgd",
            "batch_size": 8,
            "extra": True,
            "config": {"lr": 0.2, "model": {"hidden": 16}},
        },
        (
            "model: 'head.weight' is in the run but not in the checkpoint",
            "model: 'extra.weight' is in the run but not in the checkpoint",
            "model: 'out.weight' is in the checkpoint but not in the run",
            "ema: 'head.bias' is in the run but not in the checkpoint",
            "optimizer 'optimizer': parameter group 0 holds 8 parameter(s) in the checkpoint, "
            "10 in the run",
            "another optimizer type",
            # The sampler is per-rank state: another world size cannot continue it at all.
            "component 'extra' is not in the checkpoint",
            "config.lr: 0.1 in the checkpoint, 0.2 now",
            "world size is 1 in the checkpoint, 2 in the run",
        ),
        world_size=2,
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_incompatible_run_is_refused_and_left_untouched(
    mutation: Mutation,
    references: dict[str, tuple[Path, dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seeded: None,
) -> None:
    directory = tmp_path / "run"
    shutil.copytree(references[mutation.reference][0], directory, symlinks=True)
    run = build_run(seed=1, **mutation.build)
    run.train(1)  # live optimizer, scaler and EMA state that a partial restore would change
    if mutation.world_size != 1:
        # Rank 0 of a larger job, without its collectives (the multi-rank e2e tests run those).
        world = Ranks(0, mutation.world_size)
        monkeypatch.setattr(Ranks, "current", classmethod(lambda cls, timeout_s: world))
        monkeypatch.setattr(Ranks, "many", property(lambda self: False))
    with run.checkpointer(directory) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint) as raised:
            ckpt.resume()
        assert_unchanged(run, before)
        if not mutation.soft:
            with pytest.raises(IncompatibleCheckpoint):
                ckpt.resume(strict=False)
            assert_unchanged(run, before)
    differences = raised.value.differences
    for expected in mutation.expected:
        assert any(expected in d for d in differences), (expected, differences)
    # Every difference names the checkpoint it came from, once.
    assert all(d.startswith("step_000000000002.pitstop: ") for d in differences)
    assert len(set(differences)) == len(differences)


def test_the_unmutated_run_resumes_exactly(
    references: dict[str, tuple[Path, dict[str, Any]]], reference: Path, seeded: None
) -> None:
    """The control of the matrix: the same run, built afresh, restores to the saved state."""
    run = build_run(seed=1)
    run.train(1)
    with run.checkpointer(reference) as ckpt:
        progress = ckpt.resume()
    assert progress == Progress(step=2, batch_in_epoch=2, samples=8)
    # The sampler's position is the loop's business (set_position(progress)), not resume()'s.
    position = (run.sampler.epoch, run.sampler.batch_in_epoch)
    assert_unchanged(run, {**references["full"][1], "sampler": position})


def test_failed_load_state_dict_rolls_back(tmp_path: Path, seeded: None) -> None:
    """A component that fails while loading undoes the components loaded before it."""
    saved = build_run()
    saved.extra = {"refuses": Counter(3)}
    with saved.checkpointer(tmp_path) as ckpt:
        saved.train(2)
        ckpt.save(saved.progress)
    run = build_run(seed=1)
    run.train(1)
    run.extra = {"refuses": Refuses(4)}  # loaded after optimizer, scheduler, scaler, sampler
    with run.checkpointer(tmp_path) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint) as raised:
            ckpt.resume()
        assert_unchanged(run, before)
    assert raised.value.differences == (
        "step_000000000002.pitstop: component 'refuses': load_state_dict failed: refusing to load",
    )


class WithExtraState(nn.Sequential):
    def get_extra_state(self) -> dict[str, int]:
        return {"version": 1}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


def test_model_extra_state_mismatch_is_all_or_nothing(reference: Path, seeded: None) -> None:
    run = build_run(seed=1)
    run.model = WithExtraState(OrderedDict(run.model.named_children()))
    run.train(1)
    with run.checkpointer(reference) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint):
            ckpt.resume()
        assert_unchanged(run, before)


class RefusingEma(nn.Sequential):
    """An EMA module whose extra state refuses what the checkpoint holds (a version check)."""

    refuse = False

    def get_extra_state(self) -> dict[str, int]:
        return {"version": 1}

    def set_extra_state(self, state: dict[str, int]) -> None:
        if self.refuse:
            raise RuntimeError("EMA version check failed")


def _ema_of(model: nn.Module, *, refuse: bool) -> RefusingEma:
    ema = RefusingEma(copy.deepcopy(OrderedDict(model.named_children())))
    ema.refuse = refuse
    return ema


class Stomps(nn.Linear):
    """A layer whose own load code overwrites its tensors, then fails."""

    armed = False

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        if not self.armed:
            super()._load_from_state_dict(state_dict, prefix, *args)
            return
        with torch.no_grad():
            self.weight.fill_(123.0)
        raise RuntimeError("layer refused")


def _saved_with_extra(directory: Path, *, own_ema: bool = False) -> None:
    saved = build_run()
    if own_ema:
        saved.ema, saved.ema_updates = _ema_of(saved.model, refuse=False), False  # type: ignore[assignment]
    saved.extra = {"refuses": Counter(3)}
    with saved.checkpointer(directory) as ckpt:
        saved.train(2)
        ckpt.save(saved.progress)


def test_an_ema_that_fails_while_loading_leaves_the_model_untouched(
    tmp_path: Path, seeded: None
) -> None:
    """Issue 10, defect 1: the EMA fails in set_extra_state after every check passed."""
    _saved_with_extra(tmp_path, own_ema=True)
    run = build_run(seed=1)
    run.ema, run.ema_updates = _ema_of(run.model, refuse=True), False  # type: ignore[assignment]
    run.extra = {"refuses": Counter(4)}
    run.train(1)
    with run.checkpointer(tmp_path) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint, match="EMA version check failed"):
            ckpt.resume()
        assert_unchanged(run, before)


def test_a_module_whose_own_load_code_fails_is_put_back(tmp_path: Path, seeded: None) -> None:
    _saved_with_extra(tmp_path)
    run = build_run(seed=1)
    stomps = Stomps(16, 16)
    stomps.load_state_dict(run.model.fc2.state_dict())
    stomps.armed = True
    run.model.fc2 = stomps
    run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=0.1)
    run.scheduler = LambdaLR(run.optimizer, lambda step: 0.5**step)
    run.extra = {"refuses": Counter(4)}
    run.train(1)
    with run.checkpointer(tmp_path) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint, match="layer refused"):
            ckpt.resume()
        assert_unchanged(run, before)


def test_a_failure_while_restoring_the_rng_puts_everything_back(
    tmp_path: Path, seeded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved_with_extra(tmp_path)
    run = build_run(seed=1)
    run.extra = {"refuses": Counter(4)}
    run.train(1)
    real = restore.restore_rng
    calls = []

    def half_then_fail(state: Any) -> None:
        calls.append(state)
        if len(calls) == 1:  # the checkpoint's streams: some are set, then it fails
            random.setstate(state["python"])
            torch.set_rng_state(state["torch"].clone())
            raise ValueError("malformed NumPy state")
        real(state)

    monkeypatch.setattr(restore, "restore_rng", half_then_fail)
    with run.checkpointer(tmp_path) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint, match="random number generators"):
            ckpt.resume()
        assert_unchanged(run, before)
    assert len(calls) >= 2  # the streams were put back


def test_plain_modules_are_not_copied_for_rollback(tmp_path: Path, seeded: None) -> None:
    """No second copy of plain weights: only modules with load code of their own are cloned."""
    assert restore._plain(build_model())
    assert restore._plain(AveragedModel(build_model()))
    assert not restore._plain(WithExtraState(nn.Linear(2, 2)))
    assert not restore._plain(nn.Sequential(Stomps(2, 2)))
    hooked = build_model()
    hooked.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not restore._plain(hooked)


# --- strict=False -----------------------------------------------------------------------------


def test_strict_false_lets_soft_differences_pass_with_warnings(
    references: dict[str, tuple[Path, dict[str, Any]]],
    reference: Path,
    caplog: pytest.LogCaptureFixture,
    seeded: None,
) -> None:
    run = build_run(seed=1, extra=True, config={"lr": 0.3, "model": {"hidden": 16}})
    with run.checkpointer(reference) as ckpt, caplog.at_level(logging.WARNING, "pitstop"):
        progress = ckpt.resume(strict=False)
    assert progress.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "pitstop"]
    assert any("component 'extra' is not in the checkpoint" in w for w in warnings), warnings
    assert any("config.lr: 0.1 in the checkpoint, 0.3 now" in w for w in warnings), warnings
    assert run.extra["extra"].count == 5  # starts fresh
    expected = references["full"][1]
    assert_same(expected["model"], run.model.state_dict())
    assert_same(expected["state"]["optimizer"], run.optimizer.state_dict())


@pytest.mark.parametrize("build", [{"model": {"out_features": 3}}, {"double": True}])
def test_strict_false_still_refuses_shapes_and_dtypes(
    build: dict[str, Any], reference: Path, seeded: None
) -> None:
    run = build_run(seed=1, extra=True, **build)
    with run.checkpointer(reference) as ckpt:
        before = capture(run)
        with pytest.raises(IncompatibleCheckpoint) as raised:
            ckpt.resume(strict=False)
        assert_unchanged(run, before)
    assert any(" has shape " in d or " has dtype " in d for d in raised.value.differences)


# --- deferred components ----------------------------------------------------------------------


def test_deferred_component_is_applied_on_register(
    references: dict[str, tuple[Path, dict[str, Any]]], reference: Path, seeded: None
) -> None:
    saved = references["full"][1]["state"]["scaler"]
    run = build_run(seed=1)
    assert run.scaler.state_dict() != saved
    with run.checkpointer(reference, without=("scaler",)) as ckpt:
        assert ckpt.resume().step == 2
        assert run.scaler.state_dict() != saved  # not applied yet
        ckpt.register("scaler", run.scaler)
        assert_same(saved, run.scaler.state_dict())
        # Registered now: the next save holds it.
        path = ckpt.save(Progress(step=3)).path
    assert pitstop.load(path)["state"]["scaler"]["scale"] == saved["scale"]


def test_register_what_the_checkpoint_lacks_starts_fresh(
    reference: Path, caplog: pytest.LogCaptureFixture, seeded: None
) -> None:
    run = build_run(seed=1)
    with run.checkpointer(reference) as ckpt:
        ckpt.resume()
        with caplog.at_level(logging.WARNING, "pitstop"):
            ckpt.register("counter", Counter(2))
    messages = [r.getMessage() for r in caplog.records if r.name == "pitstop"]
    assert any("'counter'" in m and "starts fresh" in m for m in messages), messages


def test_register_before_resume_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with (
        Checkpointer(tmp_path, model=build_model()) as ckpt,
        caplog.at_level(logging.WARNING, "pitstop"),
    ):
        ckpt.register("counter", Counter(2))
    assert not [r for r in caplog.records if r.name == "pitstop"]


def test_register_duplicate_name(reference: Path) -> None:
    run = build_run()
    with run.checkpointer(reference) as ckpt:
        with pytest.raises(ConfigError, match="'optimizer' is already registered"):
            ckpt.register("optimizer", Counter())
        with pytest.raises(ConfigError, match="has no state_dict"):
            ckpt.register("thing", object())  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="non-empty str"):
            ckpt.register("", Counter())


def test_deferred_mismatch_is_refused_and_not_registered(reference: Path, seeded: None) -> None:
    run = build_run(seed=1)
    with run.checkpointer(reference, without=("sampler",)) as ckpt:
        ckpt.resume()
        wrong = ResumableSampler(len(DATA), 8, seed=3)
        with pytest.raises(IncompatibleCheckpoint) as raised:
            ckpt.register("sampler", wrong)
        assert any(
            "component 'sampler': ResumableSampler.batch_size: checkpoint has 4, this run has 8"
            in d
            for d in raised.value.differences
        )
        # Not registered: the name is still free, and the stored state still waits for it.
        ckpt.register("sampler", run.sampler)
        path = ckpt.save(Progress(step=3)).path
    assert pitstop.load(path)["ranked"][0]["sampler"]["batch_size"] == 4  # per-rank state


def test_deferred_optimizer_gets_the_parameter_group_checks(reference: Path) -> None:
    run = build_run(seed=1)
    reordered = torch.optim.AdamW(list(run.model.parameters())[::-1], lr=0.1)
    with run.checkpointer(reference, without=("optimizer",)) as ckpt:
        ckpt.resume()
        with pytest.raises(IncompatibleCheckpoint, match="holds other parameters"):
            ckpt.register("optimizer", reordered)  # today: restored without a check


# --- saving -----------------------------------------------------------------------------------


def test_maybe_save_follows_the_policy(tmp_path: Path) -> None:
    model = build_model()
    with Checkpointer(tmp_path, model=model, policy=Policy(every_steps=2, keep_last=None)) as ckpt:
        saved = {step: ckpt.maybe_save(Progress(step=step)) for step in range(6)}
        assert [s for s, c in saved.items() if c is not None] == [2, 4]
        assert saved[4] is not None
        assert saved[4].reason is SaveReason.INTERVAL
        assert [c.step for c in ckpt.checkpoints()] == [2, 4]
        # Again at the same step: already saved.
        assert ckpt.maybe_save(Progress(step=4)) is None
    assert sorted(p.name for p in tmp_path.glob("*.pitstop")) == [
        "step_000000000002.pitstop",
        "step_000000000004.pitstop",
    ]


def test_save_always_writes(tmp_path: Path) -> None:
    model = build_model()
    progress = Progress(step=3, epoch=1, batch_in_epoch=1, samples=12, tokens=5)
    with Checkpointer(tmp_path, model=model, policy=Policy(every_steps=100)) as ckpt:
        first = ckpt.save(progress, metrics={"loss": 0.25})
        second = ckpt.save(progress, reason="before eval")
    assert first.path == tmp_path / "step_000000000003.pitstop"
    assert first.path.is_file()
    assert first.step == 3
    assert first.progress == progress
    assert first.reason is SaveReason.MANUAL
    assert first.metrics == {"loss": 0.25}
    assert second.path == first.path
    assert second.detail == "before eval"
    assert second.seq > first.seq
    assert (tmp_path / "last").resolve() == first.path.resolve()
    stored = pitstop.load(first.path)
    assert_same(dict(model.state_dict()), dict(stored["weights"]["raw"]))


def test_finish_at_a_normal_end(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, model=build_model(), policy=Policy(every_steps=5)) as ckpt:
        ckpt.maybe_save(Progress(step=5))
        final = ckpt.finish(Progress(step=7))
    assert final is not None
    assert final.reason is SaveReason.FINAL
    assert final.step == 7
    assert (tmp_path / "final").resolve() == final.path.resolve()
    assert (tmp_path / "last").resolve() == final.path.resolve()


def test_finish_on_a_stop(tmp_path: Path) -> None:
    stop = StopRequest()
    stop.request("SIGTERM")
    with Checkpointer(tmp_path, model=build_model(), policy=Policy(every_steps=5)) as ckpt:
        saved = ckpt.finish(Progress(step=7), stop=stop)
        assert saved is not None
        assert saved.reason is SaveReason.STOP
        assert saved.detail == "SIGTERM"
        assert [c.detail for c in ckpt.checkpoints()] == ["SIGTERM"]
    assert not (tmp_path / "final").exists()
    assert not (tmp_path / "final").is_symlink()
    assert (tmp_path / "last").resolve() == saved.path.resolve()


def test_maybe_save_on_a_stop(tmp_path: Path) -> None:
    stop = StopRequest()
    with Checkpointer(tmp_path, model=build_model(), policy=Policy(every_steps=5)) as ckpt:
        assert ckpt.maybe_save(Progress(step=3), stop=stop) is None
        stop.request()
        saved = ckpt.maybe_save(Progress(step=3), stop=stop)
    assert saved is not None
    assert saved.reason is SaveReason.STOP
    assert saved.detail == "requested"


def test_checkpoints_oldest_first(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, model=build_model(), policy=Policy(keep_last=None)) as ckpt:
        ckpt.save(Progress(step=5))
    with Checkpointer(tmp_path, model=build_model(), policy=Policy(keep_last=None)) as ckpt:
        ckpt.resume()
        ckpt.save(Progress(step=5))  # at the step it resumed at: allowed
        with pytest.raises(
            ConfigError, match="progress went backwards: step 1, but this run is at step 5"
        ):
            ckpt.save(Progress(step=1))  # resume()'s result not used
    with Checkpointer(
        tmp_path, model=build_model(), policy=Policy(keep_last=None), overwrite=True
    ) as ckpt:
        for step in (1, 3):  # another timeline, started afresh, saves lower steps later
            ckpt.save(Progress(step=step))
        listed = ckpt.checkpoints()
    assert [c.step for c in listed] == [5, 1, 3]
    assert [c.seq for c in listed] == sorted(c.seq for c in listed)
    with Checkpointer(tmp_path, model=build_model()) as ckpt:
        assert [c.step for c in ckpt.checkpoints()] == [5, 1, 3]


def test_metrics_are_converted(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, model=build_model()) as ckpt:
        saved = ckpt.save(
            Progress(step=1),
            metrics={"loss": torch.tensor(0.5), "acc": np.float32(0.25), "n": 3},
        )
        assert saved.metrics == {"loss": 0.5, "acc": 0.25, "n": 3.0}
        assert all(type(v) is float for v in saved.metrics.values())
        assert ckpt.checkpoints()[-1].metrics == saved.metrics
    with Checkpointer(tmp_path, model=build_model()) as ckpt:
        assert ckpt.checkpoints()[-1].metrics == {"loss": 0.5, "acc": 0.25, "n": 3.0}


@pytest.mark.parametrize(
    "value", ["high", None, [1.0, 2.0], torch.tensor([1.0, 2.0]), {"a": 1}], ids=repr
)
def test_non_numeric_metric(tmp_path: Path, value: object) -> None:
    with Checkpointer(tmp_path, model=build_model()) as ckpt:
        with pytest.raises(ConfigError, match=r"metrics\['quality'\]"):
            ckpt.save(Progress(step=1), metrics={"loss": 1.0, "quality": value})
        with pytest.raises(ConfigError, match=r"metrics\['quality'\]"):
            ckpt.maybe_save(Progress(step=1), metrics={"quality": value})
        assert ckpt.checkpoints() == []
    assert list(tmp_path.glob("*.pitstop")) == []


def test_progress_must_be_a_progress(tmp_path: Path) -> None:
    with (
        Checkpointer(tmp_path, model=build_model()) as ckpt,
        pytest.raises(ConfigError, match=r"progress must be a pitstop\.Progress"),
    ):
        ckpt.save(3)  # type: ignore[arg-type]


# --- resuming ---------------------------------------------------------------------------------


def test_resume_from_an_empty_directory(tmp_path: Path, seeded: None) -> None:
    run = build_run()
    run.train(1)
    before = capture(run)
    with run.checkpointer(tmp_path / "new") as ckpt:
        assert ckpt.resume() == Progress()
        assert ckpt.resume("best") == Progress()
    assert_unchanged(run, before)


def _model_after(step: int) -> nn.Module:
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return model


def test_resume_best(tmp_path: Path) -> None:
    policy = Policy(best=Best("loss"))
    model = build_model()
    with Checkpointer(tmp_path, model=model, policy=policy) as ckpt:
        model.load_state_dict(_model_after(1).state_dict())
        best = ckpt.maybe_save(Progress(step=1), metrics={"loss": 0.5})
        assert best is not None
        assert best.reason is SaveReason.BEST
        model.load_state_dict(_model_after(2).state_dict())
        assert ckpt.maybe_save(Progress(step=2), metrics={"loss": 0.9}) is None
        ckpt.save(Progress(step=2), metrics={"loss": 0.9})
    assert (tmp_path / "best").resolve() == best.path.resolve()
    live = build_model(seed=5)
    with Checkpointer(tmp_path, model=live, policy=policy) as ckpt:
        assert ckpt.resume("best") == Progress(step=1)
        assert_same(dict(_model_after(1).state_dict()), dict(live.state_dict()))
        assert ckpt.resume() == Progress(step=2)
        assert_same(dict(_model_after(2).state_dict()), dict(live.state_dict()))
        with pytest.raises(pitstop.CheckpointNotFound, match="final"):
            ckpt.resume("final")


def test_resume_from_an_explicit_file(tmp_path: Path) -> None:
    model = build_model()
    with Checkpointer(tmp_path / "a", model=model, policy=Policy(keep_last=None)) as ckpt:
        model.load_state_dict(_model_after(1).state_dict())
        first = ckpt.save(Progress(step=1, samples=4))
        model.load_state_dict(_model_after(2).state_dict())
        ckpt.save(Progress(step=2, samples=8))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    renamed = elsewhere / "weights-of-step-one.bin"
    shutil.copyfile(first.path, renamed)

    live = build_model(seed=5)
    with Checkpointer(tmp_path / "a", model=live) as ckpt:
        assert ckpt.resume(first.path) == Progress(step=1, samples=4)
        assert_same(dict(_model_after(1).state_dict()), dict(live.state_dict()))
    live = build_model(seed=5)
    with Checkpointer(tmp_path / "b", model=live) as ckpt:
        assert ckpt.resume(renamed) == Progress(step=1, samples=4)
        assert_same(dict(_model_after(1).state_dict()), dict(live.state_dict()))
        assert ckpt.resume(str(first.path)) == Progress(step=1, samples=4)
        with pytest.raises(pitstop.CheckpointNotFound):
            ckpt.resume(tmp_path / "nothing-here.pitstop")


def _flip_tensor_byte(path: Path) -> None:
    blob = fileformat.read_manifest(path).blobs[0]
    with open(path, "r+b") as file:
        file.seek(blob.offset)
        byte = file.read(1)
        file.seek(blob.offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_newest_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_model()
    with Checkpointer(tmp_path, model=model, policy=Policy(keep_last=None)) as ckpt:
        model.load_state_dict(_model_after(1).state_dict())
        ckpt.save(Progress(step=1))
        model.load_state_dict(_model_after(2).state_dict())
        newest = ckpt.save(Progress(step=2))
    _flip_tensor_byte(newest.path)
    live = build_model(seed=5)
    with (
        Checkpointer(tmp_path, model=live) as ckpt,
        caplog.at_level(logging.WARNING, "pitstop"),
    ):
        assert ckpt.resume() == Progress(step=1)
    assert_same(dict(_model_after(1).state_dict()), dict(live.state_dict()))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(newest.path.name in w for w in warnings), warnings


# --- lifetime ---------------------------------------------------------------------------------


def test_one_checkpointer_per_directory(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path, model=build_model())
    try:
        with pytest.raises(DirectoryLocked):
            Checkpointer(tmp_path, model=build_model())
        first.save(Progress(step=1))
    finally:
        first.close()
    first.close()  # idempotent
    with Checkpointer(tmp_path, model=build_model()) as second:
        assert second.resume() == Progress(step=1)


def test_closed_checkpointer_refuses(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, model=build_model())
    ckpt.close()
    calls: list[Callable[[], object]] = [
        ckpt.resume,
        ckpt.wait,
        lambda: ckpt.save(Progress(step=1)),
        lambda: ckpt.maybe_save(Progress(step=1)),
        lambda: ckpt.finish(Progress(step=1)),
        lambda: ckpt.register("counter", Counter()),
    ]
    for call in calls:
        with pytest.raises(PitstopError, match="closed"):
            call()
    assert list(tmp_path.glob("*.pitstop")) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"async_save": "yes"},
        {"async_save": None},
        {"model": {"fc.weight": torch.zeros(1)}},
        {"ema": "not a module"},
        {"state": {"counter": object()}},
    ],
    ids=["async yes", "async None", "model", "ema", "component"],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"model": build_model(), **kwargs}
    with pytest.raises(ConfigError):
        Checkpointer(tmp_path, **arguments)
    # Nothing is left locked.
    with Checkpointer(tmp_path, model=build_model()):
        pass


@pytest.mark.parametrize("async_save", [False, True, "overlap"])
def test_save_and_resume_in_every_save_mode(
    tmp_path: Path, async_save: bool | str, seeded: None
) -> None:
    run = build_run()
    with run.checkpointer(tmp_path, async_save=async_save) as ckpt:
        run.train(2)
        ckpt.maybe_save(run.progress)  # no policy: nothing to do
        saved = ckpt.save(run.progress)
        expected = capture(run)
        run.train(1)  # changes the live state while (or after) it is written
        final = ckpt.finish(run.progress)
        assert [c.step for c in ckpt.checkpoints()] == [2, 3]
    assert final is not None
    assert final.reason is SaveReason.FINAL
    live = build_run(seed=1)
    with live.checkpointer(tmp_path) as ckpt:
        assert ckpt.resume(saved.path) == run.progress.__class__(
            step=2, batch_in_epoch=2, samples=8
        )
    position = (live.sampler.epoch, live.sampler.batch_in_epoch)
    assert_unchanged(live, {**expected, "sampler": position})


# --- wrapped models ---------------------------------------------------------------------------


def test_data_parallel_is_unwrapped(tmp_path: Path) -> None:
    inner = build_model(seed=2)
    wrapped = nn.DataParallel(inner)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    with Checkpointer(tmp_path, model=wrapped, state={"optimizer": optimizer}) as ckpt:
        saved = ckpt.save(Progress(step=1))
    raw = pitstop.load(saved.path)["weights"]["raw"]
    assert list(raw) == list(inner.state_dict())
    assert not any(name.startswith("module.") for name in raw)

    plain = build_model(seed=9)
    pitstop.load_weights(plain, saved.path)
    assert_same(dict(inner.state_dict()), dict(plain.state_dict()))

    # And the whole state resumes into an unwrapped model with its own optimizer.
    other = build_model(seed=9)
    with Checkpointer(
        tmp_path,
        model=other,
        state={"optimizer": torch.optim.AdamW(other.parameters(), lr=0.1)},
    ) as ckpt:
        assert ckpt.resume() == Progress(step=1)
    assert_same(dict(inner.state_dict()), dict(other.state_dict()))


def test_a_run_without_sharded_state_never_imports_dcp(tmp_path: Path) -> None:
    """torch's optimizers import DTensor's module in every run (torch 2.5 on); telling a sharded
    model apart must not import torch.distributed.checkpoint too (a tenth of a second or more,
    on every start and resume). In a fresh interpreter: this one may have imported it already."""
    import subprocess
    import sys

    script = (
        "import sys, torch, pitstop\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.AdamW(m.parameters())\n"
        "imported = 'torch.distributed.tensor' in sys.modules\n"
        "from importlib.util import find_spec  # DTensor's public module (torch 2.5 on)\n"
        "assert imported or find_spec('torch.distributed.tensor._api') is None\n"
        f"with pitstop.Checkpointer({str(tmp_path)!r}, model=m, state={{'optimizer': o}}) as c:\n"
        "    c.save(pitstop.Progress(step=1)); c.resume()\n"
        "print('dcp', 'torch.distributed.checkpoint' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dcp", "False"]
