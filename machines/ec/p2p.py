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

Every entry point takes `now` and gives it to the bus before looking at a machine, so a
message that waited meets the state its deadlines decided.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvhandoff.machines.ec.cache import EmbeddingCache
from kvhandoff.machines.ec.consumer_read import (
    EC_CONSUMER_READ,
    Ack,
    FallBackLocal,
    ReadCtx,
    ReadDone,
    ReadFailed,
    RetryNextStep,
    Send,
)
from kvhandoff.machines.ec.events import PeerDisconnected
from kvhandoff.machines.ec.producer_grant import (
    EC_PRODUCER_GRANT,
    Check,
    GrantCtx,
    XferDone,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol import ec_wire
from kvhandoff.protocol.ec_config import ECLayout
from kvhandoff.protocol.ec_grants import check_xfer_ack
from kvhandoff.protocol.ec_publication import PublishedEncoding
from kvhandoff.protocol.errors import RemoteProtocolError

__all__ = ["P2PConsumer", "P2PProducer"]


FallbackHook = Callable[[str, str], None]
"""`on_fallback(mm_hash, reason)`: requests waiting for `mm_hash` encode it locally."""
RetiredHook = Callable[[str, bool], None]
"""`on_retired(mm_hash, landed)`: a read ended (`landed`: its bytes are in the tier)."""


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
        on_retired: RetiredHook | None = None,
        config: Mapping[str, float] | None = None,
    ) -> None:
        self.bus = bus
        self.cache = cache
        self.layout = layout
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.on_fallback = on_fallback
        self.on_retired = on_retired
        self.remote_errors = 0
        self.stale_acks = 0
        self.late_completions = 0
        self._serial = itertools.count(1)
        self._retry: deque[str] = deque()
        machine = bus.register(EC_CONSUMER_READ, config)
        self.max_not_ready = machine.config["consumer_max_not_ready_retries"]
        bus.handle(RetryNextStep, lambda inst, effect: self._retry.append(effect.mm_hash))
        bus.handle(FallBackLocal, lambda inst, effect: on_fallback(effect.mm_hash, effect.reason))
        bus.on_retire(self._retired)

    def _retired(self, inst: Instance[Any]) -> None:
        if self.on_retired is not None and inst.machine.decl is EC_CONSUMER_READ:
            self.on_retired(str(inst.key), inst.has("landed"))

    def read(self, mm_hash: str) -> Instance[ReadCtx] | None:
        return self.bus.get(EC_CONSUMER_READ, mm_hash)

    def in_flight(self, mm_hash: str) -> bool:
        """True while requests must wait for this read (not quarantined, not over)."""
        return self.bus.has_tag(EC_CONSUMER_READ, mm_hash, "in_flight")

    def start_read(self, mm_hash: str, published: PublishedEncoding, now: float) -> bool:
        """Reserve a destination and send the first `XferReq`; False when no room."""
        if self.read(mm_hash) is not None:
            return False
        num_blocks = self.layout.blocks_for(published.size_bytes)
        entry = self.cache.reserve(mm_hash, num_blocks, published.size_bytes, "read", now)
        if entry is None:
            return False
        ctx = ReadCtx(
            mm_hash,
            peer_host=published.peer_host,
            peer_port=published.peer_port,
            size_bytes=published.size_bytes,
            dest_blocks=entry.ctx.blocks,
            compat_hash=self.compat_hash,
            engine_id=self.engine_id,
            agent_name=self.engine_id,
            id_prefix=f"{self.engine_id}:{next(self._serial)}:",
            max_not_ready=self.max_not_ready,
        )
        self.bus.create(EC_CONSUMER_READ, ctx, now)
        self.bus.dispatch(EC_CONSUMER_READ, mm_hash, Send(), now)
        return True

    def step(self, now: float) -> None:
        """Once per scheduler step: ask again for every read a NACK_NOT_READY deferred."""
        pending, self._retry = self._retry, deque()
        for mm_hash in pending:
            if self.bus.has_tag(EC_CONSUMER_READ, mm_hash, "retry_pending"):
                self.bus.dispatch(EC_CONSUMER_READ, mm_hash, Send(), now)

    # -- adapter events --------------------------------------------------------------------

    def _reject(self, message: str, peer: str | None) -> RemoteProtocolError:
        self.remote_errors += 1
        return RemoteProtocolError(message, peer=peer)

    def on_xfer_ack(self, data: bytes, now: float, *, peer: str | None = None) -> None:
        """An `XferAck` arrived on a DEALER."""
        try:
            ack = ec_wire.decode_xfer_ack(data, peer=peer)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.advance(now)
        inst = self.read(ack.mm_hash)
        if inst is None:
            raise self._reject(f"XferAck for {ack.mm_hash!r}, which no read awaits", peer)
        ctx = inst.ctx
        if not inst.has("awaiting_ack") or ack.transfer_id != ctx.transfer_id:
            if ack.transfer_id.startswith(ctx.id_prefix):
                self.stale_acks += 1  # an earlier attempt's answer: harmless
                return
            raise self._reject(f"XferAck {ack.transfer_id!r} answers no request of ours", peer)
        try:
            check_xfer_ack(
                ack, ctx.request(), block_size_bytes=self.layout.block_size_bytes, peer=peer
            )
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.dispatch(EC_CONSUMER_READ, ack.mm_hash, Ack(ack), now)

    def _awaited(self, mm_hash: str, transfer_id: str, now: float) -> bool:
        """Whether a READ of `transfer_id` may still complete for `mm_hash` at `now`."""
        self.bus.advance(now)
        inst = self.read(mm_hash)
        if inst is None or inst.ctx.transfer_id != transfer_id or not inst.has("read_posted"):
            self.late_completions += 1
            return False
        return True

    def on_read_done(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """The NIXL READ of `transfer_id` completed."""
        if self._awaited(mm_hash, transfer_id, now):
            self.bus.dispatch(EC_CONSUMER_READ, mm_hash, ReadDone(), now)

    def on_read_failed(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """The NIXL READ of `transfer_id` failed."""
        if self._awaited(mm_hash, transfer_id, now):
            self.bus.dispatch(EC_CONSUMER_READ, mm_hash, ReadFailed(), now)

    def on_peer_disconnected(self, peer_host: str, peer_port: int, now: float) -> None:
        """The DEALER of producer `peer_host:peer_port` lost its peer."""
        bus = self.bus
        bus.advance(now)
        for inst in bus.instances(EC_CONSUMER_READ):
            ctx = inst.ctx
            live = bus.get(EC_CONSUMER_READ, inst.key) is inst  # not ended by an earlier one
            if live and (ctx.peer_host, ctx.peer_port) == (peer_host, peer_port):
                bus.dispatch(EC_CONSUMER_READ, inst.key, PeerDisconnected(), now)


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
        machine = bus.register(EC_PRODUCER_GRANT, config)
        self.lease_s = machine.config["pin_lease_s"]

    def register_nixl_agent(self, agent_name: str, agent_metadata: bytes, base_addr: int) -> None:
        """The NIXL adapter registered the region; grants may name it from now on."""
        self.agent_name = agent_name
        self.agent_metadata = bytes(agent_metadata)
        self.region_base_addr = base_addr

    def grants(self) -> list[Instance[GrantCtx]]:
        return self.bus.instances(EC_PRODUCER_GRANT)

    def on_message(self, peer: bytes | str, data: bytes, now: float) -> None:
        """A consumer's `XferReq` or `XferDone` arrived on the ROUTER from identity `peer`."""
        shown = peer.hex() if isinstance(peer, bytes) else peer
        try:
            msg = ec_wire.decode_producer_message(data, peer=shown)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.advance(now)
        if isinstance(msg, ec_wire.XferReq):
            self._on_request(peer, msg, shown, now)
        else:
            self._on_done(peer, msg, shown, now)

    def _on_request(self, peer: bytes | str, req: ec_wire.XferReq, shown: str, now: float) -> None:
        key = (peer, req.transfer_id)
        if self.bus.get(EC_PRODUCER_GRANT, key) is not None:
            self.remote_errors += 1
            raise RemoteProtocolError(f"XferReq {req.transfer_id!r} is already granted", peer=shown)
        entry = self.cache.entry(req.mm_hash)
        check = Check(
            req=req,
            expected_hash=self.compat_hash,
            entry_present=entry is not None,
            entry_loadable=entry is not None and entry.has("loadable"),
            entry_blocks=() if entry is None else entry.ctx.blocks,
            entry_size_bytes=0 if entry is None else entry.ctx.size_bytes,
        )
        ctx = GrantCtx(
            key,
            peer=peer,
            mm_hash=req.mm_hash,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            region_base_addr=self.region_base_addr,
            block_size_bytes=self.layout.block_size_bytes,
            lease_s=self.lease_s,
        )
        self.bus.create(EC_PRODUCER_GRANT, ctx, now)
        self.bus.dispatch(EC_PRODUCER_GRANT, key, check, now)

    def _on_done(self, peer: bytes | str, done: ec_wire.XferDone, shown: str, now: float) -> None:
        key = (peer, done.transfer_id)
        inst = self.bus.get(EC_PRODUCER_GRANT, key)
        if inst is None or inst.ctx.mm_hash != done.mm_hash:
            self.remote_errors += 1
            raise RemoteProtocolError(
                f"XferDone {done.transfer_id!r} for {done.mm_hash!r} matches no live grant",
                peer=shown,
            )
        try:
            self.bus.dispatch(EC_PRODUCER_GRANT, key, XferDone(done.ok), now)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise

    def on_peer_disconnected(self, peer: bytes | str, now: float) -> None:
        """A consumer went away; its grants keep their pins until the lease ends."""
        bus = self.bus
        bus.advance(now)
        for inst in bus.instances(EC_PRODUCER_GRANT):
            if inst.ctx.peer == peer and bus.get(EC_PRODUCER_GRANT, inst.key) is inst:
                bus.dispatch(EC_PRODUCER_GRANT, inst.key, PeerDisconnected(), now)
