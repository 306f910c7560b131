# The S3 client: obstore's store for a bucket, configured as every AWS tool is.
#
# Rules: endpoint, credentials and region come from the standard AWS configuration, as every
# AWS tool reads it: storage_options, over the environment (AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION), over the profile
# (AWS_PROFILE, or storage_options' "profile") in ~/.aws/credentials and ~/.aws/config
# (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE) — the order is pitstop.core.s3.s3config's
# profile_settings; an http:// endpoint is allowed (local servers). Retries follow the core's
# schedule (retry_settings) and end within DEADLINE_S. Without the extra installed, asking for
# it is one ConfigError naming `pip install pitstop[s3]`. A failure's cause is said in words (a
# missing bucket, refused credentials) for the StoreError that names the URL. Requests are one
# prefix's requests (get, put, head, delete, list), each failure a StoreError naming the URL,
# each ETag seen noted. A file is put by the client reading it itself, in the parts the core's
# file_plan sets; a checkpoint file being written is an Upload: its bytes go out as the parts of
# one multipart upload while the rest is written (pitstop.core.s3.uploads' stream_plan), copied
# as they come (a writer may reuse its buffers), and its header and last writes (a checkpoint's
# manifest and footer) are kept, for the commit to read its manifest from. (The two requests
# obstore does not make, to list and abort a dead writer's multipart uploads, are
# pitstop.shell.store.lease's.)
# How: obstore, imported on first use (put, open_writer).

"""The S3 client behind ``s3://`` locations: opening it, its requests, what its errors mean."""

from __future__ import annotations

import collections
import configparser
import contextlib
import errno
import io
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pitstop.core.s3.objects import Location, parse_url
from pitstop.core.s3.s3config import profile_settings, retry_settings
from pitstop.core.s3.uploads import KEEP_HEAD, MAX_PARTS, UploadPlan, file_plan
from pitstop.errors import ConfigError
from pitstop.shell.format.untrusted import read_untrusted

__all__ = [
    "DEADLINE_S",
    "SMALL",
    "Requests",
    "StoreError",
    "Upload",
    "cause",
    "obstore_module",
    "open_store",
    "resolved",
]

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
    config = resolved(options)
    client = dict(config.pop("client_options", None) or {})
    retry = config.pop("retry_config", None)
    endpoint = str(config.get("endpoint", os.environ.get("AWS_ENDPOINT_URL", "")))
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    if endpoint:
        config.setdefault("endpoint", endpoint)
        config.setdefault("virtual_hosted_style_request", False)
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


_T = TypeVar("_T")
SMALL = 1 << 20
"""The largest pointer, commit or lease object read."""


class Requests:
    """The requests to one ``s3://bucket/prefix``: a failure is a :class:`StoreError` naming
    the URL and its cause; the ETag of each object this process last read or wrote is noted."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            self.location = parse_url(url)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.url = self.location.url()
        self.options = dict(storage_options or {})
        self.client = open_store(self.location, storage_options)
        self._etags: dict[str, str] = {}  # the ETag this process last saw, by name

    def call(self, what: str, name: str, request: Callable[[Any], _T]) -> _T:
        """``request(obstore)``; a failure is a :class:`StoreError` naming the URL and cause
        (a missing object stays ``FileNotFoundError``, a failed condition ``FileExistsError``)."""
        obstore = obstore_module()
        try:
            return request(obstore)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                errno.ENOENT, f"{self.location.url(name)} does not exist"
            ) from exc
        except Exception as exc:
            kind = type(exc).__name__
            if kind in {"AlreadyExistsError", "PreconditionError"}:
                raise FileExistsError(
                    errno.EEXIST, f"{self.location.url(name)} was written by another writer"
                ) from exc
            raise StoreError(f"could not {what} {self.location.url(name)}: {cause(exc)}") from exc

    def get(self, name: str, limit: int = SMALL) -> bytes:
        """The object ``name`` (at most ``limit`` bytes, else ``ValueError``); its ETag noted."""
        key = self.location.key(name)
        result = self.call("read", name, lambda o: o.get(self.client, key))
        if result.meta["size"] > limit:
            raise ValueError(f"{self.location.url(name)} is larger than {limit} bytes")
        data = bytes(self.call("read", name, lambda o: result.bytes()))
        if result.meta.get("e_tag"):
            self._etags[name] = result.meta["e_tag"]
        return data

    def etag(self, name: str) -> str | None:
        """The ETag of ``name`` this process last read or wrote."""
        return self._etags.get(name)

    def put(self, name: str, data: bytes | Path, mode: object) -> str:
        """Put ``data`` at ``name`` with ``mode`` (``"create"``, ``{"e_tag": ...}``); the ETag.
        A file (``Path``) is read by the client itself, in the parts the core plans."""
        key = self.location.key(name)
        plan = file_plan(len(data) if isinstance(data, bytes) else data.stat().st_size)
        result = self.call(
            "write",
            name,
            lambda o: o.put(
                self.client,
                key,
                data,
                mode=mode,
                chunk_size=plan.part_size,
                max_concurrency=plan.concurrency,
            ),
        )
        etag = str(result.get("e_tag") or "")
        self._etags[name] = etag
        return etag

    def swap(self, name: str, data: bytes) -> None:
        """Replace the small object ``name`` by compare-and-swap on the ETag last seen (created
        if none was seen and none is there); ``FileExistsError`` when another writer moved it."""
        etag = self._etags.get(name)
        if etag is None:
            meta = self.head(name)
            etag = None if meta is None else meta.get("e_tag")
        self.put(name, data, "create" if etag is None else {"e_tag": etag})

    def head(self, name: str) -> dict[str, Any] | None:
        """The object's metadata, ``None`` when it does not exist."""
        key = self.location.key(name)
        try:
            meta = self.call("look up", name, lambda o: o.head(self.client, key))
        except FileNotFoundError:
            return None
        return dict(meta)

    def delete(self, name: str) -> None:
        """Delete the object ``name`` (one already gone is no error)."""
        key = self.location.key(name)
        self.call("delete", name, lambda o: o.delete(self.client, key))
        self._etags.pop(name, None)

    def listing(self, under: str = "") -> tuple[list[str], list[str]]:
        """``(objects, common prefixes)`` directly under the prefix (or ``under`` in it), as
        names relative to the prefix."""
        prefix = self.location.key(under) if under else self.location.prefix
        found = self.call(
            "list", under, lambda o: o.list_with_delimiter(self.client, prefix or None)
        )
        cut = len(prefix) + 1 if prefix else 0
        objects = [str(o["path"])[cut:] for o in found["objects"]]
        return objects, [str(p)[cut:].rstrip("/") for p in found["common_prefixes"]]

    def data_names(self) -> list[str]:
        """Every data object's name relative to the prefix (``.data/<token>/<name>``)."""
        prefix = self.location.key(".data") + "/"
        cut = len(self.location.prefix) + 1 if self.location.prefix else 0

        def walk(o: Any) -> list[str]:
            return [str(m["path"])[cut:] for chunk in o.list(self.client, prefix) for m in chunk]

        return self.call("list", ".data", walk)


class Upload(io.RawIOBase):
    """The object ``name`` written as a stream (the checkpoint writer's file): its bytes go out
    as the parts of one multipart upload while the rest is still being written (one PUT when it
    stays under a part), at most the plan's concurrency at once; nothing is visible before
    :meth:`finish`, and :meth:`abort` drops what was sent. Its first ``KEEP_HEAD`` bytes and its
    last writes, a part or more, are written at :meth:`close` at their offsets into the file
    ``local`` (made sparse, the object's size): a checkpoint's header, and its manifest and
    footer (each one write), read from there as from the whole file."""

    def __init__(self, requests: Requests, name: str, local: Path, plan: UploadPlan) -> None:
        super().__init__()
        self.name = requests.location.url(name)
        self._requests, self._object, self._local, self._plan = requests, name, local, plan
        key = requests.location.key(name)
        self._writer = requests.call(
            "write",
            name,
            lambda o: o.open_writer(
                requests.client,
                key,
                buffer_size=plan.part_size,
                max_concurrency=plan.concurrency,
            ),
        )
        self.position = 0
        self._head = b""
        self._tail: collections.deque[tuple[int, bytes]] = collections.deque()
        self._kept = 0  # bytes in _tail

    def writable(self) -> bool:
        """Yes."""
        return True

    def write(self, data: Any) -> int:
        """Send ``data`` on (a copy: the caller may reuse its buffer); the bytes taken."""
        piece = bytes(data)
        if not piece:
            return 0
        if self.position + len(piece) > self._plan.largest:
            raise OSError(
                errno.EFBIG,
                f"{self.name}: a checkpoint file streamed to object storage holds at most "
                f"{self._plan.largest} bytes ({MAX_PARTS} parts of {self._plan.part_size}); "
                "save to a local directory with remote=, or sharded",
            )
        self._requests.call("write", self._object, lambda o: self._writer.write(piece))
        if self.position < KEEP_HEAD:
            self._head += piece[: KEEP_HEAD - self.position]
        self._tail.append((self.position, piece))
        self._kept += len(piece)
        while self._kept - len(self._tail[0][1]) >= self._plan.part_size:
            self._kept -= len(self._tail.popleft()[1])
        self.position += len(piece)
        return len(piece)

    def close(self) -> None:
        """Write what was kept into the local file, at its offsets; close it."""
        if self.closed:
            return
        try:
            with self._local.open("r+b") as local:
                local.truncate(self.position)
                for at, piece in ((0, self._head), *self._tail):
                    local.seek(at)
                    local.write(piece)
        finally:
            super().close()

    def finish(self) -> None:
        """Complete the upload: the object appears (a part that failed to go up aborts it)."""
        try:
            self._requests.call("write", self._object, lambda o: self._writer.flush())
        except BaseException:
            self.abort()
            raise
        self._requests.call("write", self._object, lambda o: self._writer.close())

    def abort(self) -> None:
        """Drop the upload: the parts sent are freed (where this fails, the next writer's open
        aborts it)."""
        with contextlib.suppress(Exception):
            self._writer.__exit__(OSError, None, None)


def resolved(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` with what the AWS profile adds (the keys neither they nor the environment
    set), its ``profile`` key taken out, and a region (``us-east-1`` when none gives one)."""
    config = dict(options or {})
    _, profile = profile_settings(
        config,
        os.environ,
        _ini(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")),
        _ini(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")),
    )
    config.pop("profile", None)
    config.update(profile)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    config.setdefault("region", region or "us-east-1")
    return config


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
