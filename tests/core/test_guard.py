"""Guards before writing: here, where an import may write."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.guard import import_target_problem
from pitstop.core.naming import checkpoint_name

directories = st.sampled_from(["runs/a/checkpoints", "/data/run 1/ckpt", "ckpt"])


@given(directories, st.integers(0, 5))
def test_an_import_may_write_into_a_directory_without_checkpoints(
    directory: str, count: int
) -> None:
    assert import_target_problem(None, directory=directory, count=count) is None


@given(directories, st.integers(0, 10**9), st.integers(1, 1000))
def test_an_import_into_a_run_is_refused_naming_the_directory_and_its_newest_step(
    directory: str, step: int, count: int
) -> None:
    name = checkpoint_name(step)
    problem = import_target_problem((step, name), directory=directory, count=count)
    assert problem is not None
    assert problem.startswith(
        f"{directory} already holds {count} checkpoint(s) (the newest is step {step}, {name})"
    )
    assert problem.endswith("Import into a new or empty checkpoint directory")
