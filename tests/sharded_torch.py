"""Imported first by a test module of sharded state (FSDP2, DTensor through DCP), as
``pytest.importorskip("sharded_torch", exc_type=ImportError)``: on a torch that lacks it the
module is skipped with the reason (the feature, the torch it needs, this torch, the APIs it
lacks) instead of failing to import DCP's staging or FSDP2. See also onerank.NEEDS_SHARDED."""

from __future__ import annotations

from onerank import SHARDED_MISSING, SHARDED_REASON

if SHARDED_MISSING:
    raise ImportError(SHARDED_REASON)
