# Stop requests: a flag that signals, schedulers and any rank can raise.
#
# Rules: a signal handler only records the request (flag and reason, e.g. "SIGTERM"); saving and
# communication happen in the training loop, never in the handler. catch_signals() handles
# SIGINT and SIGTERM while it is active, in the main thread only (Python delivers signals
# there), and restores the previous handlers on exit. A second SIGINT while a stop is pending
# raises KeyboardInterrupt: the user insists. sync() makes every rank agree: True everywhere if
# any rank asked to stop.
# How: a plain object with a bool and a reason; sync() is an all-reduce (MAX) of one integer
# when torch.distributed is initialized.

"""StopRequest: pause a run cleanly on a signal, a scheduler's notice, or a request."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from pitstop.errors import PitstopError

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A request to stop the run at the next safe point; truthy once requested."""

    def __init__(self) -> None:
        self._requested = False
        self._reason: str | None = None

    def request(self, reason: str = "requested") -> None:
        """Ask the run to stop; the first reason given is kept."""
        if not self._requested:
            self._reason = reason
        self._requested = True

    @property
    def requested(self) -> bool:
        """Whether a stop was requested (on this rank; see :meth:`sync`)."""
        return self._requested

    @property
    def reason(self) -> str | None:
        """Why the stop was requested (``"SIGTERM"``, ``"SIGINT"``, a caller's text), if it was."""
        return self._reason

    def __bool__(self) -> bool:
        return self._requested

    def __repr__(self) -> str:
        state = f"requested ({self._reason})" if self._requested else "not requested"
        return f"<StopRequest {state}>"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._requested and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"{name} again while a stop ({self._reason}) was pending")
        self.request(name)

    @contextlib.contextmanager
    def catch_signals(self) -> Iterator[StopRequest]:
        """Turn SIGINT and SIGTERM into stop requests while the block runs.

        Must be entered in the main thread; the previous handlers come back on exit.
        """
        if threading.current_thread() is not threading.main_thread():
            raise PitstopError(
                "StopRequest.catch_signals() must run in the main thread: Python delivers "
                "signals only there"
            )
        previous: dict[signal.Signals, Any] = {}
        try:
            for sig in _SIGNALS:
                previous[sig] = signal.signal(sig, self._handle)
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def sync(self) -> bool:
        """Return whether any rank requested a stop (every rank gets the same answer).

        Single-process runs just return the flag. With torch.distributed initialized this is a
        collective: every rank must call it at the same point of the loop.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return self._requested
        backend = dist.get_backend()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        flag = torch.tensor([1 if self._requested else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self._requested:
            self.request("another rank requested a stop")
        return bool(flag.item())
