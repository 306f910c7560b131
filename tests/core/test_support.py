"""What an optional feature needs from torch, and the error that says so."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.support import SHARDED_STATE, torch_too_old
from pitstop.errors import ConfigError

VERSIONS = st.from_regex(r"\A2\.[0-9]{1,2}\.[0-9](\+[a-z0-9]{1,6})?\Z")
MISSING = st.lists(st.sampled_from(SHARDED_STATE.apis), min_size=1, unique=True)


@given(installed=VERSIONS, missing=MISSING, asked_by=st.sampled_from(["a Checkpointer", "x"]))
def test_the_error_names_what_was_asked_the_torch_it_needs_the_installed_one_and_what_lacks(
    installed: str, missing: list[str], asked_by: str
) -> None:
    error = torch_too_old(SHARDED_STATE, asked_by=asked_by, installed=installed, missing=missing)
    assert isinstance(error, ConfigError)
    text = str(error)
    assert text.startswith(f"{asked_by} needs {SHARDED_STATE.name}")
    assert f"torch {SHARDED_STATE.minimum} or newer" in text
    assert f"this is torch {installed}," in text
    assert all(api in text for api in missing)
    assert all(api not in text for api in SHARDED_STATE.apis if api not in missing)


def test_sharded_state_needs_the_first_torch_with_dcps_default_stager() -> None:
    assert SHARDED_STATE.minimum == "2.9"  # DefaultStager, StagingOptions, async_stager=
    assert any("DefaultStager" in api for api in SHARDED_STATE.apis)
