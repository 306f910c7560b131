"""Shared test configuration: hypothesis profiles.

``ci`` (the default) keeps the whole suite within minutes on 2 cores; ``thorough`` is for long
local runs: ``HYPOTHESIS_PROFILE=thorough make unit``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,  # no timing assertions: a slow CI machine must not fail a property
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
