"""Object storage's decisions: key names, commit and lease records, the retry schedule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.naming import checkpoint_name
from pitstop.core.s3.objects import (
    Commit,
    Lease,
    LeaseVerdict,
    data_name,
    decode_commit,
    decode_lease,
    encode_commit,
    encode_lease,
    judge_lease,
    orphans,
    parse_data_name,
    parse_url,
    range_reads,
    renew_after,
)
from pitstop.core.s3.s3config import profile_settings, retry_settings
from pitstop.errors import ConfigError
from strategies import small_steps

tokens = st.text("abcXYZ019_-", min_size=1, max_size=12)
times = st.floats(0, 1e10, allow_nan=False)


@given(small_steps, tokens)
def test_a_data_name_round_trips_and_is_the_attempts_own(step: int, token: str) -> None:
    name = checkpoint_name(step)
    assert parse_data_name(data_name(name, token)) == (token, name)
    assert data_name(name, token) != data_name(name, token + "x")


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://bkt", "bkt", ""),
        ("s3://bkt/a/b/", "bkt", "a/b"),
        ("s3://my.bkt-1/run", "my.bkt-1", "run"),
    ],
)
def test_urls_parse(url: str, bucket: str, prefix: str) -> None:
    location = parse_url(url)
    assert (location.bucket, location.prefix) == (bucket, prefix)
    assert location.url() == url.rstrip("/")


@pytest.mark.parametrize(
    "url", ["s3://", "s3://B/run", "s3://bkt/a/../b", "s3://bkt/a//b", "/tmp/x"]
)
def test_bad_urls_are_refused_naming_them(url: str) -> None:
    with pytest.raises(ValueError, match=r"s3://|not an s3"):
        parse_url(url)


@given(
    small_steps,
    tokens,
    st.integers(0, 2**40),
    st.dictionaries(st.sampled_from(["seq", "detail"]), st.integers()),
)
def test_a_commit_round_trips(step: int, token: str, size: int, entry: dict[str, int]) -> None:
    name = checkpoint_name(step)
    commit = Commit(name=name, data=data_name(name, token), size=size, entry=entry)
    assert decode_commit(name, encode_commit(commit)) == commit


@given(small_steps, tokens)
def test_a_commit_never_vouches_for_another_name(step: int, token: str) -> None:
    name, other = checkpoint_name(step), checkpoint_name(step + 1)
    raw = encode_commit(Commit(name=name, data=data_name(name, token), size=1))
    with pytest.raises(ValueError, match="commits"):
        decode_commit(other, raw)
    with pytest.raises(ValueError, match="not JSON"):
        decode_commit(name, raw[:-1])


@given(st.lists(st.tuples(small_steps, tokens), max_size=8), st.sets(st.integers(0, 7)))
def test_orphans_are_exactly_the_uncommitted_uploads(
    uploads: list[tuple[int, str]], committed: set[int]
) -> None:
    names = [data_name(checkpoint_name(s), t) for s, t in uploads]
    commits = [
        Commit(name=checkpoint_name(uploads[i][0]), data=names[i], size=0)
        for i in committed
        if i < len(uploads)
    ]
    left = orphans(names, commits)
    assert set(left) == set(names) - {c.data for c in commits}


@given(times, times, st.booleans())
def test_a_live_lease_is_never_taken_over(expires: float, now: float, gone: bool) -> None:
    lease = Lease(run_id="r", host="h", pid=1, since=0.0, expires=expires)
    verdict = judge_lease(lease, present=True, now=now, holder_gone=gone)
    if now < expires and not gone:
        assert verdict is LeaseVerdict.HELD
    else:
        assert verdict is LeaseVerdict.TAKE_OVER
    assert judge_lease(None, present=False, now=now, holder_gone=gone) is LeaseVerdict.FREE
    assert judge_lease(None, present=True, now=now, holder_gone=gone) is LeaseVerdict.HELD
    assert decode_lease(encode_lease(lease)) == lease
    assert decode_lease(b"{not a lease") is None


@given(st.floats(0.001, 1e6))
def test_a_lease_is_renewed_twice_before_it_expires(ttl: float) -> None:
    assert 2 * renew_after(ttl) < ttl


@given(st.floats(0.1, 600), st.integers(0, 12))
def test_retries_wait_at_most_half_the_deadline(deadline: float, retries: int) -> None:
    settings = retry_settings(deadline, max_retries=retries)
    delays = settings.delays()
    assert len(delays) == retries
    assert sum(delays) <= deadline / 2 + 1e-9
    assert list(delays) == sorted(delays)


@given(st.integers(0, 1000), st.integers(1, 10**8), st.integers(0, 10**8))
def test_range_reads_cover_every_byte_once(reads_: int, chunk: int, tail: int) -> None:
    size = max(0, (reads_ - 1) * chunk) + tail % chunk if reads_ else tail % chunk
    reads = range_reads(size, chunk)
    assert all(0 < end - start <= chunk for start, end in reads)
    assert [s for s, _ in reads[1:]] == [e for _, e in reads[:-1]]
    assert (reads[0][0] if reads else 0) == 0
    assert (reads[-1][1] if reads else 0) == size


# --- the AWS configuration: options, then the environment, then the profile ------------------

PROFILE = {
    "aws_access_key_id": "AKIDPROFILE",
    "aws_secret_access_key": "secret-profile",
    "region": "eu-west-3",
    "endpoint_url": "http://127.0.0.1:9000",
}


def test_a_named_profile_gives_its_credentials_region_and_endpoint() -> None:
    config = {"profile lab": {"region": "eu-west-1", "endpoint_url": "http://lab:9000"}}
    credentials = {"lab": {k: v for k, v in PROFILE.items() if k.startswith("aws_")}}
    name, settings = profile_settings({}, {"AWS_PROFILE": "lab"}, credentials, config)
    assert name == "lab"
    assert settings == {
        "access_key_id": "AKIDPROFILE",
        "secret_access_key": "secret-profile",
        "region": "eu-west-1",
        "endpoint": "http://lab:9000",
    }


def test_the_credentials_file_wins_over_the_config_file_for_one_profile() -> None:
    config = {"default": {"region": "us-west-2", "aws_access_key_id": "FROMCONFIG"}}
    credentials = {"default": {"aws_access_key_id": "FROMCREDENTIALS"}}
    _, settings = profile_settings({}, {}, credentials, config)
    assert settings == {"access_key_id": "FROMCREDENTIALS", "region": "us-west-2"}


def test_options_choose_the_profile_and_win_over_it() -> None:
    credentials = {"a": {"region": "r-a"}, "b": {"region": "r-b", "endpoint_url": "http://b"}}
    env = {"AWS_PROFILE": "a"}
    name, settings = profile_settings({"profile": "b", "region": "mine"}, env, credentials, {})
    assert (name, settings) == ("b", {"endpoint": "http://b"})


def test_environment_credentials_take_none_of_the_profiles_keys() -> None:
    # A session token from the profile must never be paired with another key id.
    credentials = {"default": {**PROFILE, "aws_session_token": "token-profile"}}
    env = {"AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_DEFAULT_REGION": "ap-south-1"}
    _, settings = profile_settings({}, env, credentials, {})
    assert settings == {"endpoint": "http://127.0.0.1:9000"}


def test_a_named_profile_that_no_file_holds_is_one_error_naming_it() -> None:
    config = {"default": {}, "profile lab": {}}
    with pytest.raises(ConfigError, match=r"'labb' is in neither .*profiles there: default, lab"):
        profile_settings({}, {"AWS_PROFILE": "labb"}, {}, config)
    assert profile_settings({}, {}, {}, {}) == ("default", {})  # no files, no profile: nothing


_KEYS = st.sampled_from([*sorted(PROFILE), "aws_session_token"])
_SETTINGS = ("access_key_id", "secret_access_key", "session_token", "region", "endpoint")
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_PROFILE")


@given(
    profile=st.dictionaries(_KEYS, st.text("abc", min_size=1, max_size=3)),
    environ=st.dictionaries(st.sampled_from(_ENV), st.sampled_from(["", "default", "x"])),
    options=st.dictionaries(st.sampled_from(_SETTINGS), st.just("opt")),
)
def test_the_profile_fills_only_what_options_and_environment_leave(
    profile: dict[str, str], environ: dict[str, str], options: dict[str, str]
) -> None:
    try:
        name, settings = profile_settings(options, environ, {"default": profile}, {})
    except ConfigError:
        assert environ.get("AWS_PROFILE") == "x"  # named, and in neither file
        return
    assert name == (environ.get("AWS_PROFILE") or "default")
    credentials = {"access_key_id", "secret_access_key", "session_token"}
    for setting, value in settings.items():
        assert setting not in options
        assert value in profile.values()
        if setting in credentials:
            assert not environ.get("AWS_ACCESS_KEY_ID")
            assert not credentials & set(options)
        if setting == "region":
            assert not environ.get("AWS_REGION")
            assert not environ.get("AWS_DEFAULT_REGION")
        if setting == "endpoint":
            assert not environ.get("AWS_ENDPOINT_URL")
    if name == "default" and not environ.get("AWS_ENDPOINT_URL") and "endpoint" not in options:
        assert settings.get("endpoint") == profile.get("endpoint_url")
