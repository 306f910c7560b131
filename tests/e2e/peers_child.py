"""One rank of tests/e2e/test_ranks.py's peer test: a copy sent from rank 0 to rank 1.

A copy of several chunks (and one that is a whole number of chunks, and an empty one)
arrives whole; a sender whose file ends early, and a receiver whose write fails, each raise
a SaveError on their own side while the other side ends too (no rank waits for a message
that never comes). Prints ``ok <n>`` and exits 0, or raises.
"""

from __future__ import annotations

import datetime
import io
import os
from collections.abc import Callable

import torch.distributed as dist

from pitstop.errors import SaveError
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.peers import receive, send

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ranks = Ranks.current(timeout_s=60)
CHUNK = 64
checked = 0


class Full(io.BytesIO):
    """A file whose writes fail once ``limit`` bytes are written (a full disk)."""

    limit = 100

    def write(self, data: object) -> int:
        if self.tell() >= self.limit:
            raise OSError(28, "No space left on device")
        return super().write(data)  # type: ignore[arg-type]


for size in (0, 1, CHUNK, 5 * CHUNK, 5 * CHUNK + 7):
    data = bytes((i * 31 + 7) % 256 for i in range(size))
    if rank == 0:
        send(ranks, 1, io.BytesIO(data), size, f"copy {size}", chunk=CHUNK)
    else:
        out = io.BytesIO()
        assert receive(ranks, 0, out, f"copy {size}", chunk=CHUNK) == size
        assert out.getvalue() == data, size
    checked += 1


def failure(work: Callable[[], object]) -> str:
    """The SaveError ``work()`` raises (an AssertionError if it raises none)."""
    try:
        work()
    except SaveError as exc:
        return str(exc)
    raise AssertionError(f"{work} raised no SaveError")


# The sender's file ends after 100 of the 300 bytes it announced: both sides raise.
if rank == 0:
    said = failure(lambda: send(ranks, 1, io.BytesIO(bytes(100)), 300, "short", chunk=CHUNK))
    assert "short ended at byte 100 of 300" in said, said
else:
    said = failure(lambda: receive(ranks, 0, io.BytesIO(), "short", chunk=CHUNK))
    assert "rank 0 could not send short" in said, said
checked += 1

# The receiver's disk fills up: it raises, and the sender still ends.
if rank == 0:
    send(ranks, 1, io.BytesIO(bytes(300)), 300, "full", chunk=CHUNK)
else:
    said = failure(lambda: receive(ranks, 0, Full(), "full", chunk=CHUNK))
    assert "No space" in said, said
checked += 1

dist.barrier()
print(f"ok {checked}", flush=True)
dist.destroy_process_group()
os._exit(0)
