"""The restore's copy into the live modules runs on the calling thread alone, and torch's
intra-op thread count is set back after it, whatever happens in it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pitstop.shell.state.restore import one_thread


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_the_copy_runs_on_one_thread_and_the_count_is_set_back() -> None:
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="a load hook"), one_thread():
        raise RuntimeError("a load hook failed")
    assert torch.get_num_threads() == 2
