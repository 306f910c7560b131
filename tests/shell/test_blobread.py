"""Reading a checkpoint once: checked as it is read, each tensor where the caller places it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import pitstop
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import blobread
from pitstop.shell.format import fileformat as ff
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.state.capture import LiveState

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=[1, 3], ids=["one-reader", "three-readers"])
def readers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every test here runs with one reader (its CRCs on the pool) and with three readers
    (each checksumming what it read), whatever this machine's cores."""
    count: int = request.param
    monkeypatch.setattr(blobread, "default_threads", lambda: count)
    return count


def _tree() -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 70, generator=generator)
    return {
        "weights": {
            "raw": {"w": weight, "w_t": weight.t(), "b": torch.randn(70, generator=generator)}
        },
        "state": {
            "optimizer": {
                "state": {
                    0: {
                        "step": torch.tensor(3.0),
                        "exp_avg": torch.randn(300, 70, generator=generator),
                    }
                },
                "param_groups": [{"lr": 0.1, "params": [0]}],
            }
        },
        "empty": torch.empty(0),
    }


def _save(path: Path, tree: object) -> Path:
    with open(path, "wb") as file:
        ff.write(file, ff.prepare(tree), {})
    return path


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _blob_of(path: Path, key: str) -> ff.Blob:
    manifest = ff.read_manifest(path)
    return manifest.blobs[manifest.tensors[manifest.tensor_paths.index((key,))].blob]


def _is_mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as lines:
        for line in lines:
            fields = line.split(maxsplit=5)
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop:
                return len(fields) == 6 and fields[5].strip() == str(path)
    return False


def _is_placed(path: tuple[str | int, ...]) -> torch.device | None:
    return CPU if path[0] == "state" else None


# --- fileformat.load with place= and verify="file" ----------------------------------------------


def test_placed_tensors_come_back_equal_in_private_memory(tmp_path: Path) -> None:
    path = _save(tmp_path / "c.pitstop", _tree())
    mapped = ff.load(path)
    placed = ff.load(path, place=_is_placed)
    assert isinstance(mapped, dict)
    assert isinstance(placed, dict)
    original = _tree()
    for tree in (mapped, placed):
        assert torch.equal(tree["weights"]["raw"]["w"], original["weights"]["raw"]["w"])  # type: ignore[index]
    moments = placed["state"]["optimizer"]["state"][0]["exp_avg"]
    stored = mapped["state"]["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(moments, stored)
    assert placed["state"]["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    raw = placed["weights"]["raw"]
    assert raw["w_t"].untyped_storage().data_ptr() == raw["w"].untyped_storage().data_ptr()
    if sys.platform == "linux":
        assert _is_mapped_from(raw["w"], path)  # left mapped: copied from the page cache
        assert not _is_mapped_from(moments, path)  # read into memory of its own
    moments.add_(1)  # writable, and never written back
    again = ff.load(path, place=_is_placed)
    assert torch.equal(again["state"]["optimizer"]["state"][0]["exp_avg"], stored)  # type: ignore[index]


def _vm_flags(tensor: torch.Tensor) -> list[str]:
    """The kernel's flags of the mapping that holds the middle of ``tensor``'s memory."""
    address = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2
    inside = False
    with open("/proc/self/smaps") as lines:
        for line in lines:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(x, 16) for x in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="no transparent huge pages here (Linux with THP only)",
)
def test_a_placed_tensor_of_huge_pages_size_is_advised_for_them(tmp_path: Path) -> None:
    """A placed tensor of 8 MiB (an optimizer moment) is read into memory advised for
    transparent huge pages (the mapping's ``hg`` flag: MADV_HUGEPAGE), before the read first
    touches it; a mapped one is not read into new memory at all. The values are the file's."""
    moment = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB
    path = _save(tmp_path / "c.pitstop", {"state": {"m": moment}, "weights": {"w": moment + 1}})
    placed = ff.load(path, place=_is_placed)
    assert isinstance(placed, dict)
    assert torch.equal(placed["state"]["m"], moment)
    assert "hg" in _vm_flags(placed["state"]["m"])
    assert _is_mapped_from(placed["weights"]["w"], path)
    assert torch.equal(placed["weights"]["w"], moment + 1)


def test_empty_and_zero_dimensional_tensors_are_placed_too(tmp_path: Path) -> None:
    tree = {"state": {"empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}, "w": torch.ones(3)}
    path = _save(tmp_path / "c.pitstop", tree)
    loaded = ff.load(path, verify="file", place=_is_placed)
    assert isinstance(loaded, dict)
    assert loaded["state"]["empty"].shape == (0, 4)
    assert loaded["state"]["scalar"].item() == 2.5
    assert torch.equal(loaded["w"], torch.ones(3))


@pytest.mark.parametrize("place", [None, _is_placed], ids=["mapped", "placed"])
def test_a_blob_read_in_many_chunks_is_checked_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, place: object
) -> None:
    monkeypatch.setattr(blobread, "CHUNK", 4096)  # every blob spans several chunks
    path = _save(tmp_path / "c.pitstop", _tree())
    tree = ff.load(path, verify="file", place=place)  # type: ignore[arg-type]
    assert isinstance(tree, dict)
    expected = _tree()["state"]["optimizer"]["state"][0]["exp_avg"]  # type: ignore[index]
    assert torch.equal(tree["state"]["optimizer"]["state"][0]["exp_avg"], expected)
    for key in ("weights.raw.w", "state.optimizer.state[0].exp_avg"):
        blob = _blob_of(path, key)
        _flip(path, blob.offset + blob.length // 2)  # in a middle chunk
        with pytest.raises(CheckpointCorrupt, match="fails its checksum"):
            ff.load(path, verify="file", place=place)  # type: ignore[arg-type]
        with pytest.raises(CheckpointCorrupt, match="fails its checksum"):
            ff.verify(path)
        _flip(path, blob.offset + blob.length // 2)
    ff.verify(path)


def test_verify_file_checks_what_the_selection_does_not_need(tmp_path: Path) -> None:
    path = _save(tmp_path / "c.pitstop", _tree())
    blob = _blob_of(path, "weights.raw.w")
    padding = blob.stop  # the byte after an unaligned blob is padding
    assert blob.length % ff.ALIGNMENT
    _flip(path, padding)
    assert ff.load(path, select=("state",)) is not None  # a checked subtree load: not its bytes
    with pytest.raises(CheckpointCorrupt, match="padding byte"):
        ff.load(path, select=("state",), verify="file")
    with pytest.raises(CheckpointCorrupt, match="padding byte"):
        ff.verify(path)
    _flip(path, padding)
    _flip(path, blob.offset)
    assert ff.load(path, select=("state",), place=_is_placed) is not None
    with pytest.raises(CheckpointCorrupt, match=r"weights\.raw\.w.* fails its checksum"):
        ff.load(path, select=("state",), verify="file", place=_is_placed)


def test_an_unchecked_load_reads_only_placed_blobs(tmp_path: Path) -> None:
    path = _save(tmp_path / "c.pitstop", _tree())
    blob = _blob_of(path, "state.optimizer.state[0].exp_avg")
    _flip(path, blob.offset)
    tree = ff.load(path, verify=False, place=_is_placed)
    assert isinstance(tree, dict)
    moments = tree["state"]["optimizer"]["state"][0]["exp_avg"]
    expected = _tree()["state"]["optimizer"]["state"][0]["exp_avg"]  # type: ignore[index]
    assert not torch.equal(moments, expected)
    with pytest.raises(CheckpointCorrupt):
        ff.load(path, place=_is_placed)


def test_a_file_cut_short_while_it_is_read_is_corrupt(tmp_path: Path) -> None:
    path = _save(tmp_path / "c.pitstop", _tree())
    manifest = ff.read_manifest(path)
    with open(path, "rb") as file:
        os.truncate(path, manifest.blobs[1].offset + 8)
        with pytest.raises(CheckpointCorrupt, match="ended early"):
            blobread.read_blobs(file, manifest, range(len(manifest.blobs)))


# --- the resume's read ------------------------------------------------------------------------


def _live(optimizer: torch.optim.Optimizer, model: nn.Module) -> LiveState:
    return LiveState(model=model, ema=None, components={"optimizer": optimizer}, config=None)


def test_the_resume_places_optimizer_state_on_its_parameters_device() -> None:
    model = nn.Linear(3, 2)
    reading = ResumeRead(_live(torch.optim.AdamW(model.parameters()), model))
    assert reading.place(("state", "optimizer", "state", 1, "exp_avg")) == CPU
    assert reading.place(("state", "optimizer", "state", 1, "step")) is None
    assert reading.place(("state", "optimizer", "state", 2, "exp_avg")) is None  # no such param
    assert reading.place(("state", "optimizer", "param_groups", 0, "lr")) is None
    assert reading.place(("state", "scheduler", "state", 0, "x")) is None
    assert reading.place(("weights", "raw", "weight")) is None
    assert reading.place(("ranked", 0, "optimizer", "state", 0, "exp_avg")) == CPU
    assert reading.place(("ranked", 1, "optimizer", "state", 0, "exp_avg")) is None


class _Copying(torch.optim.SGD):
    """An optimizer whose own load_state_dict might copy: its state stays mapped."""

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        super().load_state_dict(state_dict)


def test_an_optimizer_with_its_own_load_keeps_its_state_mapped() -> None:
    model = nn.Linear(3, 2)
    reading = ResumeRead(_live(_Copying(model.parameters(), lr=0.1, momentum=0.9), model))
    assert reading.place(("state", "optimizer", "state", 0, "momentum_buffer")) is None


def _trained(seed: int) -> tuple[nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fresh() -> tuple[nn.Module, torch.optim.AdamW]:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def test_resume_keeps_the_optimizer_state_it_read_and_falls_back_past_a_corrupt_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = pitstop.Policy(keep_last=None)
    first = _trained(1)
    with pitstop.Checkpointer(
        tmp_path, model=first[0], state={"opt": first[1]}, policy=policy
    ) as c:
        c.save(pitstop.Progress(step=1))
        second = _trained(2)
        first[0].load_state_dict(second[0].state_dict())
        first[1].load_state_dict(second[1].state_dict())
        newest = c.save(pitstop.Progress(step=2))
    # corrupt the newest file in an optimizer moment: a blob the resume reads into memory
    blob = _blob_of(newest.path, "state.opt.state[1].exp_avg_sq")
    _flip(newest.path, blob.offset + 3)

    model, optimizer = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        pitstop.Checkpointer(tmp_path, model=model, state={"opt": optimizer}) as c,
        caplog.at_level(logging.WARNING, "pitstop"),
    ):
        assert c.resume() == pitstop.Progress(step=1)
    assert any(newest.path.name in r.getMessage() for r in caplog.records)
    expected_model, expected_optimizer = _trained(1)
    for key, value in expected_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
        assert not torch.equal(before[key], value)
    for param, expected in zip(model.parameters(), expected_model.parameters(), strict=True):
        state = optimizer.state[param]
        want = expected_optimizer.state[expected]
        assert torch.equal(state["exp_avg_sq"], want["exp_avg_sq"])
        if sys.platform == "linux":  # read into private memory, not left mapped from the file
            assert not any(_is_mapped_from(state["exp_avg"], p) for p in tmp_path.glob("*.pitstop"))

    # only a corrupt checkpoint: nothing to resume, the run untouched
    (tmp_path / "step_000000000001.pitstop").unlink()
    model, optimizer = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pitstop.Checkpointer(tmp_path, model=model, state={"opt": optimizer}) as c:
        assert c.resume() == pitstop.Progress()
    assert not optimizer.state
    for key, value in model.state_dict().items():
        assert torch.equal(before[key], value), key


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    from torch import nn
    import pitstop
    from pitstop.shell.format import blobread

    MIB = 1 << 20
    READERS = int(sys.argv[2])
    blobread.default_threads = lambda: READERS  # this test's parameter, in this process

    def rss_anon():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon")

    def build():
        model = nn.ParameterList(nn.Parameter(torch.zeros(4 * MIB)) for _ in range(8))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    directory = sys.argv[1]
    model, optimizer = build()
    for p in model.parameters():
        p.data.normal_()
        p.grad = torch.ones_like(p)
    optimizer.step()  # a momentum buffer per parameter: the state is 2 x 128 MiB
    optimizer.zero_grad(set_to_none=True)
    with pitstop.Checkpointer(directory, model=model, state={"optimizer": optimizer}) as c:
        c.save(pitstop.Progress(step=1))
    del model, optimizer, c

    live, fresh = build()
    peak = 0
    done = threading.Event()

    def sample():
        global peak
        while not done.is_set():
            peak = max(peak, rss_anon())
            time.sleep(0.001)

    before = rss_anon()
    sampler = threading.Thread(target=sample)
    sampler.start()
    with pitstop.Checkpointer(directory, model=live, state={"optimizer": fresh}) as c:
        c.resume()
    done.set()
    sampler.join()
    peak = max(peak, rss_anon())
    after = rss_anon()
    print(json.dumps({"before": before, "peak": peak, "after": after}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_resume_holds_no_second_copy_of_the_state_in_anonymous_memory(
    tmp_path: Path, readers: int
) -> None:
    # 128 MiB of parameters and a 128 MiB momentum buffer: the resume reads the buffer into
    # memory (it becomes the optimizer's state) and copies the weights from the page cache
    # into the live model, so anonymous memory grows by the optimizer's state and at most
    # 64 MiB more. Reading the weights into memory first would add 128 MiB on top.
    probe = tmp_path / "probe.py"
    probe.write_text(_MEMORY_PROBE)
    done = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "ckpt"), str(readers)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    state = 128 * mib  # the momentum buffers, which the optimizer keeps
    grown = figures["peak"] - figures["before"]
    assert grown <= state + 64 * mib + 16 * mib, {k: v / mib for k, v in figures.items()}
    assert figures["after"] - figures["before"] >= state - 8 * mib  # the state is resident
