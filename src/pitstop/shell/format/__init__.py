"""The .pitstop file: write, read, blobs, checksums, the tree codec, the untrusted opener.

Rules: one checkpoint file at a time, given an open file or a path; what the bytes mean is
:mod:`pitstop.core.file.manifest`'s and :mod:`pitstop.core.file.layout`'s. Also here: what a
checkpoint tree may hold (``treewalk``) and what a decoded one may (``treecheck``), write-behind,
host and
device memory for reads, and the byte-progress events of long reads and writes. This room
imports only the core, the errors and itself: it knows no directory or storage (``store``), no
live training state (``state``), no ranks (``ranks``) and no DCP (``sharded``). Importing it,
reading a manifest and verifying a file import no torch: only building tensors (and writing
them) does.
"""
