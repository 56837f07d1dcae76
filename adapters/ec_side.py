"""One instance of the encoder-cache P2P tier, assembled: machines and their real edges.

`ECSide` wires the sans-IO scheduler and worker halves (`ECScheduler`, `ECWorker`) of one
instance (one DP rank, the TP rank 0 worker) to real parts and executes their effects:

- the `/dev/shm` region (R-E03): stale regions of dead owners are reaped first (B-02),
  then the region is created by this owner, mapped, and unlinked at shutdown through the
  worker's `CloseRegion` effect;
- one NIXL agent named after `engine_id`, with the region registered once; the backend
  comes from `nixl_backend` in the extra config, UCX by default (B-03);
- a copy engine (`CpuCopyEngine` unless a factory is given) executing `CopyBlocks`; what
  its `poll()` reports is fed to `ECWorker.on_copy_done` (R-E05);
- producer roles: a ZMQ ROUTER bound at the side-channel host:port (default
  `localhost:5601`; port 0 takes a free port, which is then the port published in
  `ec_transfer_params`). `SendXferAck` becomes a reply; requests are handed to
  `on_producer_message` when `poll()` runs, i.e. from the producer's own scheduler step
  (R-E09). A reply that finds its consumer gone is reported with
  `on_consumer_disconnected` (ZMQ tells a ROUTER nothing else about who left);
- consumer roles: one ZMQ DEALER per producer peer (R-E07) for `SendXferReq` and
  `SendXferDone`; acks go to `on_xfer_ack`, a lost connection to `on_peer_disconnected`
  (and the DEALER is dropped, so the next request opens a fresh one). `IssueRead` goes to
  an `ECNixlReader`: a NIXL READ of the producer's registered region into ours, with the
  producer agent metadata the `XferAck` carried loaded first when the agent is new or
  changed, so a restarted producer is read without another handshake (R-E11). Polling
  the READ reports `on_read_done` or `on_read_failed`; an agent whose peer went away is
  forgotten once no READ uses it (B-08).

Single-threaded: the engine's thread calls `poll()` and `engine_step()`; nothing here
runs on a thread of its own (NIXL's progress thread aside, or none: see
`nixl_progress_thread`). Untrusted bytes never raise out of `poll()`: they are counted in
`rejected`.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_copy_engine import CopyEngine
from kvhandoff.adapters.nixl.agent import NixlAgent, NixlTransferError
from kvhandoff.adapters.nixl.ec_reader import ECNixlReader
from kvhandoff.adapters.shm.region import (
    DEFAULT_PREFIX,
    SHM_DIR,
    SharedRegion,
    reap_stale_regions,
    region_name,
)
from kvhandoff.adapters.zmq.control import ControlClient, ControlServer, Heartbeat
from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.consumer_read import (
    CONSUMER_READ_KIND,
    IssueRead,
    SendXferDone,
    SendXferReq,
)
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import ECFinished
from kvhandoff.machines.ec.producer_grant import SendXferAck
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.ec.worker_region import CloseRegion
from kvhandoff.machines.runtime.clock import Clock, real_clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import (
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV_ALIAS,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_ENV_ALIAS,
    ECLayout,
    ECTransferConfig,
)
from kvhandoff.protocol.ec_wire import XferAck, encode_xfer_ack, encode_xfer_done, encode_xfer_req
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError

__all__ = ["CopyEngineFactory", "ECSide", "ReadOutcome"]

log = logging.getLogger("kvhandoff.ec.side")

CopyEngineFactory = Callable[[torch.Tensor, int], CopyEngine]
"""`factory(region_tensor, block_size_bytes)`: the copy engine over the region."""

_SIDE_CHANNEL_ENV = (
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV_ALIAS,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_ENV_ALIAS,
)
_MAX_OUTCOMES = 4096


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """How a consumer read of one `mm_hash` ended (kept for the last few thousand)."""

    state: str
    """`done`, `fallback_local` or `released` (after a quarantine)."""
    reason: str
    attempts: int
    not_ready: int
    """How many `NACK_NOT_READY`s it was answered before it ended."""


class ECSide:
    """The P2P encoder-cache tier of one instance over real NIXL, ZMQ and `/dev/shm`."""

    def __init__(
        self,
        config: ECTransferConfig,
        layout: ECLayout,
        *,
        compat_hash: str,
        env: Mapping[str, str] | None = None,
        listen: tuple[str, int] | None = None,
        advertise_host: str | None = None,
        instance_id: str | None = None,
        dp_rank: int = 0,
        shm_dir: str = SHM_DIR,
        region_prefix: str = DEFAULT_PREFIX,
        machine_config: Mapping[str, float] | None = None,
        clock: Clock = real_clock,
        copy_engine_factory: CopyEngineFactory | None = None,
        encoder_cache: MutableMapping[str, torch.Tensor] | None = None,
        zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None,
        nixl_progress_thread: bool = False,
    ) -> None:
        """`listen` overrides where a producer binds (else the side-channel environment,
        else `localhost:5601`); `advertise_host` is the host published to consumers (the
        bind host by default). `instance_id` names the region (default `engine_id`).
        `nixl_progress_thread` (off by default, as for push) starts NIXL's own progress
        thread, which spins a core; without it `poll()` progresses the agent, so a READ
        from this producer completes within one of its engine steps."""
        self.config = config
        self.extra = config.extra_config(env)
        if not self.extra.ec_enable_nixl:
            raise LocalProtocolError(
                "ECSide is the P2P tier: set ec_enable_nixl in ec_connector_extra_config "
                "(the local tier needs only ECScheduler, ECWorker and a copy engine)"
            )
        self.layout = layout
        self.compat_hash = compat_hash
        self.encoder_cache: MutableMapping[str, torch.Tensor] = (
            {} if encoder_cache is None else encoder_cache
        )
        self._zmq = zmq_context
        self._progress_thread = nixl_progress_thread
        self.heartbeat = Heartbeat(
            interval_ms=round(self.extra.zmq_heartbeat_interval_s * 1000),
            timeout_ms=round(self.extra.zmq_heartbeat_timeout_s * 1000),
            ttl_ms=round(self.extra.zmq_heartbeat_ttl_s * 1000),
        )
        # Counters and observers.
        self.rejected = 0
        self.acks_sent: Counter[str] = Counter()
        self.acks_undelivered = 0
        self.ack_observers: list[Callable[[XferAck], None]] = []
        self.eviction_observers: list[Callable[[EncodingEvicted], None]] = []
        self.read_outcomes: OrderedDict[str, ReadOutcome] = OrderedDict()
        self.reaped: list[str] = []
        # Edges, created below; `close()` copes with any of them missing.
        self.region: SharedRegion | None = None
        self.region_tensor: torch.Tensor | None = None
        self.copy_engine: CopyEngine | None = None
        self.agent: NixlAgent | None = None
        self.server: ControlServer | None = None
        self.reader: ECNixlReader | None = None
        self._clients: dict[tuple[str, int], ControlClient] = {}
        self._read_failures: list[tuple[str, str]] = []
        self._copy_failures: list[int] = []
        self._gone_consumers: list[bytes] = []
        self._closed = False
        self.publish_host = ""
        self.publish_port = 0
        try:
            self._start(
                env or {},
                listen,
                advertise_host,
                instance_id or config.engine_id,
                dp_rank,
                shm_dir,
                region_prefix,
                machine_config,
                clock,
                copy_engine_factory,
            )
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        env: Mapping[str, str],
        listen: tuple[str, int] | None,
        advertise_host: str | None,
        instance_id: str,
        dp_rank: int,
        shm_dir: str,
        region_prefix: str,
        machine_config: Mapping[str, float] | None,
        clock: Clock,
        copy_engine_factory: CopyEngineFactory | None,
    ) -> None:
        config, layout = self.config, self.layout
        # B-02: leftovers of owners that died (SIGKILL included) go before ours is made.
        self.reaped = reap_stale_regions(region_prefix, shm_dir)
        if self.reaped:
            log.info("reaped stale regions: %s", ", ".join(self.reaped))
        name = region_name(instance_id, dp_rank, region_prefix)
        self.region = SharedRegion.create(name, layout.region_bytes, shm_dir=shm_dir)
        self.region_tensor = self.region.as_tensor()
        factory = copy_engine_factory or CpuCopyEngine
        self.copy_engine = factory(self.region_tensor, layout.block_size_bytes)
        self.agent = NixlAgent(
            config.engine_id, self.extra.nixl_backend, progress_thread=self._progress_thread
        )
        self.agent.register_dram(self.region.addr, self.region.size)
        if config.is_consumer:
            self.reader = ECNixlReader(
                self.agent, self.region.addr, layout.block_size_bytes, layout.num_blocks
            )
        sched_env = dict(env)
        if config.is_producer:
            host, port = listen or (self.extra.side_channel_host, self.extra.side_channel_port)
            self.server = ControlServer(host, port, heartbeat=self.heartbeat, context=self._zmq)
            self.publish_host = advertise_host or host
            self.publish_port = self.server.port
            for key in _SIDE_CHANNEL_ENV:
                sched_env.pop(key, None)
            sched_env[SIDE_CHANNEL_HOST_ENV] = self.publish_host
            sched_env[SIDE_CHANNEL_PORT_ENV] = str(self.publish_port)
        self.scheduler = ECScheduler(
            config,
            layout,
            compat_hash=self.compat_hash,
            clock=clock,
            env=sched_env,
            machine_config=machine_config,
        )
        self.worker = ECWorker(config, layout, clock=clock, env=sched_env)
        self.worker.register_caches(self.region.addr, self.region.size)
        if config.is_producer:
            self.scheduler.register_nixl_agent(
                self.agent.name, self.agent.metadata(), self.region.addr
            )
        bus = self.scheduler.bus
        bus.handle(SendXferAck, self.send_ack)
        bus.handle(SendXferReq, self.send_xfer_req)
        bus.handle(SendXferDone, self.send_xfer_done)
        bus.handle(IssueRead, self.issue_read)
        bus.handle(EncodingEvicted, self._evicted)
        bus.on_retire(self._retired)
        self.worker.bus.handle(CopyBlocks, self._copy)
        self.worker.bus.handle(CloseRegion, self._close_region)

    # -- the engine's calls ----------------------------------------------------------------

    def poll(self) -> int:
        """Deliver what the edges saw: control messages, READ and copy completions, due
        timeouts. Never blocks; returns how many things it handled."""
        if self._closed:
            return 0
        self._progress()
        handled = self._poll_server() + self._poll_clients() + self._poll_reads()
        handled += self._poll_copies()
        return handled + self.scheduler.poll()

    def _progress(self) -> None:
        """Without a progress thread, one pass of the NIXL backend's progress: a READ
        target (the producer) must progress for a peer's READ to complete."""
        if self._progress_thread or self.agent is None:
            return
        try:
            self.agent.get_new_notifs()  # EC uses no notifs; the call progresses UCX
        except NixlTransferError as exc:
            log.debug("NIXL progress: %s", exc)

    def engine_step(self) -> ECFinished:
        """One engine step of the connector: the scheduler's meta to the worker, loads and
        saves submitted (encoder outputs must be in `encoder_cache`), landed copies
        reported back to the scheduler. Returns what landed since the last step."""
        self.poll()
        meta = self.scheduler.build_connector_meta()
        self.worker.start_load_caches(meta)
        self.worker.save_caches()
        self._poll_copies()
        self.scheduler.update_connector_output(self.worker.build_connector_worker_meta())
        return self.worker.get_finished()

    # -- producer edges ------------------------------------------------------------------

    def _poll_server(self) -> int:
        server = self.server
        if server is None:
            return 0
        handled = 0
        while self._gone_consumers:
            self.scheduler.on_consumer_disconnected(self._gone_consumers.pop(0))
            handled += 1
        for peer, payload in server.poll_requests():
            handled += 1
            try:
                self.scheduler.on_producer_message(peer, payload)
            except KvHandoffError as exc:  # bad bytes never stop the producer's step
                self.rejected += 1
                log.info("rejected a control message: %s", exc)
        return handled

    def send_ack(self, inst: Instance | None, effect: SendXferAck) -> None:
        """Executor of `SendXferAck`: reply on the ROUTER to the consumer identity."""
        self.acks_sent[str(effect.ack.status)] += 1
        for observer in self.ack_observers:
            observer(effect.ack)
        server, peer = self.server, effect.peer
        sent = False
        if server is not None and isinstance(peer, bytes):
            try:
                sent = self._reply(server, peer, encode_xfer_ack(effect.ack))
            except (KvHandoffError, RuntimeError, zmq.ZMQError) as exc:
                log.warning("XferAck %s not sent: %s", effect.ack.transfer_id, exc)
        if not sent:
            self.acks_undelivered += 1
            if isinstance(peer, bytes):
                self._gone_consumers.append(peer)  # delivered at the next poll

    def _reply(self, server: ControlServer, peer: bytes, data: bytes) -> bool:
        """The bytes of one `XferAck` onto the wire (fault injection overrides this)."""
        return server.reply(peer, data)

    def _evicted(self, inst: Instance | None, effect: EncodingEvicted) -> None:
        log.info("published encoding %s left the tier (%s)", effect.mm_hash, effect.reason)
        for observer in self.eviction_observers:
            observer(effect)

    # -- consumer edges: control plane ---------------------------------------------------

    def _client(self, host: str, port: int) -> ControlClient:
        client = self._clients.get((host, port))
        if client is None:
            client = ControlClient(host, port, heartbeat=self.heartbeat, context=self._zmq)
            self._clients[(host, port)] = client
        return client

    def _send(self, host: str, port: int, data: bytes, what: str) -> None:
        try:
            sent = self._client(host, port).send(data)
        except (zmq.ZMQError, ValueError, OSError, RuntimeError) as exc:
            log.warning("%s to %s:%s not sent: %s", what, host, port, exc)
            return
        if not sent:  # the ack timeout settles it
            log.warning("%s to %s:%s not sent: send queue full", what, host, port)

    def send_xfer_req(self, inst: Instance | None, effect: SendXferReq) -> None:
        """Executor of `SendXferReq`: on the DEALER of the producer peer."""
        self._send(effect.peer_host, effect.peer_port, encode_xfer_req(effect.req), "XferReq")

    def send_xfer_done(self, inst: Instance | None, effect: SendXferDone) -> None:
        """Executor of `SendXferDone`: on the DEALER of the producer peer."""
        if (effect.peer_host, effect.peer_port) not in self._clients:
            return  # that peer is gone; its grant ends with its lease
        data = encode_xfer_done(effect.done)
        self._send(effect.peer_host, effect.peer_port, data, "XferDone")

    def _poll_clients(self) -> int:
        handled = 0
        for (host, port), client in list(self._clients.items()):
            peer = f"{host}:{port}"
            for data in client.poll_replies():
                handled += 1
                try:
                    self.scheduler.on_xfer_ack(data, peer=peer)
                except KvHandoffError as exc:  # bad bytes never stop the consumer's step
                    self.rejected += 1
                    log.info("rejected an XferAck: %s", exc)
            before = client.disconnects
            client.poll_events()
            if client.disconnects > before:
                handled += 1
                log.warning("producer %s disconnected", peer)
                client.close()
                del self._clients[(host, port)]
                if self.reader is not None:
                    self.reader.peer_lost(host, port)
                self.scheduler.on_peer_disconnected(host, port)
        return handled

    # -- consumer edges: data plane ------------------------------------------------------

    def issue_read(self, inst: Instance | None, effect: IssueRead) -> None:
        """Executor of `IssueRead`: NIXL READ of the granted blocks into ours (R-E11)."""
        try:
            if self.reader is None:
                raise LocalProtocolError("this side cannot READ (not a consumer, or closed)")
            self.reader.read(effect)
        except KvHandoffError as exc:
            log.warning("READ of %s failed to post: %s", effect.mm_hash, exc)
            self._read_failures.append((effect.mm_hash, effect.transfer_id))

    def _awaited(self, mm_hash: str, transfer_id: str) -> bool:
        consumer = self.scheduler.consumer
        read = None if consumer is None else consumer.read(mm_hash)
        return read is not None and read.ctx.transfer_id == transfer_id

    def _poll_reads(self) -> int:
        failures, self._read_failures = self._read_failures, []
        completions = [(mm_hash, transfer_id, False) for mm_hash, transfer_id in failures]
        if self.reader is not None:
            completions += self.reader.poll(self._awaited)
        for mm_hash, transfer_id, ok in completions:
            if ok:
                self.scheduler.on_read_done(mm_hash, transfer_id)
            else:
                self.scheduler.on_read_failed(mm_hash, transfer_id)
        return len(completions)

    def _retired(self, inst: Instance) -> None:
        if inst.kind != CONSUMER_READ_KIND:
            return
        ctx = inst.ctx
        self.read_outcomes[inst.key] = ReadOutcome(
            inst.state, ctx.reason, ctx.attempt, ctx.not_ready
        )
        self.read_outcomes.move_to_end(inst.key)
        while len(self.read_outcomes) > _MAX_OUTCOMES:
            self.read_outcomes.popitem(last=False)

    # -- worker edges --------------------------------------------------------------------

    def _copy(self, inst: Instance | None, effect: CopyBlocks) -> None:
        engine = self.copy_engine
        try:
            if engine is None:
                raise LocalProtocolError("the copy engine is closed")
            engine.submit(effect.batch_id, effect.direction, effect.items, self.encoder_cache)
        except Exception as exc:  # an engine that raises fails its batch, never the step
            log.warning("%s batch %s not submitted: %s", effect.direction, effect.batch_id, exc)
            self._copy_failures.append(effect.batch_id)

    def _poll_copies(self) -> int:
        handled = 0
        while self._copy_failures:
            self.worker.on_copy_done(self._copy_failures.pop(0), False)
            handled += 1
        if self.copy_engine is not None:
            for batch_id, ok in self.copy_engine.poll():
                self.worker.on_copy_done(batch_id, ok)
                handled += 1
        return handled

    def _close_region(self, inst: Instance | None, effect: CloseRegion) -> None:
        """Executor of `CloseRegion`: unmap the region; unlink it when we own it (R-E03)."""
        if self.copy_engine is not None:
            self.copy_engine.close()
        self.region_tensor = None
        region = self.region
        if region is None:
            return
        try:
            region.close()
        except LocalProtocolError as exc:  # a view is still alive: unmapped when it goes
            log.warning("%s", exc)
        if effect.unlink:
            region.unlink()

    # -- facts and teardown ----------------------------------------------------------------

    @property
    def region_path(self) -> str:
        return "" if self.region is None else self.region.path

    def reads_in_flight(self) -> int:
        return 0 if self.reader is None else self.reader.in_flight()

    def loaded_agents(self) -> dict[str, bytes]:
        """Producer agents loaded now: name -> the metadata they were loaded from."""
        return {} if self.reader is None else self.reader.loaded_agents()

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.scheduler.counters())
        reader = self.reader
        if reader is not None:
            out.update(
                agents_loaded=reader.agents_loaded,
                agents_forgotten=reader.agents_forgotten,
                read_post_failures=reader.post_failures,
                reads_abandoned=reader.abandoned,
            )
        out.update(
            rejected=self.rejected,
            reads_in_flight=self.reads_in_flight(),
            acks_sent=dict(self.acks_sent),
            acks_undelivered=self.acks_undelivered,
            metrics=dict(self.scheduler.bus.metrics),
        )
        return out

    def close(self) -> None:
        """Stop the edges and close the region (the owner unlinks it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.reader is not None:
            self.reader.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self.server is not None:
            self.server.close()
        if self.agent is not None:
            self.agent.close()  # deregisters the region before it is unmapped
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()  # CloseRegion: unmap, and unlink as the owner
        elif self.region is not None:
            self._close_region(None, CloseRegion(unlink=True))

    def __enter__(self) -> ECSide:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
