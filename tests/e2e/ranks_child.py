"""One rank of tests/e2e/test_ranks.py: pitstop's collectives with values of every size.

Each rank all-gathers (with the default box and with ``PART_BOX``) and broadcasts values from
empty to far past each box (``pitstop.shell.distributed``), the ranks' sizes differing, and
checks what it got; it prints ``ok <n>`` (n: the values checked) and exits 0, or raises.
"""

from __future__ import annotations

import datetime
import functools
import os

import torch.distributed as dist

from pitstop.shell.distributed import BROADCAST_BOX, GATHER_BOX, PART_BOX, Ranks

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ranks = Ranks.current(timeout_s=60)
edges = sorted({b + d for b in (GATHER_BOX, BROADCAST_BOX, PART_BOX) for d in (-64, 0, 1)})
sizes = (0, 1, *edges, 1 << 20)


@functools.cache
def value(r: int, size: int) -> tuple[int, bytes]:
    return r, bytes((r * 7 + i) % 251 for i in range(size))


checked = 0
for size in sizes:
    for other in sizes:  # rank 0 sends ``size`` bytes, every other rank ``other``
        mine = value(rank, size if rank == 0 else other)
        expected = [value(r, size if r == 0 else other) for r in range(world)]
        assert ranks.all_gather(mine) == expected, (size, other)
        assert ranks.all_gather(mine, box=PART_BOX) == expected, (size, other)
        assert ranks.broadcast(mine if rank == 0 else None) == value(0, size), size
        checked += 3
print(f"ok {checked}", flush=True)
dist.destroy_process_group()
