"""Checkpoint names: step ⇄ name, and classifying everything else in a directory."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pitstop.core.naming import (
    LATEST_JSON,
    LOCK_NAME,
    MAX_STEP,
    NOT_A_CHECKPOINT,
    POINTER_NAMES,
    EntryKind,
    aside_name,
    attempt_token,
    checkpoint_name,
    classify,
    entry_components,
    is_checkpoint_name,
    is_file_name,
    is_sharded_name,
    parse_aside,
    parse_name,
    parse_sharded_name,
    sharded_name,
    temp_name,
    temp_token,
)
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import SaveError
from strategies import steps


def test_name_has_twelve_digits() -> None:
    assert checkpoint_name(2) == "step_000000000002.pitstop"
    assert checkpoint_name(MAX_STEP) == "step_999999999999.pitstop"


@given(steps)
def test_name_round_trips(step: int) -> None:
    name = checkpoint_name(step)
    assert parse_name(name) == step
    assert classify(name) is EntryKind.CHECKPOINT


@given(steps, steps)
def test_names_sort_like_steps(a: int, b: int) -> None:
    assert (checkpoint_name(a) < checkpoint_name(b)) == (a < b)


@given(st.text(max_size=40))
def test_anything_that_parses_is_exactly_a_checkpoint_name(name: str) -> None:
    step = parse_name(name)
    if step is not NOT_A_CHECKPOINT:
        assert checkpoint_name(step) == name


@pytest.mark.parametrize(
    "name",
    [
        "step_2.pitstop",
        "step_0000000000002.pitstop",  # 13 digits
        "step_000000000002.pt",
        "step_000000000002.pitstop.tmp",
        "step_٠٠٠٠٠٠٠٠٠٠٠٢.pitstop",  # Arabic-Indic digits are not digits here
        " step_000000000002.pitstop",
        LATEST_JSON,
        "last",
        "",
    ],
)
def test_non_checkpoint_names(name: str) -> None:
    assert parse_name(name) is NOT_A_CHECKPOINT
    assert classify(name) is not EntryKind.CHECKPOINT


@pytest.mark.parametrize("step", [MAX_STEP + 1, 10**15])
def test_steps_beyond_twelve_digits_are_an_error(step: int) -> None:
    with pytest.raises(SaveError, match=f"step {step} needs more than 12 digits"):
        checkpoint_name(step)


@pytest.mark.parametrize("step", [-1, True, 2.0])
def test_invalid_steps_are_an_error(step: object) -> None:
    with pytest.raises(SaveError, match="step"):
        checkpoint_name(step)  # type: ignore[arg-type]


@given(steps, st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True))
def test_temp_files_are_recognised_and_never_checkpoints(step: int, token: str) -> None:
    name = temp_name(checkpoint_name(step), token)
    assert classify(name) is EntryKind.TEMP
    assert parse_name(name) is NOT_A_CHECKPOINT
    assert classify(temp_name(LATEST_JSON, token)) is EntryKind.TEMP


tokens = st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)


@given(steps, tokens, tokens)
def test_an_aside_name_says_which_checkpoint_it_holds_and_no_other_name_does(
    step: int, token: str, other: str
) -> None:
    """A sharded checkpoint moved aside is a temp entry (never listed as a checkpoint) whose
    name gives back the checkpoint's; no writer's temp name of anything pitstop publishes, and
    no checkpoint, reads as one."""
    name = sharded_name(step)
    aside = aside_name(name, token)
    assert classify(aside) is EntryKind.TEMP
    assert parse_aside(aside) == name
    assert parse_sharded_name(aside) is NOT_A_CHECKPOINT
    published = [name, checkpoint_name(step), LATEST_JSON, MANIFEST_NAME, *POINTER_NAMES]
    for final in published:
        assert parse_aside(temp_name(final, other)) is NOT_A_CHECKPOINT
        assert parse_aside(final) is NOT_A_CHECKPOINT
    assert aside not in {temp_name(final, other) for final in published}


attempts = st.integers(min_value=1, max_value=10**12)


@given(tokens, attempts, tokens, attempts, st.sampled_from(["last", LATEST_JSON, "step_2"]))
@example("a1", 2, "a", 12, "last")  # a run id that ends in digits
@example("a_1", 2, "a", 12, "last")
@example("a_1", 2, "a_1_2", 1, "last")
def test_no_two_attempts_share_a_temp_name(
    run: str, attempt: int, other_run: str, other_attempt: int, final: str
) -> None:
    """Each attempt at a publish has temp names of its own, so a temp entry one could not
    remove never blocks another: two attempts' names are the same only if they are one
    attempt (of one run)."""
    token = attempt_token(run, attempt)
    other = attempt_token(other_run, other_attempt)
    assert (token == other) == ((run, attempt) == (other_run, other_attempt))
    name = temp_name(final, token)
    assert classify(name) is EntryKind.TEMP
    assert (name == temp_name(final, other)) == (token == other)
    assert parse_aside(aside_name(sharded_name(2), token)) == sharded_name(2)
    assert attempt_token(run, attempt + 1) != token


@given(tokens, attempts, tokens, st.sampled_from(["last", LATEST_JSON, "step_2", "a-b"]))
def test_a_temp_names_token_is_the_one_it_was_made_with(
    run: str, attempt: int, other: str, final: str
) -> None:
    token = attempt_token(run, attempt)
    assert temp_token(temp_name(final, token), final) == token
    for wrong in (final + "x", "x" + final):  # the temp name of another name
        with pytest.raises(ValueError, match="not a temp name"):
            temp_token(temp_name(wrong, other), final)
    with pytest.raises(ValueError, match="not a temp name"):
        temp_token(final, final)


@given(st.one_of(steps.map(checkpoint_name), steps.map(sharded_name), st.text(max_size=30)))
def test_a_names_kind_is_what_parsing_it_says(name: str) -> None:
    assert is_file_name(name) == (parse_name(name) is not NOT_A_CHECKPOINT)
    assert is_sharded_name(name) == (parse_sharded_name(name) is not NOT_A_CHECKPOINT)
    assert is_checkpoint_name(name) == (is_file_name(name) or is_sharded_name(name))


@pytest.mark.parametrize(("run", "attempt"), [("", 1), ("a b", 1), ("run", 0), ("run", True)])
def test_attempt_tokens_are_restricted(run: str, attempt: int) -> None:
    with pytest.raises(ValueError, match=r"run id|attempt"):
        attempt_token(run, attempt)


@pytest.mark.parametrize("final", ["step_000000000002.pitstop", "last", "step_2"])
def test_only_a_sharded_checkpoint_is_moved_aside(final: str) -> None:
    with pytest.raises(ValueError, match="only a sharded checkpoint"):
        aside_name(final, "run")


@pytest.mark.parametrize("token", ["", "a/b", "x y", "../x"])
def test_temp_tokens_are_restricted(token: str) -> None:
    with pytest.raises(ValueError, match="temp token"):
        temp_name("last", token)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("last", EntryKind.POINTER),
        ("best", EntryKind.POINTER),
        ("final", EntryKind.POINTER),
        (LATEST_JSON, EntryKind.LATEST_JSON),
        (LOCK_NAME, EntryKind.LOCK),
        ("notes.txt", EntryKind.FOREIGN),
        ("step_000000000100.pt", EntryKind.FOREIGN),
    ],
)
def test_classify(name: str, kind: EntryKind) -> None:
    assert classify(name) is kind


_OTHER_NAMES = st.sampled_from(
    ["run", "checkpoints", "last", "best", "final", LATEST_JSON, "step_1.pitstop", "model.pt"]
)


@given(
    st.lists(_OTHER_NAMES, max_size=3),
    steps,
    st.sampled_from([MANIFEST_NAME, "__0_0.distcp", ".metadata", "last"]),
)
def test_only_the_pointers_of_a_checkpoint_directory_may_be_links(
    above: list[str], step: int, inside: str
) -> None:
    # a checkpoint file and a sharded checkpoint directory are never reached through a link,
    # nor is any entry of a sharded one (the directory included)
    assert entry_components((*above, checkpoint_name(step))) == 1
    assert entry_components((*above, sharded_name(step))) == 1
    assert entry_components((*above, sharded_name(step), inside)) == 2
    # a pointer, latest.json or any other name is the caller's to follow or not
    for name in [*POINTER_NAMES, LATEST_JSON, LOCK_NAME, "model.pitstop"]:
        assert entry_components((*above, name)) == 0
    assert entry_components(()) == 0
