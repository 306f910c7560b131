"""Suite 4 — corruption: bit flips, overwrites and truncations anywhere in a checkpoint, in
``latest.json`` and in the pointer links.

A real run (a Checkpointer: model, optimizer, best metric) leaves steps 1, 2 (best) and 3
(last). Each case corrupts one thing in a copy of the directory, then resumes a fresh model
from it with the real Checkpointer:

* a corrupt checkpoint is detected before any of its tensors is read (no load of that file ever
  happens: every load is recorded), resume falls back to the previous one with a warning naming
  the file, and the model holds exactly the previous step's weights;
* a corrupt ``latest.json`` or link never changes an outcome: the pointers the scan reconciles
  are exactly the clean directory's, and resume restores step 3;
* repeated clean loads raise no false alarm: no warning, the same step, every time.

Reduced counts by default; every byte (and every bit of latest.json and the links) under
``-m slow``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from pitstop.core.records import Best, Pointers, Policy
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage

BEST = Best("loss")
LOSSES = {1: 0.9, 2: 0.5, 3: 0.7}
NEWEST = "step_000000000003.pitstop"


def _model(value: float = 0.0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)


def _train_to(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, -1.0)
    opt.step()
    with torch.no_grad():  # the weights say which step they are
        for p in model.parameters():
            p.fill_(float(step))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1, 2 (best) and 3 (last) of a real run."""
    path = tmp_path_factory.mktemp("corruption") / "run"
    model, opt = _model()
    policy = Policy(every_steps=1, keep_last=None, best=BEST)
    with pitstop.Checkpointer(path, model=model, state={"opt": opt}, policy=policy) as ckpt:
        for step in (1, 2, 3):
            _train_to(step, model, opt)
            ckpt.maybe_save(pitstop.Progress(step=step), metrics={"loss": LOSSES[step]})
    return path


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every file whose tensors are loaded (through pitstop.shell.format.fileformat)."""
    seen: list[str] = []
    real = fileformat.load

    def load(path: Any, **options: Any) -> object:
        seen.append(Path(path).name)
        return real(path, **options)

    monkeypatch.setattr(fileformat, "load", load)
    return seen


def _copy(clean: Path, where: Path) -> Path:
    shutil.copytree(clean, where, symlinks=True)
    return where


def _resume(path: Path) -> tuple[int, float, list[str]]:
    """Resume a fresh model from ``path``: the step, the one weight value, the warnings."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("pitstop")
    logger.addHandler(handler)
    try:
        model, opt = _model(-1.0)
        policy = Policy(every_steps=1, keep_last=None, best=BEST)
        with pitstop.Checkpointer(path, model=model, state={"opt": opt}, policy=policy) as ckpt:
            step = ckpt.resume().step
    finally:
        logger.removeHandler(handler)
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
    assert len(values) == 1, f"the model holds a mix of weights: {values}"
    return step, values.pop(), [r.getMessage() for r in records]


def _reconciled(path: Path) -> Pointers:
    return scan(LocalStorage(path), BEST).pointers


# --- the checkpoint file --------------------------------------------------------------------


def _flip(data: bytearray, offset: int, bit: int) -> None:
    data[offset] ^= 1 << bit


def _mutations(size: int, slow: bool) -> Iterator[tuple[str, Callable[[bytearray], bytes]]]:
    rng = random.Random(4)
    if slow:
        flips = list(range(size))
        overwrites = list(range(0, size, 16))
        truncations = list(range(size))
    else:
        edges = {0, 1, 63, 64, 65, size - 41, size - 40, size - 39, size - 1}
        flips = sorted(edges | set(rng.sample(range(size), 40)))
        overwrites = sorted({0, size - 40, *rng.sample(range(size), 12)})
        truncations = sorted({0, 64, size - 40, size - 1, *rng.sample(range(size), 12)})
    for offset in flips:
        bit = rng.randrange(8)

        def flip(data: bytearray, offset: int = offset, bit: int = bit) -> bytes:
            _flip(data, offset, bit)
            return bytes(data)

        yield f"bit {bit} of byte {offset} flipped", flip
    for offset in overwrites:
        noise = rng.randbytes(min(512, size - offset))

        def overwrite(data: bytearray, offset: int = offset, noise: bytes = noise) -> bytes:
            if bytes(data[offset : offset + len(noise)]) == noise:
                noise = bytes(b ^ 0xFF for b in noise)
            data[offset : offset + len(noise)] = noise
            return bytes(data)

        yield f"{len(noise)} bytes at {offset} overwritten", overwrite
    for length in truncations:
        yield f"truncated to {length} bytes", lambda data, length=length: bytes(data[:length])


@pytest.mark.parametrize(
    "slow",
    [
        pytest.param(False, id="sampled"),
        pytest.param(True, id="every-byte", marks=pytest.mark.slow),
    ],
)
def test_a_corrupt_newest_checkpoint_never_reaches_the_model(
    clean: Path, tmp_path: Path, loads: list[str], slow: bool
) -> None:
    original = (clean / NEWEST).read_bytes()
    cases = 0
    for what, mutate in _mutations(len(original), slow):
        path = _copy(clean, tmp_path / f"case{cases}")
        (path / NEWEST).write_bytes(mutate(bytearray(original)))
        loads.clear()
        step, value, warnings = _resume(path)
        assert NEWEST not in loads, f"{what}: a tensor of the corrupt file was loaded"
        assert (step, value) == (2, 2.0), f"{what}: resumed step {step} with weights {value}"
        assert any(NEWEST in w for w in warnings), f"{what}: no warning names {NEWEST}"
        shutil.rmtree(path)
        cases += 1
    assert cases >= (2 * len(original) if slow else 70)


# --- latest.json and the links ----------------------------------------------------------------


def _bit_flips(data: bytes, slow: bool) -> Iterator[tuple[str, bytes]]:
    """Every bit of every byte (slow); by default every bit of each digit — the steps and the
    values — and one random bit of every other byte."""
    rng = random.Random(5)
    for offset in range(len(data)):
        every = slow or chr(data[offset]).isdigit()
        for bit in range(8) if every else (rng.randrange(8),):
            changed = bytearray(data)
            _flip(changed, offset, bit)
            yield f"bit {bit} of byte {offset}", bytes(changed)


@pytest.mark.parametrize(
    "slow",
    [
        pytest.param(False, id="a-bit-per-byte"),
        pytest.param(True, id="every-bit", marks=pytest.mark.slow),
    ],
)
def test_a_corrupt_latest_json_never_changes_an_outcome(
    clean: Path, tmp_path: Path, slow: bool
) -> None:
    expected = _reconciled(clean)
    original = (clean / "latest.json").read_bytes()
    path = _copy(clean, tmp_path / "run")
    rng = random.Random(6)
    cases = list(_bit_flips(original, slow))
    cases += [(f"truncated to {n}", original[:n]) for n in range(0, len(original), 7)]
    cases += [
        (f"overwritten at {at}", original[:at] + rng.randbytes(16) + original[at + 16 :])
        for at in range(0, len(original), 11)
    ]
    for what, contents in cases:
        (path / "latest.json").write_bytes(contents)
        assert _reconciled(path) == expected, f"latest.json {what}: the pointers changed"
    (path / "latest.json").write_bytes(original)
    assert len(cases) >= len(original)
    # and through a real resume, for a sample
    for what, contents in cases[:: max(1, len(cases) // 20)]:
        (path / "latest.json").write_bytes(contents)
        assert _resume(path)[:2] == (3, 3.0), f"latest.json {what}"


@pytest.mark.parametrize("pointer", ["last", "best"])
@pytest.mark.parametrize(
    "slow",
    [
        pytest.param(False, id="a-bit-per-char"),
        pytest.param(True, id="every-bit", marks=pytest.mark.slow),
    ],
)
def test_a_corrupt_link_never_changes_an_outcome(
    clean: Path, tmp_path: Path, pointer: str, slow: bool
) -> None:
    expected = _reconciled(clean)
    target = os.readlink(clean / pointer).encode()
    path = _copy(clean, tmp_path / "run")
    cases = [(w, t) for w, t in _bit_flips(target, slow) if b"\0" not in t]
    cases += [(f"cut to {n}", target[:n]) for n in range(1, len(target))]
    cases += [("dangling", b"step_000000000007.pitstop"), ("absolute", str(path / "x").encode())]
    for what, changed in cases:
        (path / pointer).unlink()
        os.symlink(os.fsdecode(changed), path / pointer)
        assert _reconciled(path) == expected, f"{pointer} -> {changed!r} ({what})"
    assert _resume(path)[:2] == (3, 3.0)


# --- no false alarms --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rounds", [pytest.param(30, id="30"), pytest.param(1000, id="1000", marks=pytest.mark.slow)]
)
def test_clean_loads_raise_no_false_alarm(
    clean: Path, tmp_path: Path, rounds: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = _copy(clean, tmp_path / "run")
    expected = _reconciled(clean)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        for _ in range(rounds):
            assert _resume(path) == (3, 3.0, [])
            assert pitstop.verify(path) == path / NEWEST
            tree = pitstop.load(path / "best")
            assert isinstance(tree, dict)
            assert _reconciled(path) == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
