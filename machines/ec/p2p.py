"""P2P halves of the encoder-cache scheduler: consumer reads and producer grants (R-E07..R-E12).

Imported only when `ec_enable_nixl` is set (it loads msgspec through the wire module);
the local tier never imports it (R-E02).

`P2PConsumer` starts `ec.consumer_read` machines and turns what the ZMQ and NIXL adapters
report into their events. `P2PProducer` answers each `XferReq` with an
`ec.producer_grant` machine. Both decode untrusted bytes here: a malformed message, an
unknown status, an ack of no read in flight or a done of no grant raises
`RemoteProtocolError` after counting it in `remote_errors`, and changes no state. A
foreign version, a wrong compatibility hash or an unknown `mm_hash` in a well-formed
`XferReq` is answered with its NACK by the grant machine.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Mapping

from kvhandoff.machines.ec.cache import EmbeddingCache
from kvhandoff.machines.ec.consumer_read import (
    CONSUMER_READ_KIND,
    EC_CONSUMER_READ,
    IN_FLIGHT_STATES,
    FallBackLocal,
    RetryNextStep,
)
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT, GRANT_KIND, GrantCheck
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import ECLayout
from kvhandoff.protocol.ec_publication import PublishedEncoding
from kvhandoff.protocol.ec_wire import (
    XferDone,
    XferReq,
    check_xfer_ack,
    decode_producer_message,
    decode_xfer_ack,
)
from kvhandoff.protocol.errors import RemoteProtocolError

__all__ = ["P2PConsumer", "P2PProducer"]

log = logging.getLogger("kvhandoff.ec")

FallbackHook = Callable[[str, str], None]


class P2PConsumer:
    """Consumer reads of one scheduler: one `ec.consumer_read` per `mm_hash` in flight."""

    def __init__(
        self,
        bus: EventBus,
        cache: EmbeddingCache,
        layout: ECLayout,
        *,
        engine_id: str,
        compat_hash: str,
        on_fallback: FallbackHook,
        config: Mapping[str, float] | None = None,
    ) -> None:
        self.bus = bus
        self.cache = cache
        self.layout = layout
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.on_fallback = on_fallback
        self.remote_errors = 0
        self.stale_acks = 0
        self.late_completions = 0
        self._serial = itertools.count(1)
        self._retry: deque[str] = deque()
        bus.register(EC_CONSUMER_READ, config)
        bus.handle(RetryNextStep, lambda inst, effect: self._retry.append(effect.mm_hash))
        bus.handle(FallBackLocal, lambda inst, effect: on_fallback(effect.mm_hash, effect.reason))

    def read(self, mm_hash: str) -> Instance | None:
        return self.bus.get(CONSUMER_READ_KIND, mm_hash)

    def in_flight(self, mm_hash: str) -> bool:
        """True while requests must wait for this read (not quarantined, not over)."""
        inst = self.read(mm_hash)
        return inst is not None and inst.state in IN_FLIGHT_STATES

    def start_read(self, mm_hash: str, published: PublishedEncoding) -> bool:
        """Reserve a destination and send the first `XferReq`; False when no room."""
        if self.read(mm_hash) is not None:
            return False
        num_blocks = self.layout.blocks_for(published.size_bytes)
        entry = self.cache.reserve(mm_hash, num_blocks, published.size_bytes, "read")
        if entry is None:
            return False
        self.bus.create(
            CONSUMER_READ_KIND,
            mm_hash,
            peer_host=published.peer_host,
            peer_port=published.peer_port,
            size_bytes=published.size_bytes,
            dest_blocks=entry.ctx.blocks,
            compat_hash=self.compat_hash,
            engine_id=self.engine_id,
            agent_name=self.engine_id,
            id_prefix=f"{self.engine_id}:{next(self._serial)}:",
        )
        self.bus.dispatch(CONSUMER_READ_KIND, mm_hash, "send")
        return True

    def step(self) -> None:
        """Once per scheduler step: ask again for every read a NACK_NOT_READY deferred."""
        pending, self._retry = self._retry, deque()
        for mm_hash in pending:
            inst = self.read(mm_hash)
            if inst is not None and inst.state == "retry_next_step":
                self.bus.dispatch(CONSUMER_READ_KIND, mm_hash, "send")

    # -- adapter events --------------------------------------------------------------------

    def _reject(self, message: str, peer: str | None) -> RemoteProtocolError:
        self.remote_errors += 1
        return RemoteProtocolError(message, peer=peer)

    def on_xfer_ack(self, data: bytes, *, peer: str | None = None) -> None:
        """An `XferAck` arrived on a DEALER."""
        try:
            ack = decode_xfer_ack(data, peer=peer)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        inst = self.read(ack.mm_hash)
        if inst is None:
            raise self._reject(f"XferAck for {ack.mm_hash!r}, which no read awaits", peer)
        ctx = inst.ctx
        if inst.state != "xfer_req_sent" or ack.transfer_id != ctx.transfer_id:
            if ack.transfer_id.startswith(ctx.id_prefix):
                self.stale_acks += 1  # an earlier attempt's answer: harmless
                return
            raise self._reject(f"XferAck {ack.transfer_id!r} answers no request of ours", peer)
        try:
            check_xfer_ack(
                ack,
                ctx.request(ack.mm_hash),
                block_size_bytes=self.layout.block_size_bytes,
                peer=peer,
            )
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.dispatch(CONSUMER_READ_KIND, ack.mm_hash, "ack", ack)

    def _completion(self, mm_hash: str, transfer_id: str, event: str) -> None:
        inst = self.read(mm_hash)
        if (
            inst is None
            or inst.ctx.transfer_id != transfer_id
            or inst.state
            not in (
                "reading",
                "quarantined",
            )
        ):
            self.late_completions += 1
            return
        self.bus.dispatch(CONSUMER_READ_KIND, mm_hash, event)

    def on_read_done(self, mm_hash: str, transfer_id: str) -> None:
        """The NIXL READ of `transfer_id` completed."""
        self._completion(mm_hash, transfer_id, "read_done")

    def on_read_failed(self, mm_hash: str, transfer_id: str) -> None:
        """The NIXL READ of `transfer_id` failed."""
        self._completion(mm_hash, transfer_id, "read_failed")

    def on_peer_disconnected(self, peer_host: str, peer_port: int) -> None:
        """The DEALER of producer `peer_host:peer_port` lost its peer."""
        for inst in self.bus.instances(CONSUMER_READ_KIND):
            ctx = inst.ctx
            if (ctx.peer_host, ctx.peer_port) == (peer_host, peer_port):
                self.bus.dispatch(CONSUMER_READ_KIND, inst.key, "peer_disconnected")


class P2PProducer:
    """Producer grants of one scheduler: one `ec.producer_grant` per `XferReq`."""

    def __init__(
        self,
        bus: EventBus,
        cache: EmbeddingCache,
        layout: ECLayout,
        *,
        compat_hash: str,
        config: Mapping[str, float] | None = None,
    ) -> None:
        self.bus = bus
        self.cache = cache
        self.layout = layout
        self.compat_hash = compat_hash
        self.agent_name = ""
        self.agent_metadata = b""
        self.region_base_addr = 0
        self.remote_errors = 0
        bus.register(EC_PRODUCER_GRANT, config)

    def register_nixl_agent(self, agent_name: str, agent_metadata: bytes, base_addr: int) -> None:
        """The NIXL adapter registered the region; grants may name it from now on."""
        self.agent_name = agent_name
        self.agent_metadata = bytes(agent_metadata)
        self.region_base_addr = base_addr

    def grants(self) -> list[Instance]:
        return list(self.bus.instances(GRANT_KIND))

    def on_message(self, peer: bytes | str, data: bytes) -> None:
        """A consumer's `XferReq` or `XferDone` arrived on the ROUTER from identity `peer`."""
        shown = peer.hex() if isinstance(peer, bytes) else peer
        try:
            msg = decode_producer_message(data, peer=shown)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        if isinstance(msg, XferReq):
            self._on_request(peer, msg, shown)
        else:
            self._on_done(peer, msg, shown)

    def _on_request(self, peer: bytes | str, req: XferReq, shown: str) -> None:
        key = (peer, req.transfer_id)
        if self.bus.get(GRANT_KIND, key) is not None:
            self.remote_errors += 1
            raise RemoteProtocolError(f"XferReq {req.transfer_id!r} is already granted", peer=shown)
        entry = self.cache.entry(req.mm_hash)
        check = GrantCheck(
            req=req,
            expected_hash=self.compat_hash,
            entry_state=None if entry is None else entry.state,
            entry_blocks=() if entry is None else entry.ctx.blocks,
            entry_size_bytes=0 if entry is None else entry.ctx.size_bytes,
        )
        self.bus.create(
            GRANT_KIND,
            key,
            peer=peer,
            mm_hash=req.mm_hash,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            region_base_addr=self.region_base_addr,
            block_size_bytes=self.layout.block_size_bytes,
        )
        self.bus.dispatch(GRANT_KIND, key, "check", check)

    def _on_done(self, peer: bytes | str, done: XferDone, shown: str) -> None:
        key = (peer, done.transfer_id)
        inst = self.bus.get(GRANT_KIND, key)
        if inst is None or inst.ctx.mm_hash != done.mm_hash:
            self.remote_errors += 1
            raise RemoteProtocolError(
                f"XferDone {done.transfer_id!r} for {done.mm_hash!r} matches no live grant",
                peer=shown,
            )
        self.bus.dispatch(GRANT_KIND, key, "xfer_done", done.ok)

    def on_peer_disconnected(self, peer: bytes | str) -> None:
        """A consumer went away; its grants keep their pins until the lease ends."""
        for inst in self.bus.instances(GRANT_KIND):
            if inst.ctx.peer == peer:
                self.bus.dispatch(GRANT_KIND, inst.key, "peer_disconnected")
