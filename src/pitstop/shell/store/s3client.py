# The S3 client: obstore's store for a bucket, configured from the standard AWS environment.
#
# Rules: endpoint, credentials and region come from the AWS environment (AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION), storage_options over them; an http://
# endpoint is allowed (local servers). Retries follow the core's schedule (retry_settings) and
# end within DEADLINE_S. Without the extra installed, asking for it is one ConfigError naming
# `pip install pitstop[s3]`. A failure's cause is said in words (a missing bucket, refused
# credentials) for the StoreError that names the URL.
# How: obstore, imported on first use.

"""The S3 client behind ``s3://`` locations: opening it, and what its errors mean."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from pitstop.core.objects import Location, retry_settings
from pitstop.errors import ConfigError

__all__ = ["DEADLINE_S", "StoreError", "cause", "obstore_module", "open_store"]

DEADLINE_S = 20.0
"""How long a request may take, retries included, before it is an error."""


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
    standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), ``options``
    (obstore's S3 config keys, ``client_options``, ``retry_config``) over them."""
    obstore = obstore_module()
    config = dict(options or {})
    client = dict(config.pop("client_options", None) or {})
    retry = config.pop("retry_config", None)
    endpoint = str(config.get("endpoint", os.environ.get("AWS_ENDPOINT_URL", "")))
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    if endpoint:
        config.setdefault("endpoint", endpoint)
        config.setdefault("virtual_hosted_style_request", False)
    config.setdefault("region", os.environ.get("AWS_REGION", "us-east-1"))
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
        return "the credentials were refused (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    first = text.splitlines()[0] if text else ""
    return f"{name}: {first[:300]}"
