# Where a Checkpointer writes: a local directory, or a prefix of an object store.
#
# Rules: a location given as ``s3://bucket/prefix`` is an ObjectStorage under its lease; anything
# else is a local directory (its own Storage, or the one the caller passes) under the flock of
# pitstop.shell.store.lock. An ``s3://`` location takes no other Storage, holds no sharded
# checkpoint (yet), and without the S3 client installed is one ConfigError naming the extra;
# ``storage_options`` go to the S3 client and nowhere else.
# How: builds the CheckpointDirectory; nothing is touched until its open().

"""Opening a checkpoint location: a local directory or ``s3://bucket/prefix``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from pitstop.core.objects import is_object_url
from pitstop.core.records import Policy
from pitstop.errors import ConfigError
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import Storage

__all__ = ["checkpoint_directory"]


def checkpoint_directory(
    directory: str | os.PathLike[str],
    policy: Policy,
    storage: Storage | None,
    storage_options: Mapping[str, Any] | None,
    protect: bool,
    sharded: bool,
) -> CheckpointDirectory:
    """The CheckpointDirectory of ``directory``, not yet opened (``protect``: refuse to save
    over the checkpoints found until a resume; ``sharded``: the run holds sharded state).

    Raises :class:`~pitstop.errors.ConfigError` for an ``s3://`` location with a ``storage``
    or sharded state, or without the S3 client; and for ``storage_options`` on a local one.
    """
    if not is_object_url(directory):
        if storage_options is not None:
            raise ConfigError(
                f"Checkpointer.storage_options configure an s3:// location's client; "
                f"{directory} is a local directory"
            )
        return CheckpointDirectory(directory, policy=policy, storage=storage, protect=protect)
    assert isinstance(directory, str)
    if storage is not None:
        raise ConfigError(f"Checkpointer({directory!r}): an s3:// location takes no storage=")
    if sharded:
        raise ConfigError(
            f"Checkpointer({directory!r}): sharded checkpoints (DTensor, FSDP2) are not "
            "stored on object storage yet; use a local directory"
        )
    from pitstop.shell.store.lease import ObjectLease
    from pitstop.shell.store.objectstore import ObjectStorage

    objects = ObjectStorage(directory, storage_options=storage_options)
    run_id = uuid.uuid4().hex[:12]
    return CheckpointDirectory(
        objects.cache,
        policy=policy,
        storage=objects,
        run_id=run_id,
        protect=protect,
        lock=ObjectLease(objects, run_id),
    )
