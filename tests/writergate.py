"""Holding a Checkpointer's writer thread back at its start, so that a test names the
interleaving it checks (never a race that usually goes one way)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

import pitstop.shell.session as session_module

TIMEOUT = 60.0  # only a safeguard: a gate not opened by then is a failure, never a hang
OPENER_TIMEOUT = 20.0  # shorter, so that a test's own opener gives up first


class WriterGate:
    """Holds the writer thread back at its start until :meth:`open`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.timed_out = False

    def open(self) -> None:
        self.event.set()


def hold_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriterGate]:
    """The body of a ``writer_gate`` fixture: every writer thread started meanwhile waits for
    the gate; at teardown the gate opens, and a gate the test never opened fails it."""
    gate = WriterGate()
    real: Callable[[session_module.SaveSession], None] = session_module._work

    def held(session: session_module.SaveSession) -> None:
        gate.timed_out = not gate.event.wait(TIMEOUT)
        real(session)  # even then: a writer that never ran would hang close()

    monkeypatch.setattr(session_module, "_work", held)
    yield gate
    gate.open()  # never leave a writer thread waiting
    assert not gate.timed_out, "the test never opened the writer gate"
