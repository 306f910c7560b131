# One writer per object-storage prefix: the lease object, and clearing what dead writers left.
#
# Rules: a writer takes `<prefix>/.lock` with a conditional create; one that finds it takes it
# over only as the core's judge_lease says (expired, or its holder ran on this host and is gone),
# by compare-and-swap on the ETag it read — so of two writers taking over one lease, one wins.
# Otherwise DirectoryLocked names the holder (run, pid, host, since when, when it expires). While
# held, a thread renews it (compare-and-swap again) every third of its time; a renewal that finds
# the lease taken by another writer logs an error and stops. Opening checks the URL first (one
# error naming it: a missing bucket, refused credentials, an unreachable endpoint), and, once the
# lease is held, removes the data objects no commit names and aborts the incomplete multipart
# uploads under the prefix's data objects (uploads of writers that died).
# Releasing deletes the lease object. The two requests obstore does not make — listing the
# incomplete multipart uploads under a prefix, and aborting one — are signed here (AWS Signature
# Version 4) with the client's endpoint and static credentials (from any source the client
# reads); without static credentials (an instance role) they are skipped.
# How: an ObjectStorage's requests; wall-clock time (the core's records hold epoch seconds);
# urllib and hmac for the two signed requests.

"""The lease: one writer per ``s3://`` checkpoint prefix."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from pitstop.core.naming import LOCK_NAME, EntryKind, classify
from pitstop.core.s3.objects import (
    Lease,
    LeaseVerdict,
    Location,
    decode_lease,
    describe_lease,
    encode_lease,
    judge_lease,
    orphans,
    renew_after,
)
from pitstop.errors import CheckpointCorrupt, DirectoryLocked, SaveError
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.s3client import DEADLINE_S, resolved

__all__ = ["LEASE_S", "ObjectLease", "abort_upload", "torn_uploads"]

log = logging.getLogger("pitstop")

LEASE_S = 60.0
"""How long a lease lasts unless renewed."""


def _gone(lease: Lease) -> bool:
    """Whether the lease's holder ran on this host and is no longer running."""
    if lease.host != socket.gethostname() or lease.pid == os.getpid():
        return False
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # running, as another user
        return False
    return False


class ObjectLease:
    """The lease of one prefix, from :meth:`acquire` to :meth:`release`."""

    def __init__(self, storage: ObjectStorage, run_id: str, ttl: float = LEASE_S) -> None:
        self.storage = storage
        self.run_id = run_id
        self.ttl = ttl
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lease."""
        return self._etag is not None

    def _record(self, since: float) -> bytes:
        now = time.time()
        lease = Lease(
            run_id=self.run_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=since,
            expires=now + self.ttl,
        )
        return encode_lease(lease)

    def acquire(self) -> None:
        """Take the lease, or raise :class:`~pitstop.errors.DirectoryLocked` naming its holder;
        :class:`~pitstop.errors.SaveError` naming the URL when it cannot be reached."""
        if self.held:
            return
        url = self.storage.url
        try:
            self.storage.listing()
            self._take()
        except OSError as exc:
            raise SaveError(f"could not open {url} for writing: {exc}") from exc
        self._clear_orphans()
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="pitstop-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        storage = self.storage
        for _ in range(5):  # another writer may move it between our look and our put
            meta = storage.head(LOCK_NAME)
            held = None
            if meta is not None:
                try:
                    held = decode_lease(storage.get(LOCK_NAME, 4096))
                except FileNotFoundError:
                    continue
            now = time.time()
            verdict = judge_lease(
                held,
                present=meta is not None,
                now=now,
                holder_gone=held is not None and _gone(held),
            )
            if verdict is LeaseVerdict.HELD:
                raise DirectoryLocked(
                    f"{storage.url} is locked by {describe_lease(held, now=now)}; one writer per "
                    f"checkpoint prefix (lease object {storage.location.url(LOCK_NAME)})"
                )
            mode: object = "create" if meta is None else {"e_tag": storage.etag(LOCK_NAME)}
            try:
                self._etag = storage.put(LOCK_NAME, self._record(now), mode)
            except FileExistsError:
                continue
            if held is not None:
                log.warning(
                    "took over the lease of %s from %s",
                    storage.url,
                    describe_lease(held, now=now),
                )
            self._since = now
            return
        raise DirectoryLocked(f"{storage.url}: its lease kept changing hands; try again")

    def _clear_orphans(self) -> None:
        """Remove the data objects no commit names (their writers died before committing)."""
        storage = self.storage
        try:
            objects, _ = storage.listing()
            commits = []
            for name in objects:
                with contextlib.suppress(CheckpointCorrupt, ValueError, FileNotFoundError):
                    if classify(name) is EntryKind.CHECKPOINT:  # a file's or a sharded one's
                        commits.append(storage.commit(name))
            for name in orphans(storage.data_names(), commits):
                log.warning("removing %s, left by a writer that died", storage.location.url(name))
                storage.delete(name)
            data = storage.location.key(".data") + "/"
            for key, upload in torn_uploads(storage.location, storage.options, data) or ():
                log.warning(
                    "aborting the multipart upload of s3://%s/%s, left by a writer that died",
                    storage.location.bucket,
                    key,
                )
                abort_upload(storage.location, storage.options, key, upload)
        except (OSError, SyntaxError) as exc:  # SyntaxError: a listing that is not XML
            log.warning("could not clear dead writers' uploads from %s: %s", storage.url, exc)

    def _renew(self) -> None:
        while not self._stop.wait(renew_after(self.ttl)):
            etag = self._etag
            if etag is None:
                return
            try:
                self._etag = self.storage.put(LOCK_NAME, self._record(self._since), {"e_tag": etag})
            except FileExistsError:
                log.error("the lease of %s was taken by another writer", self.storage.url)
                return
            except OSError as exc:
                log.warning("could not renew the lease of %s: %s", self.storage.url, exc)

    def release(self) -> None:
        """Stop renewing and delete the lease object (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        etag, self._etag = self._etag, None
        if etag is None:
            return
        try:
            meta = self.storage.head(LOCK_NAME)
            if meta is not None and meta.get("e_tag") == etag:
                self.storage.delete(LOCK_NAME)
        except OSError as exc:
            log.warning("could not release the lease of %s: %s", self.storage.url, exc)


def _setting(options: Mapping[str, Any] | None, names: tuple[str, ...], env: str) -> str:
    """A client setting: the first of ``names`` in ``options`` (obstore's keys), else ``env``."""
    for name in names:
        if options and options.get(name):
            return str(options[name])
    return os.environ.get(env, "")


def _signed(
    location: Location,
    options: Mapping[str, Any] | None,
    method: str,
    key: str,
    query: Mapping[str, str],
) -> bytes | None:
    """Send one signed (SigV4) request for ``key`` of ``location``'s bucket (path style); its
    body. ``None``: no static credentials to sign with. Raises ``OSError`` when it fails."""
    options = resolved(options)
    access = _setting(options, ("access_key_id", "aws_access_key_id"), "AWS_ACCESS_KEY_ID")
    secret = _setting(
        options, ("secret_access_key", "aws_secret_access_key"), "AWS_SECRET_ACCESS_KEY"
    )
    if not access or not secret:
        return None
    token = _setting(options, ("session_token", "token", "aws_session_token"), "AWS_SESSION_TOKEN")
    region = _setting(options, ("region", "aws_region"), "AWS_REGION")
    endpoint = _setting(options, ("endpoint", "aws_endpoint", "endpoint_url"), "AWS_ENDPOINT_URL")
    endpoint = (endpoint or f"https://s3.{region}.amazonaws.com").rstrip("/")
    host = urllib.parse.urlsplit(endpoint).netloc
    path = urllib.parse.quote(f"/{location.bucket}/{key}" if key else f"/{location.bucket}", "/~")
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, '~')}={urllib.parse.quote(v, '~')}"
        for k, v in sorted(query.items())
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    empty = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": empty, "x-amz-date": stamp}
    if token:
        headers["x-amz-security-token"] = token
    names = ";".join(sorted(headers))
    canonical = "\n".join(
        (
            method,
            path,
            canonical_query,
            "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
            names,
            empty,
        )
    )
    scope = f"{day}/{region}/s3/aws4_request"
    signing = (
        f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    )
    derived = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        derived = hmac.new(derived, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(derived, signing.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={names}, "
        f"Signature={signature}"
    )
    url = f"{endpoint}{path}" + (f"?{canonical_query}" if canonical_query else "")
    request = urllib.request.Request(url, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        return bytes(response.read())


def torn_uploads(
    location: Location, options: Mapping[str, Any] | None, under: str
) -> list[tuple[str, str]] | None:
    """The incomplete multipart uploads whose key starts with ``under``: ``(key, upload id)``
    each (``None``: no static credentials to ask with). Raises ``OSError`` when it fails."""
    body = _signed(location, options, "GET", "", {"uploads": "", "prefix": under})
    if body is None:
        return None
    found = []
    for upload in ET.fromstring(body).iter():
        if upload.tag.rpartition("}")[2] != "Upload":
            continue
        fields = {child.tag.rpartition("}")[2]: child.text or "" for child in upload}
        if fields.get("Key") and fields.get("UploadId"):
            found.append((fields["Key"], fields["UploadId"]))
    return found


def abort_upload(
    location: Location, options: Mapping[str, Any] | None, key: str, upload_id: str
) -> None:
    """Abort the incomplete multipart upload ``upload_id`` of ``key`` (its parts are freed)."""
    _signed(location, options, "DELETE", key, {"uploadId": upload_id})
