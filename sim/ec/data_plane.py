"""The data plane of the simulated encoder-cache planes (simulation only).

`IssueRead` becomes a NIXL READ that completes after a delay, fails, or stalls; loading
a new producer agent may fail (`handshake_fail`). Across a partition a READ waits for
the heal; a READ from a crashed producer fails. A READ nobody awaits any more (its read
ended, its quarantine too) is cancelled when the read asks for its handle's release
(`ReleaseRead`): it lands nowhere, and only then is its destination freed. `CopyBlocks`
lands after a delay on each rank (`slow_save` makes saves late); a save writes the
entry's tag into its blocks, a load checks it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ, IssueRead, ReleaseRead
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.sim.ec.engine import Engine
from kvhandoff.sim.faults import SimFaults

__all__ = ["DataPlane"]


class DataPlane:
    """Mixin of `SimECPlane`: READs between the engines' regions, and copies."""

    clock: VirtualClock
    rng: random.Random
    faults: SimFaults
    producer: Engine
    consumer: Engine
    partitioned: bool
    read_delay: tuple[float, float]
    copy_delay: tuple[float, float]
    read_faults: list[str]
    reads_started: int
    reads_landed: int
    cancelled_reads: set[str]
    _held_reads: list[Callable[[], None]]

    # Provided by `SimECPlane`, the one class this is mixed into.

    def at(self, when: float, run: Callable[[], None]) -> None:
        raise NotImplementedError

    def count(self, name: str) -> None:
        raise NotImplementedError

    def violation(self, message: str) -> None:
        raise NotImplementedError

    def _delay(self, bounds: tuple[float, float]) -> float:
        return self.rng.uniform(*bounds)

    def _issue_read(self, engine: Engine, read: IssueRead) -> None:
        self.reads_started += 1
        if not read.producer_agent_name.startswith("agent-producer-"):
            self.violation(
                f"READ of {read.mm_hash} from agent {read.producer_agent_name!r}, not the "
                f"producer at {read.peer_host}:{read.peer_port} it asked (S-02)"
            )
            return
        producer = self.producer
        faults, rng = self.faults, self.rng
        fault = self.read_faults.pop(0) if self.read_faults else ""
        if not fault:
            if read.producer_agent_name not in engine.known_agents and (
                faults.handshake_fail and rng.random() < faults.handshake_fail
            ):
                fault = "fail"  # loading the producer's agent metadata failed
            elif faults.read_fail and rng.random() < faults.read_fail:
                fault = "fail"
            elif faults.read_stall and rng.random() < faults.read_stall:
                fault = "slow"
        if fault:
            self.count(f"read_{fault}")
        if fault == "hang":
            return
        engine.known_agents.add(read.producer_agent_name)
        bounds = (25.0, 70.0) if fault == "slow" else self.read_delay
        when = self.clock.now + self._delay(bounds)

        def land() -> None:
            if not engine.alive or engine is not self.consumer:
                return  # the consumer died: the READ's completion has no one to tell
            if self.partitioned and producer.alive:
                self._held_reads.append(land)  # the DMA waits for the link
                return
            if fault == "fail" or not producer.alive or self.producer is not producer:
                engine.scheduler.on_read_failed(read.mm_hash, read.transfer_id, self.clock.now)
                return
            self._land_read(engine, producer, read)

        self.at(when, land)

    def _release_read(self, engine: Engine, effect: ReleaseRead) -> None:
        """A quarantine ended: the reader releases the READ's handle, which cancels the
        DMA, and says so; only then is the destination freed."""
        self.cancelled_reads.add(effect.transfer_id)
        engine.scheduler.on_read_released(effect.mm_hash, self.clock.now)

    def _land_read(self, consumer: Engine, producer: Engine, read: IssueRead) -> None:
        live = consumer.scheduler.bus.get(EC_CONSUMER_READ, read.mm_hash)
        if read.transfer_id in self.cancelled_reads:
            self.cancelled_reads.discard(read.transfer_id)
            self.count("reads_cancelled")  # its handle was released: the DMA lands nowhere
            return
        if live is None or live.ctx.transfer_id != read.transfer_id:
            self.violation(f"READ {read.transfer_id} of {read.mm_hash} lands, nobody awaits it")
            return
        pool = consumer.scheduler.cache.pool
        for dst in read.dst_blocks:
            owner = pool.owner_of(dst)
            if owner != read.mm_hash:
                self.violation(f"READ of {read.mm_hash} lands in block {dst} held by {owner!r}")
                return
        awaited = live.has("read_awaited")
        for src, dst in zip(read.src_blocks, read.dst_blocks, strict=True):
            tag = producer.region[src]
            # A READ still awaited must find its source pinned; one landing in
            # quarantine may read reused blocks: its destination is discarded.
            if tag != read.mm_hash and awaited:
                self.violation(f"READ of {read.mm_hash}: source block {src} holds {tag}")
                return
            consumer.region[dst] = tag
        self.reads_landed += 1
        consumer.scheduler.on_read_done(read.mm_hash, read.transfer_id, self.clock.now)

    def _copy_on(self, engine: Engine, worker: ECWorker, inst: object, copy: CopyBlocks) -> None:
        """One rank's copy engine runs a batch; each rank lands at its own time."""
        bounds = self.copy_delay
        slow = self.faults.slow_save
        if copy.direction == "save" and slow and self.rng.random() < slow:
            bounds = (1.0, 6.0)
            self.count("slow_saves")
        when = self.clock.now + self._delay(bounds)

        def land() -> None:
            if not engine.alive:
                return
            if copy.direction == "save":
                for item in copy.items:
                    for block in item.blocks:
                        engine.region[block] = item.mm_hash
            else:
                for item in copy.items:
                    tags = {engine.region[b] for b in item.blocks}
                    if tags != {item.mm_hash}:
                        self.violation(
                            f"{engine.name} rank {worker.tp_rank}/{worker.pcp_rank} load "
                            f"{item.transfer_id} of {item.mm_hash} reads {tags}"
                        )
            worker.on_copy_done(copy.batch_id, self.clock.now)

        self.at(when, land)
