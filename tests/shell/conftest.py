"""Fixtures of the shell's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from onerank import one_rank_group
from writergate import WriterGate, hold_writer


@pytest.fixture(scope="module")
def group() -> Iterator[Any]:
    """This process as a 1-rank gloo job for the module's tests (tests/onerank.py), and a
    group of its own for DCP's async collectives."""
    with one_rank_group() as own:
        yield own


@pytest.fixture
def writer_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriterGate]:
    """The writer thread of a Checkpointer made during the test waits until ``open()``."""
    yield from hold_writer(monkeypatch)
