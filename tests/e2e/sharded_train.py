"""An FSDP2 training loop checkpointed through the public Checkpointer; run as real processes.

One process per rank (tests/multirank.py sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; 1
rank without WORLD_SIZE runs with a 1-process group all the same, as FSDP2 needs one). The
model is a small MLP with dropout (each rank its own masks and data: the ranks' RNG streams are
seeded differently), each Linear and the root sharded with ``fully_shard``; the state is AdamW
(sharded, saved through DCP) and a LambdaLR schedule (replicated, in the manifest's tree); the
EMA (``ema=``) is an AveragedModel (decay 0.9) of the unsharded model whose module is then
sharded the same way, updated after each step (``--no-ema``: none).

    python sharded_train.py --dir D --target T --out OUT [--every 2] [--keep-last 2]
        [--die-at N] [--die-in-write-at N] [--no-strict] [--strict-first] [--async | --overlap]
        [--no-ema]
        [--die-in-shards-at N] [--fail-shards-at N --fail-rank R] [--fail-part-at N]
        [--fail-stage-at N] [--fail-start-at N] [--fail-table-at N]
        [--tear-at-resume --fail-rank R] [--refuse-apply-at-resume --fail-rank R]
        [--note-checks]

``--die-at N``: right after the step-N save returns, every rank SIGKILLs itself.
``--die-in-write-at N``: the step-N save is killed between the shards and the manifest:
rank 0 SIGKILLs every rank (itself last) when the manifest write begins.
``--overlap``: ``async_save="overlap"`` (as ``--async``, the parameters and optimizer state
copied after the call: by pitstop's thread or the next optimizer step's pre-hook).
``--async``: ``async_save=True`` (DCP's async_save; published at a later call). Each save
prints ``saved <step> <status>`` as it returns; after ``finish`` the records of every save
print ``status <step> <status>``.
``--die-in-shards-at N``: rank 0 SIGKILLs every rank (itself last) when DCP begins writing
rank 0's shards of the step-N save (in the background with ``--async``).
``--drop-at N``: right after the step-N save returns, the Checkpointer is dropped without
``close()`` (and collected); the rank prints ``dropped`` and writes no output file.
``--hold-shards-at N``: every rank's DCP write of the step-N shards waits until that rank's
loop has taken the next optimizer step (so the shards are written from what was staged, after
the live tensors changed).
``--fail-shards-at N --fail-rank R``: rank R's DCP write of the step-N shards raises OSError;
a SaveError from ``maybe_save`` prints ``save error <message as JSON>`` and training goes on.
``--fail-part-at N --fail-rank R``: rank R's own part of the step-N save (its RNG and per-rank
state, taken after its shards are written or staged) raises OSError (rank R raises it as
itself, the others a SaveError naming it; in the background, every rank a SaveError naming
it, at a later call); with each save error, each rank then prints ``write began <bool> ended
<bool>``: whether DCP had set up its write of the step-N shards, and whether that write had
ended, before the error came.
``--fail-start-at N --fail-rank R`` (with ``--async``): rank R's call of DCP's ``async_save``
for the step-N save raises OSError (every other rank's DCP write has begun); the same lines as
``--fail-part-at``.
``--fail-table-at N --fail-rank R``: rank R's table of the files it wrote for the step-N save
(made in DCP's write step, for rank 0 with DCP's results) raises OSError; the same lines as
``--fail-part-at``.
``--fail-stage-at N --fail-rank R`` (with ``--async``): rank R's staging of the step-N save
(DCP's stager copying its shards) raises OSError; the same lines as ``--fail-part-at``.
``--tear-at-resume --fail-rank R``: rank R's own shard file loses its second half as the
resume's checked read begins, before it is checked (a disk failing before the read).
``--refuse-apply-at-resume --fail-rank R``: rank R's optimizer refuses the state the resume
read (every check passed), raising
CheckpointCorrupt. When the resume raises, each rank prints
``untouched model <bool> ema <bool> optimizer <bool> schedule <bool> rng <bool>``: whether its
local shards (the model's, the EMA's), its optimizer (no state), its schedule and its RNG are
as they were before.
``--note-checks``: each verification of shard files in the resume's choice prints ``checked
<the files, as JSON>``.
``--remote URL [--remote-keep-last K] [--remote-every E] [--remote-secret S]``: a remote tier
at URL retired by ``Policy(keep_last=K, keep_every=E)`` (S: a wrong secret for its client);
after close, rank 0 prints ``tiers <[[step, tiers], ...] as JSON>``, and the output file
holds the RNG state too (``rng``). ``--stop-at N``: after
the step-N save every rank sends itself SIGTERM (a StopRequest is installed), the ranks agree
to stop and ``finish(stop=...)`` pauses the run (``stopped N``). ``--out-resumed``: right
after the resume each rank writes ``<OUT>.resumed.rank<R>.pitstop`` (the state restored, its
RNG state). ``--fresh``: no resume.
``--strict-first``: resume with strict=True first and print the error it raises, then resume
with strict=False (the run is untouched by the refused one).

Each rank writes ``<OUT>.rank<R>.pitstop`` (a pitstop file): its local shards and the full
tensors of the model, the optimizer and the EMA, the scheduler's state, the step it resumed
from, and draws from its torch RNG after training. A PitstopError prints ``error <Type> <message as
JSON>`` and exits 3.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sharded_loop import exit_before_teardown, say, snapshot, write_result  # the engine's child
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell import shardsave
from pitstop.shell.sharded import choice, dcpio, dcpstate, rawread, shardwrite
from pitstop.shell.store import sharddir

EXIT_PITSTOP_ERROR = 3


def shard(model: nn.Sequential) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)


def build(with_ema: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any, AveragedModel | None]:
    torch.manual_seed(0)  # the same initial weights on every rank, as fully_shard needs
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 5))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if with_ema else None
    shard(model)
    if ema is not None:  # FSDP2 modules cannot be copied: the EMA's module is sharded after
        shard(ema.module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, schedule, ema


def kill_in_write(step: int, pids: list[int]) -> None:
    """Rank 0's manifest write of ``step`` SIGKILLs every rank instead (itself last)."""
    real = sharddir.write_manifest

    def write_manifest(directory: Any, layout: Any, meta: Any, *args: Any, **kw: Any) -> None:
        if meta["progress"]["step"] == step:
            say(f"killing in write {step}")
            for pid in pids:
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        real(directory, layout, meta, *args, **kw)

    sharddir.write_manifest = write_manifest  # type: ignore[assignment]


def in_shards(step: int, act: Any) -> None:
    """DCP's write of this rank's shards of the ``step`` save calls ``act()`` first."""
    real = dcpio.Writer.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if Path(self.path).name.endswith(sharded_name(step)):
            act()
        return real(self, plan, planner)

    dcpio.Writer.write_data = write_data  # type: ignore[method-assign]


def kill_all(pids: list[int]) -> None:
    say("killing in shards")
    for pid in pids:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def hold(stepped: threading.Event, timeout: float) -> None:
    if not stepped.wait(timeout):
        raise OSError("the held write was never released")


def inject(msg: str) -> None:
    raise OSError(msg)


def fail_part(step: int, at: list[int], rank: int) -> None:
    """This rank's own part of the ``step`` save (its RNG and per-rank state, sent to rank 0
    after its shards are written or staged) cannot be taken."""
    real = shardsave.rank_state

    def rank_state(live: Any) -> Any:
        if at[0] == step:
            raise OSError(f"part injected on rank {rank}")
        return real(live)

    shardsave.rank_state = rank_state  # type: ignore[assignment]


def fail_table(step: int, rank: int) -> None:
    """This rank's table of the files it wrote for the ``step`` save cannot be made (it is
    made in DCP's write step, on DCP's thread in the background)."""
    real = dcpio.file_table

    def file_table(directory: Path, *args: Any, **kwargs: Any) -> Any:
        if directory.name.endswith(sharded_name(step)):
            raise OSError(f"table injected on rank {rank}")
        return real(directory, *args, **kwargs)

    dcpio.file_table = file_table  # type: ignore[assignment]


def fail_stage(step: int, at: list[int], rank: int) -> None:
    """This rank's staging of the ``step`` save (the copy of its shards to host buffers that
    DCP's background write starts from) raises."""
    real = DefaultStager.stage

    def stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        if at[0] == step:
            raise OSError(f"staging injected on rank {rank}")
        return real(self, state_dict, **kwargs)

    DefaultStager.stage = stage  # type: ignore[method-assign]


def fail_start(step: int, rank: int) -> None:
    """This rank's call of DCP's ``async_save`` for the ``step`` save raises, before DCP's
    write begins here."""
    real = shardwrite.async_save

    def async_save(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs["storage_writer"].path).name.endswith(sharded_name(step)):
            raise OSError(f"start injected on rank {rank}")
        return real(*args, **kwargs)

    shardwrite.async_save = async_save  # type: ignore[assignment]


def note_write(step: int, began: list[bool], ended: list[bool]) -> None:
    """``began[0]`` turns True once DCP sets up this rank's write of the ``step`` shards
    (before its first collective), ``ended[0]`` once its write of them has returned."""
    real_set_up = dcpio.Writer.set_up_storage_writer
    real_write = dcpio.Writer.write_data

    def ours(writer: Any) -> bool:
        return Path(writer.path).name.endswith(sharded_name(step))

    def set_up_storage_writer(self: Any, *args: Any, **kwargs: Any) -> Any:
        if ours(self):
            began[0] = True
        return real_set_up(self, *args, **kwargs)

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        try:
            return real_write(self, plan, planner)
        finally:
            if ours(self):
                ended[0] = True

    dcpio.Writer.set_up_storage_writer = set_up_storage_writer  # type: ignore[method-assign]
    dcpio.Writer.write_data = write_data  # type: ignore[method-assign]


def tear_at_resume(rank: int) -> None:
    """This rank's own shard file loses its second half as the resume's checked read of it
    begins (it verified when the checkpoint was saved): the first candidate only."""
    real = rawread.check_read
    torn: list[Path] = []

    def check_read(directory: Path, *args: Any, **kwargs: Any) -> Any:
        path = Path(directory) / f"__{rank}_0.distcp"
        if not torn:  # the first checkpoint read only
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            torn.append(path)
        return real(directory, *args, **kwargs)

    rawread.check_read = check_read  # type: ignore[assignment]


def refuse_apply_at_resume(rank: int) -> None:
    """This rank's optimizer refuses the state the resume read, once every check passed."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise pitstop.CheckpointCorrupt(f"optimizer refused its state on rank {rank}")

    dcpstate.set_optimizer_state_dict = refuse  # type: ignore[assignment]


def note_checks() -> None:
    """Each verification of shard files in the resume's choice prints the files it checks
    (alone, or with the checked read)."""
    real = choice.verify_sharded
    real_read = rawread.check_read

    def verify_sharded(root: Path, layout: Any, names: Any = None) -> None:
        say(f"checked {json.dumps(sorted(names))}")
        real(root, layout, names)

    def check_read(directory: Path, plan: Any, checks: Any, *args: Any) -> Any:
        say(f"checked {json.dumps(sorted(checks))}")
        return real_read(directory, plan, checks, *args)

    choice.verify_sharded = verify_sharded  # type: ignore[assignment]
    rawread.check_read = check_read  # type: ignore[assignment]


def local(module: nn.Module | None) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s local shards (and plain tensors), by name."""
    if module is None:
        return {}
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in module.state_dict().items()
    }


def as_before(model: nn.Module, optimizer: Any, schedule: Any, ema: Any) -> dict[str, Any]:
    """What a failed resume must leave as it was (no collective: the optimizer stays as is)."""
    return {
        "model": local(model),
        "ema": local(ema),
        "optimizer": len(optimizer.state),
        "schedule": {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"},
        "rng": torch.get_rng_state(),
    }


def untouched(before: dict[str, Any], now: dict[str, Any]) -> str:
    same = {
        "model": all(torch.equal(before["model"][k], now["model"][k]) for k in before["model"]),
        "ema": all(torch.equal(before["ema"][k], now["ema"][k]) for k in before["ema"]),
        "optimizer": before["optimizer"] == now["optimizer"],
        "schedule": before["schedule"] == now["schedule"],
        "rng": torch.equal(before["rng"], now["rng"]),
    }
    return "untouched " + " ".join(f"{k} {v}" for k, v in same.items())


def train(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any] | None:
    model, optimizer, schedule, ema = build(not args.no_ema)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if args.die_in_write_at is not None and rank == 0:
        kill_in_write(args.die_in_write_at, pids)
    if args.die_in_shards_at is not None and rank == 0:
        in_shards(args.die_in_shards_at, lambda: kill_all(pids))
    stepped = threading.Event()  # --hold-shards-at: set by the optimizer step after the save
    if args.hold_shards_at is not None:
        in_shards(args.hold_shards_at, lambda: hold(stepped, args.pg_timeout))
    if args.fail_shards_at is not None and rank == args.fail_rank:
        in_shards(args.fail_shards_at, lambda: inject(f"injected on rank {rank}"))
    at = [0]  # the step of the call being made
    began, ended = [False], [False]  # --fail-part-at, -stage-at, -start-at: DCP's write of it
    failing = next(
        (
            n
            for n in (args.fail_part_at, args.fail_stage_at, args.fail_start_at, args.fail_table_at)
            if n is not None
        ),
        None,
    )
    if failing is not None:
        note_write(failing, began, ended)
    if args.fail_part_at is not None and rank == args.fail_rank:
        fail_part(args.fail_part_at, at, rank)
    if args.fail_table_at is not None and rank == args.fail_rank:
        fail_table(args.fail_table_at, rank)
    if args.fail_stage_at is not None and rank == args.fail_rank:
        fail_stage(args.fail_stage_at, at, rank)
    if args.fail_start_at is not None and rank == args.fail_rank:
        fail_start(args.fail_start_at, rank)
    policy = pitstop.Policy(every_steps=args.every, keep_last=args.keep_last)
    tier: dict[str, Any] = {}
    if args.remote is not None:  # a remote tier, retired by its own policy
        remote_policy = pitstop.Policy(
            keep_last=args.remote_keep_last, keep_every=args.remote_every
        )
        tier = {"remote": args.remote, "remote_policy": remote_policy}
        if args.remote_secret is not None:
            tier["storage_options"] = {"secret_access_key": args.remote_secret}
    stop = pitstop.StopRequest()
    if args.stop_at is not None:
        stop.install()
    ckpt = pitstop.Checkpointer(
        args.dir,
        model=model,
        ema=ema,
        state={"optimizer": optimizer, "schedule": schedule},
        policy=policy,
        timeout_s=args.pg_timeout,
        async_save="overlap" if args.overlap else args.async_save,
        **tier,
    )
    if args.strict_first:
        try:
            ckpt.resume()
        except pitstop.IncompatibleCheckpoint as exc:
            say(f"strict error {json.dumps(str(exc))}")
    if args.tear_at_resume and rank == args.fail_rank:
        tear_at_resume(rank)
    if args.refuse_apply_at_resume and rank == args.fail_rank:
        refuse_apply_at_resume(rank)
    if args.note_checks:
        note_checks()
    before = as_before(model, optimizer, schedule, ema)
    try:
        strict = not (args.no_strict or args.strict_first)
        progress = pitstop.Progress() if args.fresh else ckpt.resume(strict=strict)
    except pitstop.PitstopError:
        say(untouched(before, as_before(model, optimizer, schedule, ema)))
        raise
    say(f"resumed {progress.step}")
    say(f"resume collectives {ckpt._ranks._round}")  # pitstop's, in the resume() call
    resumed = progress.step
    if args.out_resumed:  # the state restored, before any step
        rng = torch.get_rng_state()
        restored = snapshot(model, optimizer, ema)
        restored["schedule"] = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
        write_result(f"{args.out}.resumed", rank, world, {**restored, "rng": rng})
    saves: list[pitstop.Checkpoint] = []
    while progress.step < args.target:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        if ema is not None:
            ema.update_parameters(model)
        if args.hold_shards_at is not None and progress.step == args.hold_shards_at:
            stepped.set()  # the step after the held save
        optimizer.zero_grad()
        schedule.step()
        progress = progress.advance(samples=4 * world)
        at[0] = progress.step
        try:
            saved = ckpt.maybe_save(progress)
        except (pitstop.SaveError, OSError) as exc:  # a rank's own OSError is raised as itself
            say(f"save error {json.dumps(str(exc))}")
            if failing is not None:  # whether DCP's write of that save began, and had ended
                say(f"write began {began[0]} ended {ended[0]}")
            saved = None
        if saved is not None:
            saves.append(saved)
            say(f"saved {saved.step} {saved.status.value}")
        say(f"step {progress.step}")
        if progress.step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if progress.step == args.stop_at:  # a SIGTERM to every rank: they pause together
            os.kill(os.getpid(), signal.SIGTERM)
        if args.stop_at is not None and stop.sync():
            say(f"stopped {progress.step}")
            break
        if progress.step == args.drop_at:
            del ckpt, saved, saves
            gc.collect()
            say("dropped")
            return None
    ckpt.finish(progress, stop=stop if stop else None)
    stop.uninstall()
    for saved in saves:
        say(f"status {saved.step} {saved.status.value}")
    ckpt.close()
    say(f"checkpoints {[c.path.name for c in ckpt.checkpoints()]}")
    if args.remote is not None:
        say(f"tiers {json.dumps([[c.step, list(c.tiers)] for c in ckpt.checkpoints()])}")
    out = snapshot(model, optimizer, ema)
    out["schedule"] = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
    out["resumed"] = resumed
    if args.remote is not None:  # compared with a resumed run's --out-resumed
        out["rng"] = torch.get_rng_state()
    out["draws"] = torch.rand(4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--die-in-write-at", type=int)
    parser.add_argument("--no-strict", action="store_true")
    parser.add_argument("--no-ema", action="store_true")
    parser.add_argument("--strict-first", action="store_true")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--die-in-shards-at", type=int)
    parser.add_argument("--hold-shards-at", type=int)
    parser.add_argument("--drop-at", type=int)
    parser.add_argument("--fail-shards-at", type=int)
    parser.add_argument("--fail-part-at", type=int)
    parser.add_argument("--fail-stage-at", type=int)
    parser.add_argument("--fail-start-at", type=int)
    parser.add_argument("--fail-table-at", type=int)
    parser.add_argument("--tear-at-resume", action="store_true")
    parser.add_argument("--refuse-apply-at-resume", action="store_true")
    parser.add_argument("--note-checks", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--remote")
    parser.add_argument("--remote-keep-last", type=int, default=1)
    parser.add_argument("--remote-every", type=int)
    parser.add_argument("--remote-secret")
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--out-resumed", action="store_true")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.pg_timeout),
    )
    try:
        try:
            result = train(args, rank, world)
        except pitstop.PitstopError as exc:
            say(f"error {type(exc).__name__} {json.dumps(str(exc))}")
            return EXIT_PITSTOP_ERROR
        if result is None:
            return 0
        write_result(args.out, rank, world, result)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_before_teardown(main())
