"""Agreement between ranks: rank 0 decides and writes; every rank hears the same answer.

Rules: :class:`~pitstop.shell.ranks.distributed.Ranks` carries out :mod:`pitstop.core.ranks`'s
rounds over torch.distributed (one process: no collective at all), on the named, bounded
collectives of :class:`~pitstop.shell.ranks.collectives.Collectives`; ``outcomes`` raises an
error on one rank as the same error on every rank, ``roundfailure`` names a collective that
did not complete, ``boxes`` carries a value in a collective's fixed-size box (``valuecodec``
encodes it: msgpack, a closed set of types, never a pickle), and ``packing``
turns a state tree into bytes for another rank and back. It uses the core, the errors and
:mod:`pitstop.shell.format` (the tree codec); never live state (``state``), a directory
(``store``) or DCP (``sharded``).
"""
