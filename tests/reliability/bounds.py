"""Bounded calls: a call must end within a time and grow peak resident memory by less than a
bound (VmHWM from /proc/self/status, reset through /proc/self/clear_refs; /proc/self/statm
where that reset is not allowed)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


def _peak_bytes() -> int:
    with open("/proc/self/status", "rb") as status:
        match = _HWM.search(status.read())
    assert match is not None
    return int(match.group(1)) * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
    except OSError:
        return False
    return True


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bounded(
    call: Callable[[], object], *, seconds: float = 5.0, memory: int = 500 << 20
) -> tuple[object, BaseException | None, int]:
    """Run ``call`` on a thread; fail unless it ends within ``seconds`` and grows this
    process's peak resident memory by less than ``memory`` bytes. Returns its result, its
    exception, and the growth measured."""
    outcome: list[Any] = [None, None]

    def run() -> None:
        try:
            outcome[0] = call()
        except BaseException as error:
            outcome[1] = error

    peak = _reset_peak()
    before = _resident_bytes()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    growth = (_peak_bytes() if peak else _resident_bytes()) - before
    assert growth < memory, f"grew resident memory by {growth >> 20} MiB"
    return outcome[0], outcome[1], growth
