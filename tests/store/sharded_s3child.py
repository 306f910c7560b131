"""tests/e2e/sharded_train.py with one fault more, for a sharded run on ``s3://``.

``--fail-upload-at N --fail-rank R``: rank R's upload of its shard objects of the step-N save
raises OSError (in DCP's write step, once its files are written); every other argument is
sharded_train.py's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))

import sharded_train

from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell import shardsave


def fail_upload(step: int, rank: int) -> None:
    real = shardsave.upload_shards

    def upload_shards(storage: Any, directory: Path, table: Any) -> None:
        if directory.name.endswith(sharded_name(step)):
            raise OSError(f"upload injected on rank {rank}")
        real(storage, directory, table)

    shardsave.upload_shards = upload_shards  # type: ignore[assignment]


def main() -> int:
    argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    if "--fail-upload-at" in argv:
        at = argv.index("--fail-upload-at")
        step = int(argv[at + 1])
        del argv[at : at + 2]
        failing = int(argv[argv.index("--fail-rank") + 1]) if "--fail-rank" in argv else 1
        if rank == failing:
            fail_upload(step, rank)
    return sharded_train.main(argv)


if __name__ == "__main__":
    sharded_train.exit_before_teardown(main())
