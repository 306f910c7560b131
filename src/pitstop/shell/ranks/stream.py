# A direct TCP stream between two writers for the bulk bytes of a copy, set up through
# pitstop's group and agreed by both sides (pitstop.core.ranks.stream).
#
# Rules: the receiver listens on an ephemeral port of the address this host uses to reach the
# rendezvous (a UDP socket connected toward MASTER_ADDR says which; PITSTOP_PEER_ADDRESS
# overrides it; PITSTOP_PEER_STREAM=0 turns streams off on that node) and offers address,
# port and a random token over the group; the sender connects, presents the token and reports
# whether it could; the receiver accepts (a connection without the token is closed, the next
# one tried, until the deadline) and sends its verdict, which both follow: the stream, or the
# group for both. Every connect (at most CONNECT_S), accept, send and receive is bounded by
# pitstop's timeout; the listening socket is closed once the handshake ends, the stream by its
# user on every path.
# On the stream the bytes travel in order, with no framing: both sides know the sizes from
# the header sent over the group before, and a trailer over the group ends the copy.
# How: blocking sockets with timeouts; the three handshake messages are fixed-size tensors on
# pitstop's group (``exchange``: pitstop.shell.ranks.peers' bounded point-to-point message).

"""A direct socket between two writers for a copy's bytes, offered, tokened and agreed."""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Final

import torch

from pitstop.core.ranks.stream import OFFER_BYTES, Offer, may_accept, no_offer, stream_agreed
from pitstop.shell.ranks.distributed import Ranks

__all__ = ["ADDRESS_ENV", "STREAM_ENV", "receive_exactly", "receiver_stream", "sender_stream"]

ADDRESS_ENV: Final = "PITSTOP_PEER_ADDRESS"
"""The address a node's receiver listens on and offers (default: the one toward MASTER_ADDR)."""

STREAM_ENV: Final = "PITSTOP_PEER_STREAM"
"""``0``: this node neither offers nor takes a stream (its copies travel over the group)."""

CONNECT_S: Final = 5.0
"""The most a sender waits for its connection to an offer (``timeout_s`` where less; a LAN
connects in milliseconds): an address it cannot reach falls back to the group within seconds."""

Exchange = Callable[[Ranks, torch.Tensor, int], None]
"""One bounded message on pitstop's group: ``exchange(ranks, tensor, peer)`` (send or receive)."""


def _enabled() -> bool:
    return os.environ.get(STREAM_ENV, "1").strip() not in {"0", "false", "no", "off"}


def _address() -> str | None:
    """The address to listen on: :data:`ADDRESS_ENV`, else the one this host uses toward
    MASTER_ADDR (``None``: neither is known)."""
    given = os.environ.get(ADDRESS_ENV, "").strip()
    if given:
        return given
    master = os.environ.get("MASTER_ADDR", "").strip()
    if not master:
        return None
    try:
        family = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "9") or 9)))
            return str(probe.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return None


def _listen(timeout_s: float) -> tuple[socket.socket, Offer] | None:
    """A listening socket on an ephemeral port and its offer (``None``: no stream here)."""
    host = _address() if _enabled() else None
    if host is None:
        return None
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        listener.bind((host, 0))
        listener.listen(4)
        listener.settimeout(timeout_s)
        offer = Offer(host, int(listener.getsockname()[1]), secrets.token_hex(16))
        offer.to_bytes()  # an address too long for the wire: no stream
    except (OSError, ValueError):
        listener.close()
        return None
    return listener, offer


def _accept(listener: socket.socket, token: str, timeout_s: float) -> socket.socket | None:
    """The connection that presents ``token`` (others are closed), or ``None`` by the deadline."""
    deadline = time.monotonic() + timeout_s
    want = token.encode()
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except OSError:  # the deadline passed (TimeoutError is an OSError), or accept failed
            return None
        try:
            conn.settimeout(max(min(left, 10.0), 0.001))  # the sender sent it before it reported
            got = bytearray(len(want))
            receive_exactly(conn, memoryview(got))
            if hmac.compare_digest(bytes(got), want):
                conn.settimeout(timeout_s)
                return conn
        except OSError:
            pass
        conn.close()  # not the sender: refused
    return None


def _connect(offer: Offer, timeout_s: float) -> socket.socket | None:
    """A connection to ``offer`` that presented its token (``None``: it could not be made)."""
    try:
        sock = socket.create_connection((offer.host, offer.port), timeout=min(timeout_s, CONNECT_S))
    except OSError:
        return None
    try:
        sock.settimeout(timeout_s)
        sock.sendall(offer.token.encode())
    except OSError:
        sock.close()
        return None
    return sock


def receive_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (each receive bounded by its timeout); a stream that ends
    first is an OSError."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError(f"the stream ended after {got} of {view.nbytes} bytes")
        got += n


def receiver_stream(
    ranks: Ranks, source: int, send: Exchange, receive: Exchange
) -> socket.socket | None:
    """The receiver's side of the handshake with ``source``: its stream, or ``None`` (the
    group, as the sender is told). Every message travels whatever failed."""
    listening = _listen(ranks.timeout_s)
    conn: socket.socket | None = None
    try:
        offer = listening[1].to_bytes() if listening else no_offer()
        send(ranks, torch.frombuffer(bytearray(offer), dtype=torch.uint8), source)
        report = torch.zeros(1, dtype=torch.int64)
        receive(ranks, report, source)
        if listening is not None and may_accept(True, bool(report[0])):
            conn = _accept(listening[0], listening[1].token, ranks.timeout_s)
        agreed = stream_agreed(listening is not None, bool(report[0]), conn is not None)
        send(ranks, torch.tensor([int(agreed)], dtype=torch.int64), source)
    except BaseException:
        if conn is not None:
            conn.close()
        raise
    finally:
        if listening is not None:
            listening[0].close()
    if not agreed and conn is not None:
        conn.close()
        conn = None
    return conn


def sender_stream(
    ranks: Ranks, target: int, send: Exchange, receive: Exchange
) -> socket.socket | None:
    """The sender's side of the handshake with ``target``: the stream the receiver agreed
    to, or ``None`` (the group)."""
    box = torch.zeros(OFFER_BYTES, dtype=torch.uint8)
    receive(ranks, box, target)
    offer = Offer.from_bytes(box.numpy().tobytes())
    sock = _connect(offer, ranks.timeout_s) if offer is not None and _enabled() else None
    try:
        send(ranks, torch.tensor([int(sock is not None)], dtype=torch.int64), target)
        verdict = torch.zeros(1, dtype=torch.int64)
        receive(ranks, verdict, target)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if not int(verdict[0]) and sock is not None:
        sock.close()
        sock = None
    return sock
