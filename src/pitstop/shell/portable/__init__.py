"""Weights and checkpoints in and out: load_weights, export_weights, import_checkpoint, load, info.

Rules: what leaves a checkpoint (its weights as a plain state dict, a ``.pt`` or
``.safetensors`` file; its whole tree; what its manifest says) and what comes in from other
tools (a torch.save, Lightning or Accelerate checkpoint, read without unpickling). Each call
stands alone: it resolves its checkpoint argument through ``store`` and reads through
``format`` (a sharded one through ``sharded``). It may use every room and the public
:class:`~pitstop.shell.checkpoint.Checkpoint` record, never a driver of the Checkpointer.
"""
