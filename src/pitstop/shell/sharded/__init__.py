"""DTensor / FSDP2 state through torch.distributed.checkpoint (DCP).

Rules: the engine (``engine``: write, verify, plan and read DCP directories, gather for
export), its adapters (``dcpio``, ``dcpwrite``; ``rawread``, the resume's read), the state
dict DCP saves (``dcpstate``), staging for DCP's async_save (``shardstage``), the writer
(``shardwrite``), a background save settled on its writers (``handover``), the choice of a
checkpoint to resume (``choice``) and that choice across directories the ranks do not share
(``acrossnodes``). DCP is imported only when a run's state
is sharded: ``support`` (feature detection, and whether state is sharded) imports none of it,
and so must this ``__init__``. It uses the rooms below it — ``ranks``, ``state``, ``store``,
``format`` — and never a driver of the Checkpointer.
"""
