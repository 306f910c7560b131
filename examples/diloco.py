"""DiLoCo across processes, checkpointed by pitstop: stop any rank, resume, bit for bit.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"): every rank keeps a local copy of the model and trains it for H inner steps with
AdamW on its own data shard; then the outer step averages the pseudo-gradients (global
parameters minus local parameters) across the ranks with one all-reduce and applies them to
the global model with Nesterov-momentum SGD (the outer optimizer); every rank then copies the
global model into its local one and the next round begins.

The :class:`DiLoCo` coordinator holds all of that state, and it is created after training has
started — after ``ckpt.resume()`` — so pitstop restores it as deferred components, in two
parts (see :class:`GlobalPart` and :class:`LocalPart`)::

    ckpt.register("global", coordinator.global_part)               # replicated: stored once
    ckpt.register("local", coordinator.local_part, per_rank=True)  # each rank its own slot

Why this is safe from the ordering bug of the seed document ("the coordinator resume ordering
can install a fresh global model and then overwrite its baseline with checkpointed local
state"): the pseudo-gradient's baseline *is* the global model (it changes only at the outer
step), so there is no second copy to get out of step; each part restores only its own tensors
(the local part never writes into the global model, nor the global part into the local
model), so the two registrations may come in either order; and the global part carries the
global model's weights itself, so a model the coordinator installs when it starts (``--init``,
e.g. pretrained weights) is replaced by the checkpointed global model on a resume, never the
other way round. After a part is restored, :meth:`DiLoCo.install` refuses to run.

The outer step is split in two: :meth:`DiLoCo.reduce` (end of a round: all-reduce the
pseudo-gradient into ``pending``) and :meth:`DiLoCo.apply_pending` (before the next inner
step: the outer optimizer's step, the round's id added to ``applied`` — the processed-delta
set — and the local model reset to the new global one). A checkpoint taken at a round
boundary therefore holds the agreed, not yet applied delta, so a resume neither repeats the
all-reduce nor loses it; a delta whose round is already in ``applied`` is never applied again,
and a checkpoint that claims both is refused on resume.

The Checkpointer's ``model`` is the global model (what ``pitstop export`` and
``pitstop.load_weights`` give you). Its tensors also appear in the global part, and the tiny
language model ties its output projection to its embedding; pitstop writes each storage
once, so none of that costs a byte twice.

Run it (CPU, gloo; a tiny model and synthetic data, seconds)::

    torchrun --nproc-per-node 2 examples/diloco.py --dir runs/diloco/checkpoints --report
    # or, one process per rank:
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/diloco.py ...

SIGINT/SIGTERM to any rank stops every rank at the same step (``maybe_save`` agrees it) with one
checkpoint; running the same command again resumes. Without WORLD_SIZE it runs as one process.

    python examples/diloco.py --dir D [--rounds 4] [--inner 4] [--every N] [--init FILE]
        [--out OUT] [--report] [--register-order global-first|local-first]
        [--hold-at N --hold-rank R]

``--out OUT``: each rank writes ``OUT.rank<R>.pt`` (load it with ``torch.load(...,
weights_only=True)``): the coordinator's state at the end, its state right after the
registrations (``resumed``), the batches it trained on, and draws from each RNG. Test hook:
``--hold-at N --hold-rank R`` — after printing ``step N``, rank R waits until a signal has
arrived, so a SIGTERM sent on seeing that line always stops the run at step N.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import logging
import os
import random
import select
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import pitstop

VOCAB, DIM, LENGTH = 256, 64, 8  # the tiny language model and its sequences
SAMPLES, BATCH = 64, 4  # 2 ranks: 32 sequences each, 8 batches per epoch
HOLD_LIMIT_S = 300.0  # a held rank gives up (exit 4) when no signal comes: never hang forever
EXIT_PITSTOP_ERROR = 3
EXIT_TEST_HOOK = 4

log = logging.getLogger("diloco")


# --- the model and the data -----------------------------------------------------------------


class TinyLM(nn.Module):
    """Next-token prediction over a small vocabulary; the output projection is tied to the
    embedding (one parameter under two names: ``emb.weight`` and ``head.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        hidden = hidden + self.drop(torch.tanh(self.mix(hidden)))
        logits: torch.Tensor = self.head(hidden)
        return logits


def make_model(seed: int = 0) -> TinyLM:
    """A TinyLM whose initial weights depend only on ``seed`` (the global RNG is untouched)."""
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        return TinyLM()
    finally:
        torch.set_rng_state(state)


def make_data(seed: int = 1) -> torch.Tensor:
    """SAMPLES sequences of LENGTH + 1 tokens from a noisy random transition table."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(VOCAB, (VOCAB,), generator=generator)
    tokens = torch.empty(SAMPLES, LENGTH + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (SAMPLES,), generator=generator)
    for t in range(LENGTH):
        noise = torch.rand(SAMPLES, generator=generator) < 0.1
        random_tokens = torch.randint(VOCAB, (SAMPLES,), generator=generator)
        tokens[:, t + 1] = torch.where(noise, random_tokens, table[tokens[:, t]])
    return tokens


# --- the coordinator --------------------------------------------------------------------------


def _clone(tree: Any) -> Any:
    """A deep copy of a state tree with every tensor cloned (nothing aliases the source)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, Mapping):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


class DiLoCo:
    """The DiLoCo coordinator of one rank: local and global model, inner and outer optimizer.

    ``global_model`` is the model every rank agrees on (pass the same one to the
    Checkpointer as its ``model``); the coordinator makes the local copy. ``init``: weights
    to install into the global model now (a plain state dict, e.g. pretrained or exported
    weights) — on a resume, registering :attr:`global_part` replaces them with the
    checkpointed global model. ``group``: the process group of the all-reduce (default: the
    default group; ``world_size == 1`` needs none).

    State: the local model and the inner AdamW (different on every rank), the global model
    and the outer Nesterov SGD with its momentum (the same on every rank), the counters
    (inner steps, outer rounds reduced), the pending deltas (reduced, not yet applied, by
    round) and ``applied``: the rounds whose delta was applied, in order.
    """

    def __init__(
        self,
        global_model: nn.Module,
        *,
        inner_steps: int,
        init: Mapping[str, torch.Tensor] | None = None,
        inner_lr: float = 3e-3,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        world_size: int = 1,
        group: Any = None,
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        self.inner_steps = inner_steps
        self.world_size = world_size
        self.group = group
        self._restored: set[str] = set()  # the parts load_state_dict has filled
        self.global_model = global_model
        self.local_model = copy.deepcopy(global_model)  # ties stay tied
        self.inner_opt = torch.optim.AdamW(
            self.local_model.parameters(), lr=inner_lr, weight_decay=0.01
        )
        self.outer_opt = torch.optim.SGD(
            global_model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True
        )
        self.inner_step = 0  # inner AdamW steps taken (the same count on every rank)
        self.round = 0  # outer rounds reduced: pending and applied together are range(round)
        self.local_round = 0  # the round whose global model the local model started from
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.applied: list[int] = []
        self.global_part = GlobalPart(self)
        self.local_part = LocalPart(self)
        if init is not None:
            self.install(init)

    # --- training ---------------------------------------------------------------------

    def install(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Make ``weights`` the global (and local) model; only before any state is restored."""
        if self._restored:
            raise RuntimeError(
                f"install() after the coordinator's {sorted(self._restored)} state was "
                "restored would overwrite the checkpointed global model"
            )
        with torch.no_grad():
            self.global_model.load_state_dict(weights)
            self.local_model.load_state_dict(self.global_model.state_dict())

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One inner AdamW step on the local model; the round's reduce after the H-th."""
        self.apply_pending()
        self.local_model.train()
        logits = self.local_model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.inner_opt.step()
        self.inner_step += 1
        if self.inner_step % self.inner_steps == 0:
            self.reduce()
        return loss.detach()

    def reduce(self) -> None:
        """End of a round: average (global - local) over the ranks into ``pending``."""
        names = [name for name, _ in self.global_model.named_parameters()]
        with torch.no_grad():
            local = dict(self.local_model.named_parameters())
            deltas = [p - local[name] for name, p in self.global_model.named_parameters()]
            flat = torch.cat([d.reshape(-1) for d in deltas])
            if self.world_size > 1:
                dist.all_reduce(flat, group=self.group)
                flat /= self.world_size
            pieces = flat.split([d.numel() for d in deltas])
            self.pending[self.round] = {
                name: piece.view_as(d).clone()
                for name, piece, d in zip(names, pieces, deltas, strict=True)
            }
        self.round += 1

    def apply_pending(self) -> list[int]:
        """Apply every pending delta (oldest first) with the outer optimizer; return the rounds.

        A round already in ``applied`` is dropped, never applied twice. The local model then
        restarts from the new global model.
        """
        done = []
        for round_id in sorted(self.pending):
            delta = self.pending.pop(round_id)
            if round_id in self.applied:
                log.warning("round %d's delta was already applied; dropped", round_id)
                continue
            for name, param in self.global_model.named_parameters():
                param.grad = delta[name]
            self.outer_opt.step()
            self.outer_opt.zero_grad(set_to_none=True)
            self.applied.append(round_id)
            done.append(round_id)
        if done:
            with torch.no_grad():
                self.local_model.load_state_dict(self.global_model.state_dict())
            self.local_round = len(self.applied)
        return done

    def check(self) -> None:
        """Raise if the local state does not belong to the global state (after restoring)."""
        problems = _bookkeeping_problems(self.round, self.pending.keys(), self.applied)
        if self.local_round != len(self.applied):
            problems.append(
                f"the local model started from round {self.local_round}, but the global model "
                f"has {len(self.applied)} round(s) applied"
            )
        if problems:
            raise RuntimeError("DiLoCo state is inconsistent: " + "; ".join(problems))

    # --- the whole state, for use without pitstop's split ---------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Both parts: ``{"global": ..., "local": ...}`` (live tensors, not copies)."""
        return {"global": self.global_part.state_dict(), "local": self.local_part.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore both parts; each only touches its own tensors, so the order is free."""
        self.global_part.load_state_dict(state["global"])
        self.local_part.load_state_dict(state["local"])


def _bookkeeping_problems(round_: int, pending: Any, applied: list[int]) -> list[str]:
    """What is wrong with a coordinator's counters, pending rounds and applied rounds."""
    problems = []
    pending = sorted(pending)
    if len(set(applied)) != len(applied):
        problems.append(f"a round is applied twice: {applied}")
    if applied != sorted(applied):
        problems.append(f"applied rounds are out of order: {applied}")
    twice = sorted(set(pending) & set(applied))
    if twice:
        problems.append(f"round(s) {twice} are both pending and applied")
    if sorted(set(pending) | set(applied)) != list(range(round_)):
        problems.append(
            f"pending {pending} and applied {applied} are not the {round_} round(s) reduced"
        )
    return problems


class GlobalPart:
    """The replicated part of a :class:`DiLoCo`: equal on every rank, so stored once.

    The global model's weights, the outer optimizer (its momentum), the counters, the pending
    deltas and the applied rounds. Loading it never touches the local model.
    """

    def __init__(self, coordinator: DiLoCo) -> None:
        self._c = coordinator

    def state_dict(self) -> dict[str, Any]:
        c = self._c
        return {
            "model": c.global_model.state_dict(),
            "outer": c.outer_opt.state_dict(),
            "inner_step": c.inner_step,
            "round": c.round,
            "pending": {r: dict(delta) for r, delta in c.pending.items()},
            "applied": list(c.applied),
        }

    def state_differences(self, stored: Mapping[str, Any]) -> list[str]:
        """pitstop asks before restoring: a stored state whose bookkeeping is wrong is refused."""
        return _bookkeeping_problems(
            int(stored["round"]), stored["pending"].keys(), [int(r) for r in stored["applied"]]
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        c = self._c
        problems = self.state_differences(state)
        if problems:
            raise ValueError("; ".join(problems))
        with torch.no_grad():
            c.global_model.load_state_dict(state["model"])
        c.outer_opt.load_state_dict(_clone(state["outer"]))
        c.inner_step = int(state["inner_step"])
        c.round = int(state["round"])
        c.pending = {int(r): _clone(dict(delta)) for r, delta in state["pending"].items()}
        c.applied = [int(r) for r in state["applied"]]
        c._restored.add("global")


class LocalPart:
    """The per-rank part of a :class:`DiLoCo`: the local model and the inner optimizer.

    ``round``: the round whose global model the local model started from. Loading it never
    touches the global model.
    """

    def __init__(self, coordinator: DiLoCo) -> None:
        self._c = coordinator

    def state_dict(self) -> dict[str, Any]:
        c = self._c
        return {
            "model": c.local_model.state_dict(),
            "inner": c.inner_opt.state_dict(),
            "round": c.local_round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        c = self._c
        with torch.no_grad():
            c.local_model.load_state_dict(state["model"])
        c.inner_opt.load_state_dict(_clone(state["inner"]))
        c.local_round = int(state["round"])
        c._restored.add("local")


# --- the training loop ------------------------------------------------------------------------


def report(enabled: bool, text: str) -> None:
    if enabled:
        print(text, flush=True)


def _wait_for_a_signal(wakeup: int, done: Callable[[], bool]) -> None:
    """Block until ``done()`` is true; each signal wakes the select through ``wakeup``."""
    while not done():
        ready, _, _ = select.select([wakeup], [], [], HOLD_LIMIT_S)
        if not ready:
            print("hold: no signal came", flush=True)
            raise SystemExit(EXIT_TEST_HOOK)
        with contextlib.suppress(BlockingIOError):
            os.read(wakeup, 512)


def _snapshot(coordinator: DiLoCo) -> Any:
    """A copy of the coordinator's whole state (what --out compares)."""
    return _clone(coordinator.state_dict())


def _batches(sampler: pitstop.ResumableSampler, progress: pitstop.Progress) -> Iterator[Any]:
    """This rank's batches from ``progress`` on, epoch after epoch; ``None`` ends an epoch."""
    while True:
        sampler.set_position(progress)
        yield from sampler
        progress = progress.next_epoch()
        yield None  # the epoch ended: the caller moves its progress to the next epoch


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds to train (absolute)")
    parser.add_argument("--inner", type=int, default=4, help="H: inner steps per round")
    parser.add_argument("--every", type=int, default=None, help="save every N steps (default H)")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--init", default=None, help="weights the global model starts from")
    parser.add_argument("--out", default=None, help="each rank writes OUT.rank<R>.pt")
    parser.add_argument("--report", action="store_true", help="print step/round/saved lines")
    parser.add_argument(
        "--register-order", choices=("global-first", "local-first"), default="global-first"
    )
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--hold-rank", type=int, default=1)
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    world = int(os.environ["WORLD_SIZE"]) if distributed else 1
    if distributed:
        dist.init_process_group(
            "gloo",
            init_method="env://",  # MASTER_ADDR / MASTER_PORT, for both launchers
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.pg_timeout),
        )
    try:
        return train(args, rank, world)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int) -> int:
    tokens = make_data()
    global_model = make_model()  # the same initial weights on every rank
    # From here on each rank has its own streams: its own dropout masks and draws.
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    sampler = pitstop.ResumableSampler(SAMPLES, BATCH, seed=3, rank=rank, world_size=world)
    target = args.rounds * args.inner

    holding = args.hold_at is not None and rank == args.hold_rank
    wakeup = -1
    if holding:
        wakeup, wakeup_w = os.pipe()
        os.set_blocking(wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)

    stop = pitstop.StopRequest()
    batches: list[list[int]] = []
    ckpt = None
    try:
        ckpt = pitstop.Checkpointer(
            args.dir,
            model=global_model,
            state={"sampler": sampler},
            policy=pitstop.Policy(every_steps=args.every or args.inner, keep_last=args.keep_last),
            timeout_s=args.pg_timeout,
        )
        progress = ckpt.resume()
        report(args.report, f"resumed {progress.step}")

        # Training has started; now the coordinator starts, installing its initial weights,
        # and pitstop hands it the checkpointed state (if the resumed checkpoint holds any).
        init = torch.load(args.init, weights_only=True) if args.init else None
        coordinator = DiLoCo(global_model, inner_steps=args.inner, init=init, world_size=world)
        # Every rank registers both parts, in the same order; either order gives one state.
        if args.register_order == "local-first":
            ckpt.register("local", coordinator.local_part, per_rank=True)
            ckpt.register("global", coordinator.global_part)
        else:
            ckpt.register("global", coordinator.global_part)
            ckpt.register("local", coordinator.local_part, per_rank=True)
        coordinator.check()
        resumed = {
            "progress": [progress.step, progress.epoch, progress.batch_in_epoch],
            "coordinator": _snapshot(coordinator),
        }

        stream = _batches(sampler, progress)
        with stop.catch_signals():
            while progress.step < target and not stop:
                indices = next(stream)
                if indices is None:
                    progress = progress.next_epoch()
                    continue
                batches.append(list(indices))
                before = len(coordinator.applied)
                coordinator.train_step(tokens[indices])
                progress = progress.advance(samples=len(indices) * world)
                if progress.step == target:
                    coordinator.apply_pending()  # the last outer step: "final" holds all rounds
                if len(coordinator.applied) > before:
                    report(args.report, f"round {len(coordinator.applied)}")
                report(args.report, f"step {progress.step}")
                if holding and progress.step == args.hold_at:
                    _wait_for_a_signal(wakeup, lambda: stop.requested_here)
                saved = ckpt.maybe_save(progress, stop=stop)
                if saved is not None:
                    report(args.report, f"saved {saved.step}")
        ckpt.finish(progress, stop=stop)
        report(args.report, f"finished {progress.step} stop={stop.reason}")
        closing, ckpt = ckpt, None
        closing.close()
    except pitstop.PitstopError as exc:
        print(f"error {type(exc).__name__} {exc}", flush=True)
        return EXIT_PITSTOP_ERROR
    finally:
        if ckpt is not None:  # after an error: release the directory, keep the first error
            try:
                ckpt.close()
            except Exception as exc:
                print(f"close after the error: {type(exc).__name__}: {exc}", flush=True)

    if args.out:
        result = {
            "rank": rank,
            "world_size": world,
            "coordinator": _snapshot(coordinator),
            "weights": _clone(global_model.state_dict()),  # what the Checkpointer saves
            "sampler": sampler.state_dict(),
            "batches": batches,
            "progress": [progress.step, progress.epoch, progress.batch_in_epoch, progress.samples],
            "resumed": resumed,
            "stop_reason": stop.reason,
            "draws": [torch.rand(3), random.random(), float(np.random.rand())],
        }
        torch.save(result, f"{args.out}.rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
