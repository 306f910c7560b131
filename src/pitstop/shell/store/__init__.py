"""Where checkpoints live: the Storage protocol and the local checkpoint directory.

Rules: every step that changes a checkpoint directory is one call of a
:class:`~pitstop.shell.store.storage.Storage` (so a fault-injecting one can fail any of them):
publish (temp name, fsync, rename, directory fsync), pointers, retention's deletions, the
directory lock, the scan, the choice of a checkpoint to resume from (``resolve``), and sharded
checkpoint directories as directories (``sharddir``: file tables, manifest, publish, delete).
It uses the core, the errors and :mod:`pitstop.shell.format` (to read manifests and verify
files), nothing else of the shell: no live torch state (``state``), no ranks (``ranks``), no
DCP (``sharded``). A second backend (an object store) is one new module here.
"""
