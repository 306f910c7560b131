"""Shared fixtures of the reliability suites: the fork server and fast directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliability.forkclient import ForkServer


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """One fork server for the session (torch imported once); ended when the session ends."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver") / "stderr.log")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on a memory filesystem (/dev/shm) where there is one, else tmp_path.

    For suites about processes dying (not power loss): an fsync there costs nothing, so a kill
    sweep spends its time on kills, not on the disk.
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="pitstop-reliability-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
