# The S3 client: obstore's store for a bucket, configured as every AWS tool is.
#
# Rules: endpoint, credentials and region come from the standard AWS configuration, as every
# AWS tool reads it: storage_options, over the environment (AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION), over the profile
# (AWS_PROFILE, or storage_options' "profile") in ~/.aws/credentials and ~/.aws/config
# (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE) — the order is pitstop.core.objects'
# profile_settings; an http:// endpoint is allowed (local servers). Retries follow the core's
# schedule (retry_settings) and end within DEADLINE_S. Without the extra installed, asking for
# it is one ConfigError naming `pip install pitstop[s3]`. A failure's cause is said in words (a
# missing bucket, refused credentials) for the StoreError that names the URL.
# How: obstore, imported on first use.

"""The S3 client behind ``s3://`` locations: opening it, and what its errors mean."""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from pitstop.core.objects import Location, profile_settings, retry_settings
from pitstop.errors import ConfigError
from pitstop.shell.format.untrusted import read_untrusted

__all__ = ["DEADLINE_S", "StoreError", "cause", "obstore_module", "open_store"]

DEADLINE_S = 20.0
"""How long a request may take, retries included, before it is an error."""
_AWS_FILE_LIMIT = 1 << 20  # the AWS credentials and config files are small


class StoreError(OSError):
    """A request to the object store failed (after its retries); the message names the URL."""


def obstore_module() -> Any:
    """obstore, or the ConfigError that names the extra to install."""
    try:
        import obstore
    except ImportError:
        raise ConfigError(
            "s3:// checkpoint locations need the S3 client: pip install pitstop[s3]"
        ) from None
    return obstore


def open_store(location: Location, options: Mapping[str, Any] | None = None) -> Any:
    """An S3 client for ``location``'s bucket: endpoint, credentials and region from the
    standard AWS configuration (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ..., then the
    profile ``AWS_PROFILE`` names in ``~/.aws/credentials`` and ``~/.aws/config``), ``options``
    (obstore's S3 config keys, ``profile``, ``client_options``, ``retry_config``) over them."""
    obstore = obstore_module()
    config = dict(options or {})
    client = dict(config.pop("client_options", None) or {})
    retry = config.pop("retry_config", None)
    _, profile = profile_settings(
        config,
        os.environ,
        _ini(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")),
        _ini(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")),
    )
    config.pop("profile", None)
    config.update(profile)
    endpoint = str(config.get("endpoint", os.environ.get("AWS_ENDPOINT_URL", "")))
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    if endpoint:
        config.setdefault("endpoint", endpoint)
        config.setdefault("virtual_hosted_style_request", False)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    config.setdefault("region", region or "us-east-1")
    client.setdefault("connect_timeout", timedelta(seconds=5))
    client.setdefault("timeout", timedelta(seconds=DEADLINE_S * 6))
    if retry is None:
        plan = retry_settings(DEADLINE_S)
        retry = {
            "max_retries": plan.max_retries,
            "retry_timeout": timedelta(seconds=plan.timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=plan.initial_s),
                "max_backoff": timedelta(seconds=plan.max_backoff_s),
                "base": plan.base,
            },
        }
    try:
        return obstore.store.S3Store(
            location.bucket, config=config, client_options=client, retry_config=retry
        )
    except Exception as exc:  # a bad option: obstore's message names it
        raise ConfigError(f"{location.url()}: cannot configure the S3 client: {exc}") from exc


def _ini(path: str) -> dict[str, dict[str, str]]:
    """The sections of the AWS credentials or config file at ``path`` (``~`` expanded); none
    when it does not exist. ConfigError naming the file when it cannot be read or parsed."""
    name = Path(path).expanduser()
    try:
        text = read_untrusted(name, _AWS_FILE_LIMIT, follow_symlinks=True).decode("utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the AWS configuration file {name}: {exc}") from exc
    parser = configparser.ConfigParser(interpolation=None, default_section="\0none")
    try:
        parser.read_string(text, source=str(name))
    except configparser.Error as exc:
        raise ConfigError(f"the AWS configuration file {name} is malformed: {exc}") from exc
    return {section: dict(parser[section]) for section in parser.sections()}


def cause(exc: BaseException) -> str:
    """What went wrong with a request, in words: a missing bucket, refused credentials, or the
    client's own first line."""
    text = str(exc)
    if "NoSuchBucket" in text:
        return "the bucket does not exist"
    name = type(exc).__name__
    refused = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403 Forbidden")
    if name in {"PermissionDeniedError", "UnauthenticatedError"} or any(
        code in text for code in refused
    ):
        keys = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile"
        return f"the credentials were refused ({keys})"
    first = text.splitlines()[0] if text else ""
    return f"{name}: {first[:300]}"
