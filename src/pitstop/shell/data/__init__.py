"""Data loading state: DataLoader workers' random state, and which loaders a checkpoint keeps.

Rules: ``WorkerRNG`` wraps a dataset so that the state torchdata's ``StatefulDataLoader``
snapshots inside each worker carries that worker's Python, NumPy and torch random state, and
restores it inside the worker; in the main process (``num_workers=0``) it carries none, since
the checkpoint's own RNG streams are restored there. ``loaders`` tells the live state which
components are ``StatefulDataLoader``s (per-rank state, like every ``ResumableSampler``)
without importing torchdata, an optional extra, and keeps a plain ``DataLoader`` component as
a ``PlainLoader`` whose resume warns that its data is not restored; ``stateless_stream`` names
a ``WorkerRNG`` stream without state (refused on a strict resume). This room imports only
torch, the core and the errors; the rooms above (``state``) use it.
"""
