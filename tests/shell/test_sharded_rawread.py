"""The resume's read of a sharded checkpoint finds each tensor's elements without torch.load.

``raw_record`` finds the storage record of a torch.save'd contiguous tensor of the dtype and
shape the manifest gives, and refuses (``None``: torch.load reads it) a tensor of another
stride, storage or shape, and damaged bytes — never raising, never pointing past the item. In
one process (a 1-rank gloo group, FSDP2): a resume whose every item goes through the torch.load
fallback restores the same state, and a resume reads no tensor with torch.load otherwise.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.shell.sharded import rawread

pytestmark = [NEEDS_GLOO, NEEDS_SHARDED]


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def found(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    return rawread.raw_record(data[:4096], data[-4096:], len(data), dtype, shape)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.tensor(5.0),
        torch.arange(6, dtype=torch.bfloat16),
        torch.arange(10, dtype=torch.int64).reshape(2, 5, 1),
        torch.zeros(0, 3),
    ],
    ids=["float32", "scalar", "bfloat16", "int64-3d", "empty"],
)
def test_the_elements_of_a_contiguous_tensor_are_found_where_torch_save_put_them(
    tensor: torch.Tensor,
) -> None:
    data = saved(tensor)
    at = found(data, tensor.dtype, tuple(tensor.shape))
    assert at is not None
    size = tensor.numel() * tensor.element_size()
    assert data[at : at + size] == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_another_stride_storage_shape_or_dtype_is_left_to_torch_load() -> None:
    transposed = torch.arange(12, dtype=torch.float32).reshape(4, 3).t().clone()
    assert not transposed.is_contiguous()
    assert found(saved(transposed), torch.float32, (3, 4)) is None
    view = torch.arange(10, dtype=torch.float32)[2:5]  # its storage holds 10 elements
    assert found(saved(view), torch.float32, (3,)) is None
    plain = saved(torch.zeros(3, 4))
    assert found(plain, torch.float32, (4, 3)) is None
    assert found(plain, torch.int32, (3, 4)) is None
    assert found(plain, torch.float32, (3, 4)) is not None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_bytes_never_raise_nor_point_past_the_item(data: st.DataObject) -> None:
    original = saved(torch.arange(24, dtype=torch.float32).reshape(4, 6))
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(damaged) - 1))
        damaged[where] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(damaged)))
    item = bytes(damaged[:cut])
    at = found(item, torch.float32, (4, 6))
    if at is not None:
        assert at >= 0
        assert at + 24 * 4 <= len(item)


def local_state(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of the model and of each optimizer state tensor, copied."""
    state = {f"model.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    for i, moments in enumerate(optimizer.state.values()):
        for key, value in moments.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            state[f"optimizer.{i}.{key}"] = local.clone()
    return state


def save_one(root: Path) -> dict[str, torch.Tensor]:
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    return local_state(model, optimizer)


def resumed(root: Path) -> dict[str, torch.Tensor]:
    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 1
    return local_state(model, optimizer)


def test_a_resume_reads_no_tensor_with_torch_load_and_its_fallback_restores_the_same(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    expected = save_one(root)
    loads: list[object] = []
    real_load = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        value = real_load(*args, **kwargs)
        loads.append(value)
        return value

    monkeypatch.setattr(torch, "load", counted)
    direct = resumed(root)
    assert not [v for v in loads if isinstance(v, torch.Tensor)]  # values only (lr, betas...)
    assert direct.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(direct[key], value), key
    monkeypatch.setattr(rawread, "raw_record", lambda *args: None)  # every item: torch.load
    loads.clear()
    fallback = resumed(root)
    assert len([v for v in loads if isinstance(v, torch.Tensor)]) >= len(expected)
    for key, value in expected.items():
        assert torch.equal(fallback[key], value), key


def test_items_of_a_file_checked_early_are_found_as_its_check_reads_past_them(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The items of the file the rank wrote are found while its check still reads: each once
    the check's stream has passed it (its pages read), all before the check is waited for."""
    from pitstop.shell.sharded import filecheck

    root = tmp_path / "checkpoints"
    expected = save_one(root)
    calls: list[tuple[str, bool]] = []
    past, verified = filecheck.Started.read_past, filecheck.Started.verified
    asked, crc = threading.Event(), filecheck.crc32_update

    def held(*args: Any) -> Any:  # the check reads on only once an item is asked for
        asked.wait(timeout=60)
        return crc(*args)

    def reading(self: Any, name: str, end: int) -> None:
        asked.set()
        past(self, name, end)
        calls.append(("past", self._read.get(name, 0) >= end))

    def waiting(self: Any, name: str) -> None:
        calls.append(("verified", True))
        verified(self, name)

    monkeypatch.setattr(filecheck, "crc32_update", held)
    monkeypatch.setattr(filecheck.Started, "read_past", reading)
    monkeypatch.setattr(filecheck.Started, "verified", waiting)
    restored = resumed(root)
    assert ("past", True) in calls, calls
    assert ("past", False) not in calls, calls
    assert calls.index(("verified", True)) > max(i for i, c in enumerate(calls) if c[0] == "past")
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key


def test_nothing_of_a_damaged_file_is_loaded_before_its_check_fails(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every item left to torch.load (a value, or a tensor not found plain): none of the
    newest checkpoint, whose shard is damaged, is loaded — its check fails first — and the
    one before is restored."""
    root = tmp_path / "checkpoints"
    expected = save_one(root)
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.resume()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        ckpt.save(pitstop.Progress(step=2))
    shard = next((root / "step_000000000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    loads: list[object] = []
    real_load = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        loads.append(real_load(*args, **kwargs))
        return loads[-1]

    monkeypatch.setattr(torch, "load", counted)
    monkeypatch.setattr(rawread, "raw_record", lambda *args: None)
    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 1
    tensors = [v for v in loads if isinstance(v, torch.Tensor)]
    assert len(tensors) == len(expected)  # step 1's alone
    restored = local_state(model, optimizer)
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
