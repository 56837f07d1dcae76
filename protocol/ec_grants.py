"""Checks and builders of the encoder-cache `XferReq`/`XferAck` exchange (R-E09, R-E10).

The producer checks a request's version and compatibility before looking it up
(`check_xfer_req`) and answers with `nack` or `grant_ack`; the consumer checks that an ack
answers its request and fits it (`check_xfer_ack`). The messages and their codec live in
`ec_wire`. P2P only: imports msgspec through it (R-E02).
"""

from __future__ import annotations

from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, EXTENSIONS, REGION_BASE, XferStatus
from kvhandoff.protocol.ec_wire import XferAck, XferReq, validate_grant
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["check_xfer_ack", "check_xfer_req", "grant_ack", "nack"]


def check_xfer_req(req: XferReq, *, expected_hash: str) -> XferStatus | None:
    """The NACK a producer owes `req` before looking it up, or None when it may proceed.

    Version first (`NACK_VERSION`, R-E09), then compatibility (`NACK_INCOMPAT`, R-E10),
    then a request that names no session and no transfer id (`NACK_INTERNAL`, as vLLM 0.33:
    its grant could not be told apart from another peer's). Presence and readiness
    (`NACK_MISSING`, `NACK_NOT_READY`) are the producer's to check.
    """
    if req.version != EC_CONNECTOR_VERSION:
        return XferStatus.NACK_VERSION
    if req.compat_hash != expected_hash:
        return XferStatus.NACK_INCOMPAT
    if not (req.session_id or req.transfer_id):
        return XferStatus.NACK_INTERNAL
    return None


def check_xfer_ack(
    ack: XferAck, req: XferReq, *, block_size_bytes: int | None = None, peer: str | None = None
) -> None:
    """Raise `RemoteProtocolError` unless `ack` answers `req` (and, on OK, fits it).

    Checks the echoed `transfer_id` (when the producer echoes one; a stock vLLM producer
    does not), `session_id` (when echoed) and `mm_hash`; for an `OK` grant also that it
    names `req.num_blocks` blocks (holding `req.size_bytes` bytes when the producer says
    its size), and, when given, that the producer's block size equals the consumer's
    `block_size_bytes`.
    """
    tid = ack.transfer_id or req.transfer_id
    sid = ack.session_id or req.session_id
    if (tid, sid, ack.mm_hash) != (req.transfer_id, req.session_id, req.mm_hash):
        raise RemoteProtocolError(
            f"XferAck for ({ack.transfer_id!r}, {ack.mm_hash!r}) does not answer "
            f"XferReq ({req.transfer_id!r}, {req.mm_hash!r})",
            peer=peer,
        )
    if ack.status is not XferStatus.OK:
        return
    if len(ack.block_indices) != req.num_blocks or ack.size_bytes not in (0, req.size_bytes):
        raise RemoteProtocolError(
            f"XferAck {ack.transfer_id!r} grants {len(ack.block_indices)} blocks / "
            f"{ack.size_bytes} bytes, requested {req.num_blocks} / {req.size_bytes}",
            peer=peer,
        )
    if block_size_bytes is not None and ack.block_size_bytes != block_size_bytes:
        raise RemoteProtocolError(
            f"XferAck {ack.transfer_id!r} has block_size_bytes {ack.block_size_bytes}, "
            f"local layout uses {block_size_bytes}",
            peer=peer,
        )


def nack(req: XferReq, status: XferStatus, *, producer_agent_name: str = "") -> XferAck:
    """The refusal of `req` with `status` (any status but `OK`). As vLLM's, it carries
    `mm_hash` and `status`; kvhandoff's fields (the transfer id, the extensions) only
    for a consumer that sent a transfer id."""
    if status is XferStatus.OK:
        raise LocalProtocolError("nack() needs a NACK status; use grant_ack() to grant")
    if not req.transfer_id:
        return XferAck(mm_hash=req.mm_hash, status=status)
    return XferAck(
        mm_hash=req.mm_hash,
        status=status,
        session_id=req.session_id,
        transfer_id=req.transfer_id,
        producer_agent_name=producer_agent_name,
        extensions=EXTENSIONS,
    )


def grant_ack(
    req: XferReq,
    *,
    producer_agent_name: str,
    producer_agent_metadata: bytes,
    block_indices: list[int],
    block_size_bytes: int,
    size_bytes: int,
    region_base_addr: int,
    lease_s: float,
    mem_descriptor: bytes = b"",
) -> XferAck:
    """The `OK` answer to `req`; `LocalProtocolError` if the grant is incoherent.

    Coherent means what `decode_xfer_ack` demands of an `OK` ack: agent metadata,
    distinct non-negative blocks that hold `size_bytes`, a positive lease. The ack carries
    vLLM's fields (`session_id`, `src_block_indices`, `agent_metadata`, `mem_descriptor`)
    and kvhandoff's; `mem_descriptor` is left out for a consumer that advertised
    `region_base` (C-04).
    """
    if REGION_BASE in req.extensions:
        mem_descriptor = b""
    ack = XferAck(
        mm_hash=req.mm_hash,
        status=XferStatus.OK,
        session_id=req.session_id,
        block_indices=list(block_indices),
        producer_agent_metadata=producer_agent_metadata,
        mem_descriptor=mem_descriptor,
        transfer_id=req.transfer_id,
        producer_agent_name=producer_agent_name,
        block_size_bytes=block_size_bytes,
        size_bytes=size_bytes,
        region_base_addr=region_base_addr,
        lease_s=float(lease_s),
        extensions=EXTENSIONS,
    )
    try:
        validate_grant(ack, None)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(f"invalid grant: {exc}") from exc
    return ack
