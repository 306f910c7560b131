"""DiLoCo (examples/diloco.py) checkpointed by pitstop: 2 ranks on gloo, real processes.

The coordinator is created after ``ckpt.resume()`` and restored as two deferred components:
``global`` (replicated: global model, outer momentum, counters, pending deltas, applied
rounds) and ``local`` (per rank: local model, inner AdamW). Every run installs the same
"pretrained" weights (``--init``) when the coordinator starts, as a real job would.

Checked here:
* the seed's ordering bug cannot happen: on a resume the installed model is replaced by the
  checkpointed global model, the checkpointed local state goes to the local model only (not
  into the global model, the pseudo-gradient's baseline), in either registration order;
* a run stopped twice by a SIGTERM to one rank — mid-round, then at a round boundary with a
  reduced delta pending — and resumed each time is bitwise the uninterrupted run;
* a tensor that appears in several parts of the state is stored once (file sizes).

The in-process tests use the coordinator with one rank and no process group. Every job is a
tests/multirank.py Job: each wait is bounded, every process it started is killed at its end.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest
import torch

import pitstop
from multirank import Job
from pitstop.shell.format import fileformat
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "diloco.py"
RANKS = 2
ROUNDS, INNER = 4, 4  # 16 inner steps: 2 epochs of 8 batches per rank
TARGET = ROUNDS * INNER
MID_ROUND = 6  # the first stop: 2 inner steps into round 1 (local != global)
BOUNDARY = 12  # the second stop: round 2 reduced, its delta pending, not applied
COMPARED = ("coordinator", "weights", "sampler", "draws", "progress")


def _example() -> ModuleType:
    name = "pitstop_examples_diloco"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- running the example --------------------------------------------------------------------


def job(directory: Path, out: Path, init: Path, *options: str) -> Job:
    common = ("--rounds", str(ROUNDS), "--inner", str(INNER), "--init", str(init), "--report")
    return Job(SCRIPT, "--dir", directory, "--out", out, *common, *options, ranks=RANKS)


def outputs(out: Path) -> list[dict[str, Any]]:
    """What each rank wrote to ``<out>.rank<R>.pt``."""
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(RANKS)]


def run(directory: Path, out: Path, init: Path, *options: str) -> list[dict[str, Any]]:
    with job(directory, out, init, *options) as running:
        running.wait().check()
    return outputs(out)


def run_and_stop(
    directory: Path, out: Path, init: Path, *options: str, rank: int, at: int
) -> list[dict[str, Any]]:
    """Run, but SIGTERM ``rank`` alone once it printed ``step {at}`` (it holds there)."""
    hold = ("--hold-at", str(at), "--hold-rank", str(rank))
    with job(directory, out, init, *hold, *options) as running:
        running.wait_for(rank, f"step {at}")
        running.signal(rank, signal.SIGTERM)
        finished = running.wait().check()
    results = outputs(out)
    for r, result in enumerate(results):
        assert result["progress"][0] == at, (r, finished.describe())
        assert result["stop_reason"] is not None, (r, finished.describe())
    assert results[rank]["stop_reason"] == "SIGTERM"
    return results


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights every run installs when its coordinator starts (not the seed-0 model)."""
    path = tmp_path_factory.mktemp("pretrained") / "pretrained.pt"
    torch.save(_example().make_model(seed=7).state_dict(), path)
    return path


@attrs.frozen
class Straight:
    results: list[dict[str, Any]]
    directory: Path


@attrs.frozen
class Chain:
    """Stopped at MID_ROUND (SIGTERM to rank 1), resumed registering the local part first
    and stopped at BOUNDARY (SIGTERM to rank 0), resumed to the end."""

    first: list[dict[str, Any]]
    second: list[dict[str, Any]]
    third: list[dict[str, Any]]
    directory: Path


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Straight:
    root = tmp_path_factory.mktemp("straight")
    return Straight(run(root / "ckpt", root / "out", pretrained), root / "ckpt")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Chain:
    root = tmp_path_factory.mktemp("chain")
    directory = root / "ckpt"
    first = run_and_stop(directory, root / "first", pretrained, rank=1, at=MID_ROUND)
    second = run_and_stop(
        directory,
        root / "second",
        pretrained,
        "--register-order",
        "local-first",
        rank=0,
        at=BOUNDARY,
    )
    third = run(directory, root / "third", pretrained)
    return Chain(first, second, third, directory)


def _global(result: Mapping[str, Any]) -> dict[str, Any]:
    return result["coordinator"]["global"]  # type: ignore[no-any-return]


def _local(result: Mapping[str, Any]) -> dict[str, Any]:
    return result["coordinator"]["local"]  # type: ignore[no-any-return]


def _differ(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


# --- the tests ------------------------------------------------------------------------------


def test_a_fresh_run_starts_from_the_installed_model(straight: Straight, pretrained: Path) -> None:
    installed = torch.load(pretrained, weights_only=True)
    seed_0 = _example().make_model(seed=0).state_dict()
    assert _differ(installed, seed_0)  # --init really replaced the model the script built
    results = straight.results
    for rank, result in enumerate(results):
        assert result["resumed"]["progress"] == [0, 0, 0], rank
        assert_same(installed, _global(result["resumed"])["model"], f"rank {rank} global")
        assert_same(installed, _local(result["resumed"])["model"], f"rank {rank} local")
    # The replicated part really is the same on every rank (it is stored once, from rank 0).
    assert_same(_global(results[0]), _global(results[1]), "global part")
    assert results[0]["batches"] != results[1]["batches"]  # each rank its own shard
    final = _global(results[0])
    assert final["applied"] == list(range(ROUNDS))
    assert final["pending"] == {}
    assert (final["round"], final["inner_step"]) == (ROUNDS, TARGET)
    assert _differ(installed, final["model"])
    for rank, result in enumerate(results):  # the last outer step reset every local model
        assert_same(final["model"], _local(result)["model"], f"rank {rank} local")
    # What the Checkpointer saves as the model, and pitstop exports, is the global model.
    stored = pitstop.load(straight.directory / "final")
    assert_same(final["model"], stored["weights"]["raw"], "final weights")


def test_a_resume_restores_the_checkpointed_state_not_the_installed_model(
    chain: Chain, pretrained: Path
) -> None:
    """The seed's ordering bug: installing a fresh global model at coordinator start, then
    overwriting its baseline with checkpointed local state. Here the coordinator of the second
    run installed ``pretrained`` after ``ckpt.resume()`` and registered the local part first."""
    installed = torch.load(pretrained, weights_only=True)
    for rank, (before, after) in enumerate(zip(chain.first, chain.second, strict=True)):
        resumed = after["resumed"]
        assert resumed["progress"] == before["progress"][:3], rank
        # Mid-round: the local model has moved away from the global one, so a local state
        # written into the global model (or the reverse) could not go unnoticed.
        assert _differ(_global(before)["model"], _local(before)["model"]), rank
        assert_same(_global(before), _global(resumed), f"rank {rank} global part")
        assert_same(_local(before), _local(resumed), f"rank {rank} local part")
        assert _differ(installed, _global(resumed)["model"]), rank
        assert _global(resumed)["pending"] == {}
        assert _global(resumed)["applied"] == [0]
    # Each rank got its own local state back (its own shard, its own dropout masks).
    resumed_locals = [_local(result["resumed"])["model"] for result in chain.second]
    assert _differ(*resumed_locals)


def test_a_delta_pending_at_the_stop_is_applied_once_after_the_resume(chain: Chain) -> None:
    reduced = BOUNDARY // INNER - 1  # the round whose reduce ran at the BOUNDARY step
    for rank, (before, after) in enumerate(zip(chain.second, chain.third, strict=True)):
        stored = _global(before)
        assert sorted(stored["pending"]) == [reduced], rank
        assert stored["applied"] == list(range(reduced)), rank
        assert_same(_global(before), _global(after["resumed"]), f"rank {rank} global part")
        assert_same(_local(before), _local(after["resumed"]), f"rank {rank} local part")
        final = _global(after)
        assert final["applied"] == list(range(ROUNDS)), rank
    # The stop checkpoint itself holds the delta, once, in the replicated part.
    manifest = fileformat.read_manifest(chain.directory / f"step_{BOUNDARY:012d}.pitstop")
    assert (manifest.meta["reason"], manifest.meta.get("detail")) == ("stop", "SIGTERM")
    pending = _paths_under(manifest, "state.global.pending")
    assert pending, manifest.tensor_paths
    assert all(p.startswith(f"state.global.pending[{reduced}]") for p in pending), pending
    assert not _paths_under(manifest, "ranked", contains="pending")


def test_sigterm_twice_then_resume_is_bitwise_identical(straight: Straight, chain: Chain) -> None:
    segments = (chain.first, chain.second, chain.third)
    # Rank 1 got the first SIGTERM, rank 0 the second; the agreed reason is every rank's.
    reasons = [[result["stop_reason"] for result in s] for s in segments]
    assert reasons == [["SIGTERM", "SIGTERM"], ["SIGTERM", "SIGTERM"], [None, None]]
    for rank, whole in enumerate(straight.results):
        batches = [b for segment in segments for b in segment[rank]["batches"]]
        assert batches == whole["batches"], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], chain.third[rank][key], f"rank {rank} {key}")


# --- stored once ----------------------------------------------------------------------------


def _paths_under(manifest: Any, prefix: str, contains: str = "") -> list[str]:
    return [
        path
        for paths in manifest.tensor_paths
        for path in paths
        if path.startswith(prefix) and contains in path
    ]


def _blob_of(manifest: Any, path: str) -> int:
    for descriptor, paths in zip(manifest.tensors, manifest.tensor_paths, strict=True):
        if path in paths:
            return int(descriptor.blob)
    raise AssertionError(f"{path} is not in {manifest.path}")


def _blobs_under(manifest: Any, prefixes: Iterable[str]) -> set[int]:
    prefixes = tuple(prefixes)
    return {
        d.blob
        for d, paths in zip(manifest.tensors, manifest.tensor_paths, strict=True)
        if any(p.startswith(prefixes) for p in paths)
    }


def _unique_bytes(trees: Iterable[Any]) -> int:
    """The bytes of every distinct storage the tensors of ``trees`` use (a live state)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for tree in trees:
        visit(tree)
    return sum(seen.values())


def _live_like_the_boundary_checkpoint() -> Any:
    """A one-rank coordinator in the state shape of the BOUNDARY checkpoint: a round applied
    (so the outer momentum exists), another reduced and pending."""
    example = _example()
    coordinator = example.DiLoCo(example.make_model(), inner_steps=INNER)
    tokens = example.make_data()[:4]
    for _ in range(2 * INNER):
        coordinator.train_step(tokens)
    assert sorted(coordinator.pending) == [1]
    assert coordinator.applied == [0]
    return coordinator


def _cloned(tree: Any) -> Any:
    """``tree`` with every tensor its own copy: the same state with all sharing broken."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree


def test_a_tensor_in_several_parts_of_the_state_is_stored_once(
    chain: Chain, tmp_path: Path
) -> None:
    path = chain.directory / f"step_{BOUNDARY:012d}.pitstop"
    manifest = fileformat.read_manifest(path)
    # The global model's tensors are the Checkpointer's model and the coordinator's global
    # part at once, and the model ties head.weight to emb.weight: one blob for all four.
    shared = {
        _blob_of(manifest, f"{where}['{name}']")
        for where in ("weights.raw", "state.global.model")
        for name in ("emb.weight", "head.weight")
    }
    assert len(shared) == 1, manifest.tensor_paths
    assert _blob_of(manifest, "weights.raw['mix.weight']") == _blob_of(
        manifest, "state.global.model['mix.weight']"
    )
    # The replicated part's blobs hold exactly its distinct storages' bytes: the global model
    # once, the outer momentum, the pending delta — nothing twice, nothing per rank.
    live = _live_like_the_boundary_checkpoint()
    expected = _unique_bytes([live.global_model.state_dict(), live.global_part.state_dict()])
    params = _unique_bytes([live.global_model.state_dict()])
    assert expected == 3 * params  # model, momentum, pending delta
    replicated = _blobs_under(manifest, ("weights.", "state.global."))
    assert sum(manifest.blobs[b].length for b in replicated) == expected

    # The same state with its sharing broken costs the duplicated bytes more: the global
    # model a second time, and the tied embedding twice more (once in each copy).
    tree = pitstop.load(path)
    broken = tmp_path / "broken.pitstop"
    with open(broken, "wb") as f:
        fileformat.write(f, fileformat.prepare(_cloned(tree)), dict(manifest.meta))
    embedding = live.global_model.emb.weight.nbytes
    duplicated = params + 2 * embedding
    assert broken.stat().st_size - path.stat().st_size >= duplicated, (
        broken.stat().st_size,
        path.stat().st_size,
        duplicated,
    )


def test_a_per_rank_tensor_shared_within_its_part_is_stored_once(chain: Chain) -> None:
    manifest = fileformat.read_manifest(chain.directory / f"step_{BOUNDARY:012d}.pitstop")
    live = _live_like_the_boundary_checkpoint()
    expected = _unique_bytes([live.local_part.state_dict()])
    for rank in range(RANKS):
        where = f"ranked[{rank}].local.model"
        assert _blob_of(manifest, f"{where}['emb.weight']") == _blob_of(
            manifest, f"{where}['head.weight']"
        ), rank
        own = _blobs_under(manifest, (f"ranked[{rank}].local.",))
        assert sum(manifest.blobs[b].length for b in own) == expected, rank


# --- in one process: the coordinator's own guarantees -----------------------------------------


def _checkpointed_mid_round(directory: Path) -> tuple[Any, dict[str, Any]]:
    """A one-rank run stopped 2 steps into round 1; its coordinator and a copy of its state."""
    example = _example()
    model = example.make_model()
    with pitstop.Checkpointer(directory, model=model) as ckpt:
        ckpt.resume()
        coordinator = example.DiLoCo(model, inner_steps=INNER)
        ckpt.register("global", coordinator.global_part)
        ckpt.register("local", coordinator.local_part, per_rank=True)
        tokens = example.make_data()[:4]
        for _ in range(INNER + 2):
            coordinator.train_step(tokens)
        ckpt.save(pitstop.Progress(step=INNER + 2))
        return coordinator, _cloned(coordinator.state_dict())


def test_the_local_part_never_writes_into_the_global_model(
    tmp_path: Path, pretrained: Path
) -> None:
    _, stored = _checkpointed_mid_round(tmp_path / "ckpt")
    example = _example()
    installed = torch.load(pretrained, weights_only=True)
    model = example.make_model()
    with pitstop.Checkpointer(tmp_path / "ckpt", model=model) as ckpt:
        ckpt.resume()
        coordinator = example.DiLoCo(model, inner_steps=INNER, init=installed)
        ckpt.register("local", coordinator.local_part, per_rank=True)
        # Only the local part is back: the global model (the pseudo-gradient's baseline) is
        # still exactly what the coordinator installed, untouched by the local state...
        assert_same(installed, coordinator.global_model.state_dict(), "global model")
        assert_same(stored["local"], _cloned(coordinator.local_part.state_dict()), "local")
        with pytest.raises(RuntimeError, match="inconsistent"):
            coordinator.check()  # ...and the coordinator knows it is not a whole state yet.
        # Installing now would overwrite restored state: refused.
        with pytest.raises(RuntimeError, match="overwrite"):
            coordinator.install(installed)
        ckpt.register("global", coordinator.global_part)
        coordinator.check()
        assert_same(stored, _cloned(coordinator.state_dict()), "coordinator")


def test_a_round_both_pending_and_applied_is_refused_on_resume(tmp_path: Path) -> None:
    coordinator, _ = _checkpointed_mid_round(tmp_path / "ckpt")
    example = _example()
    # A state that claims round 0's delta is both applied and still pending (as if it were
    # received twice): saved as is, refused when a coordinator registers it.
    model = example.make_model()
    with pitstop.Checkpointer(tmp_path / "bad", model=model) as ckpt:
        bad = example.DiLoCo(model, inner_steps=INNER)
        bad.load_state_dict(coordinator.state_dict())
        bad.pending = {0: {n: torch.zeros_like(p) for n, p in model.named_parameters()}}
        ckpt.register("global", bad.global_part)
        ckpt.save(pitstop.Progress(step=INNER + 2))
    fresh_model = example.make_model()
    with pitstop.Checkpointer(tmp_path / "bad", model=fresh_model) as ckpt:
        ckpt.resume()
        fresh = example.DiLoCo(fresh_model, inner_steps=INNER)
        before = _cloned(fresh.global_part.state_dict())
        with pytest.raises(pitstop.IncompatibleCheckpoint, match="both pending and applied"):
            ckpt.register("global", fresh.global_part)
        assert_same(before, _cloned(fresh.global_part.state_dict()), "untouched")
