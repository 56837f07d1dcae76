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
  `ec_transfer_params`); see `ec_side_producer.ProducerEdges` (R-E09, B-01);
- consumer roles: one ZMQ DEALER per producer peer and NIXL READs into our region; see
  `ec_side_consumer.ConsumerEdges` (R-E07, R-E11, B-08).

With `tp_size` x `pcp_size` > 1 (`local_worker=False`) this side is the scheduler's
process only: each worker rank is an `ECWorkerSide` (`ec_worker_side.py`) in its own
process, attached to this side's region; the engine carries `build_connector_meta()` down
and the ranks' `ECWorkerMeta` back to `update_connector_output()` (R-T01, R-T02). The
scheduler-side calls carry vLLM 0.33's `ECConnectorBase` names (`ec_side_engine.py`).

Single-threaded: the engine's thread calls `poll()` and `engine_step()`; nothing here
runs on a thread of its own (NIXL's progress thread aside, or none: see
`nixl_progress_thread`). Each of those reads the injected `clock` once and passes `now`
down; code that calls the scheduler half directly passes `side.clock()`. Untrusted bytes
never raise out of `poll()`: they go to `rejections`, a `RejectionLog` counted per peer
and logged at WARNING, rate-limited.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import zmq

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_copy_engine import CopyEngine
from kvhandoff.adapters.ec_side_consumer import ConsumerEdges, ReadOutcome
from kvhandoff.adapters.ec_side_engine import EngineCalls
from kvhandoff.adapters.ec_side_producer import ProducerEdges
from kvhandoff.adapters.nixl.agent import NixlAgent, NixlTransferError
from kvhandoff.adapters.nixl.ec_reader import ECNixlReader
from kvhandoff.adapters.shm.region import (
    DEFAULT_PREFIX,
    SHM_DIR,
    SharedRegion,
    reap_stale_regions,
    region_name,
)
from kvhandoff.adapters.trace import TraceConfig, open_trace, trace_settings
from kvhandoff.adapters.zmq.control import ControlClient, ControlServer, Heartbeat
from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.consumer_read import IssueRead, ReleaseRead, SendXferDone, SendXferReq
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import ECFinished
from kvhandoff.machines.ec.nixl_gate import require_nixl
from kvhandoff.machines.ec.producer_grant import SendXferAck
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.ec.worker_region import CloseRegion
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.ec_config import (
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV_ALIAS,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_ENV_ALIAS,
    ECLayout,
    ECTransferConfig,
)
from kvhandoff.protocol.ec_wire import XferAck
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

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


class ECSide(ProducerEdges, ConsumerEdges, EngineCalls):
    """The P2P encoder-cache tier of one instance over real NIXL, ZMQ and `/dev/shm`."""

    scheduler: ECScheduler
    worker: ECWorker | None

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
        trace: TraceConfig | None = None,
        tp_size: int = 1,
        pcp_size: int = 1,
        local_worker: bool = True,
    ) -> None:
        """`listen` overrides where a producer binds (else the side-channel environment,
        else `localhost:5601`); `advertise_host` is the host published to consumers (the
        bind host by default). `instance_id` names the region (default `engine_id`).
        `nixl_progress_thread` (off by default, as for push) starts NIXL's own progress
        thread, which spins a core; without it `poll()` progresses the agent, so a READ
        from this producer completes within one of its engine steps.
        `tp_size` x `pcp_size` worker ranks report each load (R-T02). With `local_worker`
        (one rank only) this side also runs the TP 0 worker and `engine_step()`; without,
        the ranks are `ECWorkerSide`s in their own processes, attached to this side's
        region, stepped by the engine through `build_connector_meta` /
        `update_connector_output` (R-T01)."""
        self.config = config
        env = dict(os.environ) if env is None else env  # VLLM_EC_SIDE_CHANNEL_HOST / _PORT
        self.extra = config.extra_config(env)
        if not self.extra.ec_enable_nixl:
            raise LocalProtocolError(
                "ECSide is the P2P tier: set ec_enable_nixl in ec_connector_extra_config "
                "(the local tier needs only ECScheduler, ECWorker and a copy engine)"
            )
        require_nixl()  # the seed's RuntimeError, before anything touches /dev/shm (R-E02)
        self.layout = layout
        self.compat_hash = compat_hash
        self.clock = clock
        self.encoder_cache: MutableMapping[str, torch.Tensor] = (
            {} if encoder_cache is None else encoder_cache
        )
        if local_worker and tp_size * pcp_size != 1:
            raise LocalProtocolError(
                "a local worker is one rank: with tp_size x pcp_size > 1 run each rank as an "
                "ECWorkerSide (local_worker=False)"
            )
        self.tp_size, self.pcp_size, self.local_worker = tp_size, pcp_size, local_worker
        self._zmq = zmq_context
        self._progress_thread = nixl_progress_thread
        # The transition trace (off unless `trace` or KVHANDOFF_TRACE names a target).
        self.trace = open_trace(trace_settings(trace, clock), instance_id or config.engine_id)
        self.heartbeat = Heartbeat(
            interval_ms=round(self.extra.zmq_heartbeat_interval_s * 1000),
            timeout_ms=round(self.extra.zmq_heartbeat_timeout_s * 1000),
            ttl_ms=round(self.extra.zmq_heartbeat_ttl_s * 1000),
        )
        # Counters and observers.
        self.rejections = RejectionLog(log, what="control message")
        self.acks_sent: Counter[str] = Counter()
        self.acks_undelivered = 0
        self.ack_observers: list[Callable[[XferAck], None]] = []
        self.eviction_observers: list[Callable[[EncodingEvicted], None]] = []
        # A bounded record of how retired reads ended, for reports (no lifecycle).
        self.read_outcomes: OrderedDict[str, ReadOutcome] = OrderedDict()
        self.reaped: list[str] = []
        # Edges, created below; `close()` copes with any of them missing.
        self.region: SharedRegion | None = None
        self.region_tensor: torch.Tensor | None = None
        self.copy_engine: CopyEngine | None = None
        self.agent: NixlAgent | None = None
        self.server: ControlServer | None = None
        self.reader: ECNixlReader | None = None
        # A socket cache by producer address (opened on first send, dropped when it loses
        # its peer); the producer's lifecycle is `ec.consumer_read`'s and `ec.producer_agent`'s.
        self._clients: dict[tuple[str, int], ControlClient] = {}
        # An inbox: consumers an XferAck could not reach (seen inside an effect handler),
        # told to the scheduler at the next poll.
        self._gone_consumers: list[bytes] = []
        self._closed = False
        self.publish_host = ""
        self.publish_port = 0
        try:
            self._start(
                env,
                listen,
                advertise_host,
                instance_id or config.engine_id,
                dp_rank,
                shm_dir,
                region_prefix,
                machine_config,
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
                self.agent,
                self.region.addr,
                layout.block_size_bytes,
                layout.num_blocks,
                clock=self.clock,
            )
        sched_env = dict(env)
        if config.is_producer:
            host, port = listen or (self.extra.side_channel_host, self.extra.side_channel_port)
            self.server = ControlServer(
                host,
                port,
                heartbeat=self.heartbeat,
                context=self._zmq,
                on_reject=self._frame_reject,
            )
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
            env=sched_env,
            machine_config=machine_config,
            tp_size=self.tp_size,
            pcp_size=self.pcp_size,
        )
        worker = None
        if self.local_worker:
            worker = ECWorker(config, layout, env=sched_env)  # TP 0 / PCP 0: the writer
        self.worker = worker
        role = config.ec_role or ""
        if self.trace is not None:
            self.trace.attach(self.scheduler.bus, proc=instance_id, role=role, bus_name="scheduler")
        if worker is not None:
            if self.trace is not None:
                self.trace.attach(worker.bus, proc=instance_id, role=role, bus_name="worker")
            worker.register_region(self.region.addr, self.region.size, self.clock())
        if config.is_producer:
            self.scheduler.register_nixl_agent(
                self.agent.name, self.agent.metadata(), self.region.addr
            )
        bus = self.scheduler.bus
        bus.handle(SendXferAck, self.send_ack)
        bus.handle(SendXferReq, self.send_xfer_req)
        bus.handle(SendXferDone, self.send_xfer_done)
        bus.handle(IssueRead, self.issue_read)
        bus.handle(ReleaseRead, self.release_read)
        bus.handle(EncodingEvicted, self._evicted)
        bus.on_retire(self._retired)
        if worker is not None:
            worker.bus.handle(CopyBlocks, self._copy)
            worker.bus.handle(CloseRegion, self._close_region)

    def _frame_reject(self, peer: str, reason: str) -> None:
        """A control socket dropped a message of the wrong frame shape (S-06)."""
        self.rejections.reject(peer, f"control frames: {reason}", self.clock())

    @property
    def rejected(self) -> int:
        """Control messages rejected so far (bad bytes, unknown or stale requests)."""
        return self.rejections.total

    # -- the engine's calls ----------------------------------------------------------------

    def poll(self) -> int:
        """Deliver what the edges saw: control messages, READ and copy completions, due
        timeouts. Never blocks; returns how many things it handled."""
        self._open("poll")
        return self._poll(self.clock())

    def _open(self, call: str) -> None:
        if self._closed:
            raise LocalProtocolError(f"ECSide.{call}: the side was closed")

    def _poll(self, now: float) -> int:
        handled = self._progress(now)
        handled += self._poll_server(now) + self._poll_clients(now) + self._poll_reads(now)
        handled += self._poll_copies(now)
        return handled + self.scheduler.poll(now)

    def _progress(self, now: float) -> int:
        """The READ notifs consumers' READs carried (C-03: `<session_id>:<mm_hash>`
        releases the grant it names); without a progress thread, draining them is also
        the pass of the NIXL backend's progress a READ of ours needs to complete."""
        if self.agent is None:
            return 0
        try:
            notifs = self.agent.get_new_notifs()
        except NixlTransferError as exc:
            log.debug("NIXL progress: %s", exc)
            return 0
        if self.server is None:  # a consumer only: nobody READs from us
            return 0
        for sender, message in notifs:
            try:
                if not self.scheduler.on_read_notif(sender, message, now):
                    # Late (its lease ended) or naming nobody's grant: counted, logged (S-06).
                    self.rejections.reject(sender, "READ notif names no live grant", now)
            except RemoteProtocolError as exc:  # bad bytes never stop the producer's step
                self.rejections.reject(sender, exc, now)
        return len(notifs)

    def engine_step(self) -> ECFinished:
        """One engine step of the connector: the scheduler's meta to the worker, loads and
        saves submitted (encoder outputs must be in `encoder_cache`), landed copies
        reported back to the scheduler. Returns what landed since the last step."""
        self._open("engine_step")
        now = self.clock()
        worker = self.worker
        if worker is None:
            raise LocalProtocolError(
                "ECSide.engine_step: the worker ranks run as ECWorkerSides; step them with "
                "build_connector_meta and update_connector_output"
            )
        self._poll(now)
        meta = self.scheduler.build_connector_meta(now)
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(now)
        worker.save_caches(now)
        self._poll_copies(now)
        self.scheduler.update_connector_output(worker.build_connector_worker_meta(now), now)
        return worker.take_landed()

    # -- worker edges --------------------------------------------------------------------

    def _copy(self, inst: Instance[Any] | None, effect: CopyBlocks) -> None:
        engine = self.copy_engine
        try:
            if engine is None:
                raise LocalProtocolError("the copy engine is closed")
            engine.submit(effect.batch_id, effect.direction, effect.items, self.encoder_cache)
        except Exception as exc:  # an engine that raises fails its batch, never the step
            log.warning("%s batch %s not submitted: %s", effect.direction, effect.batch_id, exc)
            if self.worker is not None:
                self.worker.on_copy_refused(effect.batch_id)  # failed at the next poll

    def _poll_copies(self, now: float) -> int:
        worker = self.worker
        if worker is None:
            return 0
        handled = worker.fail_refused(now)
        if self.copy_engine is not None:
            for batch_id, ok in self.copy_engine.poll():
                worker.on_copy_done(batch_id, now, ok=ok)
                handled += 1
        return handled

    def _close_region(self, inst: Instance[Any] | None, effect: CloseRegion) -> None:
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
                foreign_agents_refused=reader.foreign_agents,
                read_post_failures=reader.post_failures,
                reads_abandoned=reader.abandoned,
            )
        server = self.server
        if server is not None:  # the producer's ROUTER (S-01, S-03, S-06)
            out.update(
                router_accepted=server.accepted,
                router_dropped=server.dropped,
                router_oversized=server.oversized,
                router_disconnects=server.disconnects,
            )
        out.update(
            rejected=self.rejected,
            rejected_by_reason=self.rejections.reasons(),
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
        scheduler: ECScheduler | None = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.shutdown()  # nothing is reported cached any more
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown(self.clock())  # CloseRegion: unmap, and unlink as the owner
        elif self.region is not None:
            self._close_region(None, CloseRegion(unlink=True))
        if self.trace is not None:
            self.trace.flush()

    def __enter__(self) -> ECSide:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
