"""Weights on their own: unwrapping, raw/EMA views, load_weights, export_weights.

Checkpoints are real files holding the tree the Checkpointer stores: ``weights.raw`` (the
unwrapped model's state dict), ``weights.ema`` (the EMA module's own state dict), ``ema``
(AveragedModel's ``n_averaged``), ``state`` and ``rng``; the manifest meta carries the catalog
entry and ``weights: {ema, ema_buffers, buffers}``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
from dirtools import save
from pitstop.core.metadata import entry_meta
from pitstop.core.records import Best, CheckpointEntry, Policy, Progress
from pitstop.core.saving.schedule import Call
from pitstop.errors import CheckpointCorrupt, ConfigError, IncompatibleCheckpoint, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.portable.weights import (
    export_weights,
    load_weights,
    plain_state_dict,
    unwrap_model,
    weights_view,
)
from pitstop.shell.store import atomic
from pitstop.shell.store.directory import CheckpointDirectory
from storagetrace import Op, OsSpy, durability_problems, recording_local_storage

# --- helpers ----------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
    )


def assert_same_state(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        assert bitwise_equal(tensor, actual[name]), name


def trained(ema: bool | str = False, steps: int = 3) -> tuple[Net, AveragedModel | None]:
    """A Net after a few SGD steps; optionally an EMA, updated each step but the last.

    ``ema``: False (none), "own" (AveragedModel averaging buffers) or "raw" (use_buffers=False).
    The last step runs after the EMA update, so the raw model's buffers differ from the EMA's.
    """
    model = Net(seed=1)
    averaged = (
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=ema == "own")
        if ema
        else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if averaged is not None and step < steps - 1:
            averaged.update_parameters(model)
    return model, averaged


def checkpoint_tree(
    model: nn.Module, ema: nn.Module | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree and the ``weights`` meta the Checkpointer stores for ``model`` and ``ema``."""
    weights: dict[str, Any] = {"raw": plain_state_dict(model)}
    tree: dict[str, Any] = {"weights": weights, "state": {}, "rng": {"seed": 0}}
    ema_buffers = "own"
    if ema is not None:
        weights["ema"] = unwrap_model(ema).state_dict()
        if isinstance(ema, AveragedModel):
            tree["ema"] = {"n_averaged": ema.n_averaged}
            ema_buffers = "own" if ema.use_buffers else "raw"
    meta = {
        "ema": ema is not None,
        "ema_buffers": ema_buffers,
        "buffers": [name for name, _ in unwrap_model(model).named_buffers()],
    }
    return tree, meta


def write(
    directory: Path, tree: dict[str, Any], weights_meta: dict[str, Any], step: int = 5
) -> Path:
    entry = CheckpointEntry(progress=Progress(step=step), seq=1, reason="manual")
    path = directory / entry.name
    prepared = fileformat.prepare(tree)
    with open(path, "wb") as file:
        fileformat.write(file, prepared, {**entry_meta(entry), "weights": weights_meta})
    return path


def save_model(directory: Path, model: nn.Module, ema: nn.Module | None = None) -> Path:
    return write(directory, *checkpoint_tree(model, ema))


def publish(
    directory: CheckpointDirectory,
    step: int,
    model: nn.Module,
    ema: nn.Module | None,
    metrics: dict[str, float],
    call: Call,
) -> None:
    """Save like the Checkpointer: the core decides and plans, the directory executes."""
    tree, meta = checkpoint_tree(model, ema)
    save(directory, step, call=call, metrics=metrics, tree=tree, meta={"weights": meta})


def corrupt_blob_of(path: Path, key_path: str) -> None:
    manifest = fileformat.read_manifest(path)
    index = next(i for i, paths in enumerate(manifest.tensor_paths) if key_path in paths)
    blob = manifest.blobs[manifest.tensors[index].blob]
    with open(path, "r+b") as file:
        file.seek(blob.offset)
        byte = file.read(1)[0]
        file.seek(blob.offset)
        file.write(bytes([byte ^ 0x01]))


@pytest.fixture(scope="module")
def compile_fn() -> Any:
    """torch.compile, where this torch and Python have it; nothing is ever run compiled."""
    try:
        with warnings.catch_warnings():
            # importing torch._dynamo may warn about torch's own deprecated internals
            warnings.simplefilter("ignore", DeprecationWarning)
            probe = torch.compile(nn.Linear(1, 1))
        assert probe.state_dict()
    except Exception as error:  # no dynamo for this Python, a broken install, ...
        pytest.skip(f"torch.compile is unavailable: {error}")
    return torch.compile


# --- unwrapping -------------------------------------------------------------------------------


def test_unwrap_model_strips_data_parallel_and_averaged_model() -> None:
    model = Net()
    assert unwrap_model(model) is model
    assert unwrap_model(nn.DataParallel(nn.DataParallel(model))) is model
    averaged = AveragedModel(model)  # holds a copy of model
    assert unwrap_model(averaged) is averaged.module
    assert unwrap_model(nn.DataParallel(averaged)) is averaged.module


def test_unwrap_model_strips_torch_compile_in_any_nesting(compile_fn: Any) -> None:
    model = Net()
    for wrapped in (
        compile_fn(model),
        nn.DataParallel(compile_fn(model)),
        compile_fn(nn.DataParallel(model)),
        compile_fn(nn.DataParallel(compile_fn(model))),
    ):
        assert unwrap_model(wrapped) is model
        assert list(plain_state_dict(wrapped)) == list(model.state_dict())


def test_plain_state_dict_drops_compiled_submodule_segments(compile_fn: Any) -> None:
    model = Net()
    plain = list(model.state_dict())
    model.fc = compile_fn(model.fc)  # type: ignore[assignment]
    assert "fc._orig_mod.weight" in model.state_dict()
    assert list(plain_state_dict(nn.DataParallel(model))) == plain


class _Shell(nn.Module):
    """A wrapper pitstop does not know: its only child is `.module`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


class _Mixed(nn.Module):
    """A model of its own with a submodule that happens to be called `module`."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.other = nn.Linear(2, 2)


def test_plain_state_dict_strips_a_prefix_only_every_key_has() -> None:
    model = Net()
    assert list(plain_state_dict(_Shell(_Shell(model)))) == list(model.state_dict())
    mixed = _Mixed()
    assert list(plain_state_dict(mixed)) == list(mixed.state_dict())  # "module." kept
    state = plain_state_dict(model)
    assert all(  # no copies
        state[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items()
    )


def test_plain_state_dict_refuses_names_that_would_collide() -> None:
    model = nn.Module()
    model._orig_mod = nn.Linear(2, 2)
    model.weight = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ConfigError, match=r"'weight' and '_orig_mod\.weight' both become"):
        plain_state_dict(model)


# --- views and loading ------------------------------------------------------------------------


def test_raw_weights_load_bitwise_into_a_fresh_model(tmp_path: Path) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    fresh = Net(seed=7)
    before = {name: id(p) for name, p in fresh.named_parameters()}
    load_weights(fresh, path)
    assert_same_state(source.state_dict(), fresh.state_dict())
    # copied into the model's own tensors, which do not map the file
    assert {name: id(p) for name, p in fresh.named_parameters()} == before
    view = weights_view(path, "raw")
    assert all(
        p.untyped_storage().data_ptr() != view[n].untyped_storage().data_ptr()
        for n, p in fresh.state_dict().items()
    )


def test_ema_without_averaged_buffers_takes_the_raw_buffers(tmp_path: Path) -> None:
    model, ema = trained(ema="raw")
    assert ema is not None
    path = save_model(tmp_path, model, ema)
    raw, own = model.state_dict(), ema.module.state_dict()
    assert not bitwise_equal(raw["bn.running_mean"], own["bn.running_mean"])  # the test bites
    assert fileformat.read_manifest(path).meta["weights"]["ema_buffers"] == "raw"  # type: ignore[index]

    view = weights_view(path, "ema")
    buffers = {name for name, _ in model.bn.named_buffers(prefix="bn")}
    assert buffers == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert set(view) == set(own)
    for name in view:
        assert bitwise_equal(view[name], (raw if name in buffers else own)[name]), name
    assert not bitwise_equal(view["fc.weight"], raw["fc.weight"])

    fresh = Net(seed=7)
    load_weights(fresh, path, weights="ema")
    assert_same_state({n: view[n] for n in fresh.state_dict()}, fresh.state_dict())


def test_ema_averaging_buffers_keeps_its_own(tmp_path: Path) -> None:
    model, ema = trained(ema="own")
    assert ema is not None
    path = save_model(tmp_path, model, ema)
    own = ema.module.state_dict()
    assert not bitwise_equal(own["bn.running_mean"], model.state_dict()["bn.running_mean"])
    assert_same_state(own, weights_view(path, "ema"))
    fresh = Net(seed=7)
    load_weights(fresh, path, weights="ema")
    assert_same_state(own, fresh.state_dict())


def test_any_module_can_be_the_ema(tmp_path: Path) -> None:
    model, _ = trained()
    shadow = Net(seed=3)  # a hand-rolled EMA: a plain module, its own buffers
    path = save_model(tmp_path, model, shadow)
    fresh = Net(seed=7)
    load_weights(fresh, path, weights="ema")
    assert_same_state(shadow.state_dict(), fresh.state_dict())


def test_asking_for_ema_without_one_names_the_file(tmp_path: Path) -> None:
    path = save_model(tmp_path, trained()[0])
    fresh = Net(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(IncompatibleCheckpoint, match=rf"{path.name} holds no EMA weights"):
        load_weights(fresh, path, weights="ema")
    assert_same_state(before, fresh.state_dict())


@pytest.mark.parametrize("bad", ["EMA", "best", "", None, 1])
def test_a_bad_weights_value_is_a_config_error(tmp_path: Path, bad: Any) -> None:
    path = save_model(tmp_path, trained()[0])
    for call in (
        lambda: weights_view(path, bad),
        lambda: load_weights(Net(), path, weights=bad),
        lambda: export_weights(path, tmp_path / "out.pt", weights=bad),
    ):
        with pytest.raises(ConfigError, match=r"weights must be 'raw' or 'ema', got"):
            call()
    assert not (tmp_path / "out.pt").exists()


def test_pointers_and_directories_select_the_position(tmp_path: Path) -> None:
    run = tmp_path / "run"
    models = {}
    with CheckpointDirectory(
        run / "checkpoints", policy=Policy(keep_last=None, best=Best("loss"))
    ) as directory:
        for step, loss, call in ((1, 0.1, Call.MAYBE), (2, 0.5, Call.MANUAL)):
            model, ema = trained(ema="raw", steps=step + 1)
            publish(directory, step, model, ema, metrics={"loss": loss}, call=call)
            models[step] = (model, ema)

    def expected(step: int, weights: str) -> dict[str, torch.Tensor]:
        model, ema = models[step]
        assert ema is not None
        if weights == "raw":
            return model.state_dict()
        own, raw = ema.module.state_dict(), model.state_dict()
        buffers = {name for name, _ in model.named_buffers()}
        return {n: raw[n] if n in buffers else own[n] for n in own}

    checkpoints = run / "checkpoints"
    for where, step in ((checkpoints / "best", 1), (checkpoints, 2), (checkpoints / "last", 2)):
        for weights in ("raw", "ema"):
            fresh = Net(seed=7)
            load_weights(fresh, where, weights=weights)  # type: ignore[arg-type]
            assert_same_state(expected(step, weights), fresh.state_dict())
    # the seed's example, as written
    fresh = Net(seed=7)
    pitstop.load_weights(fresh, run / "checkpoints" / "best", weights="ema")
    assert_same_state(expected(1, "ema"), fresh.state_dict())


def test_loading_ema_reads_only_the_ema_bytes(tmp_path: Path) -> None:
    model, ema = trained(ema="own")
    path = save_model(tmp_path, model, ema)
    corrupt_blob_of(path, "weights.raw['fc.weight']")
    with pytest.raises(CheckpointCorrupt, match=r"fc\.weight.* fails its checksum"):
        weights_view(path, "raw")
    fresh = Net(seed=7)
    load_weights(fresh, path, weights="ema")
    assert ema is not None
    assert_same_state(ema.module.state_dict(), fresh.state_dict())


def test_ema_with_raw_buffers_reads_and_checks_only_those_raw_bytes(tmp_path: Path) -> None:
    model, ema = trained(ema="raw")
    path = save_model(tmp_path, model, ema)
    corrupt_blob_of(path, "weights.raw['head.weight']")  # a raw parameter: never needed
    load_weights(Net(seed=7), path, weights="ema")
    corrupt_blob_of(path, "weights.raw['bn.running_var']")  # a raw buffer: needed, checked
    fresh = Net(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointCorrupt, match=r"bn\.running_var.* fails its checksum"):
        load_weights(fresh, path, weights="ema")
    assert_same_state(before, fresh.state_dict())


class _Four(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(2, 3))  # fits
        self.b = nn.Parameter(torch.randn(4))  # stored with another shape
        self.d = nn.Parameter(torch.randn(2))  # stored with another dtype
        self.e = nn.Parameter(torch.randn(5))  # not stored
        self.register_buffer("f", torch.arange(3))  # fits


def test_incompatible_weights_list_every_difference_and_touch_nothing(tmp_path: Path) -> None:
    stored = {
        "a": torch.ones(2, 3),
        "b": torch.ones(3),
        "c": torch.ones(1),  # not in the model
        "d": torch.ones(2, dtype=torch.float64),
        "f": torch.zeros(3, dtype=torch.int64),
    }
    path = write(tmp_path, {"weights": {"raw": stored}}, {"ema": False})
    model = _Four()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IncompatibleCheckpoint) as caught:
        load_weights(model, path)
    differences = caught.value.differences
    assert len(differences) == 4, differences
    assert all(str(path) in d for d in differences)
    text = "\n".join(differences)
    assert "'e' is in the run but not in the checkpoint" in text
    assert "'c' is in the checkpoint but not in the run" in text
    assert "'b' has shape [3] in the checkpoint, [4] in the run" in text
    assert "'d' has dtype float64 in the checkpoint, float32 in the run" in text
    assert_same_state(before, model.state_dict())  # not even 'a' or 'f' were copied


def test_a_wrapped_model_is_loaded_through_its_wrappers(tmp_path: Path) -> None:
    source, _ = trained()
    path = save_model(tmp_path, nn.DataParallel(source))  # stored unwrapped
    fresh = Net(seed=7)
    load_weights(nn.DataParallel(_Shell(fresh)), path)
    assert_same_state(source.state_dict(), fresh.state_dict())


def test_a_model_with_compiled_submodules_loads_by_plain_names(
    tmp_path: Path, compile_fn: Any
) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    fresh = Net(seed=7)
    fresh.fc = compile_fn(fresh.fc)  # type: ignore[assignment]
    load_weights(compile_fn(fresh), path)
    assert_same_state(source.state_dict(), plain_state_dict(fresh))


# --- export -----------------------------------------------------------------------------------


def test_export_pt_round_trips_without_prefixes(tmp_path: Path) -> None:
    model, ema = trained(ema="own")
    assert ema is not None
    path = save_model(tmp_path, nn.DataParallel(model), ema)
    out_dir = tmp_path / "exports"
    for weights, expected in (("raw", model.state_dict()), ("ema", ema.module.state_dict())):
        out = out_dir / f"{weights}.pt"
        assert export_weights(path, out, weights=weights) == out  # type: ignore[arg-type]
        loaded = torch.load(out, weights_only=True)
        assert type(loaded) is dict
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in loaded)
        assert_same_state(expected, loaded)
        assert all(t.is_contiguous() for t in loaded.values())
        fresh = Net(seed=7)
        fresh.load_state_dict(loaded, strict=True)
    assert sorted(os.listdir(out_dir)) == ["ema.pt", "raw.pt"]  # no temp files left


def test_export_keeps_tied_tensors_tied_and_makes_them_contiguous(tmp_path: Path) -> None:
    shared = torch.randn(4, 3)
    stored = {"emb": shared, "head": shared, "t": shared.t()}
    path = write(tmp_path, {"weights": {"raw": stored}}, {"ema": False})
    out = export_weights(path, tmp_path / "tied.pt")
    loaded = torch.load(out, weights_only=True)
    assert loaded["emb"].untyped_storage().data_ptr() == loaded["head"].untyped_storage().data_ptr()
    assert loaded["t"].is_contiguous()
    assert bitwise_equal(loaded["t"], shared.t().contiguous())


def test_export_replaces_the_file_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = trained()
    path = save_model(tmp_path, model)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "probe").touch()
    umask_mode = (out_dir / "probe").stat().st_mode & 0o777
    out = out_dir / "w.pt"
    out.write_bytes(b"previous export")

    def fail_midway(obj: object, file: Any) -> None:
        file.write(b"half a file")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", fail_midway)
        with pytest.raises(SaveError, match=r"could not write .*w\.pt: disk full") as info:
            export_weights(path, out)
    assert f"{out}:" in str(info.value)  # the path asked for, not the temp file's
    assert out.read_bytes() == b"previous export"
    assert sorted(os.listdir(out_dir)) == ["probe", "w.pt"]  # the temp file is gone

    export_weights(path, out)
    assert_same_state(model.state_dict(), torch.load(out, weights_only=True))
    assert out.stat().st_mode & 0o777 == umask_mode  # an ordinary file, not mkstemp's 0o600
    assert sorted(os.listdir(out_dir)) == ["probe", "w.pt"]


def test_export_is_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_model(tmp_path, trained()[0])
    ops: list[Op] = []
    monkeypatch.setattr(atomic, "LocalStorage", recording_local_storage(ops))
    spy = OsSpy(monkeypatch)
    out = export_weights(path, tmp_path / "exports" / "w.pt")
    assert durability_problems(ops) == []
    assert Op("replace", ops[0].name, "w.pt") in ops  # through the one atomic-write helper
    assert spy.problems(out) == []


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "BF16", torch.bfloat16])
def test_export_dtype_converts_floating_point_tensors_only(
    tmp_path: Path, dtype: str | torch.dtype
) -> None:
    model, _ = trained()
    path = save_model(tmp_path, model)
    loaded = torch.load(export_weights(path, tmp_path / "w.pt", dtype=dtype), weights_only=True)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            assert bitwise_equal(loaded[name], tensor.to(torch.bfloat16)), name
        else:
            assert bitwise_equal(loaded[name], tensor), name
    assert loaded["bn.num_batches_tracked"].dtype == torch.int64


@pytest.mark.parametrize("dtype", ["int8", "fp8", torch.int64, 16])
def test_export_refuses_a_dtype_that_is_not_floating_point(tmp_path: Path, dtype: Any) -> None:
    path = save_model(tmp_path, trained()[0])
    with pytest.raises(ConfigError, match="dtype"):
        export_weights(path, tmp_path / "w.pt", dtype=dtype)
    assert not (tmp_path / "w.pt").exists()


def test_export_safetensors_without_the_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_model(tmp_path, trained()[0])
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails, installed or not
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ConfigError, match=r"install pitstop\[safetensors\]"):
        export_weights(path, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_export_safetensors_round_trips_when_installed(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, _ = trained()
    path = save_model(tmp_path, model)
    out = export_weights(path, tmp_path / "w.safetensors", dtype="fp16")
    loaded = safetensors_torch.load_file(out)
    (tmp_path / "probe").touch()
    assert out.stat().st_mode == (tmp_path / "probe").stat().st_mode
    for name, tensor in model.state_dict().items():
        want = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
        assert bitwise_equal(loaded[name], want), name


@pytest.mark.parametrize("name", ["w.bin", "w.pth", "w", "w.pt.tmp"])
def test_export_refuses_an_unknown_suffix(tmp_path: Path, name: str) -> None:
    path = save_model(tmp_path, trained()[0])
    with pytest.raises(ConfigError, match=r"suffix must be \.pt or \.safetensors"):
        export_weights(path, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_the_public_names_are_the_shell_functions() -> None:
    assert pitstop.load_weights is load_weights
    assert pitstop.export_weights is export_weights
    assert {"load_weights", "export_weights"} <= set(pitstop.__all__)


def test_with_the_checkpointer_when_it_exists(tmp_path: Path) -> None:
    checkpointer = getattr(pitstop, "Checkpointer", None)
    if checkpointer is None:
        pytest.skip("pitstop.Checkpointer is not built yet")
    model, ema = trained(ema="raw")
    assert ema is not None
    with checkpointer(tmp_path / "ck", model=model, ema=ema) as ckpt:
        ckpt.save(Progress(step=3))
    buffers = {name for name, _ in model.named_buffers()}
    expected = {
        n: (model.state_dict() if n in buffers else ema.module.state_dict())[n]
        for n in model.state_dict()
    }
    fresh = Net(seed=7)
    load_weights(fresh, tmp_path / "ck", weights="ema")
    assert_same_state(expected, fresh.state_dict())


# --- strict=False and map_location ---------------------------------------------------------------


class _NewHead(nn.Module):
    """Net's body with another head: fine-tuning a trained model for a new task."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.classifier = nn.Linear(3, 5)


def test_strict_false_loads_what_is_shared_and_returns_the_rest(tmp_path: Path) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    model = _NewHead()
    head = {k: v.clone() for k, v in model.classifier.state_dict().items()}
    result = load_weights(model, path, strict=False)
    assert result.missing_keys == ["classifier.weight", "classifier.bias"]
    assert result.unexpected_keys == ["head.weight", "head.bias"]
    assert (result.missing_keys, result.unexpected_keys) == tuple(result)  # load_state_dict-like
    shared = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}
    assert_same_state(shared, {k: v for k, v in model.state_dict().items() if k in shared})
    assert_same_state(head, model.classifier.state_dict())  # the new head kept its values
    with pytest.raises(IncompatibleCheckpoint, match=r"'classifier\.weight' is in the run"):
        load_weights(_NewHead(), path)  # strict=True (the default) still refuses


def test_strict_true_returns_nothing_left_out(tmp_path: Path) -> None:
    source, _ = trained()
    result = load_weights(Net(seed=7), save_model(tmp_path, source))
    assert result == ([], [])


def test_strict_false_still_refuses_shape_and_dtype_differences(tmp_path: Path) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    model = _NewHead()
    model.fc = nn.Linear(4, 6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IncompatibleCheckpoint) as caught:
        load_weights(model, path, strict=False)
    text = "\n".join(caught.value.differences)
    assert "'fc.weight' has shape [3, 4] in the checkpoint, [6, 4] in the run" in text
    assert "is in the run but not" not in text  # only what strict=False cannot pass
    assert_same_state(before, model.state_dict())


def test_map_location_loads_a_meta_model_from_the_file_mapping_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    loaded: list[Any] = []
    real_load = fileformat.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        tree = real_load(*args, **kwargs)
        loaded.append(tree)
        return tree

    monkeypatch.setattr(fileformat, "load", spy)
    with torch.device("meta"):
        model = Net(seed=7)
    with pytest.raises(ConfigError, match=r"meta device.*map_location"):
        load_weights(model, path)
    loaded.clear()
    assert load_weights(model, path, map_location="cpu") == ([], [])
    assert_same_state(source.state_dict(), model.state_dict())
    # The parameters are the memory-mapped tensors themselves: no second copy on the host.
    [mapped] = loaded
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, nn.Parameter)
        assert parameter.data_ptr() == mapped[name].data_ptr(), name
        assert parameter.requires_grad
    model.fc.weight.data.add_(1.0)  # writable, copy-on-write: the file keeps its bytes
    fresh = Net(seed=9)
    load_weights(fresh, path)
    assert_same_state(source.state_dict(), fresh.state_dict())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight


def test_map_location_keeps_tied_parameters_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = _Tied()
    path = save_model(tmp_path, source)
    with torch.device("meta"):
        model = _Tied()
    load_weights(model, path, map_location=torch.device("cpu"))
    assert model.out.weight is model.embed.weight
    assert len(list(model.parameters())) == 1
    assert bitwise_equal(model.embed.weight, source.embed.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_map_location_cuda_puts_the_weights_on_the_device(tmp_path: Path) -> None:
    source, _ = trained()
    path = save_model(tmp_path, source)
    with torch.device("meta"):
        model = Net(seed=7)
    load_weights(model, path, map_location="cuda")
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert_same_state(source.state_dict(), model.state_dict())


@pytest.mark.parametrize("bad", ["nowhere", 3, object()])
def test_a_bad_map_location_is_a_config_error(tmp_path: Path, bad: Any) -> None:
    path = save_model(tmp_path, trained()[0])
    with pytest.raises(ConfigError, match="map_location"):
        load_weights(Net(), path, map_location=bad)
