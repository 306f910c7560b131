"""Each rank's lines, rebuilt from one stream of torchrun's ``--tee`` output.

torchrun tees a worker's output by redirecting it to a log file and tailing that file: a
thread per rank loops on ``readline()`` and writes ``[default<rank>]:`` plus what it read to
torchrun's own stdout (or stderr), sleeping 0.1 s whenever it reaches the end of the file
(``torch.distributed.elastic.multiprocessing.tail_log.tail_logfile``). A line that is in the
file only in part when the tailer looks — under ``PYTHONUNBUFFERED=1`` every ``print()`` is
two ``write()`` calls, the text and then ``"\\n"``; a loaded machine preempts a worker between
the two — is forwarded in parts, each with the prefix, and only the last with the newline::

    [default1]:ready 4242 4243[default0]:ready 4240 4241\\n    (one line of torchrun's output)
    [default1]:\\n

Read line by line, that is one line for rank 1 that is not the line it printed (and rank 0's
line swallowed into it), then an empty one. :class:`TeeJoiner` splits each line of the
stream at every prefix instead, keeps a rank's parts that ended without a newline, and
returns the rank's line once its newline comes. Text without a prefix is torchrun's own.
Limit: a rank that prints a literal ``[default<its rank or another>]:`` is split there.
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["PREFIX", "TeeJoiner"]

PREFIX = re.compile(r"\[default(\d+)\]:")
"""torchrun's ``--tee`` prefix of a rank's output (the role ``default``, the local rank)."""


class TeeJoiner:
    """Turns the lines of one torchrun ``--tee`` stream into ``(key, line)`` pairs.

    ``key`` is a rank from ``ranks``, or ``launcher`` for torchrun's own lines. One joiner per
    stream: torchrun's stdout and stderr each carry every rank's parts, and a part on one
    never continues a line on the other.
    """

    def __init__(self, ranks: Collection[int], launcher: int) -> None:
        self._ranks = frozenset(ranks)
        self._launcher = launcher
        self._parts: dict[int, list[str]] = {}  # rank -> the parts of its unfinished line

    def _prefix_at(self, line: str, pos: int) -> re.Match[str] | None:
        match = PREFIX.match(line, pos)
        return match if match and int(match.group(1)) in self._ranks else None

    def _next_prefix(self, line: str, pos: int) -> int:
        for match in PREFIX.finditer(line, pos):
            if int(match.group(1)) in self._ranks:
                return match.start()
        return len(line)

    def feed(self, line: str) -> list[tuple[int, str]]:
        """The lines that one line of the stream (without its newline) completes."""
        done: list[tuple[int, str]] = []
        pos = 0
        while True:
            match = self._prefix_at(line, pos)
            if match is None:  # torchrun's own (a write of its own ends with a newline)
                done.append((self._launcher, line[pos:]))
                return done
            rank = int(match.group(1))
            end = self._next_prefix(line, match.end())
            part = line[match.end() : end]
            if end == len(line):  # the part that carried the newline: the line is complete
                done.append((rank, "".join([*self._parts.pop(rank, []), part])))
                return done
            self._parts.setdefault(rank, []).append(part)  # forwarded without its newline
            pos = end

    def close(self) -> list[tuple[int, str]]:
        """The unfinished lines, once the stream has ended (output that ended mid-line)."""
        done = [(rank, "".join(parts)) for rank, parts in sorted(self._parts.items())]
        self._parts.clear()
        return done
