"""Suite 5 — hostile inputs, each refused within 5 s and 500 MiB.

Into a real run's directory (steps 1 and 2 of a Checkpointer) goes one hostile thing at a time:
a FIFO, a device (a symlink to /dev/zero or /dev/urandom, a character device node), a
directory, a 2 GiB sparse file, a symlink out of the directory (``..``, absolute, ``/etc``), in
place of ``latest.json``, of a pointer, of the newest checkpoint or of ``.lock``; or a newest
checkpoint that is hostile inside — pickle payloads (a canary proves nothing ran), absurd
lengths, shapes and offsets, deep nesting, unknown msgpack ext types, a forged footer claiming
a 1 GiB manifest. Then every reader and the writer are called on it — ``pitstop.load(dir)``,
``load(dir/"last")``, ``verify(dir/"last")``, ``info(dir/"last")``, a Checkpointer's
``resume()`` — each on a thread that must end within 5 s having grown this process's peak
resident memory (VmHWM, reset through /proc/self/clear_refs) by less than 500 MiB. Each call
returns or raises a PitstopError naming what it refused; no other exception, and nothing
outside the directory is touched.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from pitstop.errors import PitstopError
from reliability.bounds import bounded
from shell.test_fileformat import DATA, HOSTILE, assemble, document, packed

NEWEST = "step_000000000002.pitstop"
GiB = 1 << 30


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "run"
    model = torch.nn.Linear(4, 3)
    with pitstop.Checkpointer(path, model=model, policy=pitstop.Policy(keep_last=None)) as ckpt:
        for step in (1, 2):
            ckpt.save(pitstop.Progress(step=step))
    return path


def _copy(clean: Path, where: Path) -> Path:
    where.mkdir()
    for entry in clean.iterdir():
        if entry.is_symlink():
            os.symlink(os.readlink(entry), where / entry.name)
        elif entry.name != ".lock":
            (where / entry.name).write_bytes(entry.read_bytes())
    return where


# --- what goes in place of an entry ----------------------------------------------------------


def _replace(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()


def _fifo(path: Path) -> None:
    _replace(path)
    os.mkfifo(path)


def _link(target: str) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        _replace(path)
        os.symlink(target, path)

    return plant


def _device(path: Path) -> None:
    _replace(path)
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        os.symlink("/dev/zero", path)  # unprivileged: the same device, through a link


def _directory(path: Path) -> None:
    _replace(path)
    path.mkdir()
    (path / "inside").write_text("x")


def _sparse(size: int) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        _replace(path)
        with open(path, "wb") as file:
            file.truncate(size)

    return plant


def _bytes(data: bytes) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        _replace(path)
        path.write_bytes(data)

    return plant


def _forged_footer(path: Path) -> None:
    """A 2 GiB sparse file with a valid header and a footer claiming a 1 GiB manifest."""
    _replace(path)
    size = 2 * GiB + 4096
    head = struct.pack("<8sII44s", b"PITSTOP\0", 1, 0, bytes(44))
    head += struct.pack("<I", zlib.crc32(head))
    offset = size - 40 - GiB
    foot = struct.pack("<8sIIQQI", b"\0POTSTIP", 1, 0, offset, GiB, 0)
    foot += struct.pack("<I", zlib.crc32(foot))
    with open(path, "wb") as file:
        file.write(head)
        file.truncate(size - 40)
        file.seek(size - 40)
        file.write(foot)


class _Canary:
    """Unpickling this creates the directory ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def _protocol0_canary(path: Path) -> bytes:
    """A pickle (protocol 0, written by hand: pickle itself is banned here) of os.mkdir(path)."""
    return b"cos\nmkdir\n(S'" + str(path).encode() + b"'\ntR."


ENTRY_CASES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "latest.json is a FIFO": ("latest.json", _fifo),
    "latest.json -> /dev/zero": ("latest.json", _link("/dev/zero")),
    "latest.json -> /dev/urandom": ("latest.json", _link("/dev/urandom")),
    "latest.json is a device": ("latest.json", _device),
    "latest.json is 2 GiB, sparse": ("latest.json", _sparse(2 * GiB)),
    "latest.json is a directory": ("latest.json", _directory),
    "latest.json -> /etc/passwd": ("latest.json", _link("/etc/passwd")),
    "latest.json nested 200000 deep": ("latest.json", _bytes(b"[" * 200_000)),
    "latest.json with a 900000-digit number": ("latest.json", _bytes(b"1" * 900_000)),
    "latest.json pointing out": (
        "latest.json",
        _bytes(
            json.dumps(
                {"pointers": {"last": "/etc/passwd", "best": "../../x", "final": ".."}}
            ).encode()
        ),
    ),
    "last is a FIFO": ("last", _fifo),
    "last -> /dev/zero": ("last", _link("/dev/zero")),
    "last is a device": ("last", _device),
    "last is a directory": ("last", _directory),
    "last -> /etc/passwd": ("last", _link("/etc/passwd")),
    "last -> ..": ("last", _link("..")),
    "last -> ../run/step": ("last", _link(f"../run/{NEWEST}")),
    "last -> itself": ("last", _link("last")),
    "best -> /etc": ("best", _link("/etc")),
    "final is a FIFO": ("final", _fifo),
    "newest is a FIFO": (NEWEST, _fifo),
    "newest -> /dev/zero": (NEWEST, _link("/dev/zero")),
    "newest is a device": (NEWEST, _device),
    "newest is a directory": (NEWEST, _directory),
    "newest is 2 GiB of zeros, sparse": (NEWEST, _sparse(2 * GiB)),
    "newest claims a 1 GiB manifest": (NEWEST, _forged_footer),
    "newest -> /etc/passwd": (NEWEST, _link("/etc/passwd")),
    ".lock is a FIFO": (".lock", _fifo),
    ".lock -> /dev/zero": (".lock", _link("/dev/zero")),
    ".lock is a directory": (".lock", _directory),
}


def _calls(path: Path) -> dict[str, Callable[[], object]]:
    def resume() -> object:
        model = torch.nn.Linear(4, 3)
        with pitstop.Checkpointer(path, model=model) as ckpt:
            return ckpt.resume()

    return {
        "load(dir)": lambda: pitstop.load(path),
        "load(dir/last)": lambda: pitstop.load(path / "last"),
        "verify(dir/last)": lambda: pitstop.verify(path / "last"),
        "info(dir/last)": lambda: pitstop.info(path / "last"),
        "Checkpointer.resume()": resume,
    }


def _assert_refused_or_handled(what: str, call: str, outcome: tuple[object, Any, int]) -> None:
    _, error, _ = outcome
    if error is not None and not isinstance(error, PitstopError):
        raise AssertionError(f"{what}: {call} raised {type(error).__name__}: {error}") from error


@pytest.mark.parametrize("case", list(ENTRY_CASES), ids=list(ENTRY_CASES))
def test_a_hostile_entry_is_refused_within_bounds(clean: Path, tmp_path: Path, case: str) -> None:
    name, plant = ENTRY_CASES[case]
    path = _copy(clean, tmp_path / "run")
    outside = {p: p.stat().st_mtime_ns for p in (Path("/etc/passwd"),) if p.exists()}
    plant(path / name)
    for call, run in _calls(path).items():
        outcome = bounded(run)
        _assert_refused_or_handled(case, call, outcome)
    assert {p: p.stat().st_mtime_ns for p in outside} == outside


def test_a_symlinked_lock_never_touches_its_target(clean: Path, tmp_path: Path) -> None:
    path = _copy(clean, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, path / ".lock")
    _, error, _ = bounded(lambda: pitstop.Checkpointer(path, model=torch.nn.Linear(4, 3)))
    assert isinstance(error, PitstopError)
    assert ".lock" in str(error)
    assert victim.read_text() == "precious"


# --- a newest checkpoint that is hostile inside ------------------------------------------------


def _hostile_files(where: Path) -> dict[str, Callable[[Path], None]]:
    canary = where / "canary"
    files: dict[str, Callable[[Path], None]] = {}
    for case, (options, _) in HOSTILE.items():
        options = dict(options)
        manifest = options.pop("raw", None)
        if manifest is None:
            manifest = packed(options.pop("manifest", document()))

        def plant(
            path: Path, manifest: bytes = manifest, options: dict[str, Any] = options
        ) -> None:
            _replace(path)
            assemble(path, manifest, DATA, **options)

        files[case] = plant
    pickled = _protocol0_canary(canary)

    def as_manifest(path: Path) -> None:
        _replace(path)
        assemble(path, pickled)

    def as_value(path: Path) -> None:
        _replace(path)
        assemble(path, packed(document(tree={"p": pickled, "x": document()["tree"]})), DATA)

    def as_torch_file(path: Path) -> None:
        _replace(path)
        torch.save({"p": _Canary(canary)}, path)

    files["a pickle as the manifest"] = as_manifest
    files["a pickle as a stored value"] = as_value
    files["a torch.save pickle"] = as_torch_file
    files["an array claiming 2**32-1 items, nested"] = _nested_claims
    return files


def _nested_claims(path: Path) -> None:
    """A manifest of 1000 nested arrays, each claiming 2**32-1 items (none of them present)."""
    _replace(path)
    assemble(path, b"\xdd\xff\xff\xff\xff" * 1000 + bytes(4096), DATA)


def test_hostile_checkpoint_contents_are_refused_within_bounds(clean: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    cases = _hostile_files(tmp_path)
    assert len(cases) >= 40
    for index, (case, plant) in enumerate(cases.items()):
        path = _copy(clean, tmp_path / f"run{index}")
        plant(path / NEWEST)
        for call, run in _calls(path).items():
            result, error, _ = bounded(run)
            _assert_refused_or_handled(case, call, (result, error, 0))
            if call == "Checkpointer.resume()" and error is None:
                assert result == pitstop.Progress(step=1), f"{case}: resumed {result}"
        # the file itself, named directly: refused (a pickle stored as a value is only bytes)
        for check in (pitstop.verify, pitstop.load, pitstop.info):
            result, error, _ = bounded(lambda check=check, path=path: check(path / NEWEST))
            if case == "a pickle as a stored value" and check is not pitstop.info:
                assert error is None
                assert check is pitstop.verify or result["p"] == _protocol0_canary(canary)
            else:
                assert isinstance(error, PitstopError), f"{case}: {check.__name__} took it"
    assert not canary.exists(), "a pickle payload ran"
