"""pitstop's imperative shell: torch state, files, the background writer, signals.

It asks :mod:`pitstop.core` what to do and does exactly that.

Rules: the shell is rooms with one-way doors, each a sub-package with one job, and the
Checkpointer's drivers here that use them (``pyproject.toml``'s import-linter contracts enforce
the doors, and ``make test`` runs them)::

    manager, savecall, saving, carryout, resuming, resumeread, registration, lifetime,
    session, shardsave       the Checkpointer and its per-call drivers: may use every room
    portable/                weights and checkpoints in and out (load_weights, export_weights,
                             import_checkpoint, load, info)
    checkpoint               the public Checkpoint record and the calls' argument checks
    sharded/                 DTensor / FSDP2 state through torch.distributed.checkpoint
    stop                     the public StopRequest, its answer agreed between ranks (beside
                             sharded/: neither uses the other)
    ranks/  state/  store/   agreement between ranks; live torch state; where checkpoints live
                             (none of the three uses another)
    format/                  the .pitstop file
    sampler                  the public ResumableSampler: uses no other module
    data/                    the public WorkerRNG; which components are StatefulDataLoaders
                             (beside sampler: neither uses the other)

A room uses only the rooms below it, never a driver; nothing here imports the CLI or the
trainer. The public modules stay where users import them from (``pitstop.shell.sampler``,
``pitstop.shell.stop``, ``pitstop.shell.checkpoint``).
"""
