"""The optional cluster key: sealed control notifs between kvhandoff peers (S-05).

NIXL tells a receiver who sent a notif by the sender agent's own word: any process that
can reach an agent can claim another agent's name, and every agent's name is public
through the side channel. Without a key, a spoofed name therefore looks like the peer it
names. With a shared cluster key (configured on every kvhandoff engine of a cluster,
never defaulted), every control notif kvhandoff sends to a peer (``PUSH_REG``, heartbeats,
completion notifs, ``PUSH_FAIL``) travels sealed::

    KVHA: + msgpack([sender agent name, the notif, nonce, sealed_at,
                     HMAC-SHA256(key, domain | sender | nonce | sealed_at | notif)])

and the receiver opens it only when the tag verifies and the sealed sender is the agent
NIXL says sent it. A process without the key can neither forge a notif nor pass a sealed
one off under another name.

Replays: the same bytes sent again later, by anyone, are refused (`ReplayWindow`). A
sealed notif is fresh for `ttl` seconds after `sealed_at` (the sender's wall clock, within
`skew` of the receiver's); within that time its nonce is remembered and a second copy is
refused; after it, it is refused as stale. A receiver also refuses what was sealed before
it started (less a `start_grace` of clock skew), so bytes captured before a restart are
not served to the new process even while they are fresh. What stays outside this
protection: reading the wire (NIXL does not encrypt; neither KV nor notifs are
confidential), a replay within `start_grace` of a restart, and, above `capacity` sealed
notifs per `ttl + skew` on one rank, a replay of a nonce the window had to let go.

Peers advertise the extension and the key's id (not the key) in the handshake, and a side
with a key refuses a peer without the same key id (`check_compatible`).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import struct
from typing import Final, NamedTuple

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.push_wire import MSGPACK_DECODE_ERRORS

__all__ = [
    "AUTH_PREFIX",
    "MIN_KEY_BYTES",
    "ClusterKey",
    "NonceSource",
    "Opened",
    "ReplayWindow",
    "is_sealed",
    "peek_sealed",
]

AUTH_PREFIX: Final = b"KVHA:"
MIN_KEY_BYTES: Final = 16
_DOMAIN: Final = b"kvhandoff-notif-v2\x00"
_TAG_BYTES: Final = 32
_MAX_SENDER: Final = 256
NONCE_BYTES: Final = 16


class _Sealed(msgspec.Struct, array_like=True, frozen=True):
    sender: str
    message: bytes
    nonce: bytes
    sealed_at: float
    tag: bytes


class Opened(NamedTuple):
    """A sealed notif that verified: the notif, and what the replay window checks."""

    message: bytes
    nonce: bytes
    sealed_at: float


class NonceSource:
    """Unique nonces for one process: a random prefix (given, so this module stays pure)
    and a counter. Uniqueness is what the window needs; the tag makes them unforgeable."""

    __slots__ = ("_count", "_prefix")

    def __init__(self, prefix: bytes) -> None:
        if len(prefix) != NONCE_BYTES - 8:
            raise LocalProtocolError(f"a nonce prefix is {NONCE_BYTES - 8} bytes")
        self._prefix = bytes(prefix)
        self._count = itertools.count()

    def next(self) -> bytes:
        return self._prefix + next(self._count).to_bytes(8, "big")  # atomic under the GIL


_DECODER: Final = msgspec.msgpack.Decoder(_Sealed)


def is_sealed(data: bytes) -> bool:
    return data.startswith(AUTH_PREFIX)


def peek_sealed(data: bytes) -> bytes | None:
    """The notif inside a sealed one, unverified (for observers that hold no key, such
    as the simulator's checks); None when `data` is not a well-formed seal."""
    if not data.startswith(AUTH_PREFIX):
        return None
    try:
        return _DECODER.decode(memoryview(data)[len(AUTH_PREFIX) :]).message
    except MSGPACK_DECODE_ERRORS:
        return None


class ClusterKey:
    """A shared secret of the cluster; `seal` and `open` notifs with it."""

    __slots__ = ("_secret", "key_id")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise LocalProtocolError(
                f"a cluster key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}"
            )
        self._secret = bytes(secret)
        digest = hmac.new(self._secret, b"kvhandoff-key-id", hashlib.sha256).hexdigest()
        self.key_id = digest[:16]

    @classmethod
    def from_text(cls, text: str) -> ClusterKey:
        return cls(text.encode("utf-8"))

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKey(id={self.key_id})"

    def _tag(self, sender: bytes, nonce: bytes, sealed_at: float, message: bytes) -> bytes:
        mac = hmac.new(self._secret, _DOMAIN, hashlib.sha256)
        mac.update(len(sender).to_bytes(2, "big"))
        mac.update(sender)
        mac.update(len(nonce).to_bytes(1, "big"))
        mac.update(nonce)
        mac.update(struct.pack(">d", sealed_at))
        mac.update(message)
        return mac.digest()

    def seal(self, sender: str, message: bytes, *, nonce: bytes, sealed_at: float) -> bytes:
        """`message` sealed as sent by agent `sender` at wall time `sealed_at`, under a
        nonce used once (`NonceSource`)."""
        raw = sender.encode("utf-8")
        if not raw or len(raw) > _MAX_SENDER:
            raise LocalProtocolError(f"cannot seal for agent name {sender[:80]!r}")
        if len(nonce) != NONCE_BYTES:
            raise LocalProtocolError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        body = bytes(message)
        tag = self._tag(raw, nonce, float(sealed_at), body)
        return AUTH_PREFIX + msgspec.msgpack.encode(
            _Sealed(sender, body, nonce, float(sealed_at), tag)
        )

    def open(self, sender: str, data: bytes) -> Opened:
        """The notif inside `data`, which NIXL says `sender` sent; `RemoteProtocolError`
        unless it is sealed with this key by that very agent. Freshness is the
        `ReplayWindow`'s to check."""
        if not data.startswith(AUTH_PREFIX):
            raise RemoteProtocolError("notif is not sealed with the cluster key", peer=sender)
        try:
            sealed = _DECODER.decode(memoryview(data)[len(AUTH_PREFIX) :])
        except MSGPACK_DECODE_ERRORS as exc:
            raise RemoteProtocolError(f"malformed sealed notif: {exc}", peer=sender) from exc
        raw = sealed.sender.encode("utf-8", "surrogatepass")
        if (
            len(sealed.tag) != _TAG_BYTES
            or len(raw) > _MAX_SENDER
            or len(sealed.nonce) != NONCE_BYTES
        ):
            raise RemoteProtocolError(
                "sealed notif has a malformed tag, nonce or sender", peer=sender
            )
        expected = self._tag(raw, sealed.nonce, sealed.sealed_at, sealed.message)
        if not hmac.compare_digest(sealed.tag, expected):
            raise RemoteProtocolError("sealed notif fails the cluster key check", peer=sender)
        if sealed.sender != sender:
            raise RemoteProtocolError(
                f"sealed notif of agent {sealed.sender[:80]!r} arrived from {sender!r}",
                peer=sender,
            )
        return Opened(sealed.message, sealed.nonce, sealed.sealed_at)


class ReplayWindow:
    """The nonces of sealed notifs one receiver accepted and that are still fresh (S-05,
    see the module docstring). Time is an argument: `now` is the receiver's wall clock.
    Memory is bounded by `capacity` nonces; when full, the nonce that goes stale first is
    let go (counted in `evicted`)."""

    __slots__ = (
        "_expiries",
        "_seen",
        "capacity",
        "evicted",
        "skew",
        "start_grace",
        "started_at",
        "ttl",
    )

    def __init__(
        self,
        started_at: float,
        *,
        ttl: float = 120.0,
        skew: float = 5.0,
        start_grace: float = 1.0,
        capacity: int = 1 << 18,
    ) -> None:
        if ttl <= 0 or skew < 0 or start_grace < 0 or capacity < 1:
            raise LocalProtocolError("a replay window needs ttl > 0, skew >= 0, capacity >= 1")
        self.started_at = started_at
        self.ttl = ttl
        self.skew = skew
        self.start_grace = start_grace
        self.capacity = capacity
        self.evicted = 0
        self._seen: set[bytes] = set()
        self._expiries: list[tuple[float, bytes]] = []  # a heap: when each nonce goes stale

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, opened: Opened, now: float, peer: str | None = None) -> bytes:
        """The notif of `opened` if it is fresh and seen for the first time; else a
        `RemoteProtocolError` (stale, from the future, sealed before this receiver
        started, or a replay)."""
        sealed_at = opened.sealed_at
        if not sealed_at >= now - self.ttl - self.skew:  # also refuses NaN
            raise RemoteProtocolError(
                f"stale sealed notif (sealed {now - sealed_at:.1f} s ago)", peer=peer
            )
        if sealed_at > now + self.skew:
            raise RemoteProtocolError(
                f"sealed notif from the future ({sealed_at - now:.1f} s ahead)", peer=peer
            )
        if sealed_at < self.started_at - self.start_grace:
            raise RemoteProtocolError(
                "sealed notif sealed before this receiver started (a replay)", peer=peer
            )
        self._forget_stale(now)
        if opened.nonce in self._seen:
            raise RemoteProtocolError("replayed sealed notif", peer=peer)
        if len(self._seen) >= self.capacity:
            _expiry, oldest = heapq.heappop(self._expiries)
            self._seen.discard(oldest)
            self.evicted += 1
        self._seen.add(opened.nonce)
        heapq.heappush(self._expiries, (sealed_at + self.ttl + self.skew, opened.nonce))
        return opened.message

    def _forget_stale(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] < now:
            self._seen.discard(heapq.heappop(expiries)[1])
