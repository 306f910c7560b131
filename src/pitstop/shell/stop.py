# Stop requests: a flag that signals, schedulers and any rank can raise.
#
# Rules: a signal handler only records the request (flag and reason, e.g. "SIGTERM"); saving and
# communication happen in the training loop, never in the handler. catch_signals() handles
# SIGINT and SIGTERM while its block runs, install() until uninstall(); both in the main thread
# only (Python delivers signals there), and both put the previous handlers back. A previous
# handler installed outside Python (signal.getsignal() is None: a C library's) is put back as
# the C-level disposition it was. A catch_signals() context entered and never exited (the
# misuse `catch_signals().__enter__()` in a flat script) warns when it is collected and keeps
# its handlers installed, as install() would, instead of silently restoring the defaults. A
# second SIGINT while a stop is pending raises KeyboardInterrupt: the user insists.
# With several ranks, what a loop sees (bool(stop), requested, reason) is the ranks' last agreed
# answer, never this rank's own flag: sync() agrees, and so does every save call given the stop
# (maybe_save(progress, stop=stop) — pitstop.shell.savecall); a request heard after an agreement
# waits for the next one. The rule is the core's (pitstop.core.ranks). With one process, a
# request is the answer at once.
# How: a plain object holding the core's StopState; the C-level disposition is saved and
# restored as opaque bytes through the C library's sigaction(); sync() is one all-reduce of a
# small code per rank, on the default process group, bounded by its timeout (a failure names
# the call and the ranks that did not arrive: pitstop.shell.ranks.roundfailure.named_failure).

"""StopRequest: pause a run cleanly on a signal, a scheduler's notice, or a request."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
import warnings
from types import FrameType, TracebackType
from typing import Any

import attrs
import torch

from pitstop.core.ranks import (
    StopState,
    agree_codes,
    agreed,
    heard,
    offer_code,
    offered_reason,
    visible,
)
from pitstop.errors import PitstopError

__all__ = ["SignalScope", "StopRequest"]

log = logging.getLogger("pitstop")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# More than any platform's struct sigaction (152 bytes on Linux x86-64): saved and restored
# whole, never interpreted.
_SIGACTION_BYTES = 1024

_LAST_FLAG: list[torch.Tensor] = []
"""The last sync()'s tensor, referenced until the next sync (past its StopRequest): torch
2.4's gloo worker that drops a collective's last tensor reference takes the GIL, which
destroy_process_group holds while it joins that worker (pitstop.shell.ranks.collectives)."""


def _libc() -> Any:
    if sys.platform == "win32":  # pragma: no cover - no sigaction there
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "sigaction") else None
    except OSError:  # pragma: no cover - a platform without a C library to open
        return None


def _c_disposition(sig: signal.Signals) -> bytes | None:
    """The C-level disposition of ``sig`` (struct sigaction, as opaque bytes), if readable."""
    libc = _libc()
    if libc is None:
        return None
    buffer = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(int(sig), None, buffer) != 0:
        return None
    return buffer.raw


def _set_c_disposition(sig: signal.Signals, raw: bytes) -> bool:
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.sigaction(int(sig), ctypes.create_string_buffer(raw, len(raw)), None) == 0)


@attrs.frozen(kw_only=True)
class _Previous:
    """A signal's handler before pitstop's: a Python one, or (handler None) a C-level one."""

    handler: Any
    c_disposition: bytes | None = attrs.field(default=None, repr=False)


def _check_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise PitstopError(
            f"StopRequest.{what} must run in the main thread: Python delivers signals only there"
        )


def _install(handler: Any, what: str) -> dict[signal.Signals, _Previous]:
    """Install ``handler`` for SIGINT and SIGTERM; return what was there before."""
    _check_main_thread(what)
    saved: dict[signal.Signals, _Previous] = {}
    try:
        for sig in _SIGNALS:
            # None: a handler installed outside Python, which signal.signal() cannot put back;
            # keep its C-level disposition to restore it later.
            raw = _c_disposition(sig) if signal.getsignal(sig) is None else None
            previous = signal.signal(sig, handler)
            saved[sig] = _Previous(handler=previous, c_disposition=raw)
    except BaseException:
        _restore(saved)
        raise
    return saved


def _restore(saved: dict[signal.Signals, _Previous]) -> None:
    """Put back the handlers ``_install`` replaced."""
    for sig, previous in saved.items():
        if previous.handler is not None:
            signal.signal(sig, previous.handler)
            continue
        signal.signal(sig, signal.SIG_DFL)  # Python's own handler off first
        raw = previous.c_disposition
        if raw is None or not _set_c_disposition(sig, raw):
            log.warning(
                "the previous %s handler was installed outside Python and could not be put "
                "back; %s now has the default action",
                sig.name,
                sig.name,
            )


class SignalScope:
    """What :meth:`StopRequest.catch_signals` returns: use it as ``with stop.catch_signals():``.

    Entering installs the handlers, exiting restores the previous ones. A scope entered and
    never exited (``stop.catch_signals().__enter__()``) warns when it is collected and leaves
    its handlers installed, as :meth:`StopRequest.install` does; :meth:`StopRequest.uninstall`
    then restores the previous ones.
    """

    def __init__(self, stop: StopRequest) -> None:
        self._stop = stop
        self._saved: dict[signal.Signals, _Previous] | None = None

    def __enter__(self) -> StopRequest:
        if self._saved is not None:
            raise PitstopError("this catch_signals() context is already active")
        self._saved = _install(self._stop._handle, "catch_signals()")
        return self._stop

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            _restore(saved)

    def __del__(self) -> None:
        saved, self._saved = getattr(self, "_saved", None), None
        if saved is None:
            return
        self._stop._adopt(saved)
        warnings.warn(
            "StopRequest.catch_signals() was entered but never exited (called as "
            "catch_signals().__enter__()?): its SIGINT/SIGTERM handlers stay installed for the "
            "rest of the process, as with stop.install(); use `with stop.catch_signals():` "
            "around a block, or stop.install() and stop.uninstall()",
            RuntimeWarning,
            stacklevel=2,
        )


def _many_ranks() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class StopRequest:
    """A request to stop the run at the next safe point; truthy once requested.

    With several ranks it is truthy once the ranks *agreed* on a stop — at :meth:`sync` or at a
    save call given it (``maybe_save(progress, stop=stop)``) — so every rank sees the same
    answer between two agreements and a loop that acts on it leaves at the same step
    everywhere; :attr:`requested_here` says what this rank itself heard.
    """

    def __init__(self) -> None:
        self._state = StopState()
        # What a signal handler or request() heard: the only attribute they write (the first
        # reason kept), folded into _state when it is read. A handler that wrote _state itself
        # could land between an agreement's read of _state and its write, and be lost.
        self._asked: str | None = None
        self._installed: dict[signal.Signals, _Previous] | None = None

    def request(self, reason: str = "requested") -> None:
        """Ask the run to stop; the first reason given is kept.

        With several ranks the request counts from the next agreement (:meth:`sync`, or a save
        call given this StopRequest), on every rank at once.
        """
        if self._asked is None:
            self._asked = reason

    def _now(self) -> StopState:
        """The state with the request heard folded in."""
        asked = self._asked
        return self._state if asked is None else heard(self._state, asked)

    @property
    def requested(self) -> bool:
        """Whether to stop: the ranks' last agreed answer (one process: the request itself)."""
        return visible(self._now(), many=_many_ranks())[0]

    @property
    def requested_here(self) -> bool:
        """Whether this rank itself heard a request (a signal, :meth:`request`), agreed or
        not yet."""
        return self._now().heard

    @property
    def reason(self) -> str | None:
        """Why the run stops (``"SIGTERM"``, ``"SIGINT"``, a caller's text), if it does: the
        agreed reason with several ranks, the same on every rank."""
        return visible(self._now(), many=_many_ranks())[1]

    def __bool__(self) -> bool:
        return self.requested

    def __repr__(self) -> str:
        now = self._now()
        seen, reason = visible(now, many=_many_ranks())
        state = f"requested ({reason})" if seen else "not requested"
        if not seen and now.heard:
            state += f", heard here ({now.heard_reason}), agreed at the next call"
        return f"<StopRequest {state}>"

    def _offer(self) -> tuple[bool, str]:
        """What this rank brings to a save call's inputs (the core's ``offered_reason``)."""
        return offered_reason(self._now())

    def _agreed(self, stop: bool, reason: str, ranks: int) -> bool:
        """Adopt the ranks' agreement (every rank at the same call); whether it stops now
        where it did not before."""
        now = self._now()
        self._state = agreed(now, stop=stop, reason=reason, ranks=ranks)
        return self._state.agreed and not now.agreed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._asked is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"{name} again while a stop ({self._asked}) was pending")
        self.request(name)

    def catch_signals(self) -> SignalScope:
        """Turn SIGINT and SIGTERM into stop requests while a ``with`` block runs.

        ``with stop.catch_signals():`` must be entered in the main thread; the previous
        handlers come back on exit. For a flat script with no block to wrap, use
        :meth:`install`.
        """
        return SignalScope(self)

    def install(self) -> None:
        """Turn SIGINT and SIGTERM into stop requests from now on, until :meth:`uninstall`.

        Main thread only. Installing twice is a no-op; the handlers from before the first
        install are the ones :meth:`uninstall` restores.
        """
        if self._installed is None:
            self._installed = _install(self._handle, "install()")

    def uninstall(self) -> None:
        """Restore the handlers that :meth:`install` replaced; a no-op when not installed."""
        if self._installed is None:
            return
        _check_main_thread("uninstall()")
        saved, self._installed = self._installed, None
        _restore(saved)

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` (or an abandoned ``catch_signals()``) holds the handlers."""
        return self._installed is not None

    def _adopt(self, saved: dict[signal.Signals, _Previous]) -> None:
        """Keep a collected scope's handlers installed, as if :meth:`install` had put them."""
        if self._installed is None:
            self._installed = saved

    def sync(self) -> bool:
        """Agree with every rank on whether to stop, and return the answer (the same on every
        rank: True if any rank heard a request, now or before).

        Single-process runs just return the request. With torch.distributed initialized this
        is a collective on the default process group: every rank must call it at the same
        point of the loop. It is optional: a save call given the StopRequest
        (``maybe_save(progress, stop=stop)``) agrees too, in the round it makes anyway.
        """
        if not _many_ranks():
            return self.requested
        from pitstop.shell.ranks.roundfailure import named_failure

        dist = torch.distributed
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        world, rank = dist.get_world_size(), dist.get_rank()
        codes = torch.zeros(world, dtype=torch.int32, device=device)
        codes[rank] = offer_code(self._now())
        try:
            dist.all_reduce(codes, op=dist.ReduceOp.SUM)
        except RuntimeError as exc:
            raise named_failure("StopRequest.sync()", "its all-reduce", exc) from exc
        _LAST_FLAG[:] = [codes]  # held past this StopRequest: see _LAST_FLAG
        stop, reason = agree_codes(codes.tolist())
        self._agreed(stop, reason, world)
        return self.requested
