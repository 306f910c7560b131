# Where a Checkpointer writes: a local directory, or a prefix of an object store.
#
# Rules: a location given as ``s3://bucket/prefix`` is an ObjectStorage under its lease; anything
# else is a local directory (its own Storage, or the one the caller passes) under the flock of
# pitstop.shell.store.lock. An ``s3://`` location takes no other Storage (its sharded
# checkpoints: pitstop.shell.store.shardobjects); without the S3 client it is one ConfigError
# naming the extra;
# ``storage_options`` go to the S3 client and nowhere else. A local directory with ``remote=``
# (an ``s3://`` URL) is a TieredDirectory: local publish first, upload in the background, the
# remote tier's own retention (``remote_policy``, by default the local one's), for a file or a
# sharded checkpoint alike; a remote tier is not itself a remote location.
# How: builds the CheckpointDirectory; nothing is touched until its open().

"""Opening a checkpoint location: a local directory or ``s3://bucket/prefix``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from pitstop.core.records import Policy
from pitstop.core.s3.objects import is_object_url
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
    tier: tuple[object, object] = (None, None),
) -> CheckpointDirectory:
    """The CheckpointDirectory of ``directory``, not yet opened (``protect``: refuse to save
    over the checkpoints found until a resume; ``tier``: ``(remote, remote_policy)``, the
    ``s3://`` URL of a remote tier and its retention).

    Raises :class:`~pitstop.errors.ConfigError` for an ``s3://`` location with a ``storage``,
    or without the S3 client; for ``storage_options`` on a local one without
    a remote tier; and for a ``remote`` or ``remote_policy`` that is not what it must be.
    """
    remote, remote_policy = tier
    if remote is not None or remote_policy is not None:
        return _tiered(directory, policy, storage, storage_options, protect, remote, remote_policy)
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
    from pitstop.shell.store.lease import ObjectLease
    from pitstop.shell.store.objectstore import ObjectStorage

    objects = ObjectStorage(directory, storage_options=storage_options)
    objects.as_blobs = True  # its fetches are the resume's: loaded once, from obstore's buffers
    run_id = uuid.uuid4().hex[:12]
    return CheckpointDirectory(
        objects.cache,
        policy=policy,
        storage=objects,
        run_id=run_id,
        protect=protect,
        lock=ObjectLease(objects, run_id),
    )


def _tiered(
    directory: str | os.PathLike[str],
    policy: Policy,
    storage: Storage | None,
    storage_options: Mapping[str, Any] | None,
    protect: bool,
    remote: object,
    remote_policy: object,
) -> CheckpointDirectory:
    """A local directory with a remote tier at ``remote`` (checked here)."""
    where = f"Checkpointer({str(directory)!r}, remote={remote!r})"
    if not is_object_url(remote):
        raise ConfigError(
            f"{where}: remote must be an object-store URL, 's3://bucket/prefix' "
            f"(remote_policy= goes with it)"
        )
    assert isinstance(remote, str)
    if is_object_url(directory):
        raise ConfigError(f"{where}: the directory of a remote tier must be a local directory")
    if remote_policy is not None and not isinstance(remote_policy, Policy):
        raise ConfigError(
            f"{where}: remote_policy must be a pitstop.Policy (its keep_last and keep_every "
            f"retire the remote checkpoints), got {type(remote_policy).__name__}"
        )
    from pitstop.shell.store.tiers import TieredDirectory

    own = remote_policy if remote_policy is not None else policy
    return TieredDirectory(
        directory,
        remote_url=remote,
        remote_policy=attrs.evolve(own, best=policy.best),
        storage_options=storage_options,
        policy=policy,
        storage=storage,
        protect=protect,
    )
