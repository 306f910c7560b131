"""Fixtures of the ``s3://`` tests: one real S3 server per test module, and a fresh prefix
of its bucket per test, with the AWS environment pointing at it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from s3server import BUCKET, S3Server

pytest.importorskip("obstore", reason="the s3 extra: pip install pitstop[s3]")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server.start(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard AWS environment of the server, set for this test."""
    env = s3_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def s3_url(s3_env: dict[str, str]) -> str:
    """A fresh, empty prefix of the test bucket."""
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def local_tmp(tmp_path: Path) -> Path:
    return tmp_path
