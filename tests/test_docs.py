"""Every code block in README.md and docs/*.md that claims an output is run, and prints it.

What is run
    * A ``python`` block immediately followed (blank lines allowed) by a ``text``, ``console`` or
      ``output`` block: the python block runs as ``__main__`` and its standard output must match
      the second block. It must exit normally (a block that shows an error catches it).
    * A ``console`` / ``sh`` / ``shell`` / ``bash`` block with lines starting with ``$ ``: each
      such line is a command (a trailing backslash continues it on the next line); the lines
      after it, up to the next command, are its output — standard output and standard error
      together, as a terminal shows them. ``$ echo $?`` shows the previous command's exit status;
      a command that exits non-zero must be followed by ``$ echo $?``.

    * Every other ``python`` block: it runs as ``__main__`` and must exit normally (what it
      prints is not compared). A block runs as pasted alone, so it imports and defines what it
      uses; a block that cannot (a signature, a piece of a loop, code that needs many ranks or
      CUDA) is marked as a fragment (below) and skipped on purpose.

    Nothing else is run: shell blocks without a ``$`` prompt, illustrations. A block of another
    kind that contains ``$ `` lines fails ``test_shell_examples_are_tagged``: tag it ``console``
    so that it runs (or is skipped).

Matching
    Lines are compared with trailing whitespace stripped (rich pads its tables), ignoring blank
    lines at the start and end. ``...`` inside a line matches any text within that line
    (addresses, pids, timings, sizes, temp paths), and the spaces just before it are optional so
    that a wildcard can keep a table aligned; a line that is only ``...`` matches any number of
    lines, none included.

Order, directories, dependencies
    Each page runs in a fresh temporary directory of its own that holds a copy of ``configs/``, as
    a checkout does, and its blocks run in page order: a later block sees what earlier ones wrote
    (``runs/...``, files). Selecting one test runs the earlier blocks of its page first.

Markers, an HTML comment just before a block (blank lines between are allowed)
    * ``<!-- doc-test: skip (REASON) -->``: not run; its test is skipped with REASON. For blocks
      that need what CI does not have (CUDA, a network) or whose output is not reproducible.
    * ``<!-- doc-test: fragment (REASON) -->``: a python block that is not a whole program
      (REASON says what it lacks); not run, its test skipped as a fragment.
    * ``<!-- doc-test: prelude -->``: a python block that prints nothing and is prepended to
      every later python block of the page (a function that later blocks call).
    * ``<!-- doc-test: file NAME -->``: the block's text is written to NAME in the page's
      directory (a configuration file, a script that a later command runs).

Processes
    Every python block and every command runs in a process of its own, in its own process
    group, which the test ends: it is killed, with everything it started, after 120 s or when it
    is done. ``pitstop ...``, ``python -c ...`` and ``python SCRIPT ...`` commands and the python
    blocks run in processes forked from the tests' *zygote* (tests/zygote.py: it has imported
    torch and pitstop once; importing torch costs about 2 s per process, and this file runs some
    40 of them). A forked job starts from that freshly imported state, with default signal
    handlers, stdin from /dev/null and umask 022, runs as ``python -m pitstop ...``, ``python
    SCRIPT`` or (a block, ``python -c``) a script of its code would, and ends as an interpreter
    exit does, but for tearing down every module. Every other command runs under ``bash``, with
    the venv's ``bin`` first on PATH. ``PITSTOP_DOC_TEST_NO_ZYGOTE=1`` runs everything as plain
    subprocesses instead (slow, the same results).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import zygote

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120
SHELL_LANGS = {"console", "sh", "shell", "bash"}
OUTPUT_LANGS = {"text", "console", "output"}
# Variables that would change how rich or a terminal lays out the output.
TERMINAL_VARS = {"COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"}

FRAGMENT = "fragment: "  # the start of a fragment's skip reason
_FENCE = re.compile(r"^```\s*([\w+-]*)[^`]*$")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(\w+)\s*(.*?)\s*-->$")


# --- the pages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence
    lang: str
    text: str
    markers: dict[str, str]


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, with the doc-test markers just before each."""
    blocks: list[Block] = []
    lines = text.splitlines()
    markers: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        fence = _FENCE.match(lines[i])
        marker = _MARKER.match(line)
        if marker:
            markers[marker.group(1)] = marker.group(2).strip("() ")
        elif fence:
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            assert j < len(lines), f"unclosed code block at line {i + 1}"
            body = "\n".join(lines[i + 1 : j]) + "\n"
            blocks.append(Block(i + 1, j + 1, fence.group(1).lower(), body, markers))
            markers = {}
            i = j
        elif line:
            markers = {}  # a marker belongs to the block right after it
        i += 1
    return blocks


@dataclass(frozen=True)
class Command:
    command: str
    expected: list[str]


@dataclass(frozen=True)
class Step:
    """One thing a page's run does, in page order."""

    kind: str  # "python", "shell", "file", "prelude"
    page: str
    line: int
    text: str = ""  # python code, a file's contents
    expected: list[str] = field(default_factory=list)  # python: the claimed output
    commands: list[Command] = field(default_factory=list)  # shell
    name: str = ""  # file: its name
    skip: str | None = None
    compare: bool = True  # python: whether its output is compared with ``expected``

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def parse_commands(text: str) -> list[Command]:
    commands: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            assert commands, f"output before the first command: {line!r}"
            commands[-1].expected.append(line)
            i += 1
            continue
        command = line[2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1].rstrip() + " " + lines[i].strip()
        commands.append(Command(command, []))
        i += 1
    return commands


def page_steps(path: Path) -> list[Step]:
    """A page's steps, in page order; raises on a marker that applies to nothing."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = parse_blocks("\n".join(lines))
    steps: list[Step] = []
    used: set[int] = set()
    for index, block in enumerate(blocks):
        if index in used:
            continue
        where = f"{page}:{block.line}"
        skip = block.markers.get("skip")
        fragment = block.markers.get("fragment")
        if skip == "" or fragment == "":
            raise AssertionError(f"{where}: a skip or fragment marker needs its reason")
        if fragment is not None and block.lang != "python":
            raise AssertionError(f"{where}: only a python block can be a fragment")
        if fragment is not None:
            skip = f"{FRAGMENT}{fragment}"
        step = None
        if "file" in block.markers:
            step = Step("file", page, block.line, text=block.text, name=block.markers["file"])
        elif block.lang == "python" and "prelude" in block.markers:
            step = Step("prelude", page, block.line, text=block.text)
        elif block.lang == "python":
            output = blocks[index + 1] if index + 1 < len(blocks) else None
            between = lines[block.end : output.line - 1] if output is not None else []
            if (
                output is not None
                and output.lang in OUTPUT_LANGS
                and not any(s.strip() for s in between)
            ):
                if fragment is not None:
                    raise AssertionError(f"{where}: a block that shows its output is no fragment")
                used.add(index + 1)
                expected = output.text.splitlines()
                step = Step("python", page, block.line, block.text, expected, skip=skip)
            else:
                step = Step("python", page, block.line, block.text, skip=skip, compare=False)
        elif block.lang in SHELL_LANGS and any(s.startswith("$ ") for s in block.text.splitlines()):
            commands = parse_commands(block.text)
            step = Step("shell", page, block.line, commands=commands, skip=skip)
        if step is None and block.markers:
            raise AssertionError(f"{where}: {block.markers} on a block that is not run")
        if step is not None and step.kind in ("file", "prelude") and skip is not None:
            raise AssertionError(f"{where}: a {step.kind} block cannot be skipped")
        if step is not None:
            steps.append(step)
    return steps


STEPS = {path.relative_to(ROOT).as_posix(): page_steps(path) for path in PAGES}
ITEMS = [step for steps in STEPS.values() for step in steps if step.kind in ("python", "shell")]


# --- matching -------------------------------------------------------------------------------


def _normalise(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_pattern(line: str) -> re.Pattern[str]:
    """``line`` as a regex: ``...`` matches any text; the spaces before it are optional, so that
    a wildcard can keep a table's columns aligned (``│  ... KiB │`` matches ``│ 21.8 KiB │``)."""
    *heads, tail = line.split("...")
    return re.compile(
        "".join(re.escape(head.rstrip(" ")) + ".*" for head in heads) + re.escape(tail)
    )


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` is what ``expected`` shows, with its ``...`` wildcards."""
    want, got = _normalise(expected), _normalise(actual)
    patterns = [None if line.strip() == "..." else _line_pattern(line) for line in want]

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        pattern = patterns[i]
        if pattern is None:  # any number of lines
            return match(i + 1, j) or (j < len(got) and match(i, j + 1))
        return j < len(got) and pattern.fullmatch(got[j]) is not None and match(i + 1, j + 1)

    return match(0, 0)


# --- running things -------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TERMINAL_VARS}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave as written
    env["PYTHONIOENCODING"] = "utf-8"
    env["OMP_NUM_THREADS"] = "1"  # as the zygote's: a job's output does not depend on it
    return env


class Runner:
    """Runs jobs (a pitstop command, a python script or code) in processes of their own."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.count = 0
        self.fork = os.environ.get("PITSTOP_DOC_TEST_NO_ZYGOTE") != "1"

    def run(
        self, kind: str, argv: list[str], cwd: Path, *, code: str = ""
    ) -> tuple[int | None, str, str]:
        """Run a job; return its exit status (None: timed out), stdout and stderr.

        ``kind`` "cli": ``pitstop`` with ``argv``; "script": ``python *argv``; "code": ``code``
        with ``sys.argv = argv``; "bash": ``argv[0]`` under bash, stderr into stdout.
        """
        self.count += 1
        out = self.scratch / f"{self.count}.out"
        err = out if kind in ("cli", "bash") else self.scratch / f"{self.count}.err"
        if kind == "bash":
            command = ["bash", "-c", f"umask 022\n{argv[0]}"]
        elif kind == "cli":
            command = [sys.executable, "-m", "pitstop", *argv[1:]]
        elif kind == "script":
            command = [sys.executable, *argv]
        else:
            script = self.scratch / f"{self.count}.py"
            script.write_text(code, encoding="utf-8")
            command = [sys.executable, str(script), *argv[1:]]
        rc = self._process(command, cwd, out, err, forked=self.fork and kind != "bash")
        text_err = err.read_text(encoding="utf-8") if err != out else ""
        return rc, out.read_text(encoding="utf-8"), text_err

    def _process(
        self, command: list[str], cwd: Path, out: Path, err: Path, *, forked: bool
    ) -> int | None:
        """``command`` to its end (``None`` past ``TIMEOUT_S``); then it and whatever it
        started are killed. Forked from the tests' zygote where it can be."""
        with contextlib.ExitStack() as files:
            stdout = files.enter_context(out.open("wb"))
            stderr = stdout if err == out else files.enter_context(err.open("wb"))
            process: subprocess.Popen[bytes] | zygote.ZygoteProcess | None = None
            if forked:
                fds = (stdout.fileno(), stderr.fileno())
                process = zygote.spawn(command[1:], _env(), cwd, fds=fds, umask=0o022)
            if process is None:
                process = subprocess.Popen(
                    command,
                    cwd=cwd,
                    env=_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stdout if err == out else stderr,
                    start_new_session=True,
                )
            try:
                return process.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # it and whatever it started
                process.wait(timeout=TIMEOUT_S)


_SHELL_SYNTAX = re.compile(r"[$`*?\[\]{}~();<>|&=]")
_QUOTED = re.compile(r"""'[^']*'|"(?:[^"\\]|\\.)*\"""")


def command_job(command: str) -> tuple[str, list[str], str]:
    """How to run one shell command: (kind, argv, code) for :meth:`Runner.run`."""
    words = shlex.split(command, comments=True)
    plain = not _SHELL_SYNTAX.search(_QUOTED.sub("", command).split(" #")[0])
    if plain and words and words[0] == "pitstop":
        return "cli", words, ""
    if plain and len(words) >= 3 and words[:2] == ["python", "-c"]:
        return "code", ["-c", *words[3:]], words[2]
    if plain and len(words) >= 2 and words[0] == "python" and not words[1].startswith("-"):
        return "script", words[1:], ""
    return "bash", [command], ""


@dataclass
class CommandResult:
    command: str
    expected: list[str]
    output: str
    rc: int | None


class PageRun:
    """A page's steps, run once and in order, in the page's own directory."""

    def __init__(self, page: str, directory: Path, runner: Runner) -> None:
        self.page = page
        self.directory = directory
        self.runner = runner
        self.steps = STEPS[page]
        self.done = 0
        self.preludes: list[str] = []
        self.results: dict[int, Any] = {}
        shutil.copytree(ROOT / "configs", directory / "configs")

    def result(self, step: Step) -> Any:
        index = self.steps.index(step)
        while self.done <= index:
            self.results[self.done] = self._run(self.steps[self.done])
            self.done += 1
        return self.results[index]

    def _run(self, step: Step) -> Any:
        if step.skip is not None:
            return None
        if step.kind == "file":
            (self.directory / step.name).write_text(step.text, encoding="utf-8")
            return None
        if step.kind == "prelude":
            self.preludes.append(step.text)
            return None
        if step.kind == "python":
            code = "".join(self.preludes) + step.text
            # Line numbers in a traceback: those of the code as run, preludes first.
            return self.runner.run("code", [step.id], self.directory, code=code)
        results = []
        previous: int | None = 0
        for command in step.commands:
            if command.command.strip() == "echo $?":
                results.append(CommandResult(command.command, command.expected, f"{previous}", 0))
                continue
            kind, argv, code = command_job(command.command)
            previous, output, _ = self.runner.run(kind, argv, self.directory, code=code)
            results.append(CommandResult(command.command, command.expected, output, previous))
        return results


@pytest.fixture(scope="module")
def page_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    runner = Runner(tmp_path_factory.mktemp("doc-test-jobs"))
    runs: dict[str, PageRun] = {}

    def get(page: str) -> PageRun:
        if page not in runs:
            name = re.sub(r"\W", "-", page)
            runs[page] = PageRun(page, tmp_path_factory.mktemp(name), runner)
        return runs[page]

    return get


def _show(lines: list[str] | str) -> str:
    text = lines if isinstance(lines, str) else "\n".join(lines)
    return (
        "\n".join(f"    | {line}" for line in text.rstrip("\n").splitlines()) or "    | (nothing)"
    )


# --- the torch the outputs were recorded with --------------------------------------------

# What the torch that the pages' outputs were recorded with (2.13) gives for numerics_probe():
# losses and metrics follow its CPU dropout stream, exported sizes its torch.save layout.
RECORDED_NUMERICS = (31, 1577)


@functools.cache
def numerics_probe() -> tuple[int, int]:
    """This torch's CPU dropout draws (kept of 64 at p=0.5, seed 0) and torch.save's size of
    one small tensor: what a page's losses, metrics and exported sizes depend on."""
    import io

    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        kept = int(torch.nn.functional.dropout(torch.ones(64), 0.5).count_nonzero())
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buffer)
    return kept, len(buffer.getvalue())


def skip_if_recorded_with_other_numerics(step: Step) -> None:
    """A block's output that differs on a torch whose dropout stream or torch.save layout is
    not the recording torch's (an older torch the package supports) is skipped, saying so."""
    import torch

    if numerics_probe() != RECORDED_NUMERICS:
        pytest.skip(
            f"{step.id}: its output was recorded on a torch whose CPU dropout stream and "
            f"torch.save layout give {RECORDED_NUMERICS}; torch {torch.__version__} gives "
            f"{numerics_probe()} (numbers and sizes differ)"
        )


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("step", ITEMS, ids=[step.id for step in ITEMS])
def test_doc_block_prints_what_the_doc_shows(step: Step, page_run: Any) -> None:
    if step.skip is not None:
        pytest.skip(step.skip)
    started = time.monotonic()
    result = page_run(step.page).result(step)
    if step.kind == "python":
        rc, out, err = result
        assert rc is not None, f"{step.id}: still running after {TIMEOUT_S} s; killed"
        assert rc == 0, f"{step.id}: exited with status {rc}\n{_show(out)}\n{_show(err)}"
        if not step.compare:
            return
        if not output_matches(step.expected, out.splitlines()):
            skip_if_recorded_with_other_numerics(step)
            pytest.fail(
                f"{step.id}: the block prints\n{_show(out)}\nbut the doc shows\n"
                f"{_show(step.expected)}\n(stderr)\n{_show(err)}",
                pytrace=False,
            )
        return
    problems = []
    for i, command in enumerate(result):
        if command.rc is None:
            problems.append(f"$ {command.command}\n    still running after {TIMEOUT_S} s; killed")
            continue
        if not output_matches(command.expected, command.output.splitlines()):
            problems.append(
                f"$ {command.command}\n  prints\n{_show(command.output)}\n  but the doc shows\n"
                f"{_show(command.expected)}"
            )
        following = result[i + 1].command.strip() if i + 1 < len(result) else ""
        if command.rc != 0 and following != "echo $?":
            problems.append(
                f"$ {command.command}\n  exits with status {command.rc}, and the doc shows no "
                f"`$ echo $?` after it\n{_show(command.output)}"
            )
    if problems and all(" but the doc shows" in p for p in problems):
        skip_if_recorded_with_other_numerics(step)
    assert not problems, f"{step.id} (ran {time.monotonic() - started:.1f} s):\n" + "\n".join(
        problems
    )


def test_every_page_is_searched_and_blocks_are_found() -> None:
    assert "README.md" in STEPS
    assert "docs/cli.md" in STEPS
    assert len(ITEMS) >= 10, [step.id for step in ITEMS]


def test_every_python_block_runs_or_is_a_fragment() -> None:
    """No python block is left out: each one runs, or says why it is not a whole program."""
    runs = {(step.page, step.line) for step in ITEMS}
    left_out = [
        f"{path.relative_to(ROOT).as_posix()}:{block.line}"
        for path in PAGES
        for block in parse_blocks(path.read_text(encoding="utf-8"))
        if block.lang == "python"
        and not {"file", "prelude"} & set(block.markers)
        and (path.relative_to(ROOT).as_posix(), block.line) not in runs
    ]
    assert not left_out, left_out


def test_shell_examples_are_tagged() -> None:
    """A block showing ``$ `` commands must be a console block, so that it is run (or skipped)."""
    untagged = [
        f"{path.relative_to(ROOT).as_posix()}:{block.line}"
        for path in PAGES
        for block in parse_blocks(path.read_text(encoding="utf-8"))
        if block.lang not in SHELL_LANGS
        and "file" not in block.markers
        and any(line.startswith("$ ") for line in block.text.splitlines())
    ]
    assert not untagged, f"tag these blocks ```console: {untagged}"


def test_markers_are_known() -> None:
    """A misspelt marker would silently not apply."""
    bad = []
    for path in PAGES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if "doc-test" in line:
                marker = _MARKER.match(line.strip())
                if not marker or marker.group(1) not in ("skip", "fragment", "prelude", "file"):
                    bad.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}")
    assert not bad, bad


def test_the_demo_output_is_the_same_on_both_pages() -> None:
    """Both pages show one `pitstop demo` output (it is skipped above: see its marker)."""

    def demo(page: str) -> list[str]:
        shells = [s for s in STEPS[page] if s.kind == "shell"]
        return next(c.expected for s in shells for c in s.commands if c.command == "pitstop demo")

    assert demo("docs/cli.md") == demo("docs/getting-started.md")


@pytest.mark.parametrize(
    ("expected", "actual", "matches"),
    [
        (["a", "b"], ["a", "b  ", ""], True),
        (["at 0x..."], ["at 0x7f3a"], True),
        (["at 0x..."], ["at 1x7f3a"], False),
        (["a (1.2)"], ["a (132)"], False),  # the rest of the line is literal
        (["│  ... KiB │"], ["│ 21.8 KiB │"], True),
        (["│  ... KiB │"], ["│ 21.8 KiB  │"], False),
        (["a", "...", "z"], ["a", "z"], True),
        (["a", "...", "z"], ["a", "b", "c", "z"], True),
        (["a", "...", "z"], ["a", "b", "c"], False),
        (["a"], ["a", "b"], False),
        (["took ... s"], ["took 1.0 s", "extra"], False),
    ],
)
def test_wildcard_matching(expected: list[str], actual: list[str], matches: bool) -> None:
    assert output_matches(expected, actual) is matches
