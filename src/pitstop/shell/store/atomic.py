# Writing one file atomically and durably, wherever it goes.
#
# Rules: every file pitstop writes appears by the one publish sequence
# (pitstop.shell.store.publish): an exclusive temp file beside the target → write → fsync → close →
# rename over the target → fsync the directory. Until the rename, what was at the path stays as it
# was; after the call, the new file and its name are on disk. Any failure raises SaveError naming
# the path asked for (not the temp file) and leaves no temp file behind; a failure after the rename
# over an old file keeps the new one (the old one is gone). Files are created 0o666 less the umask,
# like any file the user creates. The writer gets a buffered file that writes every byte it is given
# (a raw write may write fewer, and torch.save does not check).
# How: a LocalStorage on the target's directory and publish_file; the checkpoint directory uses
# publish_file on its own Storage directly, so both follow the same steps.

"""write_atomically: one durable, atomic file write for exports and the trainer's files."""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

from pitstop.core.naming import temp_name
from pitstop.errors import SaveError
from pitstop.shell.store.publish import publish_file
from pitstop.shell.store.storage import LocalStorage

__all__ = ["write_atomically"]

_USER_FILE_MODE = 0o666  # less the umask, as open() creates files (mkstemp would make 0o600)


def write_atomically(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    *,
    check: Callable[[Path], object] | None = None,
    opened: Callable[[Path], object] | None = None,
) -> Path:
    """Make ``path`` hold what ``write(file)`` writes, atomically and durably; return the path.

    ``write`` gets a binary file (buffered, seekable) positioned at its start; it need not
    flush or close it. ``check``, if given, is called with the temp file's path once every
    byte is written, before the file is made durable and published: what it raises is a
    failed write (nothing is published). The parent directory is created if needed. Raises
    :class:`~pitstop.errors.SaveError` naming ``path`` when any step fails; then ``path`` is
    as it was and no temp file is left — unless only the directory fsync after the new file
    replaced an old one failed: the old one is gone, so ``path`` keeps the new one (complete,
    fsynced) and the message says so. ``opened``, if given, is called with the temp file's
    path before ``write`` (a writer that reads back what it wrote).
    """
    target = Path(path)
    if target.name in {"", ".", ".."}:
        raise SaveError(f"cannot write {target}: it does not name a file")
    storage = LocalStorage(target.parent, mode=_USER_FILE_MODE)
    token = secrets.token_hex(6)

    def put(file: BinaryIO, _sync: Callable[[], None]) -> None:
        buffered = io.BufferedWriter(cast(io.RawIOBase, file))
        try:
            if opened is not None:
                opened(storage.path(temp_name(target.name, token)))
            write(cast(BinaryIO, buffered))
            buffered.flush()
            if check is not None:
                check(storage.path(temp_name(target.name, token)))
        except BaseException:
            file.close()  # the temp file is abandoned: drop what is still buffered, and
            buffered.close()  # this is a no-op now, so nothing flushes it later either
            raise
        buffered.detach()  # the descriptor stays open: publish_file fsyncs and closes it

    publish_file(storage, target.name, token, put)
    return target
