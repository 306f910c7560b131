# How a checkpoint's bytes go up to object storage: the part plan of its multipart upload.
#
# Rules: S3 takes at most MAX_PARTS parts in one multipart upload, each of MIN_PART to MAX_PART
# bytes (the last may be smaller), and objects of at most MAX_OBJECT bytes. A checkpoint file is
# streamed as it is written (its size unknown until its end): in parts of STREAM_PART, so one of
# up to STREAM_PART * MAX_PARTS bytes streams (larger: an error that says so, before a part past
# the limit is sent). A file whose size is known (already on disk: a remote tier's upload, a
# sharded checkpoint's files) goes in parts of at least STREAM_PART, as small as keeps it within
# MAX_PARTS, in whole MiB. At most CONCURRENCY parts are in flight at once, so the memory an
# upload holds is about CONCURRENCY parts. A stream keeps the first KEEP_HEAD bytes (a
# checkpoint's header) and its last writes, a part or more (its manifest and footer, each one
# write), for the commit to read the manifest from.
# How: pure arithmetic over sizes.

"""The part plan of an upload to object storage."""

from __future__ import annotations

from typing import Final

import attrs

from pitstop.core.file.framing import HEADER_SIZE

__all__ = [
    "CONCURRENCY",
    "KEEP_HEAD",
    "MAX_OBJECT",
    "MAX_PART",
    "MAX_PARTS",
    "MIN_PART",
    "STREAM_PART",
    "UploadPlan",
    "file_plan",
    "stream_plan",
]

MIB: Final = 1 << 20
MAX_PARTS: Final = 10_000
MIN_PART: Final = 5 * MIB
MAX_PART: Final = 5 << 30
MAX_OBJECT: Final = 5 << 40
STREAM_PART: Final = 8 * MIB
"""The part size of a streamed upload: a checkpoint file of up to about 78 GiB streams."""
CONCURRENCY: Final = 12
"""Parts in flight at once (obstore's own ``put`` sends as many)."""
KEEP_HEAD: Final = HEADER_SIZE
"""The bytes a stream keeps from its start: the file's header."""


@attrs.frozen
class UploadPlan:
    """Parts of ``part_size`` bytes, at most ``concurrency`` in flight at once."""

    part_size: int
    concurrency: int

    @property
    def largest(self) -> int:
        """The largest object this plan uploads (``MAX_PARTS`` parts)."""
        return min(MAX_OBJECT, self.part_size * MAX_PARTS)

    def parts(self, size: int) -> int:
        """How many parts an object of ``size`` bytes takes (one, for an empty one)."""
        return max(1, -(-size // self.part_size))


def stream_plan() -> UploadPlan:
    """The plan of a checkpoint file uploaded as it is written (its size not known yet)."""
    return UploadPlan(STREAM_PART, CONCURRENCY)


def file_plan(size: int) -> UploadPlan:
    """The plan of a file of ``size`` bytes: parts of at least ``STREAM_PART``, the smallest
    whole number of MiB that keeps it within ``MAX_PARTS``. ``ValueError`` for a size S3 does
    not take in one object (over ``MAX_OBJECT``, or negative)."""
    if not 0 <= size <= MAX_OBJECT:
        raise ValueError(f"an object holds 0 to {MAX_OBJECT} bytes, not {size}")
    needed = -(-size // MAX_PARTS)  # the smallest part that keeps it within MAX_PARTS
    return UploadPlan(max(STREAM_PART, -(-needed // MIB) * MIB), CONCURRENCY)
