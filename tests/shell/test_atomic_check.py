"""write_atomically's check: it sees every byte at the temp file before anything is published,
and what it raises leaves the target as it was, with no temp file."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import pytest

from pitstop.errors import SaveError
from pitstop.shell.store.atomic import write_atomically


def test_the_check_sees_the_whole_file_and_a_failed_check_publishes_nothing(
    tmp_path: Path,
) -> None:
    target = tmp_path / "copy.bin"
    target.write_bytes(b"old")
    seen: list[tuple[Path, bytes]] = []

    def write(file: BinaryIO) -> None:
        file.write(b"new " * 1000)

    def refuse(temp: Path) -> None:
        seen.append((temp, temp.read_bytes()))
        raise ValueError("blob 3 does not match its CRC-32")

    with pytest.raises(SaveError, match=r"copy\.bin.*blob 3"):
        write_atomically(target, write, check=refuse)
    assert seen[0][1] == b"new " * 1000
    assert seen[0][0].parent == tmp_path
    assert seen[0][0] != target
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.bin"]

    write_atomically(target, write, check=lambda temp: seen.append((temp, temp.read_bytes())))
    assert target.read_bytes() == seen[1][1] == b"new " * 1000
