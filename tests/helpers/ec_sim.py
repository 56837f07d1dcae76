"""A seeded in-memory control and data plane for encoder-cache connectors (tests only).

It executes the effects of real `ECScheduler`/`ECWorker` halves on a `VirtualClock`:

- `SendXferReq`, `SendXferDone`, `SendXferAck` become byte messages on a link with a
  delay; a link keeps FIFO order, may drop messages, and a disconnect drops what is in
  flight and tells both ends.
- `IssueRead` becomes a NIXL READ that completes after a delay (or fails, or hangs),
  copying block tags from the producer's region into the consumer's.
- `CopyBlocks` becomes a copy that lands after a delay: a save writes the entry's tag into
  the region blocks, a load checks them.

Regions hold one tag per block (the `mm_hash` whose bytes it holds), so a READ or a load
of the wrong blocks is caught. Everything random comes from one `random.Random(seed)`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.clock import VirtualClock
from kvhandoff.machines.ec_cache_entry import EncodingEvicted
from kvhandoff.machines.ec_consumer_read import IssueRead, SendXferDone, SendXferReq
from kvhandoff.machines.ec_copy_batch import CopyBlocks
from kvhandoff.machines.ec_meta import ECRequestInfo
from kvhandoff.machines.ec_producer_grant import SendXferAck
from kvhandoff.machines.ec_request import FailRequest
from kvhandoff.machines.ec_scheduler import ECScheduler
from kvhandoff.machines.ec_worker import ECWorker
from kvhandoff.protocol.ec_config import ECLayout, ECRole, ECTransferConfig
from kvhandoff.protocol.ec_status import compatibility_hash
from kvhandoff.protocol.ec_wire import encode_xfer_ack, encode_xfer_done, encode_xfer_req
from kvhandoff.protocol.errors import RemoteProtocolError

HIDDEN = 4
DTYPE_SIZE = 2
BLOCK_BYTES = HIDDEN * DTYPE_SIZE
COMPAT = compatibility_hash("1.0", "model", "bfloat16", BLOCK_BYTES)


def layout(num_blocks: int) -> ECLayout:
    return ECLayout(hidden_dim=HIDDEN, dtype_size=DTYPE_SIZE, ec_cpu_bytes=num_blocks * BLOCK_BYTES)


def transfer_config(
    role: ECRole, num_blocks: int, *, engine_id: str, p2p: bool = True, **extra: Any
) -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={
            "ec_cpu_bytes": num_blocks * BLOCK_BYTES,
            "ec_enable_nixl": p2p,
            **extra,
        },
        engine_id=engine_id,
    )


@dataclass
class Engine:
    """One instance: a scheduler half, one worker half, and its region's block tags."""

    name: str
    role: ECRole
    scheduler: ECScheduler
    worker: ECWorker
    region: list[str | None]
    host: str = ""
    port: int = 0
    epoch: int = 0
    evicted: list[EncodingEvicted] = field(default_factory=list)
    failed: list[FailRequest] = field(default_factory=list)


@dataclass(order=True)
class _Event:
    when: float
    seq: int
    run: Callable[[], None] = field(compare=False)


class Sim:
    """Seeded executor of the effects of a producer and a consumer."""

    def __init__(
        self,
        seed: int = 0,
        *,
        producer_blocks: int = 16,
        consumer_blocks: int = 16,
        net_delay: tuple[float, float] = (0.01, 0.2),
        copy_delay: tuple[float, float] = (0.0, 0.5),
        read_delay: tuple[float, float] = (0.01, 0.5),
        machine_config: dict[str, float] | None = None,
        producer_role: ECRole = "ec_producer",
        consumer_role: ECRole = "ec_consumer",
        eviction_observer: Callable[[Engine, str, list[Any]], None] | None = None,
        on_engine: Callable[[Engine], None] | None = None,
        ack_observer: Callable[[str, Any, str, str], None] | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.clock = VirtualClock()
        self.net_delay = net_delay
        self.copy_delay = copy_delay
        self.read_delay = read_delay
        self.machine_config = machine_config or {}
        self.eviction_observer = eviction_observer
        self.on_engine = on_engine
        self.ack_observer = ack_observer
        self._events: list[_Event] = []
        self._seq = itertools.count()
        self._link_last = {"to_producer": 0.0, "to_consumer": 0.0}
        self._link_epoch = 0
        self.producer_blocks = producer_blocks
        self.producer_role = producer_role
        self.producer = self._engine("producer", producer_role, producer_blocks, 0)
        self.consumer = self._engine("consumer", consumer_role, consumer_blocks, 0)
        # Faults armed by the test for the next matching message or read.
        self.ack_faults: list[str] = []
        self.read_faults: list[str] = []
        self.drop_next: int = 0
        # What happened, for the test's checks.
        self.delivered_acks: list[tuple[str, str, str]] = []  # (mm_hash, transfer_id, status)
        self.remote_errors: list[str] = []
        self.grant_times: dict[tuple[Any, str], float] = {}
        self.outstanding_loads: dict[str, int] = {}
        self.reads_started = 0
        self.reads_landed = 0

    # -- engines -------------------------------------------------------------------------

    def _engine(self, name: str, role: ECRole, num_blocks: int, epoch: int) -> Engine:
        engine_id = f"{name}-{epoch}"
        config = transfer_config(role, num_blocks, engine_id=engine_id)
        env = {"VLLM_EC_SIDE_CHANNEL_HOST": f"{name}.sim", "VLLM_EC_SIDE_CHANNEL_PORT": "5601"}
        lay = layout(num_blocks)
        holder: list[Engine] = []

        def observe(victim: str, order: list[Any]) -> None:
            if self.eviction_observer is not None:
                self.eviction_observer(holder[0], victim, order)

        scheduler = ECScheduler(
            config,
            lay,
            compat_hash=COMPAT,
            clock=self.clock,
            env=env,
            machine_config=self.machine_config,
            eviction_observer=observe,
        )
        worker = ECWorker(config, lay, clock=self.clock)
        worker.register_caches(0, lay.region_bytes)
        engine = Engine(name, role, scheduler, worker, [None] * num_blocks, f"{name}.sim", 5601)
        engine.epoch = epoch
        holder.append(engine)
        if config.is_producer:
            scheduler.register_nixl_agent(f"agent-{engine_id}", f"md-{engine_id}".encode(), 4096)
        bus = scheduler.bus
        bus.handle(SendXferReq, lambda inst, e: self._send("to_producer", encode_xfer_req(e.req)))
        bus.handle(
            SendXferDone, lambda inst, e: self._send("to_producer", encode_xfer_done(e.done))
        )
        bus.handle(SendXferAck, lambda inst, e: self._send_ack(engine, e))
        bus.handle(IssueRead, lambda inst, e: self._issue_read(engine, e))
        bus.handle(EncodingEvicted, lambda inst, e: engine.evicted.append(e))
        worker.bus.handle(CopyBlocks, lambda inst, e: self._copy(engine, e))
        if self.on_engine is not None:
            self.on_engine(engine)
        return engine

    def restart_producer(self) -> None:
        """The producer process dies and a fresh one takes its address."""
        old = self.producer
        self.disconnect()
        self.producer = self._engine(
            "producer", self.producer_role, self.producer_blocks, old.epoch + 1
        )

    # -- scheduling of simulated work ------------------------------------------------------

    def _at(self, when: float, run: Callable[[], None]) -> None:
        heapq.heappush(self._events, _Event(when, next(self._seq), run))

    def _delay(self, bounds: tuple[float, float]) -> float:
        return self.rng.uniform(*bounds)

    def advance(self, seconds: float, *, step: Callable[[], None] | None = None) -> None:
        """Run every due piece of work up to `now + seconds`, stepping after each."""
        target = self.clock.now + seconds
        while True:
            nexts = [e.when for e in self._events[:1]]
            for engine in (self.producer, self.consumer):
                deadline = engine.scheduler.bus.next_deadline()
                if deadline is not None:
                    nexts.append(deadline)
            due = min(nexts, default=None)
            if due is None or due > target:
                break
            self.clock.jump_to(max(due, self.clock.now))
            while self._events and self._events[0].when <= self.clock.now:
                heapq.heappop(self._events).run()
            for engine in (self.producer, self.consumer):
                engine.scheduler.poll()
            if step is not None:
                step()
        self.clock.jump_to(target)
        for engine in (self.producer, self.consumer):
            engine.scheduler.poll()
        if step is not None:
            step()

    # -- control plane -------------------------------------------------------------------

    def _send(self, link: str, data: bytes) -> None:
        epoch = self._link_epoch
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        when = max(self._link_last[link], self.clock.now + self._delay(self.net_delay))
        self._link_last[link] = when
        if link == "to_producer":
            self._at(when, lambda: self._deliver_to_producer(epoch, data))
        else:
            self._at(when, lambda: self._deliver_to_consumer(epoch, data))

    def _send_ack(self, engine: Engine, effect: SendXferAck) -> None:
        if engine is not self.producer:
            return  # a dead producer's late answer goes nowhere
        if str(effect.ack.status) == "OK":
            self.grant_times[(effect.peer, effect.ack.transfer_id)] = self.clock.now
        self._send("to_consumer", encode_xfer_ack(effect.ack))

    def _deliver_to_producer(self, epoch: int, data: bytes) -> None:
        if epoch != self._link_epoch:
            return
        try:
            self.producer.scheduler.on_producer_message(b"consumer", data)
        except RemoteProtocolError as exc:
            self.remote_errors.append(f"producer: {exc}")

    def _deliver_to_consumer(self, epoch: int, data: bytes) -> None:
        if epoch != self._link_epoch:
            return
        data, status, mm_hash = self._fault_ack(data)
        consumer = self.consumer.scheduler.consumer
        assert consumer is not None
        read = consumer.read(mm_hash)
        before = "" if read is None else read.state
        try:
            self.consumer.scheduler.on_xfer_ack(data, peer="producer")
        except RemoteProtocolError as exc:
            self.remote_errors.append(f"consumer: {exc}")
        if self.ack_observer is not None and read is not None:
            self.ack_observer(status, read, before, read.state)

    def _fault_ack(self, data: bytes) -> tuple[bytes, str, str]:
        """The ack as delivered (maybe replaced by an armed fault), its status, its mm_hash."""
        from kvhandoff.protocol.ec_status import XferStatus
        from kvhandoff.protocol.ec_wire import XferAck, decode_xfer_ack

        ack = decode_xfer_ack(data)
        if self.ack_faults:
            fault = self.ack_faults.pop(0)
            if fault == "garbage":
                return b"\xc1garbage", "garbage", ack.mm_hash
            version = 99 if fault == "NACK_VERSION" else ack.version
            status = XferStatus.NACK_INTERNAL if fault == "NACK_VERSION" else XferStatus(fault)
            ack = XferAck(version, ack.transfer_id, ack.mm_hash, status, "")
            data = encode_xfer_ack(ack)
            if version == 99:
                status = XferStatus.NACK_VERSION
            self.delivered_acks.append((ack.mm_hash, ack.transfer_id, str(status)))
            return data, str(status), ack.mm_hash
        self.delivered_acks.append((ack.mm_hash, ack.transfer_id, str(ack.status)))
        return data, str(ack.status), ack.mm_hash

    def disconnect(self) -> None:
        """The link breaks: in-flight messages are lost and both ends are told."""
        self._link_epoch += 1
        self.consumer.scheduler.on_peer_disconnected(self.producer.host, self.producer.port)
        if self.producer.scheduler.producer is not None:
            self.producer.scheduler.producer.on_peer_disconnected(b"consumer")

    # -- data plane ------------------------------------------------------------------------

    def _issue_read(self, engine: Engine, read: IssueRead) -> None:
        self.reads_started += 1
        producer = self.producer
        epoch = producer.epoch
        fault = self.read_faults.pop(0) if self.read_faults else ""
        if fault == "hang":
            return
        bounds = (25.0, 70.0) if fault == "slow" else self.read_delay
        when = self.clock.now + self._delay(bounds)

        def land() -> None:
            consumer = self.consumer
            if fault == "fail" or self.producer is not producer or producer.epoch != epoch:
                consumer.scheduler.on_read_failed(read.mm_hash, read.transfer_id)
                return
            pool = consumer.scheduler.cache.pool
            for dst in read.dst_blocks:
                owner = pool.owner_of(dst)
                assert owner == read.mm_hash, (
                    f"READ of {read.mm_hash} lands in block {dst} held by {owner!r}"
                )
            live = consumer.scheduler.consumer.read(read.mm_hash)  # type: ignore[union-attr]
            used = live is not None and live.state == "reading"
            used = used and live.ctx.transfer_id == read.transfer_id  # type: ignore[union-attr]
            for src, dst in zip(read.src_blocks, read.dst_blocks, strict=True):
                tag = producer.region[src]
                # A READ still awaited must find its source pinned; one landing in
                # quarantine may read reused blocks: its destination is discarded.
                assert tag == read.mm_hash or not used, (
                    f"READ of {read.mm_hash}: source block {src} holds {tag}"
                )
                consumer.region[dst] = tag
            self.reads_landed += 1
            consumer.scheduler.on_read_done(read.mm_hash, read.transfer_id)

        self._at(when, land)

    def _copy(self, engine: Engine, copy: CopyBlocks) -> None:
        when = self.clock.now + self._delay(self.copy_delay)
        if copy.direction == "load":
            for item in copy.items:
                self.outstanding_loads[item.mm_hash] = (
                    self.outstanding_loads.get(item.mm_hash, 0) + 1
                )

        def land() -> None:
            if copy.direction == "save":
                for item in copy.items:
                    for block in item.blocks:
                        engine.region[block] = item.mm_hash
            else:
                for item in copy.items:
                    tags = {engine.region[b] for b in item.blocks}
                    assert tags == {item.mm_hash}, f"load of {item.mm_hash} reads {tags}"
            engine.worker.on_copy_done(copy.batch_id)

        self._at(when, land)

    # -- one engine step ---------------------------------------------------------------

    def engine_step(self, engine: Engine, allocs: list[tuple[ECRequestInfo, str, int]]) -> None:
        """Allocate, build the meta, run the worker, report back (one engine step)."""
        scheduler, worker = engine.scheduler, engine.worker
        for request, mm_hash, tokens in allocs:
            scheduler.update_state_after_alloc(request, mm_hash, tokens)
        meta = scheduler.build_connector_meta()
        worker.start_load_caches(meta)
        worker.save_caches()
        report = worker.build_connector_worker_meta()
        for mm_hash in report.loaded + report.failed_loads:
            self.outstanding_loads[mm_hash] -= 1
        scheduler.update_connector_output(report)
        engine.failed.extend(scheduler.take_failed_requests())
