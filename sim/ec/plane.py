"""The in-memory encoder-cache planes, for deterministic simulation ONLY (never production).

`SimECPlane` executes the effects of a real producer and a real consumer (`ECScheduler`
and `ECWorker` halves) on a `VirtualClock`, with one seeded `random.Random`:

- Control plane: `SendXferReq`, `SendXferDone`, `SendXferAck` become byte messages on a
  link with a delay. A link keeps FIFO order unless `reorder` strikes; messages may be
  dropped, delayed or duplicated (`SimFaults`, or one-shot faults a test arms). While
  partitioned, messages wait for the heal (TCP retransmits); a disconnect (ZMQ heartbeat
  loss) drops what is in flight and tells both ends.
- Data plane (`data_plane.DataPlane`): `IssueRead` becomes a NIXL READ that completes
  after a delay, fails, or stalls; a READ nobody awaits any more is cancelled.
- Copies: `CopyBlocks` lands after a delay (`slow_save` makes saves late, so consumers
  meet `NACK_NOT_READY`); a save writes the entry's tag into its blocks, a load checks it.

The engines themselves (`Engine`, `layout`, `transfer_config`) live in `engine`.

Regions hold one tag per block (the `mm_hash` whose bytes it holds), so a READ or a load
of the wrong blocks is caught: the plane records a violation instead of raising, and the
world (`sim.ec.world`) or a test decides what that means.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.consumer_read import IssueRead, ReleaseRead, SendXferDone, SendXferReq
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.machines.ec.producer_grant import SendXferAck
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.ec_config import ECRole
from kvhandoff.protocol.ec_status import XferStatus
from kvhandoff.protocol.ec_wire import (
    XferAck,
    decode_xfer_ack,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.sim.ec.data_plane import DataPlane
from kvhandoff.sim.ec.engine import BLOCK_BYTES, COMPAT, Engine, layout, transfer_config
from kvhandoff.sim.ec.reports import ReportChannel
from kvhandoff.sim.faults import SimFaults

__all__ = ["BLOCK_BYTES", "COMPAT", "Engine", "SimECPlane", "layout", "transfer_config"]

TO_PRODUCER, TO_CONSUMER = "to_producer", "to_consumer"


@dataclass(order=True)
class _Event:
    when: float
    seq: int
    run: Callable[[], None] = field(compare=False)


class SimECPlane(DataPlane):
    """Seeded executor of the effects of one producer and one consumer."""

    def __init__(
        self,
        seed: int = 0,
        *,
        producer_blocks: int = 16,
        consumer_blocks: int = 16,
        faults: SimFaults | None = None,
        net_delay: tuple[float, float] = (0.01, 0.2),
        copy_delay: tuple[float, float] = (0.0, 0.5),
        read_delay: tuple[float, float] = (0.01, 0.5),
        machine_config: dict[str, float] | None = None,
        producer_role: ECRole = "ec_producer",
        consumer_role: ECRole = "ec_consumer",
        clock: VirtualClock | None = None,
        rng: random.Random | None = None,
        eviction_observer: Callable[[Engine, str, list[Any]], None] | None = None,
        on_engine: Callable[[Engine], None] | None = None,
        ack_observer: Callable[[str, Any, str, str], None] | None = None,
        tp_size: int = 1,
        pcp_size: int = 1,
    ) -> None:
        self.rng = rng or random.Random(seed)
        self.tp_size, self.pcp_size = tp_size, pcp_size
        self.reports = ReportChannel(random.Random(self.rng.getrandbits(64)))
        id_rng = random.Random(self.rng.getrandbits(64))
        self.transfer_ids = lambda: f"{id_rng.getrandbits(128):032x}"
        self.clock = clock or VirtualClock()
        self.faults = faults or SimFaults.none()
        self.net_delay = net_delay
        self.copy_delay = copy_delay
        self.read_delay = read_delay
        self.machine_config = machine_config or {}
        self.eviction_observer = eviction_observer
        self.on_engine = on_engine
        self.ack_observer = ack_observer
        self._events: list[_Event] = []
        self._seq = itertools.count()
        self._link_last = {TO_PRODUCER: 0.0, TO_CONSUMER: 0.0}
        self._link_epoch = 0
        self.partitioned = False
        # What waits for the heal: messages (lost if the connection drops meanwhile) and
        # READs (a DMA outlives a ZMQ reconnect).
        self._held_messages: list[Callable[[], None]] = []
        self._held_reads: list[Callable[[], None]] = []
        self.producer_blocks = producer_blocks
        self.consumer_blocks = consumer_blocks
        self.producer_role = producer_role
        self.consumer_role = consumer_role
        self.producer = self._engine("producer", producer_role, producer_blocks, 0)
        self.consumer = self._engine("consumer", consumer_role, consumer_blocks, 0)
        # One-shot faults a test arms for the next matching message or read.
        self.ack_faults: list[str] = []
        self.read_faults: list[str] = []
        self.drop_next: int = 0
        # What happened, for checks.
        self.violations: list[str] = []
        self.delivered_acks: list[tuple[str, str, str]] = []  # (mm_hash, transfer_id, status)
        self.remote_errors: list[str] = []
        self.grant_times: dict[tuple[Any, str], float] = {}
        self.counters: dict[str, int] = {}
        self.reads_started = 0
        self.reads_landed = 0
        self.cancelled_reads: set[str] = set()

    @property
    def outstanding_loads(self) -> dict[str, int]:
        return self.consumer.outstanding_loads()

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def violation(self, message: str) -> None:
        self.violations.append(f"t={self.clock.now:.4f} {message}")

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
            env=env,
            machine_config=self.machine_config,
            eviction_observer=observe,
            tp_size=self.tp_size,
            pcp_size=self.pcp_size,
            transfer_ids=self.transfer_ids,
        )
        workers = [
            ECWorker(config, lay, tp_rank=tp, pcp_rank=pcp)
            for pcp in range(self.pcp_size)
            for tp in range(self.tp_size)
        ]
        for worker in workers:
            worker.register_region(0, lay.region_bytes, self.clock.now)
        engine = Engine(name, role, scheduler, workers, [None] * num_blocks, f"{name}.sim", 5601)
        engine.epoch = epoch
        engine.identity = engine_id.encode()
        for bus in (scheduler.bus, *(worker.bus for worker in workers)):
            bus.on_error = functools.partial(self._machine_error, name)
        holder.append(engine)
        if config.is_producer:
            scheduler.register_nixl_agent(f"agent-{engine_id}", f"md-{engine_id}".encode(), 4096)
        bus = scheduler.bus
        bus.handle(
            SendXferReq,
            lambda inst, e: self._send_to_producer(engine, e.peer_host, encode_xfer_req(e.req)),
        )
        bus.handle(
            SendXferDone,
            lambda inst, e: self._send_to_producer(engine, e.peer_host, encode_xfer_done(e.done)),
        )
        bus.handle(SendXferAck, lambda inst, e: self._send_ack(engine, e))
        bus.handle(IssueRead, lambda inst, e: self._issue_read(engine, e))
        bus.handle(ReleaseRead, lambda inst, e: self._release_read(engine, e))
        bus.handle(EncodingEvicted, lambda inst, e: engine.evicted.append(e))
        for worker in workers:
            worker.bus.handle(CopyBlocks, functools.partial(self._copy_on, engine, worker))
        if self.on_engine is not None:
            self.on_engine(engine)
        return engine

    def _machine_error(self, name: str, inst: Any, event: Any, exc: BaseException) -> None:
        """An error inside a machine (an effect to a dead instance, an illegal event) is a
        bug the simulation reports, never something to log and forget."""
        self.violation(f"{name} {inst.machine.name} {inst.key!r} on {event.trigger}: {exc}")

    def crash(self, which: str) -> None:
        """`producer` or `consumer` dies: nothing it had in flight lands any more."""
        engine = self.producer if which == "producer" else self.consumer
        if not engine.alive:
            return
        engine.alive = False
        self._link_epoch += 1  # its connections are gone with it

    def restart(self, which: str) -> None:
        """A fresh process takes the dead one's address (and a new epoch)."""
        if which == "producer":
            old = self.producer
            self.producer = self._engine(
                "producer", self.producer_role, self.producer_blocks, old.epoch + 1
            )
        else:
            old = self.consumer
            self.consumer = self._engine(
                "consumer", self.consumer_role, self.consumer_blocks, old.epoch + 1
            )

    def restart_producer(self) -> None:
        """The producer process dies and a fresh one takes its address."""
        self.disconnect()
        self.crash("producer")
        self.restart("producer")

    def engines(self) -> tuple[Engine, Engine]:
        return self.producer, self.consumer

    # -- scheduling of simulated work ------------------------------------------------------

    def at(self, when: float, run: Callable[[], None]) -> None:
        """Run `run` when the clock reaches `when` (in order with the planes' own work)."""
        heapq.heappush(self._events, _Event(when, next(self._seq), run))

    def in_flight(self) -> int:
        reports = sum(len(e.reports_in_transit) for e in self.engines() if e.alive)
        return len(self._events) + len(self._held_messages) + len(self._held_reads) + reports

    def next_event(self) -> float | None:
        """The earliest time something happens by itself (work or a machine deadline)."""
        times = [self._events[0].when] if self._events else []
        for engine in self.engines():
            if engine.alive:
                deadline = engine.scheduler.bus.next_deadline()
                if deadline is not None:
                    times.append(deadline)
        return min(times, default=None)

    def next_report(self) -> float | None:
        """When the next rank report in transit is due (an engine step delivers it)."""
        dues = [ReportChannel.next_due(e) for e in self.engines() if e.alive]
        return min((due for due in dues if due is not None), default=None)

    def advance(self, seconds: float, *, step: Callable[[], None] | None = None) -> None:
        """Run every due piece of work up to `now + seconds`, stepping after each."""
        self.run_until(self.clock.now + seconds, step=step)

    def run_until(self, target: float, *, step: Callable[[], None] | None = None) -> None:
        while True:
            due = self.next_event()
            if due is None or due > target:
                break
            self.clock.jump_to(max(due, self.clock.now))
            while self._events and self._events[0].when <= self.clock.now:
                heapq.heappop(self._events).run()
            self.poll()
            if step is not None:
                step()
        self.clock.jump_to(max(target, self.clock.now))
        self.poll()
        if step is not None:
            step()

    def poll(self) -> None:
        for engine in self.engines():
            if engine.alive:
                engine.scheduler.poll(self.clock.now)

    # -- control plane -------------------------------------------------------------------

    def _send_to_producer(self, engine: Engine, host: str, data: bytes) -> None:
        """On the consumer's DEALER to `host`: the producer's, or another peer's (a
        hostile producer's messages go nowhere the simulation follows)."""
        if engine is not self.consumer or not engine.alive:
            return
        if host != self.producer.host:
            self.count("to_other_peers")
            return
        self._send(TO_PRODUCER, data, engine.identity)

    def _send(self, link: str, data: bytes, identity: bytes = b"") -> None:
        if self.drop_next > 0:
            self.drop_next -= 1
            self.count("dropped")
            return
        faults, rng = self.faults, self.rng
        if faults.drop and rng.random() < faults.drop:
            self.count("dropped")
            return
        copies = 2 if faults.duplicate and rng.random() < faults.duplicate else 1
        for _ in range(copies):
            self._post(link, data, identity)
        if copies > 1:
            self.count("duplicated")

    def _post(self, link: str, data: bytes, identity: bytes) -> None:
        faults, rng = self.faults, self.rng
        epoch = self._link_epoch
        when = self.clock.now + self._delay(self.net_delay)
        if faults.delay and rng.random() < faults.delay:
            when += rng.uniform(0.5, 4.0)
            self.count("delayed")
        if faults.reorder and rng.random() < faults.reorder:
            self.count("reordered")  # may overtake what was sent before it
        else:
            when = max(self._link_last[link], when)
            self._link_last[link] = when

        def deliver() -> None:
            if epoch != self._link_epoch:
                return  # the connection it travelled on is gone
            if self.partitioned:
                self._held_messages.append(deliver)
                return
            if link == TO_PRODUCER:
                self._deliver_to_producer(identity, data)
            else:
                self._deliver_to_consumer(data)

        self.at(when, deliver)

    def _send_ack(self, engine: Engine, effect: SendXferAck) -> None:
        if engine is not self.producer or not engine.alive:
            return  # a dead producer's late answer goes nowhere
        if effect.ack.status is XferStatus.OK:
            self.grant_times[(effect.peer, effect.ack.transfer_id)] = self.clock.now
        if effect.peer != self.consumer.identity:
            return  # the consumer it answers is gone (or hostile): not followed
        self._send(TO_CONSUMER, encode_xfer_ack(effect.ack))

    def _deliver_to_producer(self, identity: bytes, data: bytes) -> None:
        producer = self.producer
        if not producer.alive:
            return
        try:
            producer.scheduler.on_producer_message(identity, data, self.clock.now)
        except RemoteProtocolError as exc:
            self.remote_errors.append(f"producer: {exc}")

    def _deliver_to_consumer(self, data: bytes) -> None:
        consumer_engine = self.consumer
        if not consumer_engine.alive:
            return
        data, status, mm_hash = self._fault_ack(data)
        consumer = consumer_engine.scheduler.consumer
        assert consumer is not None
        read = consumer.read(mm_hash)
        before = "" if read is None else read.state
        peer = f"{self.producer.host}:{self.producer.port}"
        try:
            consumer_engine.scheduler.on_xfer_ack(data, self.clock.now, peer=peer)
        except RemoteProtocolError as exc:
            self.remote_errors.append(f"consumer: {exc}")
        if self.ack_observer is not None and read is not None:
            self.ack_observer(status, read, before, read.state)

    def _fault_ack(self, data: bytes) -> tuple[bytes, str, str]:
        """The ack as delivered (maybe replaced by an armed fault), its status, its mm_hash."""
        ack = decode_xfer_ack(data)
        if self.ack_faults:
            fault = self.ack_faults.pop(0)
            if fault == "garbage":
                return b"\xc1garbage", "garbage", ack.mm_hash
            status = XferStatus[fault]
            ack = XferAck(ack.mm_hash, status, transfer_id=ack.transfer_id)
            data = encode_xfer_ack(ack)
            self.delivered_acks.append((ack.mm_hash, ack.transfer_id, str(status)))
            return data, str(status), ack.mm_hash
        self.delivered_acks.append((ack.mm_hash, ack.transfer_id, str(ack.status)))
        return data, str(ack.status), ack.mm_hash

    def disconnect(self) -> None:
        """The link breaks: in-flight messages are lost and both ends are told."""
        self._link_epoch += 1
        self._held_messages.clear()
        producer, consumer = self.producer, self.consumer
        now = self.clock.now
        if consumer.alive:
            consumer.scheduler.on_peer_disconnected(producer.host, producer.port, now)
        if producer.alive and producer.scheduler.producer is not None:
            producer.scheduler.on_consumer_disconnected(consumer.identity, now)

    def partition(self) -> None:
        self.partitioned = True

    def heal(self) -> None:
        """The link is back: what waited (messages, stalled READs) moves on, in order."""
        self.partitioned = False
        held = self._held_messages + self._held_reads
        self._held_messages, self._held_reads = [], []
        for run in held:
            self.at(self.clock.now + self._delay(self.net_delay), run)

    # -- one engine step ---------------------------------------------------------------

    def engine_step(self, engine: Engine, allocs: list[tuple[ECRequestInfo, int]]) -> None:
        """Allocate, build the meta, run every rank's worker, deliver the rank reports
        that are due (late, duplicated or reordered under faults), one engine step."""
        if not engine.alive:
            return
        scheduler, now, faults = engine.scheduler, self.clock.now, self.faults
        for request, index in allocs:
            scheduler.update_state_after_alloc(request, index, now)
        meta = scheduler.build_connector_meta(now)
        self.reports.planned(engine, meta)
        for worker in engine.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(now)
            worker.save_caches(now)
        reports = [worker.build_connector_worker_meta(now) for worker in engine.workers]
        self.reports.send(engine, reports, now, faults)
        scheduler.update_connector_output(self.reports.deliver(engine, now, faults), now)
        engine.failed.extend(scheduler.take_failed_requests())
