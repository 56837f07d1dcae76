"""The optional cluster key: sealed control notifs between kvhandoff peers (S-05).

NIXL tells a receiver who sent a notif by the sender agent's own word: any process that
can reach an agent can claim another agent's name, and every agent's name is public
through the side channel. Without a key, a spoofed name therefore looks like the peer it
names. With a shared cluster key (configured on every kvhandoff engine of a cluster,
never defaulted), every control notif kvhandoff sends to a peer (``PUSH_REG``, heartbeats,
completion notifs, ``PUSH_FAIL``) travels sealed::

    KVHA: + msgpack([sender agent name, the notif, HMAC-SHA256(key, domain | sender | notif)])

and the receiver opens it only when the tag verifies and the sealed sender is the agent
NIXL says sent it. A process without the key can neither forge a notif nor pass a sealed
one off under another name. It can replay a notif it captured on the wire from its true
sender's name: a replay is a duplicate of a message that was already accepted (the
machines drop duplicates), and reading the wire is outside this protection (NIXL does not
encrypt; neither KV nor notifs are confidential).

Peers advertise the extension and the key's id (not the key) in the handshake, and a side
with a key refuses a peer without the same key id (`check_compatible`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.push_wire import MSGPACK_DECODE_ERRORS

__all__ = ["AUTH_PREFIX", "MIN_KEY_BYTES", "ClusterKey", "is_sealed"]

AUTH_PREFIX: Final = b"KVHA:"
MIN_KEY_BYTES: Final = 16
_DOMAIN: Final = b"kvhandoff-notif-v1\x00"
_TAG_BYTES: Final = 32
_MAX_SENDER: Final = 256


class _Sealed(msgspec.Struct, array_like=True, frozen=True):
    sender: str
    message: bytes
    tag: bytes


_DECODER: Final = msgspec.msgpack.Decoder(_Sealed)


def is_sealed(data: bytes) -> bool:
    return data.startswith(AUTH_PREFIX)


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

    def _tag(self, sender: bytes, message: bytes) -> bytes:
        mac = hmac.new(self._secret, _DOMAIN, hashlib.sha256)
        mac.update(len(sender).to_bytes(2, "big"))
        mac.update(sender)
        mac.update(message)
        return mac.digest()

    def seal(self, sender: str, message: bytes) -> bytes:
        """`message` sealed as sent by agent `sender`."""
        raw = sender.encode("utf-8")
        if not raw or len(raw) > _MAX_SENDER:
            raise LocalProtocolError(f"cannot seal for agent name {sender[:80]!r}")
        sealed = _Sealed(sender, bytes(message), self._tag(raw, bytes(message)))
        return AUTH_PREFIX + msgspec.msgpack.encode(sealed)

    def open(self, sender: str, data: bytes) -> bytes:
        """The notif inside `data`, which NIXL says `sender` sent; `RemoteProtocolError`
        unless it is sealed with this key by that very agent."""
        if not data.startswith(AUTH_PREFIX):
            raise RemoteProtocolError("notif is not sealed with the cluster key", peer=sender)
        try:
            sealed = _DECODER.decode(memoryview(data)[len(AUTH_PREFIX) :])
        except MSGPACK_DECODE_ERRORS as exc:
            raise RemoteProtocolError(f"malformed sealed notif: {exc}", peer=sender) from exc
        raw = sealed.sender.encode("utf-8", "surrogatepass")
        if len(sealed.tag) != _TAG_BYTES or len(raw) > _MAX_SENDER:
            raise RemoteProtocolError("sealed notif has a malformed tag or sender", peer=sender)
        if not hmac.compare_digest(sealed.tag, self._tag(raw, sealed.message)):
            raise RemoteProtocolError("sealed notif fails the cluster key check", peer=sender)
        if sealed.sender != sender:
            raise RemoteProtocolError(
                f"sealed notif of agent {sealed.sender[:80]!r} arrived from {sender!r}",
                peer=sender,
            )
        return sealed.message
