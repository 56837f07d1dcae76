"""P2P halves of the encoder-cache scheduler: consumer reads and producer grants (R-E07..R-E12).

Imported only when `ec_enable_nixl` is set (it loads msgspec through the wire module);
the local tier never imports it (R-E02).

`P2PConsumer` starts `ec.consumer_read` machines when a settlement asks (`StartRead`),
lets settlements join and leave a read in flight, and turns what the ZMQ and NIXL
adapters report into the reads' events. `P2PProducer` answers each `XferReq` with an
`ec.producer_grant` machine. Both decode untrusted bytes here: a malformed message, an
unknown status, an ack of no read in flight or a done of no grant raises
`RemoteProtocolError` after counting it in `remote_errors`, and changes no state. A
foreign version, a wrong compatibility hash, an unknown `mm_hash` or a consumer over its
pin cap in a well-formed `XferReq` is answered with its NACK by the grant machine.

Trust (S-02): every `XferReq` carries a fresh random transfer id drawn from
`transfer_ids` (128 bits by default) and this consumer's random session id, and an ack
counts only when it arrives from the producer the request went to, for the attempt in
flight. A stock vLLM producer echoes no transfer id (C-03): its ack counts for the read of
its `mm_hash` from that producer while that read awaits an ack, and its session id, when
echoed, must be ours. An `OK` ack that will not be
used (late, for an earlier attempt or a read that ended, or foreign) is answered with an
`XferDone(ok=False)` when its sender advertised `xfer_done` (C-04), so the producer
unpins at once instead of after its 30 s lease.

Grant release (C-03, C-04): with a producer that advertised `xfer_done` the consumer's
READ carries no notif and `XferDone` releases the grant; with any other (a stock vLLM
producer) the READ carries the notif `<session_id>:<mm_hash>`, which releases it there.
The producer accepts both: `on_read_notif` ends the grant the notif names, once, but
never a grant of a consumer that advertised `xfer_done` (it releases with `XferDone`
only), and a grant whose consumer announced its NIXL agent only by a notif from that
agent (S-02). A consumer keeps one random session per producer (as vLLM 0.33's does), so
a producer cannot name the consumer's grants on another producer.

Every entry point takes `now` and gives it to the bus before looking at a machine, so a
message that waited meets the state its deadlines decided.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvhandoff.machines.ec.cache import EmbeddingCache
from kvhandoff.machines.ec.consumer_read import (
    EC_CONSUMER_READ,
    Ack,
    Join,
    Leave,
    ReadCtx,
    ReadDone,
    ReadFailed,
    ReadReleased,
    Send,
    SendXferDone,
)
from kvhandoff.machines.ec.events import PeerDisconnected
from kvhandoff.machines.ec.producer_grant import (
    EC_PRODUCER_GRANT,
    Check,
    GrantCtx,
    ReadNotified,
    XferDone,
)
from kvhandoff.machines.ec.settlement import (
    EC_SETTLEMENT,
    JoinRead,
    LeaveRead,
    NoRoom,
    StartRead,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol import ec_wire
from kvhandoff.protocol.ec_config import ECLayout
from kvhandoff.protocol.ec_grants import check_xfer_ack
from kvhandoff.protocol.ec_status import XFER_DONE, XferStatus
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["P2PConsumer", "P2PProducer", "TransferIds", "random_transfer_id"]

TransferIds = Callable[[], str]
"""Draws the transfer id of one `XferReq` attempt."""


def random_transfer_id() -> str:
    """128 random bits, hex: an id no other peer can guess (S-02)."""
    return secrets.token_hex(16)


def _split_peer(peer: str) -> tuple[str, int] | None:
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


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
        config: Mapping[str, float] | None = None,
        transfer_ids: TransferIds = random_transfer_id,
    ) -> None:
        self.bus = bus
        self.cache = cache
        self.layout = layout
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.transfer_ids = transfer_ids
        self.remote_errors = 0
        self.stale_acks = 0
        self.late_completions = 0
        self.unused_grants_released = 0
        # Names this consumer to each producer: grants and READ notifs are keyed by it. One
        # session per producer, as vLLM 0.33's consumer has (S-02): a producer learns only
        # its own, so it cannot name our grants on another producer. Random unless the
        # transfer ids are injected (a simulation replays exactly).
        self._session_key = (
            secrets.token_bytes(32)
            if transfer_ids is random_transfer_id
            else f"session-{engine_id}".encode()
        )
        machine = bus.register(EC_CONSUMER_READ, config)
        self.max_not_ready = machine.config["consumer_max_not_ready_retries"]
        self.not_ready_s = machine.config["consumer_not_ready_timeout_s"]
        bus.handle(StartRead, self._start_read)
        bus.handle(JoinRead, self._join)
        bus.handle(LeaveRead, self._leave)

    def session_for(self, peer_host: str, peer_port: int) -> str:
        """This consumer's session id with the producer at `peer_host:peer_port`: 128 bits
        of an HMAC under a random key, so no producer can derive another's (S-02)."""
        peer = f"{peer_host}:{peer_port}".encode()
        return hmac.new(self._session_key, peer, hashlib.sha256).hexdigest()[:32]

    def read(self, mm_hash: str) -> Instance[ReadCtx] | None:
        return self.bus.get(EC_CONSUMER_READ, mm_hash)

    def has_reads(self) -> bool:
        """Whether any read lives (in flight, retrying or quarantined): its timeouts and
        completions need the engine's steps."""
        return self.bus.live(EC_CONSUMER_READ) > 0

    def in_flight(self, mm_hash: str) -> bool:
        """True while requests must wait for this read (not quarantined, not over)."""
        return self.bus.has_tag(EC_CONSUMER_READ, mm_hash, "in_flight")

    # -- what settlements ask (effects, inside the bus's step: its time is the bus's) -----

    def _start_read(self, inst: Instance[Any] | None, effect: StartRead) -> None:
        """Reserve a destination (the size was checked first, S-04) and send the first
        `XferReq`; `NoRoom` to the settlement when the tier cannot make room."""
        bus, now = self.bus, self.bus.now
        published = effect.published
        size = published.size_bytes
        entry = None
        if self.read(effect.mm_hash) is None:
            blocks = self.layout.blocks_for(size)
            entry = self.cache.reserve(effect.mm_hash, blocks, size, "read", now)
        if entry is None:
            bus.dispatch(EC_SETTLEMENT, effect.waiter, NoRoom(), now)
            return
        ctx = ReadCtx(
            effect.mm_hash,
            peer_host=published.peer_host,
            peer_port=published.peer_port,
            size_bytes=size,
            dest_blocks=entry.ctx.blocks,
            compat_hash=self.compat_hash,
            engine_id=self.engine_id,
            agent_name=self.engine_id,
            session_id=self.session_for(published.peer_host, published.peer_port),
            max_not_ready=self.max_not_ready,
            not_ready_s=self.not_ready_s,
            waiters={effect.waiter},
        )
        bus.create(EC_CONSUMER_READ, ctx, now)
        bus.dispatch(EC_CONSUMER_READ, effect.mm_hash, Send(self.transfer_ids(), now), now)

    def _join(self, inst: Instance[Any] | None, effect: JoinRead) -> None:
        self.bus.dispatch(EC_CONSUMER_READ, effect.mm_hash, Join(effect.waiter), self.bus.now)

    def _leave(self, inst: Instance[Any] | None, effect: LeaveRead) -> None:
        if self.in_flight(effect.mm_hash):
            self.bus.dispatch(EC_CONSUMER_READ, effect.mm_hash, Leave(effect.waiter), self.bus.now)

    def step(self, now: float) -> None:
        """Once per scheduler step: ask again for every read a NACK_NOT_READY deferred."""
        bus = self.bus
        for inst in bus.tagged(EC_CONSUMER_READ, "retry_pending"):
            bus.dispatch(EC_CONSUMER_READ, inst.key, Send(self.transfer_ids(), now), now)

    # -- adapter events --------------------------------------------------------------------

    def _reject(self, message: str, peer: str | None) -> RemoteProtocolError:
        self.remote_errors += 1
        return RemoteProtocolError(message, peer=peer)

    def on_xfer_ack(self, data: bytes, now: float, *, peer: str) -> None:
        """An `XferAck` arrived on the DEALER to producer `peer` (`host:port`)."""
        try:
            ack = ec_wire.decode_xfer_ack(data, peer=peer)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.advance(now)
        inst = self.read(ack.mm_hash)
        ctx = None if inst is None else inst.ctx
        if not ack.transfer_id and ctx is not None and ctx.transfer_id and peer == ctx.peer:
            # A stock vLLM producer echoes no transfer id: its ack answers the read of its
            # mm_hash from it (C-03); a session id it echoes must be ours.
            if ack.session_id and ack.session_id != ctx.session_id:
                raise self._reject(
                    f"XferAck for {ack.mm_hash!r} names session {ack.session_id!r}", peer
                )
            ack = msgspec.structs.replace(ack, transfer_id=ctx.transfer_id)
        current = ctx is not None and ack.transfer_id == ctx.transfer_id
        earlier = ctx is not None and ack.transfer_id in ctx.past_ids
        if ctx is not None and (current or earlier) and peer != ctx.peer:
            self._release_unused(ack, peer)
            raise self._reject(
                f"XferAck {ack.transfer_id!r} came from {peer}, the request went to {ctx.peer}",
                peer,
            )
        if inst is not None and current and inst.has("awaiting_ack"):
            try:
                check_xfer_ack(
                    ack,
                    inst.ctx.request(),
                    block_size_bytes=self.layout.block_size_bytes,
                    peer=peer,
                )
            except RemoteProtocolError:
                self.remote_errors += 1
                self._release_unused(ack, peer)
                raise
            self.bus.dispatch(EC_CONSUMER_READ, ack.mm_hash, Ack(ack, now), now)
            return
        if current or earlier:
            self.stale_acks += 1  # a duplicate, or an earlier attempt's answer: harmless
            if earlier:
                self._release_unused(ack, peer)
            return
        self._release_unused(ack, peer)
        raise self._reject(f"XferAck {ack.transfer_id!r} answers no request of ours", peer)

    def _release_unused(self, ack: ec_wire.XferAck, peer: str) -> None:
        """An OK we will not use: tell its sender to unpin now (if it speaks XferDone)."""
        address = _split_peer(peer)
        if ack.status is not XferStatus.OK or XFER_DONE not in ack.extensions or address is None:
            return
        done = ec_wire.XferDone(
            mm_hash=ack.mm_hash, transfer_id=ack.transfer_id, ok=False, session_id=ack.session_id
        )
        self.unused_grants_released += 1
        self.bus.execute(SendXferDone(address[0], address[1], done))

    def _awaited(self, mm_hash: str, transfer_id: str, now: float) -> bool:
        """Whether a READ of `transfer_id` may still complete for `mm_hash` at `now`."""
        self.bus.advance(now)
        inst = self.read(mm_hash)
        if inst is None or inst.ctx.transfer_id != transfer_id or not inst.has("read_posted"):
            self.late_completions += 1
            return False
        return True

    def on_read_done(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """The NIXL READ of `transfer_id` completed (and its handle was released)."""
        if self._awaited(mm_hash, transfer_id, now):
            self.bus.dispatch(EC_CONSUMER_READ, mm_hash, ReadDone(), now)

    def on_read_failed(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """The NIXL READ of `transfer_id` failed (and its handle was released)."""
        if self._awaited(mm_hash, transfer_id, now):
            self.bus.dispatch(EC_CONSUMER_READ, mm_hash, ReadFailed(), now)

    def on_read_released(self, mm_hash: str, now: float) -> None:
        """The adapter released the handle a `ReleaseRead` named."""
        if self.read(mm_hash) is None:
            raise LocalProtocolError(f"no read of {mm_hash!r} waits for its handle's release")
        self.bus.dispatch(EC_CONSUMER_READ, mm_hash, ReadReleased(), now)

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
        self.mem_descriptor = b""
        self.remote_errors = 0
        self.superseded = 0
        self.late_notifs = 0
        self.foreign_notifs = 0
        machine = bus.register(EC_PRODUCER_GRANT, config)
        self.lease_s = machine.config["pin_lease_s"]
        self.max_per_peer = machine.config["producer_max_grants_per_peer"]
        self.max_per_host = machine.config["producer_max_grants_per_host"]
        self.max_total = machine.config["producer_max_grants"]

    def pins(self) -> Counter[bytes | str]:
        """Pins each consumer holds now: its grants tagged `leased` (S-03)."""
        return Counter(inst.ctx.peer for inst in self.bus.tagged(EC_PRODUCER_GRANT, "leased"))

    def register_nixl_agent(self, agent_name: str, agent_metadata: bytes, base_addr: int) -> None:
        """The NIXL adapter registered the region; grants may name it from now on."""
        self.agent_name = agent_name
        self.agent_metadata = bytes(agent_metadata)
        self.region_base_addr = base_addr
        layout = self.layout
        self.mem_descriptor = ec_wire.encode_mem_descriptor(
            base_addr, layout.block_size_bytes, layout.num_blocks
        )

    def pins_by_host(self) -> Counter[str]:
        """Pins the consumers of each host hold now (S-03: a host may open any number of
        ZMQ identities, so it is capped as a whole too)."""
        return Counter(inst.ctx.host for inst in self.bus.tagged(EC_PRODUCER_GRANT, "leased"))

    def grants(self) -> list[Instance[GrantCtx]]:
        return self.bus.instances(EC_PRODUCER_GRANT)

    def on_message(self, peer: bytes | str, data: bytes, now: float, *, host: str = "") -> None:
        """A consumer's `XferReq` or `XferDone` arrived on the ROUTER from identity `peer`,
        connected from `host` (its address: identities are free, so caps count hosts too,
        S-03; '' when the adapter does not know it)."""
        shown = peer.hex() if isinstance(peer, bytes) else peer
        try:
            msg = ec_wire.decode_producer_message(data, peer=shown)
        except RemoteProtocolError:
            self.remote_errors += 1
            raise
        self.bus.advance(now)
        if isinstance(msg, ec_wire.XferReq):
            self._on_request(peer, msg, shown, now, host)
        else:
            self._on_done(peer, msg, shown, now)

    def _on_request(
        self, peer: bytes | str, req: ec_wire.XferReq, shown: str, now: float, host: str
    ) -> None:
        name = f"{req.session_id}:{req.mm_hash}" if req.session_id else ""
        # A stock vLLM consumer sends no transfer id: its grant is named by its session.
        key = (peer, req.transfer_id or name)
        # S-02: a consumer that speaks `xfer_done` releases its grant with `XferDone` only
        # (its READ carries no notif), so no NIXL notif may release it; a consumer that
        # announced its agent name is heard only from that agent.
        notif_key = "" if XFER_DONE in req.extensions else name
        old = self.bus.get(EC_PRODUCER_GRANT, key)
        if old is not None and req.transfer_id:
            self.remote_errors += 1
            raise RemoteProtocolError(f"XferReq {req.transfer_id!r} is already granted", peer=shown)
        if old is not None:
            # A stock consumer asks again for a grant it holds (its ack wait ran out): as
            # vLLM's producer does, the old pin goes before the new grant takes one.
            self.superseded += 1
            self.bus.dispatch(EC_PRODUCER_GRANT, key, XferDone(False), now)
        entry = self.cache.entry(req.mm_hash)
        pins, by_host = self.pins(), self.pins_by_host()
        check = Check(
            req=req,
            expected_hash=self.compat_hash,
            entry_present=entry is not None,
            entry_loadable=entry is not None and entry.has("loadable"),
            entry_blocks=() if entry is None else entry.ctx.blocks,
            entry_size_bytes=0 if entry is None else entry.ctx.size_bytes,
            peer_grants=pins[peer],
            host_grants=by_host[host] if host else 0,
            total_grants=pins.total(),
        )
        ctx = GrantCtx(
            key,
            peer=peer,
            host=host,
            mm_hash=req.mm_hash,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            region_base_addr=self.region_base_addr,
            block_size_bytes=self.layout.block_size_bytes,
            mem_descriptor=self.mem_descriptor,
            notif_key=notif_key,
            notif_sender=req.consumer_agent_name,
            lease_s=self.lease_s,
            max_per_peer=self.max_per_peer,
            max_per_host=self.max_per_host,
            max_total=self.max_total,
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

    def on_read_notif(self, sender: str, message: bytes, now: float) -> bool:
        """NIXL: a consumer's READ arrived with notif `<session_id>:<mm_hash>` (C-03): the
        grant it names is released. False (counted in `late_notifs`) when no live grant
        has that name (its lease ended, it was released already, or its consumer releases
        with `XferDone`); `RemoteProtocolError` for a notif that is no such name, or one
        from an agent other than the one the grant's consumer announced (S-02)."""
        try:
            key = bytes(message).decode("utf-8")
        except (UnicodeDecodeError, TypeError) as exc:
            self.remote_errors += 1
            raise RemoteProtocolError(f"READ notif is not UTF-8: {exc}", peer=sender) from exc
        if ":" not in key or len(key) > 2 * ec_wire.MAX_ID_CHARS + 1:
            self.remote_errors += 1
            raise RemoteProtocolError(f"READ notif {key[:80]!r} names no grant", peer=sender)
        bus = self.bus
        bus.advance(now)
        bound_elsewhere = ""
        for inst in bus.tagged(EC_PRODUCER_GRANT, "leased"):
            ctx = inst.ctx
            if ctx.notif_key != key:
                continue
            if ctx.notif_sender and ctx.notif_sender != sender:
                bound_elsewhere = ctx.notif_sender  # never released by a bystander (S-02)
                continue
            bus.dispatch(EC_PRODUCER_GRANT, inst.key, ReadNotified(), now)
            return True
        if bound_elsewhere:
            self.foreign_notifs += 1
            self.remote_errors += 1
            raise RemoteProtocolError(
                f"READ notif {key[:80]!r} from agent {sender[:80]!r}: its grant is bound to "
                f"agent {bound_elsewhere[:80]!r}",
                peer=sender,
            )
        self.late_notifs += 1
        return False

    def on_peer_disconnected(self, peer: bytes | str, now: float) -> None:
        """A consumer went away; its grants keep their pins until the lease ends."""
        bus = self.bus
        bus.advance(now)
        for inst in bus.instances(EC_PRODUCER_GRANT):
            if inst.ctx.peer == peer and bus.get(EC_PRODUCER_GRANT, inst.key) is inst:
                bus.dispatch(EC_PRODUCER_GRANT, inst.key, PeerDisconnected(), now)
