"""The in-memory fabric, for deterministic simulation ONLY: never a production transport.

Every simulated agent (`sim_transport.SimPushTransport`, the `PushTransport` of the
simulator) lives on one `SimNetwork`, which owns a seeded `random.Random`, the side-channel
endpoints and every message in flight. Nothing moves until the simulator tells the
network to deliver, so a run is reproducible from its seed.

- Notifs travel through the queue: `send_notif` posts, delivery appends to the
  receiver's inbox, `get_new_notifs` drains it.
- A posted WRITE (or READ) completes when the network delivers it: the bytes are copied
  at that moment (a DMA reads memory when it runs, not when it is posted), then the
  completion notif is posted to the peer, as NIXL does.
- Faults, each selectable (`SimFaults`) and drawn from the network's generator: drop /
  delay / duplicate / reorder notifs; handshake failure and stall; WRITE post failure,
  WRITE error and stall; peer crash (the agent disappears: sends to it raise, transfers
  to it end in ERR) and restart (a new agent at the same side channel); partition and
  heal (notifs across it are lost, transfers across it wait, handshakes fail).
- One-shot overrides (`fail_next_handshakes`, `fail_next_write_posts`) and explicit
  `deliver` / `drop` / `duplicate` of any message let a test choose every fault itself.

The fault vocabulary (`SimFaults`) lives in `kvhandoff.sim.faults`, `SimTransportError`
in `errors.py`, the handshake executor (`SimHandshakeExecutor`) in `executor.py`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Protocol

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.push.errors import SimTransportError

if TYPE_CHECKING:
    from kvhandoff.sim.push.transport import SimPushTransport

__all__ = ["SimMessage", "SimNetwork", "SimObserver", "SimTransfer"]

_ADDRESS_STRIDE = 1 << 40  # fake address space per simulated agent


# -- messages and transfers ------------------------------------------------------------


@dataclass(eq=False, slots=True)
class SimTransfer:
    """A posted simulated WRITE or READ: the handle `write_blocks` / `read_blocks` return.

    `src_*` is the initiator, `dst_*` the peer; a WRITE moves bytes src -> dst, a READ
    dst -> src; either way the completion notif goes to the peer.
    """

    op: Literal["WRITE", "READ"]
    src_engine: str
    src_agent: str
    dst_engine: str
    dst_agent: str
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]  # (local allocation, remote region) per member
    notif: bytes
    local_chunk: Chunk = WHOLE
    remote_chunk: Chunk = WHOLE
    xfer_status: XferState = "PROC"
    released: bool = False
    fail_on_delivery: bool = False
    members: tuple[SimTransfer, ...] = ()
    """B-13: the requests' WRITEs a batched transfer carries (`batch.py`)."""
    post_failed: bool = False
    """B-13: the batched transfer that was to carry it failed to post."""
    error: str | None = None
    batch_key: int = 0
    """B-13: its `push.write_batch` instance, once posted (0: not posted)."""
    transfer: object = None
    """B-13: the batched transfer carrying it, once posted."""

    @property
    def batch(self) -> SimTransfer | None:
        """B-13: the batched transfer that carries this request's WRITE, once flushed."""
        transfer = self.transfer
        return transfer if isinstance(transfer, SimTransfer) else None


@dataclass(eq=False, slots=True)
class SimMessage:
    """One thing on the wire: a notif, or a transfer's data."""

    seq: int
    kind: Literal["notif", "write"]
    src_engine: str
    src_agent: str
    dst_engine: str
    dst_agent: str
    deliver_at: float
    payload: bytes = b""
    transfer: SimTransfer | None = None

    def describe(self) -> str:
        if self.transfer is None:
            return f"notif {self.src_agent}->{self.dst_agent} {self.payload[:48]!r}"
        op = self.transfer.op
        return f"{op} {self.src_agent}->{self.dst_agent} notif {self.transfer.notif[:48]!r}"


class SimObserver(Protocol):
    """What the simulator's invariant checks want to see happen on the wire."""

    def notif_sent(self, src_engine: str, dst_engine: str, message: bytes) -> None: ...

    def notif_delivered(self, dst_agent: str, message: bytes) -> None: ...

    def write_posted(self, transfer: SimTransfer) -> None: ...

    def write_landed(self, transfer: SimTransfer) -> None: ...
    def read_posted(self, transfer: SimTransfer) -> None: ...
    def read_landed(self, transfer: SimTransfer) -> None: ...


# -- the network -------------------------------------------------------------------------


class SimNetwork:
    """Every simulated agent, the side-channel endpoints, and the messages in flight."""

    def __init__(
        self,
        seed: int | random.Random = 0,
        clock: VirtualClock | None = None,
        faults: SimFaults | None = None,
        *,
        latency_s: float = 0.0005,
        max_delay_s: float = 2.0,
        stall_s: tuple[float, float] = (5.0, 90.0),
    ) -> None:
        self.rng = seed if isinstance(seed, random.Random) else random.Random(seed)
        self.clock = clock if clock is not None else VirtualClock()
        self.faults = faults or SimFaults.none()
        self.latency_s = latency_s
        self.max_delay_s = max_delay_s
        self.stall_s = stall_s
        self.observer: SimObserver | None = None
        self.agents: dict[str, SimPushTransport] = {}  # agent name -> live transport
        # side channel -> (engine id, what it serves: the encoded engine handshake)
        self.endpoints: dict[tuple[str, int], tuple[str, Callable[[], bytes]]] = {}
        self.in_flight: list[SimMessage] = []
        self.partitions: set[frozenset[str]] = set()
        self.counters: dict[str, int] = {}
        # One-shot overrides, for tests that choose each fault themselves.
        self.fail_next_handshakes = 0
        self.fail_next_write_posts = 0
        self._seq = itertools.count()
        self._agent_serial = itertools.count(1)
        self._address_serial = itertools.count(1)

    # -- agents and endpoints ---------------------------------------------------------

    def new_agent_name(self, engine_id: str) -> str:
        return f"{engine_id}-agent{next(self._agent_serial)}"

    def next_address_base(self) -> int:
        """A fake, distinct address range for one agent's regions."""
        return next(self._address_serial) * _ADDRESS_STRIDE

    def attach(self, transport: SimPushTransport) -> None:
        if transport.agent_name in self.agents:
            raise LocalProtocolError(f"agent {transport.agent_name!r} is already attached")
        self.agents[transport.agent_name] = transport

    def serve(self, engine_id: str, host: str, port: int, provider: Callable[[], bytes]) -> None:
        """Answer side-channel fetches at host:port with what `provider` returns (the
        engine's encoded `EngineHandshake`)."""
        self.endpoints[(host, port)] = (engine_id, provider)

    def crash(self, engine_id: str) -> list[str]:
        """The engine's agents disappear: their messages are lost, transfers to them fail."""
        gone = [name for name, t in self.agents.items() if t.engine_id == engine_id]
        for name in gone:
            self.agents.pop(name).alive = False
        self.endpoints = {ep: v for ep, v in self.endpoints.items() if v[0] != engine_id}
        kept: list[SimMessage] = []
        for msg in self.in_flight:
            if msg.src_agent in gone or msg.dst_agent in gone:
                if msg.transfer is not None and msg.src_agent not in gone:
                    msg.transfer.xfer_status = "ERR"  # the initiator learns on its next poll
                continue
            kept.append(msg)
        self.in_flight = kept
        self._count("crash")
        return gone

    def agent_alive(self, agent_name: str) -> bool:
        return agent_name in self.agents

    # -- partitions ---------------------------------------------------------------------

    def partition(self, a: str, b: str) -> None:
        self.partitions.add(frozenset((a, b)))
        self._count("partition")

    def heal(self) -> None:
        self.partitions.clear()

    def partitioned(self, a: str, b: str) -> bool:
        return bool(self.partitions) and frozenset((a, b)) in self.partitions

    # -- faults ---------------------------------------------------------------------------

    def roll(self, fault: str) -> bool:
        p: float = getattr(self.faults, fault)
        hit = p > 0 and self.rng.random() < p
        if hit:
            self._count(fault)
        return hit

    def _count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    # -- the side channel ---------------------------------------------------------------

    def fetch(self, requester_engine: str, host: str, port: int) -> bytes:
        """The encoded handshake served at host:port, or a failure like a ZMQ timeout."""
        if self.fail_next_handshakes > 0:
            self.fail_next_handshakes -= 1
            raise SimTransportError(f"injected handshake failure at {host}:{port}")
        if self.roll("handshake_fail"):
            raise SimTransportError(f"injected handshake failure at {host}:{port}")
        served = self.endpoints.get((host, port))
        if served is None:
            raise SimTransportError(f"no side channel answers at {host}:{port}")
        engine_id, provider = served
        if self.partitioned(requester_engine, engine_id):
            raise SimTransportError(f"{host}:{port} is unreachable (partition)")
        return provider()

    # -- posting --------------------------------------------------------------------------

    def _latency(self) -> float:
        extra = self.rng.uniform(0.0, self.max_delay_s) if self.roll("delay") else 0.0
        return self.latency_s + extra

    def post_notif(self, src: SimPushTransport, dst_agent: str, message: bytes) -> None:
        dst = self._live_peer(src, dst_agent, "send_notif")
        if self.observer is not None:
            self.observer.notif_sent(src.engine_id, dst.engine_id, message)
        if self.roll("drop"):
            return
        self._enqueue(
            SimMessage(
                next(self._seq),
                "notif",
                src.engine_id,
                src.agent_name,
                dst.engine_id,
                dst_agent,
                self.clock.now + self._latency(),
                payload=bytes(message),
            )
        )

    def post_transfer(self, transfer: SimTransfer) -> None:
        """Post a WRITE or READ (the `write_*` faults apply to both)."""
        what = transfer.op
        if self.fail_next_write_posts > 0:
            self.fail_next_write_posts -= 1
            raise SimTransportError(f"injected {what} post failure")
        if self.roll("write_fail"):
            raise SimTransportError(f"injected {what} post failure")
        src = self.agents.get(transfer.src_agent)
        if src is None:
            raise SimTransportError(f"agent {transfer.src_agent!r} is gone")
        self._live_peer(src, transfer.dst_agent, what.lower())
        transfer.fail_on_delivery = self.roll("write_error")
        delay = self._latency()
        if self.roll("write_stall"):
            delay += self.rng.uniform(*self.stall_s)
        if self.observer is not None and what == "WRITE":
            for write in transfer.members or (transfer,):
                self.observer.write_posted(write)
        elif self.observer is not None:
            self.observer.read_posted(transfer)
        self._enqueue(
            SimMessage(
                next(self._seq),
                "write",
                transfer.src_engine,
                transfer.src_agent,
                transfer.dst_engine,
                transfer.dst_agent,
                self.clock.now + delay,
                transfer=transfer,
            )
        )

    def _live_peer(self, src: SimPushTransport, dst_agent: str, op: str) -> SimPushTransport:
        if not src.alive:
            raise SimTransportError(f"{op}: local agent {src.agent_name!r} is gone")
        dst = self.agents.get(dst_agent)
        if dst is None:
            raise SimTransportError(f"{op}: peer agent {dst_agent!r} is gone", peer_gone=True)
        return dst

    def _enqueue(self, msg: SimMessage) -> None:
        self.in_flight.append(msg)

    def inject_notif(self, claimed_agent: str, dst_agent: str, message: bytes) -> bool:
        """A process outside the simulated engines sends `message` to `dst_agent`, naming
        itself `claimed_agent` (NIXL sender names are self-declared, S-05)."""
        if dst_agent not in self.agents:
            return False
        self._count("injected_notif")
        self._enqueue(
            SimMessage(
                next(self._seq),
                "notif",
                "rogue",
                claimed_agent,
                self.agents[dst_agent].engine_id,
                dst_agent,
                self.clock.now + self._latency(),
                payload=bytes(message),
            )
        )
        return True

    def cancel(self, transfer: SimTransfer) -> None:
        self.in_flight = [m for m in self.in_flight if m.transfer is not transfer]

    # -- delivery ---------------------------------------------------------------------------

    def deliverable(self) -> list[int]:
        """Indices of the messages that may be delivered now (due, not across a partition)."""
        now = self.clock.now
        return [
            i
            for i, m in enumerate(self.in_flight)
            if m.deliver_at <= now
            and not (m.kind == "write" and self.partitioned(m.src_engine, m.dst_engine))
        ]

    def next_arrival(self) -> float | None:
        times = [
            m.deliver_at
            for m in self.in_flight
            if not (m.kind == "write" and self.partitioned(m.src_engine, m.dst_engine))
        ]
        return min(times) if times else None

    def deliver_next(self) -> SimMessage | None:
        """Deliver one due message: the oldest, or any of them when `reorder` strikes."""
        ready = self.deliverable()
        if not ready:
            return None
        if len(ready) > 1 and self.roll("reorder"):
            index = self.rng.choice(ready)
        else:
            index = min(ready, key=lambda i: (self.in_flight[i].deliver_at, self.in_flight[i].seq))
        return self.deliver(index)

    def deliver(self, index: int) -> SimMessage:
        """Deliver the message at `index` now, whatever its due time."""
        msg = self.in_flight.pop(index)
        if msg.kind == "notif":
            self._deliver_notif(msg)
        else:
            self._deliver_write(msg)
        return msg

    def drop(self, index: int) -> SimMessage:
        """Lose the message at `index` (a transfer's data loss ends the transfer in ERR)."""
        msg = self.in_flight.pop(index)
        if msg.transfer is not None:
            msg.transfer.xfer_status = "ERR"
        self._count("dropped")
        return msg

    def duplicate(self, index: int) -> None:
        """Put a second copy of the notif at `index` on the wire."""
        msg = self.in_flight[index]
        if msg.kind == "notif":
            self._enqueue(replace(msg, seq=next(self._seq)))

    def _deliver_notif(self, msg: SimMessage) -> None:
        dst = self.agents.get(msg.dst_agent)
        if dst is None or self.partitioned(msg.src_engine, msg.dst_engine):
            self._count("lost")
            return
        dst.inbox.append((msg.src_agent, msg.payload))
        if self.observer is not None:
            self.observer.notif_delivered(msg.dst_agent, msg.payload)
        if self.roll("duplicate"):
            self._enqueue(
                replace(msg, seq=next(self._seq), deliver_at=self.clock.now + self._latency())
            )

    def _deliver_write(self, msg: SimMessage) -> None:
        transfer = msg.transfer
        assert transfer is not None
        src = self.agents.get(transfer.src_agent)
        dst = self.agents.get(transfer.dst_agent)
        if src is None or dst is None:
            transfer.xfer_status = "ERR"
            return
        if transfer.fail_on_delivery:
            _land(src, dst, transfer, partial=True)
            transfer.xfer_status = "ERR"
            return
        _land(src, dst, transfer, partial=False)
        transfer.xfer_status = "DONE"
        if self.observer is not None and transfer.op == "WRITE":
            for write in transfer.members or (transfer,):
                self.observer.write_landed(write)
        elif self.observer is not None:
            self.observer.read_landed(transfer)
        if transfer.notif:
            self._enqueue(
                SimMessage(
                    next(self._seq),
                    "notif",
                    transfer.src_engine,
                    transfer.src_agent,
                    transfer.dst_engine,
                    transfer.dst_agent,
                    self.clock.now + self.latency_s,
                    payload=transfer.notif,
                )
            )


def _land(
    initiator: SimPushTransport, peer: SimPushTransport, transfer: SimTransfer, *, partial: bool
) -> None:
    """Copy a transfer's bytes, member by member and chunk by chunk (only the first half
    on an error)."""
    items = [
        (local_alloc, remote_region, lid, rid)
        for local_alloc, remote_region in transfer.pairs
        for lid, rid in zip(transfer.local_ids, transfer.remote_ids, strict=True)
    ]
    if partial:
        items = items[: len(items) // 2]
    lc, rc = transfer.local_chunk, transfer.remote_chunk
    for local_alloc, remote_region, lid, rid in items:
        if transfer.op == "WRITE":
            data = initiator.chunk(local_alloc, lid, lc)
            peer.write_chunk(remote_region, rid, rc, data)
        else:
            initiator.write_chunk(local_alloc, lid, lc, peer.chunk(remote_region, rid, rc))
