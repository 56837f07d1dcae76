"""The NIXL notifs of push mode and their classification (R-P06, R-P08, B-06).

Four kinds of notif share one NIXL notif channel:

* ``PUSH_REG:<msgpack>``: D registers its blocks with P (`kvhandoff.protocol.push_wire`).
* ``<request_id>:<tp_size>``: P tells D a WRITE landed (the pull-mode completion notif);
  ``request_id`` is D's own id. Ids may contain ``:``, so the tp size follows the last one.
* ``HB:<id>,<id>,...``: D renews P's leases on the listed requests; ids contain no ``,``.
* ``PUSH_FAIL:<msgpack{request_id, reason}>``: P tells D a WRITE failed to post, so D fails
  the receive at once instead of waiting for its watchdog (B-06).

`parse_notif` sorts bytes into one of the frozen records below. A completion notif may
not begin with another kind's prefix (so no request id may be ``HB``, ``PUSH_REG``,
``PUSH_FAIL`` or start with ``HB:``, ...), which keeps the classification unambiguous.
Every decoder has a size cap and raises only `RemoteProtocolError` on bad bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Final, TypeAlias

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.push_wire import (
    MSGPACK_DECODE_ERRORS,
    PUSH_REG_PREFIX,
    NonEmptyStr,
    PushRegistration,
    decode_push_reg,
)

__all__ = [
    "DEFAULT_MAX_HEARTBEAT_IDS",
    "DEFAULT_MAX_NOTIF_BYTES",
    "HEARTBEAT_PREFIX",
    "MAX_FAILURE_REASON_CHARS",
    "MAX_TP_SIZE",
    "RESERVED_PREFIXES",
    "WRITE_FAILED_PREFIX",
    "CompletionNotif",
    "HeartbeatNotif",
    "Notif",
    "PushRegNotif",
    "WriteFailedNotif",
    "decode_completion_notif",
    "decode_heartbeat",
    "decode_write_failed",
    "encode_completion_notif",
    "encode_heartbeat",
    "encode_write_failed",
    "parse_notif",
]

HEARTBEAT_PREFIX: Final = b"HB:"
WRITE_FAILED_PREFIX: Final = b"PUSH_FAIL:"
RESERVED_PREFIXES: Final = (PUSH_REG_PREFIX, WRITE_FAILED_PREFIX, HEARTBEAT_PREFIX)
"""Prefixes that mark a notif kind; a completion notif's request id may not start with one."""

DEFAULT_MAX_NOTIF_BYTES: Final = 1 << 20
DEFAULT_MAX_HEARTBEAT_IDS: Final = 65536
MAX_FAILURE_REASON_CHARS: Final = 1024
MAX_TP_SIZE: Final = 999_999_999
"""Largest tp_size a completion notif may carry (nine digits, no leading zero)."""

_TP_SIZE = re.compile(r"[1-9][0-9]{0,8}")


class PushRegNotif(msgspec.Struct, frozen=True):
    """A PUSH_REG notif (R-P02)."""

    registration: PushRegistration


class CompletionNotif(msgspec.Struct, frozen=True):
    """A WRITE completion notif ``<request_id>:<tp_size>`` (R-P06)."""

    request_id: str
    tp_size: int


class HeartbeatNotif(msgspec.Struct, frozen=True):
    """A lease heartbeat ``HB:<ids>`` (R-P08, R-P15)."""

    request_ids: tuple[str, ...]


class WriteFailedNotif(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """P could not post the WRITE for D's request ``request_id`` (B-06).

    Also the msgpack payload of ``PUSH_FAIL:``.
    """

    request_id: NonEmptyStr
    reason: Annotated[str, msgspec.Meta(max_length=MAX_FAILURE_REASON_CHARS)]


Notif: TypeAlias = PushRegNotif | CompletionNotif | HeartbeatNotif | WriteFailedNotif

_WRITE_FAILED_DECODER: Final = msgspec.msgpack.Decoder(WriteFailedNotif)


def _check_size(data: bytes, what: str, max_bytes: int, peer: str | None) -> None:
    if len(data) > max_bytes:
        raise RemoteProtocolError(
            f"{what} notif of {len(data)} bytes exceeds the {max_bytes}-byte cap", peer=peer
        )


def _utf8(data: bytes, what: str, peer: str | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"{what} notif is not valid UTF-8: {exc}", peer=peer) from exc


def _reserved_prefix(request_id: str) -> bytes | None:
    """The reserved prefix a completion notif for ``request_id`` would start with, if any.

    Prefixes end with ``:``, so ``"HB"`` is as ambiguous as ``"HB:x"`` (``b"HB:1"``).
    """
    raw = request_id.encode("utf-8", "surrogatepass") + b":"
    if not raw.startswith(RESERVED_PREFIXES):  # one test of every prefix
        return None
    return next(p for p in RESERVED_PREFIXES if raw.startswith(p))


# --- completion -------------------------------------------------------------------


def encode_completion_notif(request_id: str, tp_size: int) -> bytes:
    """Encode ``<request_id>:<tp_size>``; a bad argument raises `LocalProtocolError`."""
    if not request_id:
        raise LocalProtocolError("completion notif needs a non-empty request id")
    prefix = _reserved_prefix(request_id)
    if prefix is not None:
        raise LocalProtocolError(
            f"completion notif request id {request_id!r} starts with reserved prefix {prefix!r}"
        )
    if type(tp_size) is not int or not 1 <= tp_size <= MAX_TP_SIZE:
        raise LocalProtocolError(
            f"completion notif tp_size must be an int in 1..{MAX_TP_SIZE}, got {tp_size!r}"
        )
    try:
        return f"{request_id}:{tp_size}".encode()
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"completion notif request id is not encodable: {exc}") from exc


def decode_completion_notif(
    data: bytes, *, peer: str | None = None, max_bytes: int = DEFAULT_MAX_NOTIF_BYTES
) -> CompletionNotif:
    """Decode ``<request_id>:<tp_size>``, splitting on the last ``:``."""
    _check_size(data, "completion", max_bytes, peer)
    text = _utf8(data, "completion", peer)
    request_id, sep, tp_text = text.rpartition(":")
    if not sep:
        raise RemoteProtocolError(f"completion notif {text[:80]!r} has no ':'", peer=peer)
    if not request_id:
        raise RemoteProtocolError("completion notif has an empty request id", peer=peer)
    if _reserved_prefix(request_id) is not None:
        raise RemoteProtocolError(
            f"completion notif request id {request_id[:80]!r} starts with a reserved prefix",
            peer=peer,
        )
    if not _TP_SIZE.fullmatch(tp_text):
        raise RemoteProtocolError(
            f"completion notif for request {request_id[:80]!r} has tp_size {tp_text[:20]!r},"
            " not a positive integer",
            peer=peer,
        )
    return CompletionNotif(request_id=request_id, tp_size=int(tp_text))


# --- heartbeat --------------------------------------------------------------------


def encode_heartbeat(request_ids: Sequence[str]) -> bytes:
    """Encode ``HB:<id>,<id>,...``; ids must be non-empty and free of ``,``."""
    if not request_ids:
        raise LocalProtocolError("heartbeat needs at least one request id")
    for rid in request_ids:
        if not rid or "," in rid:
            raise LocalProtocolError(f"heartbeat request id {rid!r} is empty or contains ','")
    try:
        return HEARTBEAT_PREFIX + ",".join(request_ids).encode()
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"heartbeat request id is not encodable: {exc}") from exc


def decode_heartbeat(
    data: bytes,
    *,
    peer: str | None = None,
    max_bytes: int = DEFAULT_MAX_NOTIF_BYTES,
    max_ids: int = DEFAULT_MAX_HEARTBEAT_IDS,
) -> HeartbeatNotif:
    """Decode ``HB:<id>,<id>,...`` into the listed request ids."""
    _check_size(data, "heartbeat", max_bytes, peer)
    if not data.startswith(HEARTBEAT_PREFIX):
        raise RemoteProtocolError("notif does not start with HB:", peer=peer)
    body = _utf8(data[len(HEARTBEAT_PREFIX) :], "heartbeat", peer)
    ids = tuple(body.split(","))
    if len(ids) > max_ids:
        raise RemoteProtocolError(
            f"heartbeat lists {len(ids)} request ids, over the cap of {max_ids}", peer=peer
        )
    if "" in ids:
        raise RemoteProtocolError("heartbeat has an empty request id", peer=peer)
    return HeartbeatNotif(request_ids=ids)


# --- write failed (B-06) ----------------------------------------------------------


def encode_write_failed(request_id: str, reason: str) -> bytes:
    """Encode ``PUSH_FAIL:<msgpack>``; ``reason`` is cut to `MAX_FAILURE_REASON_CHARS`."""
    if not request_id:
        raise LocalProtocolError("PUSH_FAIL notif needs a non-empty request id")
    record = WriteFailedNotif(request_id=request_id, reason=reason[:MAX_FAILURE_REASON_CHARS])
    try:
        return WRITE_FAILED_PREFIX + msgspec.msgpack.encode(record)
    except (msgspec.MsgspecError, TypeError, ValueError) as exc:
        raise LocalProtocolError(f"cannot encode PUSH_FAIL for {request_id!r}: {exc}") from exc


def decode_write_failed(
    data: bytes, *, peer: str | None = None, max_bytes: int = DEFAULT_MAX_NOTIF_BYTES
) -> WriteFailedNotif:
    """Decode ``PUSH_FAIL:<msgpack{request_id, reason}>``."""
    _check_size(data, "PUSH_FAIL", max_bytes, peer)
    if not data.startswith(WRITE_FAILED_PREFIX):
        raise RemoteProtocolError("notif does not start with PUSH_FAIL:", peer=peer)
    try:
        return _WRITE_FAILED_DECODER.decode(memoryview(data)[len(WRITE_FAILED_PREFIX) :])
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed PUSH_FAIL: {exc}", peer=peer) from exc


# --- classification ---------------------------------------------------------------


def parse_notif(
    data: bytes, *, peer: str | None = None, max_bytes: int = DEFAULT_MAX_NOTIF_BYTES
) -> Notif:
    """Classify and decode one notif; bad bytes raise only `RemoteProtocolError`."""
    _check_size(data, "incoming", max_bytes, peer)
    if data.startswith(PUSH_REG_PREFIX):
        return PushRegNotif(decode_push_reg(data, peer=peer, max_bytes=max_bytes))
    if data.startswith(WRITE_FAILED_PREFIX):
        return decode_write_failed(data, peer=peer, max_bytes=max_bytes)
    if data.startswith(HEARTBEAT_PREFIX):
        return decode_heartbeat(data, peer=peer, max_bytes=max_bytes)
    return decode_completion_notif(data, peer=peer, max_bytes=max_bytes)
