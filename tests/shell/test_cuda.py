"""CUDA paths on a real GPU: staging from device memory on a side stream, the read path's
pinned bounce buffers, the CUDA RNG, and FSDP2 on NCCL. Skipped where no GPU is visible (CI);
run by ``benchmarks/device_check.sh`` on a GPU machine.

Each test checks a result that is wrong when the stream ordering is wrong: the state is
changed by kernels queued on the current stream right before the call, or right after it, and
what was saved (or resumed) must be exactly what the training loop saw at the call.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from onerank import NEEDS_SHARDED
from pitstop.shell.format import blobread
from trees import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES: list[bool | str] = [False, True, "overlap"]


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.Dropout(0.25), nn.ReLU(), nn.Linear(2048, 512)
    ).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> list[torch.Tensor]:
    """``n`` training steps on the GPU: the inputs and the dropout masks come from the CUDA
    generator, so a resume that restored the wrong CUDA RNG state diverges."""
    losses = []
    for _ in range(n):
        x = torch.randn(64, 512, device="cuda")
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _saved(tmp_path: Path, module: nn.Module) -> Path:
    with pitstop.Checkpointer(tmp_path / "saved", model=module) as ckpt:
        return ckpt.save(pitstop.Progress(step=1)).path


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict()["state"],
        "cuda_rng": torch.cuda.get_rng_state(),
    }


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async", "overlap"])
def test_a_cuda_run_resumes_bitwise_in_every_save_mode(tmp_path: Path, mode: bool | str) -> None:
    model, optimizer = _model(0)
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save=mode
    ) as ckpt:
        _steps(model, optimizer, 3)
        ckpt.save(pitstop.Progress(step=3))
        expected_losses = _steps(model, optimizer, 4)  # overlaps the background copy
    expected = _state(model, optimizer)

    model, optimizer = _model(1)  # other weights, another RNG position
    torch.cuda.manual_seed(12345)
    with pitstop.Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 3
        assert all(p.is_cuda for p in model.parameters())
        losses = _steps(model, optimizer, 4)
    assert_same(losses, expected_losses, "losses")
    assert_same(_state(model, optimizer), expected, "state")


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async", "overlap"])
def test_a_save_sees_the_kernels_queued_before_it_and_none_queued_after(
    tmp_path: Path, mode: bool | str
) -> None:
    layer = nn.Linear(4096, 4096, bias=False).cuda()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    big = torch.randn(4096, 4096, device="cuda")
    with pitstop.Checkpointer(
        tmp_path, model=layer, state={"optimizer": optimizer}, async_save=mode
    ) as ckpt:
        with torch.no_grad():
            # A long chain of kernels that ends by writing the weight, and the save at once:
            # a copy that does not wait for the current stream reads the old values.
            value = big
            for _ in range(30):
                value = torch.tanh(value @ big) * 0.5
            layer.weight.copy_(value)
            expected = value.cpu()
        saved = ckpt.save(pitstop.Progress(step=1))
        # Right after the call (each mode's contract allows it): a forward and backward pass,
        # the step, and outside overlap mode an in-place write. None is in the checkpoint.
        layer(big).sum().backward()
        optimizer.step()
        if mode != "overlap":
            with torch.no_grad():
                layer.weight.mul_(-1.0)
        ckpt.wait()
    stored = pitstop.load(saved.path)["weights"]["raw"]["weight"]  # type: ignore[index]
    assert_same(stored, expected)


def test_map_location_cuda_reads_across_chunks_through_the_bounce_buffers(tmp_path: Path) -> None:
    sizes = [blobread.CHUNK // 4 * 3 + 17, 5, blobread.CHUNK // 4 - 1, blobread.CHUNK // 2]
    source = nn.ParameterList(torch.randn(n) for n in sizes)
    path = _saved(tmp_path, source)
    target = nn.ParameterList(torch.zeros(n) for n in sizes)
    pitstop.load_weights(target, path, map_location="cuda")
    assert all(p.is_cuda for p in target.parameters())
    assert_same({k: v.cpu() for k, v in target.state_dict().items()}, source.state_dict())


def test_load_weights_into_cuda_tensors_lands_after_the_work_queued_on_them(
    tmp_path: Path,
) -> None:
    source = nn.Linear(4096, 4096)
    path = _saved(tmp_path, source)
    target = nn.Linear(4096, 4096).cuda()
    big = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        value = big
        for _ in range(30):
            value = torch.tanh(value @ big)
        target.weight.copy_(value)  # queued; the loaded values must land after it
    pitstop.load_weights(target, path)
    assert target.weight.is_cuda
    assert_same({k: v.cpu() for k, v in target.state_dict().items()}, source.state_dict())


def test_map_location_cuda_makes_device_tensors_equal_to_the_file(tmp_path: Path) -> None:
    source = nn.Linear(1500, 1500)
    path = _saved(tmp_path, source)
    with torch.device("meta"):
        target = nn.Linear(1500, 1500)
    pitstop.load_weights(target, path, map_location="cuda")
    assert all(t.is_cuda for t in target.state_dict().values())
    assert_same({k: v.cpu() for k, v in target.state_dict().items()}, source.state_dict())


# --- FSDP2 on NCCL (one rank: NCCL takes one GPU per rank) -----------------------------------


@pytest.fixture
def nccl() -> Iterator[None]:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("NCCL is unavailable")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", 0),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model, _ = _model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _local(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local().detach().clone()
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value

    return {"model": local(model.state_dict()), "optimizer": local(optimizer.state_dict())}


@NEEDS_SHARDED
@pytest.mark.parametrize("mode", MODES, ids=["sync", "async", "overlap"])
def test_fsdp2_on_nccl_saves_a_directory_and_resumes_bitwise(
    nccl: None, tmp_path: Path, mode: bool | str
) -> None:
    from pitstop.core.sharding.sharded import MANIFEST_NAME

    model, optimizer = _sharded(0)
    with pitstop.Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save=mode
    ) as ckpt:
        _steps(model, optimizer, 2)
        saved = ckpt.save(pitstop.Progress(step=2))
        expected_losses = _steps(model, optimizer, 3)
        ckpt.wait()
    expected = _local(model, optimizer)
    assert saved.path.is_dir()
    assert (saved.path / MANIFEST_NAME).is_file()

    model, optimizer = _sharded(1)
    torch.cuda.manual_seed(999)
    with pitstop.Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 2
        losses = _steps(model, optimizer, 3)
    assert_same(losses, expected_losses, "losses")
    assert_same(_local(model, optimizer), expected, "state")


def test_stop_request_sync_runs_on_nccl(nccl: None) -> None:
    stop = pitstop.StopRequest()
    assert stop.sync() is False
    stop.request("test")
    assert stop.sync() is True
