# The stream between two writers: whether a copy's bytes go over a direct socket or pitstop's
# group, one answer on both sides.
#
# Rules: the receiver of a copy offers a stream — the address and port it listens on and a
# random token — or offers nothing (streams turned off, no address, listening failed). The
# sender connects to an offer and presents the token, and reports whether it did; it reports
# even when nothing was offered, so that the three messages (offer, report, verdict) always
# travel, whatever failed. The receiver accepts only when it offered and the sender reports a
# connection (else an accept would wait for nobody); a connection that does not present the
# token is refused. The verdict — the stream, only when it offered, the sender connected and it
# accepted a connection with the token — is the receiver's, and is sent to the sender, which
# follows it: so both sides take the same transport, and a stream that failed anywhere is the
# group for both (never one side on each, which would leave the other waiting).
# How: frozen records and pure functions; pitstop.shell.ranks.stream runs the handshake, its
# messages fixed-size on pitstop's group.

"""The stream between two writers: one agreed choice of socket or group for a copy's bytes."""

from __future__ import annotations

import string
from typing import Final

import attrs

__all__ = ["OFFER_BYTES", "TOKEN_CHARS", "Offer", "may_accept", "no_offer", "stream_agreed"]

OFFER_BYTES: Final = 128
"""The size of an offer on the wire (an empty one: no stream offered)."""

TOKEN_CHARS: Final = 32
"""The length of an offer's token (hex digits)."""


def _is_token(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if len(value) != TOKEN_CHARS or not set(value) <= set(string.hexdigits):
        raise ValueError(f"{attribute.name} must be {TOKEN_CHARS} hex digits")


def _is_port(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 < value < 65536:
        raise ValueError(f"{attribute.name} must be a TCP port (1-65535), not {value}")


def _is_host(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value or any(c.isspace() for c in value) or not value.isprintable():
        raise ValueError(f"{attribute.name} must be an address without spaces, not {value!r}")


@attrs.frozen
class Offer:
    """A receiver's offer of a stream: where it listens and the token a sender presents."""

    host: str = attrs.field(validator=_is_host)
    port: int = attrs.field(validator=_is_port)
    token: str = attrs.field(validator=_is_token)

    def to_bytes(self) -> bytes:
        """The offer on the wire: :data:`OFFER_BYTES` bytes, zero-padded."""
        text = f"{self.host} {self.port} {self.token}".encode()
        if len(text) > OFFER_BYTES:
            raise ValueError(f"an offer for {self.host!r} does not fit {OFFER_BYTES} bytes")
        return text.ljust(OFFER_BYTES, b"\0")

    @classmethod
    def from_bytes(cls, data: bytes) -> Offer | None:
        """The offer ``data`` carries; ``None`` for no offer, or anything that is not one."""
        try:
            host, port, token = data.rstrip(b"\0").decode().split(" ")
            return cls(host, int(port), token)
        except ValueError:  # not three fields, not UTF-8, not a number, refused by a validator
            return None


def no_offer() -> bytes:
    """The wire form of no offer."""
    return bytes(OFFER_BYTES)


def may_accept(offered: bool, connected: bool) -> bool:
    """Whether the receiver waits for the sender's connection: only when it offered a stream
    and the sender reports that it connected (else nobody would come)."""
    return offered and connected


def stream_agreed(offered: bool, connected: bool, accepted: bool) -> bool:
    """The receiver's verdict, which the sender follows: the stream only when the receiver
    offered one, the sender connected and presented the token, and the receiver accepted it."""
    return may_accept(offered, connected) and accepted
