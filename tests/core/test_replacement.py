"""Settling a sharded publish that stopped part-way: never neither checkpoint, never a loss."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.replacement import Found, Holds, settle_replacement

founds = st.sampled_from(Found)


def _after(
    replacing: bool, temp: Found, aside: Found, final: Found
) -> tuple[dict[str, Found], Holds]:
    """What is under each name once the settlement is carried out (each step succeeds)."""
    plan = settle_replacement(replacing=replacing, temp=temp, aside=aside, final=final)
    disk = {"temp": temp, "aside": aside, "final": final}
    if plan.remove_temp:
        disk["temp"] = Found.MISSING
    if plan.remove_final:
        disk["final"] = Found.MISSING
    if plan.restore:
        assert disk["final"] is Found.MISSING  # a rename never lands on something
        disk["final"], disk["aside"] = disk["aside"], Found.MISSING
    if plan.remove_aside:
        disk["aside"] = Found.MISSING
    return disk, plan.holds


@given(st.booleans(), founds, founds, founds)
def test_a_settlement_never_loses_the_only_complete_checkpoint(
    replacing: bool, temp: Found, aside: Found, final: Found
) -> None:
    """Whatever is found under the three names (reachable or not): the temp directory goes;
    what could not be looked at stays; a complete checkpoint is removed only while one is under
    the real name (or it is a new one that replaced nothing); an old one is never left aside
    when the real name is free; and what the settlement says the real name holds is there."""
    plan = settle_replacement(replacing=replacing, temp=temp, aside=aside, final=final)
    disk, holds = _after(replacing, temp, aside, final)
    assert disk["temp"] is Found.MISSING
    if aside is Found.UNKNOWN:
        assert disk["aside"] is Found.UNKNOWN
    if final is Found.UNKNOWN:
        assert disk["final"] is Found.UNKNOWN
    if aside is Found.COMPLETE and disk["aside"] is Found.MISSING:
        assert disk["final"] is Found.COMPLETE
    if plan.remove_final:
        assert not replacing
        assert (temp, final) == (Found.MISSING, Found.COMPLETE)
    if replacing and Found.COMPLETE in (aside, final):  # the old one (or the new one) is whole
        assert disk["final"] is Found.COMPLETE or disk["aside"] is Found.COMPLETE
    if disk["aside"] is Found.COMPLETE:
        assert disk["final"] is not Found.MISSING  # it would have been put back
    if holds in (Holds.OLD, Holds.NEW):
        assert disk["final"] is Found.COMPLETE
    assert (holds is Holds.NOTHING) == (disk["final"] is Found.MISSING)


# The publish of a replacement, stopped after each of its steps (temp, aside, final).
REPLACEMENT = [
    ("manifest", (Found.INCOMPLETE, Found.MISSING, Found.COMPLETE), Holds.OLD),
    ("move aside", (Found.COMPLETE, Found.MISSING, Found.COMPLETE), Holds.OLD),
    ("rename", (Found.COMPLETE, Found.COMPLETE, Found.MISSING), Holds.OLD),
    ("parent fsync", (Found.MISSING, Found.COMPLETE, Found.COMPLETE), Holds.NEW),
    ("old one half removed", (Found.MISSING, Found.INCOMPLETE, Found.COMPLETE), Holds.NEW),
    ("old one removed", (Found.MISSING, Found.MISSING, Found.COMPLETE), Holds.NEW),
]
# The publish of a checkpoint whose step had none: the directory ends as it was.
FIRST = [
    ("manifest", (Found.INCOMPLETE, Found.MISSING, Found.MISSING)),
    ("rename", (Found.COMPLETE, Found.MISSING, Found.MISSING)),
    ("parent fsync", (Found.MISSING, Found.MISSING, Found.COMPLETE)),
]


@pytest.mark.parametrize(("step", "found", "holds"), REPLACEMENT, ids=[r[0] for r in REPLACEMENT])
def test_a_replacement_stopped_at_any_step_holds_the_old_checkpoint_or_the_new_one(
    step: str, found: tuple[Found, Found, Found], holds: Holds
) -> None:
    """Until the new one is renamed in, the old one stays (or is put back); from then on the
    new one stays and the old one goes. Nothing is left under a temp name."""
    temp, aside, final = found
    disk, said = _after(True, temp, aside, final)
    assert said is holds
    assert disk == {"temp": Found.MISSING, "aside": Found.MISSING, "final": Found.COMPLETE}


@pytest.mark.parametrize(("step", "found"), FIRST, ids=[r[0] for r in FIRST])
def test_a_first_publish_stopped_at_any_step_leaves_the_directory_as_it_was(
    step: str, found: tuple[Found, Found, Found]
) -> None:
    temp, aside, final = found
    disk, said = _after(False, temp, aside, final)
    assert said is Holds.NOTHING
    assert set(disk.values()) == {Found.MISSING}


@given(founds, founds)
def test_what_a_dead_writer_left_aside_goes_back_or_goes_only_once_replaced(
    aside: Found, final: Found
) -> None:
    """At open (the temp directory is a dead writer's, removed anyway): an old checkpoint
    aside goes back when its name is free, goes when a checkpoint is under its name, and
    otherwise stays; what is left of one half removed goes."""
    plan = settle_replacement(replacing=True, temp=Found.MISSING, aside=aside, final=final)
    assert plan.restore == (aside is Found.COMPLETE and final is Found.MISSING)
    assert plan.remove_aside == (
        aside is Found.INCOMPLETE or (aside is Found.COMPLETE and final is Found.COMPLETE)
    )
    assert not plan.remove_final
