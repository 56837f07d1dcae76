"""Producer grant: the producer's answer to one `XferReq` and the pin it holds (R-E09..R-E12).

Keyed by (peer, transfer_id): the consumer's ZMQ identity and the id it chose, so one
consumer can never release another's pin. The producer's scheduler creates a grant for
each decoded `XferReq` and delivers `check` with a `GrantCheck`: the request and a
snapshot of the local entry it names. The guards are tried in order:

1. `wrong_version`: the request's connector version is not ours -> `NACK_VERSION`.
2. `incompatible`: its compatibility hash (engine version, model, dtype,
   block_size_bytes) differs from ours -> `NACK_INCOMPAT`.
3. `absent`: no entry for the `mm_hash`, or one of another size -> `NACK_MISSING`.
4. `not_ready`: the entry is allocated but its GPU->mmap save has not landed ->
   `NACK_NOT_READY` (the consumer retries next step).
5. `no_agent`: this producer has no NIXL agent registered yet -> `NACK_INTERNAL`.
6. otherwise `OK`: the entry is pinned and the ack names the source block indices, the
   region base address and the producer's NIXL agent metadata (R-E11).

Every answer is a `SendXferAck(peer, ack)` effect for the ZMQ ROUTER adapter. A granted
pin is held for `pin_lease_s` (30 s): `xfer_done` (the consumer's `XferDone`) or
`lease_expired` unpins it. A disconnect does not end a grant early (the peer's READ may
still be in flight); the lease does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.ec.cache_entry import ENTRY_KIND
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Emit, Metric
from kvhandoff.protocol.ec_config import DEFAULT_PIN_LEASE_S
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus
from kvhandoff.protocol.ec_wire import XferAck, XferReq, grant_ack, nack

__all__ = [
    "EC_PRODUCER_GRANT",
    "GRANT_KIND",
    "GrantCheck",
    "GrantCtx",
    "SendXferAck",
]

GRANT_KIND = "ec.producer_grant"


@dataclass(slots=True)
class GrantCtx:
    """Who asked, for what, and this producer's identity for the ack."""

    peer: bytes | str = b""
    mm_hash: str = ""
    agent_name: str = ""
    agent_metadata: bytes = b""
    region_base_addr: int = 0
    block_size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class GrantCheck:
    """Payload of `check`: the request and a snapshot of the entry it names."""

    req: XferReq
    expected_hash: str
    entry_state: str | None = None
    entry_blocks: tuple[int, ...] = ()
    entry_size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SendXferAck:
    """ZMQ ROUTER adapter: send `ack` to the consumer identity `peer`."""

    peer: bytes | str
    ack: XferAck


def _wrong_version(inst: Any, check: GrantCheck) -> bool:
    return check.req.version != EC_CONNECTOR_VERSION


def _incompatible(inst: Any, check: GrantCheck) -> bool:
    return check.req.compat_hash != check.expected_hash


def _absent(inst: Any, check: GrantCheck) -> bool:
    return (
        check.entry_state is None
        or check.entry_size_bytes != check.req.size_bytes
        or len(check.entry_blocks) != check.req.num_blocks
    )


def _not_ready(inst: Any, check: GrantCheck) -> bool:
    return check.entry_state == "allocated"


def _no_agent(inst: Any, check: GrantCheck) -> bool:
    return not (inst.ctx.agent_name and inst.ctx.agent_metadata)


def _refuse(inst: Any, check: GrantCheck, status: XferStatus) -> list[object]:
    ack = nack(check.req, status, producer_agent_name=inst.ctx.agent_name)
    return [SendXferAck(inst.ctx.peer, ack), Metric(f"ec.producer.{status}")]


def _nack_version(inst: Any, check: GrantCheck) -> list[object]:
    return _refuse(inst, check, XferStatus.NACK_VERSION)


def _nack_incompat(inst: Any, check: GrantCheck) -> list[object]:
    return _refuse(inst, check, XferStatus.NACK_INCOMPAT)


def _nack_missing(inst: Any, check: GrantCheck) -> list[object]:
    return _refuse(inst, check, XferStatus.NACK_MISSING)


def _nack_not_ready(inst: Any, check: GrantCheck) -> list[object]:
    return _refuse(inst, check, XferStatus.NACK_NOT_READY)


def _nack_internal(inst: Any, check: GrantCheck) -> list[object]:
    return _refuse(inst, check, XferStatus.NACK_INTERNAL)


def _grant(inst: Any, check: GrantCheck) -> list[object]:
    ctx = inst.ctx
    ack = grant_ack(
        check.req,
        producer_agent_name=ctx.agent_name,
        producer_agent_metadata=ctx.agent_metadata,
        block_indices=list(check.entry_blocks),
        block_size_bytes=ctx.block_size_bytes,
        size_bytes=check.entry_size_bytes,
        region_base_addr=ctx.region_base_addr,
        lease_s=inst.machine.config["pin_lease_s"],
    )
    return [
        Emit(ENTRY_KIND, ctx.mm_hash, "pin"),
        SendXferAck(ctx.peer, ack),
        Metric("ec.producer.OK"),
    ]


def _consumed(inst: Any, ok: bool | None) -> list[object]:
    return [Emit(ENTRY_KIND, inst.ctx.mm_hash, "unpin", bool(ok))]


def _lease_expired(inst: Any, payload: Any) -> list[object]:
    return [Emit(ENTRY_KIND, inst.ctx.mm_hash, "unpin", False), Metric("ec.producer.lease_expired")]


_REFUSALS = (
    ("wrong_version", "refused_version", "nack_version"),
    ("incompatible", "refused_incompat", "nack_incompat"),
    ("absent", "refused_missing", "nack_missing"),
    ("not_ready", "refused_not_ready", "nack_not_ready"),
    ("no_agent", "refused_internal", "nack_internal"),
)

EC_PRODUCER_GRANT = Declaration(
    name=GRANT_KIND,
    description=(
        "Producer answer to one XferReq (R-E09, R-E10, R-E12): version, then "
        "compatibility hash, then presence, then readiness; OK pins the entry for a "
        "30 s lease that XferDone or the lease expiry ends."
    ),
    states=[
        "received",
        {
            "name": "granted",
            "timeout": Timeout("pin_lease_s", "expired", "lease_expired", action="unpin_expired"),
        },
        *({"name": dest, "final": True} for _, dest, _ in _REFUSALS),
        {"name": "released", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="received",
    transitions=[
        *(
            {
                "trigger": "check",
                "source": "received",
                "dest": dest,
                "conditions": guard,
                "after": action,
            }
            for guard, dest, action in _REFUSALS
        ),
        {"trigger": "check", "source": "received", "dest": "granted", "after": "grant"},
        {"trigger": "xfer_done", "source": "granted", "dest": "released", "after": "consumed"},
    ],
    ignore=[("granted", "peer_disconnected")],
    callbacks={
        "wrong_version": _wrong_version,
        "incompatible": _incompatible,
        "absent": _absent,
        "not_ready": _not_ready,
        "no_agent": _no_agent,
        "nack_version": _nack_version,
        "nack_incompat": _nack_incompat,
        "nack_missing": _nack_missing,
        "nack_not_ready": _nack_not_ready,
        "nack_internal": _nack_internal,
        "grant": _grant,
        "consumed": _consumed,
        "unpin_expired": _lease_expired,
    },
    config_defaults={"pin_lease_s": DEFAULT_PIN_LEASE_S},
    context=GrantCtx,
)
