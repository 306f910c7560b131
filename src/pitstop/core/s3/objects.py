# Checkpoints on object storage (s3://bucket/prefix): every decision the backend makes.
#
# Rules: an object store has no rename, no symlink and no flock, so a checkpoint directory there
# is a set of objects under one prefix:
#   <prefix>/.data/<token>/<name>   the checkpoint file's bytes, uploaded first, under a name no
#                                   other attempt has (the publish's temp token)
#   <prefix>/<name>                 its commit object: a small JSON record naming the data object,
#                                   its size and the catalog fields of its manifest, created with
#                                   a conditional put (If-None-Match: *) — a checkpoint whose commit
#                                   object does not exist does not exist, and of two writers
#                                   committing one name exactly one wins
#   <prefix>/.data/<token>/<name>/<file>  a sharded checkpoint's files (DCP's, each uploaded by
#                                   the rank that wrote it, and the manifest, by rank 0); its
#                                   commit object lists every file (size, CRC-32, writing rank),
#                                   and rank 0 writes it only once a listing of the data folder
#                                   shows every file at its size (commit_problem)
#   <prefix>/.data/<token>/<name>/.failed-rank-<r>  left by node writer <r> whose upload of its
#                                   ranks' files failed (its cause as text): rank 0's wait for
#                                   the files fails at once on it (failed_uploads)
#   <prefix>/last|best|final        pointers: the name they point at, replaced by compare-and-swap
#   <prefix>/latest.json            as on disk, replaced by compare-and-swap
#   <prefix>/.lock                  the lease: one writer per prefix (holder, host, since, expiry)
# A data object no commit names is what a writer that died left: the next writer removes it.
# Retention deletes a commit object first, then its data (deletion_order). A lease is taken
# when there is none, when it has expired, or when its holder ran on this host and is gone;
# renewed every third of its time. The S3 client's own settings (retries, the AWS
# configuration) are pitstop.core.s3.s3config's.
# How: pure functions over str, bytes and numbers; JSON for the small records.

"""Object storage: key names, commit and lease records, ranged reads."""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from pitstop.core.naming import NOT_A_CHECKPOINT, parse_sharded_name
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardFile
from pitstop.errors import CheckpointCorrupt

__all__ = [
    "COMMIT_FORMAT",
    "DATA_DIR",
    "ENTRY_KEYS",
    "LEASE_FORMAT",
    "Commit",
    "Lease",
    "LeaseVerdict",
    "Location",
    "commit_problem",
    "data_name",
    "decode_commit",
    "decode_lease",
    "deletion_order",
    "describe_lease",
    "encode_commit",
    "encode_lease",
    "failed_uploads",
    "failure_name",
    "is_object_url",
    "judge_lease",
    "orphans",
    "parse_data_name",
    "parse_url",
    "range_reads",
    "renew_after",
    "sharded_commit",
]

SCHEME: Final = "s3://"
DATA_DIR: Final = ".data"
COMMIT_FORMAT: Final = "pitstop-commit/1"
LEASE_FORMAT: Final = "pitstop-lease/1"
ENTRY_KEYS: Final = ("progress", "seq", "reason", "detail", "metrics", "world_size")
"""The manifest meta keys a commit object carries: what the catalog needs, so a listing reads
commit objects only, never a checkpoint's bytes."""

_BUCKET_RE: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_TOKEN_RE: Final = re.compile(r"[A-Za-z0-9_-]+")
_FAILED: Final = ".failed-rank-"


def is_object_url(value: object) -> bool:
    """Whether ``value`` is an ``s3://`` location (a str; a path never is)."""
    return isinstance(value, str) and value.startswith(SCHEME)


@attrs.frozen
class Location:
    """A checkpoint directory on object storage: a bucket and a key prefix (no slash at either
    end; empty for the bucket's root)."""

    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        """The object key of ``name`` (a plain name or ``.data/...``) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str = "") -> str:
        """``s3://bucket/prefix[/name]``, for messages."""
        base = f"{SCHEME}{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        return f"{base}/{name}" if name else base


def parse_url(url: str) -> Location:
    """The bucket and prefix of ``s3://bucket[/prefix]``; ``ValueError`` naming what is wrong."""
    if not is_object_url(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(
            f"{url!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.', '-')"
        )
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(part in {"", ".", ".."} for part in parts):
        raise ValueError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return Location(bucket=bucket, prefix=prefix)


def data_name(name: str, token: str) -> str:
    """Where the bytes of checkpoint ``name`` go for the publish attempt ``token`` (relative to
    the prefix): a name no other attempt uploads to, so an upload never overwrites a commit's."""
    if not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"a data token must match [A-Za-z0-9_-]+, got {token!r}")
    if not name or "/" in name:
        raise ValueError(f"not a plain checkpoint name: {name!r}")
    return f"{DATA_DIR}/{token}/{name}"


def failure_name(data: str, rank: int) -> str:
    """The object node writer ``rank`` leaves in the data folder ``data`` of a sharded attempt
    when it could not upload its ranks' files (its body: the cause, as text), so that rank 0,
    waiting for those files to commit the attempt, fails at once rather than at its timeout."""
    return f"{data}/{_FAILED}{rank}"


def failed_uploads(data: str, listed: Iterable[str]) -> list[tuple[int, str]]:
    """The writers' failure objects (:func:`failure_name`) among ``listed`` (names relative to
    the prefix) in the data folder ``data``: each writer's rank and object name, by rank."""
    head = f"{data}/{_FAILED}"
    found = [(n[len(head) :], n) for n in listed if n.startswith(head)]
    return sorted((int(r), n) for r, n in found if r.isdigit() and r.isascii())


def parse_data_name(relative: str) -> tuple[str, str] | None:
    """``(token, name)`` of a data object's name relative to the prefix; ``None`` otherwise."""
    parts = relative.split("/")
    if len(parts) != 3 or parts[0] != DATA_DIR or not _TOKEN_RE.fullmatch(parts[1]):
        return None
    return (parts[1], parts[2]) if parts[2] else None


@attrs.frozen(kw_only=True)
class Commit:
    """A commit object: checkpoint ``name`` is the ``size`` bytes of the data object ``data``
    (relative to the prefix); ``entry``: the catalog fields of its manifest (:data:`ENTRY_KEYS`).
    A sharded checkpoint's ``data`` is the folder of its ``files`` (each ``data/<file>``)."""

    name: str
    data: str
    size: int = attrs.field(validator=attrs.validators.ge(0))
    entry: Mapping[str, Any] = attrs.field(factory=dict)
    files: tuple[ShardFile, ...] = ()

    def objects(self) -> tuple[str, ...]:
        """The data objects it names (relative to the prefix)."""
        if not self.files:
            return (self.data,)
        return tuple(f"{self.data}/{f.name}" for f in self.files)


def sharded_commit(
    name: str, token: str, files: Iterable[ShardFile], entry: Mapping[str, Any]
) -> Commit:
    """The commit of the sharded checkpoint ``name`` whose ``files`` (every rank's, and the
    manifest) were uploaded by the publish attempt ``token``; ``ValueError`` for a name that is
    not a sharded checkpoint's, a file named twice, or no manifest among them."""
    if parse_sharded_name(name) is NOT_A_CHECKPOINT:
        raise ValueError(f"not a sharded checkpoint's name: {name!r}")
    listed = tuple(sorted(files, key=lambda f: f.name))
    names = [f.name for f in listed]
    if len(set(names)) != len(names) or MANIFEST_NAME not in names:
        raise ValueError(f"{name}: its files must be unique and hold {MANIFEST_NAME}: {names}")
    return Commit(
        name=name,
        data=data_name(name, token),
        size=sum(f.size for f in listed),
        entry={k: entry[k] for k in ENTRY_KEYS if k in entry},
        files=listed,
    )


def commit_problem(commit: Commit, listed: Mapping[str, int]) -> str | None:
    """Why ``commit`` may not be written yet (``None``: it may): each object it names must be
    ``listed`` (relative name -> size, a listing of its data) at its size — every rank's shard
    uploaded whole before the one commit makes the checkpoint exist."""
    sizes = (commit.size,) if not commit.files else tuple(f.size for f in commit.files)
    for obj, size in zip(commit.objects(), sizes, strict=True):
        found = listed.get(obj)
        if found is None:
            return f"{obj} was not uploaded"
        if found != size:
            return f"{obj} holds {found} bytes, {size} were written"
    return None


def deletion_order(commit: Commit) -> tuple[str, ...]:
    """What deleting checkpoint ``commit.name`` deletes, in order: the commit object first (from
    then on it does not exist), then its data objects."""
    return (commit.name, *commit.objects())


def encode_commit(commit: Commit) -> bytes:
    """The commit object's bytes (JSON)."""
    entry = {k: commit.entry[k] for k in ENTRY_KEYS if k in commit.entry}
    record: dict[str, Any] = {
        "format": COMMIT_FORMAT,
        "name": commit.name,
        "data": commit.data,
        "size": commit.size,
        "entry": entry,
    }
    if commit.files:
        record["files"] = [[f.name, f.size, f.crc32, f.rank] for f in commit.files]
    return json.dumps(record, sort_keys=True).encode("utf-8")


def decode_commit(name: str, raw: bytes) -> Commit:
    """The commit object of ``name`` from its bytes; ``ValueError`` naming what is wrong (a
    commit for another name, a data object outside ``.data/<token>/<name>``, a bad size)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"commit object {name} is not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT:
        raise ValueError(f"commit object {name} is not a {COMMIT_FORMAT} record")
    data, size, entry = record.get("data"), record.get("size"), record.get("entry")
    if record.get("name") != name:
        raise ValueError(f"commit object {name} commits {record.get('name')!r}")
    parsed = parse_data_name(data) if isinstance(data, str) else None
    if parsed is None or parsed[1] != name:
        raise ValueError(f"commit object {name} names no data object of it: {data!r}")
    if type(size) is not int or size < 0:
        raise ValueError(f"commit object {name} has a bad size: {size!r}")
    if not isinstance(entry, dict):
        raise ValueError(f"commit object {name} has no entry record")
    assert isinstance(data, str)
    if parse_sharded_name(name) is NOT_A_CHECKPOINT:
        return Commit(name=name, data=data, size=size, entry=entry)
    try:
        commit = sharded_commit(name, parsed[0], _files(name, record.get("files")), entry)
    except ValueError as exc:
        raise ValueError(f"commit object {exc}") from None
    if commit.size != size:
        raise ValueError(f"commit object {name}: its files add up to {commit.size}, not {size}")
    return attrs.evolve(commit, entry=entry)


def _files(name: str, rows: object) -> list[ShardFile]:
    """A sharded commit's file rows ``[name, size, crc32, rank]``; ``ValueError`` if bad."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{name} lists no files")
    try:
        return [ShardFile(name=r[0], size=r[1], crc32=r[2], rank=r[3]) for r in rows]
    except (CheckpointCorrupt, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"{name} has a bad file row: {exc}") from None


def orphans(data_names: Iterable[str], commits: Iterable[Commit]) -> list[str]:
    """The data objects (names relative to the prefix) that no commit names: uploads of
    writers that died before their commit, or data a retention left after its commit went."""
    named = {obj for commit in commits for obj in commit.objects()}
    return sorted(n for n in set(data_names) if n not in named and _is_data(n))


def _is_data(relative: str) -> bool:
    """Whether ``relative`` names a data object: ``.data/<token>/<name>``, or a sharded
    checkpoint's file ``.data/<token>/<name>/<file>``."""
    head, _, file = relative.rpartition("/")
    return parse_data_name(relative) is not None or (
        bool(file) and parse_data_name(head) is not None
    )


@attrs.frozen(kw_only=True)
class Lease:
    """The writer holding a prefix: who, where, since when, and until when (seconds since the
    epoch, the holder's clock)."""

    run_id: str
    host: str
    pid: int
    since: float
    expires: float


def encode_lease(lease: Lease) -> bytes:
    """The lease object's bytes (JSON)."""
    return json.dumps({"format": LEASE_FORMAT, **attrs.asdict(lease)}, sort_keys=True).encode()


def decode_lease(raw: bytes) -> Lease | None:
    """The lease in ``raw``; ``None`` for bytes that are no lease (an unknown holder)."""
    try:
        record = json.loads(raw.decode("utf-8"))
        if not isinstance(record, dict) or record.get("format") != LEASE_FORMAT:
            return None
        lease = Lease(
            run_id=str(record["run_id"]),
            host=str(record["host"]),
            pid=int(record["pid"]),
            since=float(record["since"]),
            expires=float(record["expires"]),
        )
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return lease if math.isfinite(lease.expires) and math.isfinite(lease.since) else None


class LeaseVerdict(enum.Enum):
    """What a writer opening a prefix does about its lease object."""

    FREE = "create it"  # none there: a conditional create
    TAKE_OVER = "replace it"  # expired, or its holder is gone: compare-and-swap on its ETag
    HELD = "refuse"  # a live writer holds it: DirectoryLocked


def judge_lease(
    held: Lease | None, *, present: bool, now: float, holder_gone: bool
) -> LeaseVerdict:
    """The verdict on the lease found (``present``: an object is there; ``held``: what it says,
    ``None`` if unreadable). ``holder_gone``: its holder ran on this host and is no longer
    running. An unreadable lease is never taken over (it may be a live writer's of another
    version): it is refused like a held one."""
    if not present:
        return LeaseVerdict.FREE
    if held is None:
        return LeaseVerdict.HELD
    if holder_gone or now >= held.expires:
        return LeaseVerdict.TAKE_OVER
    return LeaseVerdict.HELD


def renew_after(ttl: float) -> float:
    """Seconds between renewals of a lease of ``ttl`` seconds: a third, so two renewals can
    fail before it expires."""
    if not ttl > 0:
        raise ValueError(f"a lease's time must be > 0 seconds, got {ttl!r}")
    return ttl / 3


def describe_lease(lease: Lease | None, *, now: float) -> str:
    """The holder, as the DirectoryLocked message names it."""
    if lease is None:
        return "an unknown writer (the lease object is not pitstop's)"
    return (
        f"run {lease.run_id} (pid {lease.pid} on host {lease.host}, since {lease.since:.0f} "
        f"epoch seconds; its lease expires in {max(0.0, lease.expires - now):.0f} s)"
    )


def range_reads(size: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """The ranged GETs ``(start, end)`` (end exclusive) that read ``size`` bytes in order, each
    at most ``chunk`` bytes, covering every byte exactly once."""
    if chunk <= 0 or size < 0:
        raise ValueError(f"need a chunk > 0 and a size >= 0, got {chunk}, {size}")
    return tuple((at, min(at + chunk, size)) for at in range(0, size, chunk))
