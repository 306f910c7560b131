"""Importing a .safetensors file whose header lies: every entry is checked before a tensor is
built, and each lie is one ``ImportRefused`` naming the entry (``pitstop import``: exit 1, one
``error:`` line), with nothing written to the directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import pitstop
from pitstop import ImportRefused
from pitstop.cli import main

GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def _file(path: Path, header: str, body: bytes = bytes(16)) -> Path:
    """A .safetensors file whose header is the JSON text ``header``, as written."""
    encoded = header.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    return path


def _entry(**changes: object) -> str:
    """A header of a good tensor ``"ok"`` and a tensor ``"liar"`` with ``changes``."""
    liar = {**GOOD, **changes}
    return json.dumps({"__metadata__": {"format": "pt"}, "ok": GOOD, "liar": liar})


CASES = {
    "negative shape": (_entry(shape=[-1, -2], data_offsets=[0, 8]), "liar", "shape [-1, -2]"),
    "infinite shape": (_entry(shape=[1]).replace("[1]", "[1e400]"), "liar", "shape [inf]"),
    "float shape": (_entry(shape=[2.0, 2]), "liar", "shape [2.0, 2]"),
    "boolean shape": (_entry(shape=[True, 4]), "liar", "shape [True, 4]"),
    "nested shape": (_entry(shape=[[2], 2]), "liar", "nested JSON array"),
    "huge shape": (_entry(shape=[2**62, 2**62]), "liar", "data_offsets"),
    "offsets outside the file": (_entry(data_offsets=[0, 1 << 40]), "liar", "data_offsets"),
    "offsets reversed": (_entry(data_offsets=[16, 0]), "liar", "data_offsets"),
    "negative offsets": (_entry(data_offsets=[-16, 0]), "liar", "data_offsets [-16, 0]"),
    "offsets of the wrong size": (_entry(data_offsets=[0, 12]), "liar", "16 bytes"),
    "unknown dtype": (_entry(dtype="F99"), "liar", "unknown dtype 'F99'"),
    "dtype not a string": (_entry(dtype={"a": 1}), "liar", "unknown dtype a nested JSON object"),
    "entry not an object": (json.dumps({"ok": GOOD, "liar": [1, 2]}), "liar", "not a JSON object"),
    "entry missing a field": (json.dumps({"liar": {"dtype": "F32"}}), "liar", "shape"),
    "header nested 100,000 deep": (
        '{"liar": ' + "[" * 100_000 + "]" * 100_000 + "}",
        ".safetensors header",
        "nested too deeply",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lying_header_is_refused_naming_the_entry(tmp_path: Path, case: str) -> None:
    header, entry, why = CASES[case]
    source = _file(tmp_path / "model.safetensors", header)
    with pytest.raises(ImportRefused) as raised:
        pitstop.import_checkpoint(source, tmp_path / "run")
    message = str(raised.value)
    assert str(source) in message
    assert entry in message
    assert why in message
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("case", ["negative shape", "infinite shape", "header nested 100,000 deep"])
def test_pitstop_import_of_a_lying_header_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    source = _file(tmp_path / "model.safetensors", CASES[case][0])
    assert main(["import", str(source), str(tmp_path / "run")]) == 1
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, printed
    assert "Traceback" not in printed


def test_an_honest_header_still_imports(tmp_path: Path) -> None:
    body = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    source = _file(tmp_path / "model.safetensors", json.dumps({"w": GOOD}), body)
    pitstop.import_checkpoint(source, tmp_path / "run")
    loaded = pitstop.load(tmp_path / "run")
    assert loaded["weights"]["raw"]["w"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
