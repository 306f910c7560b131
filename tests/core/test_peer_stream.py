"""The stream between two writers: one agreed choice of socket or group (core.ranks.stream)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks.stream import (
    OFFER_BYTES,
    TOKEN_CHARS,
    Offer,
    may_accept,
    no_offer,
    stream_agreed,
)

hosts = st.one_of(
    st.ip_addresses().map(str),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=60),
)
offers = st.builds(
    Offer,
    hosts,
    st.integers(1, 65535),
    st.text("0123456789abcdef", min_size=TOKEN_CHARS, max_size=TOKEN_CHARS),
)


@given(
    offer=st.one_of(st.none(), offers),
    willing=st.booleans(),  # the sender's node allows streams
    reachable=st.booleans(),  # its connect succeeds
    token_arrives=st.booleans(),  # the receiver reads the token from the connection in time
)
def test_both_sides_take_the_same_transport_whatever_fails(
    offer: Offer | None, willing: bool, reachable: bool, token_arrives: bool
) -> None:
    # The handshake as the shell runs it, each side knowing only what it was sent.
    wire = offer.to_bytes() if offer is not None else no_offer()  # receiver -> sender
    assert len(wire) == OFFER_BYTES
    heard = Offer.from_bytes(wire)
    assert heard == offer
    connected = heard is not None and willing and reachable  # sender -> receiver: its report
    waits = may_accept(offer is not None, connected)
    assert waits or not connected or offer is None  # waits whenever someone connected to it
    accepted = waits and token_arrives  # never waits when nobody connected
    verdict = stream_agreed(offer is not None, connected, accepted)  # receiver -> sender
    receiver_streams = verdict and accepted  # it holds the accepted connection
    sender_streams = verdict and connected  # it follows the verdict, holding its connection
    assert receiver_streams == sender_streams == verdict
    assert verdict == (offer is not None and willing and reachable and token_arrives)
    if not connected:
        assert not waits


@given(st.binary(max_size=OFFER_BYTES))
def test_any_bytes_are_an_offer_or_none_never_an_error(data: bytes) -> None:
    offer = Offer.from_bytes(data.ljust(OFFER_BYTES, b"\0"))
    assert offer is None or Offer.from_bytes(offer.to_bytes()) == offer


@pytest.mark.parametrize(
    ("host", "port", "token"),
    [
        ("", 5, "a" * TOKEN_CHARS),
        ("a b", 5, "a" * TOKEN_CHARS),
        ("h", 0, "a" * TOKEN_CHARS),
        ("h", 65536, "a" * TOKEN_CHARS),
        ("h", 5, "a" * (TOKEN_CHARS - 1)),
        ("h", 5, "g" * TOKEN_CHARS),
    ],
)
def test_an_offer_that_cannot_be_followed_is_refused(host: str, port: int, token: str) -> None:
    with pytest.raises(ValueError, match="must be"):
        Offer(host, port, token)


def test_no_offer_is_read_as_none_and_an_offer_too_long_for_the_wire_is_refused() -> None:
    assert Offer.from_bytes(no_offer()) is None
    with pytest.raises(ValueError, match="does not fit"):
        Offer("h" * OFFER_BYTES, 5, "a" * TOKEN_CHARS).to_bytes()
