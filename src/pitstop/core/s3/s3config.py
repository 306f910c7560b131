# The S3 client's settings: how it retries, and what the standard AWS configuration gives it.
#
# Rules: transient failures are retried a bounded number of times, with a backoff whose worst
# case stays within a deadline, so a dead endpoint is an error within seconds. The client's
# settings come from the standard AWS configuration, highest first: storage_options, the
# environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN as one set, AWS_REGION
# or AWS_DEFAULT_REGION, AWS_ENDPOINT_URL), then the profile (storage_options' "profile", else
# AWS_PROFILE, else "default") in the shared credentials and config files; a profile named but
# found in neither file is an error.
# How: pure functions over mappings and numbers; the shell reads the files and the environment.

"""The S3 client's settings: the retry schedule and the AWS profile's settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from pitstop.errors import ConfigError

__all__ = ["RetrySettings", "profile_settings", "retry_settings"]


@attrs.frozen(kw_only=True)
class RetrySettings:
    """How the client retries a transient failure (a 5xx, a throttle, a reset connection):
    ``max_retries`` times, waiting ``initial_s`` growing by ``base`` up to ``max_backoff_s``,
    and never past ``timeout_s`` in all."""

    max_retries: int
    initial_s: float
    max_backoff_s: float
    base: float
    timeout_s: float

    def delays(self) -> tuple[float, ...]:
        """The worst-case wait before each retry."""
        return tuple(
            min(self.max_backoff_s, self.initial_s * self.base**i) for i in range(self.max_retries)
        )


def retry_settings(deadline_s: float, *, max_retries: int = 4) -> RetrySettings:
    """Retries whose worst-case waits add up to at most half of ``deadline_s`` (the rest is for
    the requests themselves), so an unreachable endpoint is an error within the deadline."""
    if not deadline_s > 0 or max_retries < 0:
        raise ValueError(f"need a deadline > 0 and retries >= 0, got {deadline_s}, {max_retries}")
    base = 2.0
    budget = deadline_s / 2
    total = sum(base**i for i in range(max_retries))  # initial_s * total <= budget
    initial = budget / total if total else budget
    return RetrySettings(
        max_retries=max_retries,
        initial_s=initial,
        max_backoff_s=initial * base ** max(0, max_retries - 1),
        base=base,
        timeout_s=deadline_s,
    )


# A profile's keys (credentials file, config file) -> the S3 client's config key; the
# environment variables that set the same (any of them set: the profile's value is not used).
_PROFILE_KEYS: Final = (
    ("aws_access_key_id", "access_key_id"),
    ("aws_secret_access_key", "secret_access_key"),
    ("aws_session_token", "session_token"),
    ("region", "region"),
    ("endpoint_url", "endpoint"),
)
_CREDENTIALS: Final = frozenset({"access_key_id", "secret_access_key", "session_token"})
_FROM_ENVIRONMENT: Final = {
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_ACCESS_KEY_ID",),  # the keys are one set: the id says which
    "session_token": ("AWS_ACCESS_KEY_ID",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL",),
}


def profile_settings(
    options: Mapping[str, Any],
    environ: Mapping[str, str],
    credentials: Mapping[str, Mapping[str, str]],
    config: Mapping[str, Mapping[str, str]],
    *,
    files: str = "the AWS credentials and config files",
) -> tuple[str, dict[str, str]]:
    """The profile the S3 client uses and the settings it adds: each of its keys that neither
    ``options`` (the client's config keys) nor the environment sets (the credentials as one
    set: an ``AWS_ACCESS_KEY_ID`` in the environment takes none of the profile's keys).

    ``credentials``: the shared credentials file's sections (``[NAME]``); ``config``: the
    config file's (``[profile NAME]``, or ``[default]``); a key in both comes from the
    credentials file. The profile is ``options["profile"]``, else ``AWS_PROFILE``, else
    ``default``; one named (not the default) that neither file holds is a ``ConfigError``
    naming it and ``files``.
    """
    named = options.get("profile") or environ.get("AWS_PROFILE")
    profile = str(named or "default")
    section = "default" if profile == "default" else f"profile {profile}"
    found = {**config.get(section, {}), **credentials.get(profile, {})}
    if named and profile not in credentials and section not in config:
        known = sorted({*credentials, *(s.removeprefix("profile ") for s in config)})
        raise ConfigError(
            f"the AWS profile {profile!r} is in neither of {files} "
            f"(profiles there: {', '.join(known) or 'none'})"
        )
    settings: dict[str, str] = {}
    for key, setting in _PROFILE_KEYS:
        value = found.get(key)
        if value is None or setting in options:
            continue
        if setting in _CREDENTIALS and any(k in options for k in _CREDENTIALS):
            continue
        if any(environ.get(name) for name in _FROM_ENVIRONMENT[setting]):
            continue
        settings[setting] = value
    return profile, settings
