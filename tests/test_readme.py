"""The README's Python examples run, and print what the README says they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def run_block(code: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    return capsys.readouterr().out.splitlines()


def test_the_custom_loop_example_saves_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code = python_blocks()[0]
    assert "Checkpointer" in code
    assert len(code.strip().splitlines()) <= 17
    assert run_block(code, capsys) == ["[20, 25]"]
    first = sorted(p.name for p in (tmp_path / "runs/readme/checkpoints").iterdir())
    assert "step_000000000025.pitstop" in first
    # The second run resumes at step 25: nothing to train, nothing new written.
    assert run_block(code, capsys) == ["[20, 25]"]
    assert sorted(p.name for p in (tmp_path / "runs/readme/checkpoints").iterdir()) == first


def test_the_planning_core_example(capsys: pytest.CaptureFixture[str]) -> None:
    code = python_blocks()[1]
    # Saves at the interval steps 4 and 8, then the off-interval final step 10; keep_last=2
    # deletes step 4 once step 10 is published.
    assert run_block(code, capsys) == [
        "4 interval kept: [4]",
        "8 interval kept: [4, 8]",
        "10 final kept: [8, 10]",
    ]


def test_readme_shows_what_the_examples_print() -> None:
    text = README.read_text(encoding="utf-8")
    assert "[20, 25]" in text
    assert "10 final kept: [8, 10]" in text
