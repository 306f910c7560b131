"""pitstop.import_checkpoint: torch.save, Lightning and Accelerate checkpoints become pitstop ones.

Lightning and Accelerate are not installed here, so their files are built by hand the way their
writers lay them out (a Lightning .ckpt is a torch.save of a dict; Accelerate's save_state writes
model.safetensors, optimizer.bin, scheduler.bin, scaler.pt and random_states_0.pkl). Nothing
may be unpickled: a pickle canary that would create a file proves that nothing ran.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from pitstop import Checkpointer, ImportRefused, IncompatibleCheckpoint, SaveError
from pitstop.shell.portable.importer import read_foreign


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's two groups: decayed matrices, undecayed vectors."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )


def _trained(steps: int = 3) -> tuple[Net, torch.optim.Optimizer, Any]:
    model = Net(seed=1)
    optimizer = _optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(steps):
        model.head(model.ln(model.fc(torch.randn(5, 4)))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resume(directory: Path, **kwargs: Any) -> tuple[Net, torch.optim.Optimizer, Any]:
    model = Net(seed=9)
    optimizer = _optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    with Checkpointer(
        directory, model=model, state={"optimizer": optimizer, "scheduler": scheduler}
    ) as ckpt:
        ckpt.resume(**kwargs)
    return model, optimizer, scheduler


def _canary(tmp_path: Path) -> tuple[bytes, Path]:
    """A protocol-0 pickle that, if it were ever unpickled, would create ``canary``."""
    canary = tmp_path / "canary-was-unpickled"
    payload = f"cbuiltins\nopen\n(V{canary}\nVw\ntR.".encode()
    return payload, canary


# --- torch.save training checkpoints --------------------------------------------------------------


def test_a_nanogpt_style_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    compiled_names = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    source = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": compiled_names,  # nanoGPT saves a compiled model's state dict
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "model_args": {"n_layer": 2, "n_embd": 8},
            "iter_num": 3,
            "best_val_loss": torch.tensor(1.25),
            "config": {"out_dir": "out", "max_iters": 100},
        },
        source,
    )
    record = pitstop.import_checkpoint(source, tmp_path / "run")
    assert record.path == tmp_path / "run" / "step_000000000003.pitstop"
    assert record.step == 3
    assert record.reason is pitstop.SaveReason.MANUAL
    assert record.detail == "imported from torch.save"
    assert record.config == {
        "model_args": {"n_layer": 2, "n_embd": 8},
        "best_val_loss": 1.25,
        "config": {"out_dir": "out", "max_iters": 100},
    }
    assert pitstop.verify(tmp_path / "run") == record.path

    again, optimizer2, scheduler2 = _resume(tmp_path / "run", strict=False)
    assert _same(model.state_dict(), again.state_dict())
    state, state2 = optimizer.state_dict(), optimizer2.state_dict()
    assert state["param_groups"] == state2["param_groups"]
    for index in state["state"]:
        assert _same(state["state"][index], state2["state"][index])
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_imported_optimizer_groups_must_match_by_size(tmp_path: Path) -> None:
    model, optimizer, _ = _trained()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    other = Net(seed=2)
    one_group = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with (
        Checkpointer(tmp_path / "run", model=other, state={"optimizer": one_group}) as ckpt,
        pytest.raises(IncompatibleCheckpoint, match="2 parameter group"),
    ):
        ckpt.resume()


def test_step_epoch_samples_and_tokens_come_from_the_file(tmp_path: Path) -> None:
    model, _, _ = _trained()
    torch.save(
        {
            "model_state_dict": model.state_dict(),
            "step": 12,
            "epoch": 2,
            "samples": 96,
            "tokens": 4096,
        },
        tmp_path / "c.pt",
    )
    record = pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    progress = record.progress
    assert (progress.step, progress.epoch, progress.samples, progress.tokens) == (12, 2, 96, 4096)


def test_a_bare_state_dict_is_weights_at_step_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _, _ = _trained()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        record = pitstop.import_checkpoint(tmp_path / "weights.pt", tmp_path / "run")
    assert record.step == 0
    assert "bare state dict" in caplog.text
    fresh = Net(seed=5)
    pitstop.load_weights(fresh, record.path)
    assert _same(model.state_dict(), fresh.state_dict())


def test_a_file_that_needs_unpickling_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    payload, canary = _canary(tmp_path)
    source = tmp_path / "hostile.pt"
    source.write_bytes(payload)  # a legacy (non-zip) torch file is a pickle
    with pytest.raises(ImportRefused, match=r"needs more than torch.load\(weights_only=True\)"):
        pitstop.import_checkpoint(source, tmp_path / "run")
    assert not canary.exists()
    assert not (tmp_path / "run").exists()


def test_an_object_inside_a_torch_save_file_is_refused(tmp_path: Path) -> None:
    model, _, _ = _trained()
    torch.save({"model": model.state_dict(), "args": argparse_namespace()}, tmp_path / "c.pt")
    with pytest.raises(ImportRefused, match="never unpickles") as caught:
        pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    assert str(tmp_path / "c.pt") in str(caught.value)


def argparse_namespace() -> object:
    import argparse

    return argparse.Namespace(lr=0.1)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"weights_only": 1, "nothing": "here"}, "no model state dict"),
        ({"model": {"w": 3}}, "not a state dict"),
        ([torch.zeros(2)], "holds a list"),
        ({"model": {"w": torch.zeros(2)}, "step": -1}, r"\['step'\] must be an int >= 0"),
    ],
)
def test_what_is_not_a_training_checkpoint_is_refused(
    tmp_path: Path, content: object, message: str
) -> None:
    torch.save(content, tmp_path / "c.pt")
    with pytest.raises(ImportRefused, match=message):
        pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")


def test_an_import_never_replaces_a_published_checkpoint(tmp_path: Path) -> None:
    model, _, _ = _trained()
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "c.pt")
    first = pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    before = first.path.read_bytes()
    with pytest.raises(SaveError, match=r"already holds 1 checkpoint\(s\) \(the newest is step 3"):
        pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    assert first.path.read_bytes() == before


def _contents(directory: Path) -> dict[str, bytes | str]:
    """Every entry of ``directory``: a file's bytes, a symlink's target."""
    return {
        p.name: str(p.readlink()) if p.is_symlink() else p.read_bytes()
        for p in sorted(directory.iterdir())
    }


@pytest.mark.parametrize("step", [5, 40], ids=["older than the run", "newer than the run"])
def test_an_import_into_a_run_is_refused_and_the_run_keeps_every_file_and_pointer(
    tmp_path: Path, step: int
) -> None:
    run = tmp_path / "run"
    model = Net(seed=1)
    with Checkpointer(run, model=model, policy=pitstop.Policy(keep_last=2)) as ckpt:
        for saved in (10, 20, 30):
            ckpt.save(pitstop.Progress(step=saved))
    before = _contents(run)
    torch.save({"model": model.state_dict(), "step": step}, tmp_path / "c.pt")
    with pytest.raises(SaveError) as caught:
        pitstop.import_checkpoint(tmp_path / "c.pt", run)
    assert str(caught.value).startswith(
        f"{run} already holds 2 checkpoint(s) (the newest is step 30, step_000000000030.pitstop)"
    )
    assert _contents(run) == before  # nothing moved, nothing deleted, no new file
    assert pitstop.info(run).step == 30  # last still names the run's newest


def test_pitstop_import_into_a_run_is_one_error_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop.cli import main

    model, _, _ = _trained()
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "c.pt")
    pitstop.import_checkpoint(tmp_path / "c.pt", tmp_path / "run")
    torch.save({"model": model.state_dict(), "step": 9}, tmp_path / "d.pt")
    assert main(["import", str(tmp_path / "d.pt"), str(tmp_path / "run")]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert f"{tmp_path / 'run'} already holds 1 checkpoint(s)" in errors[0]
    assert not (tmp_path / "run" / "step_000000000009.pitstop").exists()


def test_a_missing_source_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(pitstop.CheckpointNotFound, match="nothing to import"):
        pitstop.import_checkpoint(tmp_path / "nope.pt", tmp_path / "run")


# --- Lightning ------------------------------------------------------------------------------------


def test_a_lightning_checkpoint(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    source = tmp_path / "epoch=2-step=120.ckpt"
    torch.save(
        {
            "epoch": 2,
            "global_step": 120,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None}},
            "optimizer_states": [optimizer.state_dict()],
            "lr_schedulers": [scheduler.state_dict()],
            "hparams_name": "kwargs",
            "hyper_parameters": {"lr": 0.001, "hidden": 8},
        },
        source,
    )
    foreign = read_foreign(source)
    assert foreign.format == "lightning"
    assert any("loop and callback states are not imported" in n for n in foreign.notes)
    record = pitstop.import_checkpoint(source, tmp_path / "run")
    assert (record.step, record.progress.epoch) == (120, 2)
    assert record.config == {"lr": 0.001, "hidden": 8}
    assert record.detail == "imported from lightning"
    names = {t.name for t in record.tensors}
    assert "weights.raw['fc.weight']" in names  # the shared "model." prefix is gone
    again, _, scheduler2 = _resume(tmp_path / "run", strict=False)
    assert _same(model.state_dict(), again.state_dict())
    assert scheduler2.state_dict() == scheduler.state_dict()


# --- Accelerate -----------------------------------------------------------------------------------


_SAFETENSORS = {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The .safetensors layout, by hand: u64 header length, JSON header, raw bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _SAFETENSORS[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def _accelerate_dir(tmp_path: Path, name: str, *, bin_model: bool = False) -> tuple[Path, Net]:
    model, optimizer, scheduler = _trained()
    directory = tmp_path / name
    directory.mkdir()
    if bin_model:
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        write_safetensors(directory / "model.safetensors", model.state_dict())
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")
    torch.save(scheduler.state_dict(), directory / "scheduler.bin")
    torch.save(torch.amp.GradScaler("cpu", enabled=False).state_dict(), directory / "scaler.pt")
    return directory, model


def test_an_accelerate_save_state_directory(tmp_path: Path) -> None:
    directory, model = _accelerate_dir(tmp_path, "step_50")
    payload, canary = _canary(tmp_path)
    (directory / "random_states_0.pkl").write_bytes(payload)
    foreign = read_foreign(directory)
    assert foreign.format == "accelerate"
    assert set(foreign.components) == {"optimizer", "scheduler", "scaler"}
    assert any("random_states_0.pkl" in n and "never unpickled" in n for n in foreign.notes)
    record = pitstop.import_checkpoint(directory, tmp_path / "run")
    assert not canary.exists()
    assert record.step == 50  # from the directory's name
    again, _, _ = _resume(tmp_path / "run", strict=False)
    assert _same(model.state_dict(), again.state_dict())


def test_an_accelerate_directory_with_a_bin_model_and_the_step_from_its_scheduler(
    tmp_path: Path,
) -> None:
    directory, model = _accelerate_dir(tmp_path, "checkpoint_0", bin_model=True)
    foreign = read_foreign(directory)
    assert foreign.progress.step == 3  # StepLR's last_epoch after three steps
    assert any("last_epoch" in n for n in foreign.notes)
    record = pitstop.import_checkpoint(directory, tmp_path / "run")
    fresh = Net(seed=5)
    pitstop.load_weights(fresh, record.path)
    assert _same(model.state_dict(), fresh.state_dict())


def test_the_safetensors_reader_matches_the_real_one_when_installed(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(3, 2), "b": torch.arange(5), "c": torch.randn(4).bfloat16()}
    safetensors.save_file(tensors, tmp_path / "model.safetensors")
    from pitstop.shell.portable.foreignread import read_safetensors as _read_safetensors

    assert _same(tensors, _read_safetensors(tmp_path / "model.safetensors"))


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:4],
        lambda data: struct.pack("<Q", 1 << 40) + data[8:],
        lambda data: data[:8] + b"{not json" + data[17:],
    ],
)
def test_a_damaged_safetensors_file_is_refused(tmp_path: Path, damage: Any) -> None:
    directory, _ = _accelerate_dir(tmp_path, "step_1")
    model_file = directory / "model.safetensors"
    model_file.write_bytes(damage(model_file.read_bytes()))
    with pytest.raises(ImportRefused, match="safetensors"):
        read_foreign(directory)


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportRefused, match=r"no model\.safetensors or pytorch_model\.bin"):
        read_foreign(tmp_path / "empty")


# --- the command ----------------------------------------------------------------------------------


def test_pitstop_import_prints_notes_and_what_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop.cli import main

    directory, _ = _accelerate_dir(tmp_path, "step_7")
    (directory / "random_states_0.pkl").write_bytes(b"whatever")
    assert main(["import", str(directory), str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "note: skipped" in out
    assert "random_states_0.pkl" in out
    assert (
        f"imported {directory} (accelerate) as {tmp_path / 'run' / 'step_000000000007.pitstop'}"
        in out
    )
    assert "step 7" in out
    assert "components: optimizer, scaler, scheduler" in out


def test_pitstop_import_refusal_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop.cli import main

    payload, canary = _canary(tmp_path)
    (tmp_path / "bad.pt").write_bytes(payload)
    assert main(["import", str(tmp_path / "bad.pt"), str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "never unpickles" in errors[0]
    assert not canary.exists()
