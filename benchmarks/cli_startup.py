"""How long the read-only CLI takes to start: ``pitstop ls DIR`` against ``pitstop --help``.

It writes a small checkpoint directory (two saves of a tiny model) once, then runs each
command as a fresh process ``--repeats`` times, alternating, and prints the median wall time
of each and their ratio, and whether ``ls`` imported torch (``-X importtime``).

Usage::

    .venv/bin/python benchmarks/cli_startup.py [--repeats 7] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {"--help": ["--help"], "ls DIR": ["ls", "{dir}"]}


def make_directory(root: Path) -> Path:
    code = (
        "import sys, torch, pitstop\n"
        "model = torch.nn.Linear(4, 1)\n"
        "with pitstop.Checkpointer(sys.argv[1], model=model) as ckpt:\n"
        "    ckpt.save(pitstop.Progress(step=1))\n"
        "    ckpt.save(pitstop.Progress(step=2))\n"
    )
    directory = root / "checkpoints"
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, timeout=300)
    return directory


def time_command(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pitstop", *argv], check=True, capture_output=True, timeout=300
    )
    return time.perf_counter() - started


def imports_torch(argv: list[str]) -> bool:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pitstop", *argv],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return any(re.search(r"\|\s+torch$", line) for line in result.stderr.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        directory = make_directory(Path(scratch))
        commands = {
            name: [a.format(dir=directory) for a in command] for name, command in COMMANDS.items()
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():  # alternating: the same machine load
                times[name].append(time_command(command))
        medians = {name: statistics.median(values) for name, values in times.items()}
        torch_in_ls = imports_torch(commands["ls DIR"])
    for name, median in medians.items():
        print(f"pitstop {name:<8} median {median:.3f} s over {args.repeats} runs")
    ratio = medians["ls DIR"] / medians["--help"]
    print(f"ls / --help: {ratio:.2f}x; ls imports torch: {'yes' if torch_in_ls else 'no'}")
    if args.json is not None:
        record = {"medians_s": medians, "ratio": ratio, "ls_imports_torch": torch_in_ls}
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
