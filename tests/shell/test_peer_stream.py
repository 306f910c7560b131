"""The shell's side of a direct stream between writers: the address offered, the token
checked at accept (a connection without it is refused), every wait bounded."""

from __future__ import annotations

import socket

import pytest

from pitstop.shell.ranks import stream
from pitstop.shell.ranks.stream import ADDRESS_ENV, STREAM_ENV, receive_exactly

BOUND = 30.0  # seconds any wait may take here (a bound on a hang, never a timing check)


def test_the_address_offered_is_the_one_toward_the_rendezvous_or_the_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert stream._address() == "127.0.0.1"
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.2")
    assert stream._address() == "127.0.0.2"
    monkeypatch.delenv(ADDRESS_ENV)
    monkeypatch.delenv("MASTER_ADDR")
    assert stream._address() is None  # nothing known: no stream offered


def test_nothing_is_offered_where_streams_are_off_or_the_address_is_not_this_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1")
    monkeypatch.setenv(STREAM_ENV, "0")
    assert stream._listen(BOUND) is None
    monkeypatch.setenv(STREAM_ENV, "1")
    monkeypatch.setenv(ADDRESS_ENV, "192.0.2.1")  # TEST-NET-1: bind fails
    assert stream._listen(BOUND) is None


def test_a_connection_without_the_token_is_refused_and_the_senders_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1")
    monkeypatch.delenv(STREAM_ENV, raising=False)
    listening = stream._listen(BOUND)
    assert listening is not None
    listener, offer = listening
    with listener:
        stranger = socket.create_connection((offer.host, offer.port), timeout=BOUND)
        stranger.sendall(b"f" * len(offer.token))  # a wrong token, of the right length
        sender = stream._connect(offer, BOUND)
        assert sender is not None
        with stranger, sender:
            conn = stream._accept(listener, offer.token, BOUND)
            assert conn is not None
            with conn:
                sender.sendall(b"payload")
                got = bytearray(7)
                receive_exactly(conn, memoryview(got))
                assert got == b"payload"
            stranger.settimeout(BOUND)
            assert stranger.recv(1) == b""  # refused: closed by the receiver


def test_an_accept_that_nobody_answers_and_a_stream_that_ends_early_end_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1")
    listening = stream._listen(BOUND)
    assert listening is not None
    listener, offer = listening
    with listener:
        assert stream._accept(listener, offer.token, 0.2) is None  # the deadline, not a hang
        sender = stream._connect(offer, BOUND)
        assert sender is not None
        conn = stream._accept(listener, offer.token, BOUND)
        assert conn is not None
        with conn:
            sender.sendall(b"abc")
            sender.close()
            with pytest.raises(ConnectionError, match="ended after 3 of 8 bytes"):
                receive_exactly(conn, memoryview(bytearray(8)))
