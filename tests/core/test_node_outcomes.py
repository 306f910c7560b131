"""Nodes that share no directory: the catch-up plan with a remote tier (pitstop.core.ranks
catch_up: a peer's copy first, the remote tier only when no directory holds the checkpoint
whole), and one background save's outcome agreed from every writer's (core.session)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import REMOTE, DirectoryGroups, Transfer, catch_up
from pitstop.core.session import SaveStatus, agreed_status


def groups_of(count: int) -> DirectoryGroups:
    return DirectoryGroups(tuple((2 * i, 2 * i + 1) for i in range(count)))


@given(st.lists(st.booleans(), min_size=1, max_size=6), st.booleans())
def test_every_lacking_directory_gets_one_copy_from_a_peer_else_from_the_remote_tier(
    valid: list[bool], remote: bool
) -> None:
    groups = groups_of(len(valid))
    plan = catch_up(groups, valid, remote=remote)
    lacking = [w for w, ok in zip(groups.writers, valid, strict=True) if not ok]
    holders = {w for w, ok in zip(groups.writers, valid, strict=True) if ok}
    if not holders and not remote:
        assert plan is None  # complete nowhere: the resume tries the next candidate
        return
    assert plan is not None
    assert [t.target for t in plan] == lacking  # each lacking directory once, none other
    if holders:  # a peer holds it: the remote tier is never asked
        assert all(t.source in holders for t in plan)
    else:
        assert all(t.source == REMOTE for t in plan)
    assert catch_up(groups, valid, remote=False) == (plan if holders else None)


def test_a_checkpoint_only_the_remote_tier_holds_is_downloaded_by_every_node() -> None:
    groups = groups_of(2)
    assert catch_up(groups, [False, False], remote=True) == (
        Transfer(source=REMOTE, target=0),
        Transfer(source=REMOTE, target=2),
    )
    assert catch_up(groups, [False, True], remote=True) == (Transfer(source=2, target=0),)


@given(st.lists(st.sampled_from([None, *SaveStatus]), max_size=5))
def test_a_background_save_counts_once_every_copy_is_published_and_fails_if_any_fails(
    statuses: list[SaveStatus | None],
) -> None:
    agreed = agreed_status(statuses)
    held = {s for s in statuses if s is not None}
    if not held:
        assert agreed is None
    elif SaveStatus.FAILED in held:
        assert agreed is SaveStatus.FAILED
    elif SaveStatus.PENDING in held:
        assert agreed is SaveStatus.PENDING
    else:
        assert agreed is SaveStatus.PUBLISHED
    assert agreed_status([*statuses, agreed]) == agreed  # agreeing again changes nothing
