"""Live torch state: capture, restore, staging, unwrapping, fresh optimizers.

Rules: what a checkpoint holds of the live run — the model (unwrapped from DDP /
torch.compile), its EMA, components with state_dict(), RNG streams — captured as a tree
without copies (``capture``), copied into reusable host buffers (``staging``), and restored
all-or-nothing (``restore``). No decisions: the core's checks say what is compatible. It uses
the core, the errors, :mod:`pitstop.shell.format` (what a tree may hold) and the public
:mod:`pitstop.shell.sampler` and :mod:`pitstop.shell.data` (which loaders are per rank);
never a directory (``store``), ranks (``ranks``) or DCP (``sharded``).
"""
