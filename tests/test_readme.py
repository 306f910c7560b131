"""The first Python example in README.md runs, and prints what it says it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert match is not None, "README.md has no ```python block"
    return match.group(1)


def test_first_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    assert "not built yet" not in code, "the first python block must be the runnable example"

    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})

    lines = capsys.readouterr().out.splitlines()
    # Saves at the interval steps 4 and 8, then the off-interval final step 10; keep_last=2
    # deletes step 4 once step 10 is published.
    assert lines == [
        "4 interval kept: [4]",
        "8 interval kept: [4, 8]",
        "10 final kept: [8, 10]",
    ]


def test_readme_shows_the_printed_output() -> None:
    text = README.read_text(encoding="utf-8")
    assert "10 final kept: [8, 10]" in text
