"""Notif bundles: several notifs to one agent in one NIXL notif (B-13, a C-04 extension).

A batched WRITE (B-13) or a CUDA IPC launch (B-12) completes many requests at once; sending
their completion notifs one `send_notif` each costs P a NIXL round per request and D a
notif per request. Toward a peer that advertises ``notif_bundle`` in its handshake, P
sends them as ONE notif:

    ``KVH_BUNDLE:<msgpack array of bin>``

Each element is a complete notif exactly as it would have been sent alone (sealed, when a
cluster key is in use). D's transport splits a bundle back into its elements before
anything classifies them, so the push machines see the same notifs, from the same agent,
in the same order, and D's accounting is unchanged. A stock vLLM peer never advertises the
extension and never receives a bundle.

The receiver trusts nothing: a bundle is checked structurally (`check_msgpack`) before it
is decoded, holds at most `MAX_BUNDLE_NOTIFS` elements of at most `DEFAULT_MAX_NOTIF_BYTES`
each, and may not nest (an element that is itself a bundle is refused). Every failure is
a `RemoteProtocolError`; elements then go through the ordinary notif checks one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack

__all__ = [
    "EXT_NOTIF_BUNDLE",
    "MAX_BUNDLE_NOTIFS",
    "NOTIF_BUNDLE_PREFIX",
    "decode_notif_bundle",
    "encode_notif_bundle",
    "is_notif_bundle",
]

NOTIF_BUNDLE_PREFIX: Final = b"KVH_BUNDLE:"
EXT_NOTIF_BUNDLE: Final = "notif_bundle"
"""The peer splits ``KVH_BUNDLE:`` notifs (B-13); a stock vLLM peer does not advertise it."""
MAX_BUNDLE_NOTIFS: Final = 4096
"""Elements one bundle may carry (a writer pass's requests for one D rank)."""
MAX_BUNDLE_BYTES: Final = 1 << 20
"""A bundle larger than this is refused unread (and never built: the sender splits)."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[bytes])


def is_notif_bundle(message: bytes) -> bool:
    return message.startswith(NOTIF_BUNDLE_PREFIX)


def encode_notif_bundle(messages: Sequence[bytes]) -> list[bytes]:
    """The bundles that carry `messages` in order: as few as the caps allow (one, for a
    writer pass of ordinary completion notifs). An element that is itself a bundle or
    larger than a bundle may be raises `LocalProtocolError`."""
    bundles: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for message in messages:
        if is_notif_bundle(message):
            raise LocalProtocolError("a notif bundle may not carry another bundle")
        cost = len(message) + 5  # bin 32 header at most
        if cost + len(NOTIF_BUNDLE_PREFIX) + 5 > MAX_BUNDLE_BYTES:
            raise LocalProtocolError(f"a notif of {len(message)} bytes does not fit a bundle")
        if chunk and (len(chunk) == MAX_BUNDLE_NOTIFS or size + cost > MAX_BUNDLE_BYTES - 64):
            bundles.append(NOTIF_BUNDLE_PREFIX + _ENCODER.encode(chunk))
            chunk, size = [], 0
        chunk.append(bytes(message))
        size += cost
    if chunk:
        bundles.append(NOTIF_BUNDLE_PREFIX + _ENCODER.encode(chunk))
    return bundles


def decode_notif_bundle(message: bytes, *, peer: str | None = None) -> list[bytes]:
    """The notifs a bundle carries, in order; `RemoteProtocolError` on anything else."""
    if not is_notif_bundle(message):
        raise RemoteProtocolError("not a notif bundle", peer=peer)
    if len(message) > MAX_BUNDLE_BYTES:
        raise RemoteProtocolError(
            f"notif bundle of {len(message)} bytes exceeds {MAX_BUNDLE_BYTES}", peer=peer
        )
    body = memoryview(message)[len(NOTIF_BUNDLE_PREFIX) :]
    check_msgpack(
        body, max_depth=1, max_items=MAX_BUNDLE_NOTIFS + 1, what="notif bundle", peer=peer
    )
    try:
        notifs = _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed notif bundle: {exc}", peer=peer) from exc
    if not notifs:
        raise RemoteProtocolError("empty notif bundle", peer=peer)
    if any(is_notif_bundle(n) for n in notifs):
        raise RemoteProtocolError("a notif bundle carries another bundle", peer=peer)
    return notifs
