"""``pitstop`` with a pause before one micro-batch, so a test can signal it at an exact place.

    python pausing_pitstop.py N train --config ... --output-dir ...

Runs the real command line (``pitstop.cli.main``) in this process. Before the forward pass of
micro-batch N (1-based, counted in this process) it prints ``paused at micro N`` and serves
stdin, one command a line: ``check`` answers ``stop requested: True|False``; ``go`` trains on.
A signal sent while it is paused is therefore handled inside that accumulation window, and no
test has to sleep or guess: it reads lines and writes lines.
"""

from __future__ import annotations

import sys
from typing import Any

from pitstop.cli import main
from pitstop.train import trainer as trainer_module


def install(pause_at: int) -> None:
    original = trainer_module.Trainer._micro_step
    seen = 0

    def micro_step(self: trainer_module.Trainer, batch: Any, accumulate: int) -> Any:
        nonlocal seen
        seen += 1
        if seen == pause_at:
            print(f"paused at micro {seen}", flush=True)
            while True:
                command = sys.stdin.readline()
                if not command:
                    raise SystemExit("pausing_pitstop: stdin closed while paused")
                if command.strip() == "check":
                    print(f"stop requested: {bool(self.stop)}", flush=True)
                elif command.strip() == "go":
                    break
        return original(self, batch, accumulate)

    trainer_module.Trainer._micro_step = micro_step  # type: ignore[method-assign]


if __name__ == "__main__":
    install(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
