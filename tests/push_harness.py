"""Harnesses of the push requirement tests: one engine's scheduler and one worker rank's
main-thread half with their effects collected (`Halves`), a bare writer core (`writer`),
and a whole P/D pair over the simulated fabric with a spy on the wire (`world`, `Spy`).
Time is an argument: the halves take `now` from the harness's `VirtualClock`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvhandoff.machines.push.effects import ForwardToMain, ReportToMain, WakeWriter
from kvhandoff.machines.push.meta import PushConnectorOutput, PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.machines.push.worker import PushWorker, WriterItem
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.legs import PrefillCoordinates
from kvhandoff.protocol.notifs import Notif
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.sim.push.engine import Arrival
from kvhandoff.sim.push.fabric import SimTransfer
from kvhandoff.sim.push.settings import SimSettings, Topology
from kvhandoff.sim.push.world import SimulatedPushWorld

P_ENGINE = LocalEngine("prefill-0", "10.0.0.1", 5600)
D_ENGINE = LocalEngine("decode-0", "10.0.0.2", 5700)
P_COORDS = PrefillCoordinates("prefill-0", "10.0.0.1", 5600, 1)
CONFIG = PushConfig()
P_AGENT = "prefill-0-agent1"
D_AGENT = "decode-0-agent1"


def registration(
    request_id: str, blocks: tuple[int, ...] = (1, 2), **fields: Any
) -> PushRegistration:
    values: dict[str, Any] = {
        "request_id": request_id,
        "decode_engine_id": D_ENGINE.engine_id,
        "decode_host": D_ENGINE.host,
        "decode_port": D_ENGINE.port,
        "decode_tp_size": 1,
        "decode_tp_rank": 0,
        "block_ids": blocks,
        "remote_engine_id": P_ENGINE.engine_id,
        "remote_host": P_ENGINE.host,
        "remote_port": P_ENGINE.port,
        "remote_tp_size": 1,
        **fields,
    }
    return PushRegistration(**values)


def from_p(
    notif: Notif, agent: str = P_AGENT, rank: int | None = 0, at: float | None = None
) -> ForwardToMain:
    """A notif the writer forwards, sent by an agent of P's engine (rank None: unknown),
    taken from NIXL at `at` (None: applied at the main thread's `now`)."""
    engine = P_ENGINE.engine_id if rank is not None else None
    return ForwardToMain(notif, agent, engine, rank, at)


def from_d(
    notif: Notif, agent: str = D_AGENT, rank: int | None = 0, at: float | None = None
) -> ForwardToMain:
    engine = D_ENGINE.engine_id if rank is not None else None
    return ForwardToMain(notif, agent, engine, rank, at)


# -- harnesses -----------------------------------------------------------------------------


class Halves:
    """One engine's scheduler and one rank's main-thread half, effects collected. Time is
    an argument: every call passes `clock.now`."""

    def __init__(
        self, role: str, clock: VirtualClock | None = None, config: PushConfig = CONFIG
    ) -> None:
        self.clock = clock or VirtualClock()
        engine = P_ENGINE if role == "prefill" else D_ENGINE
        self.sched = PushScheduler(role, engine, config, now=self.clock.now)  # type: ignore[arg-type]
        self.worker = PushWorker(role, engine.engine_id, config, now=self.clock.now)  # type: ignore[arg-type]
        self.bus = self.worker.bus
        self.wakes = 0
        self.bus.handle(WakeWriter, lambda _i, _e: self._woken())
        self.retired: list[tuple[str, str]] = []
        self.bus.on_retire(lambda inst: self.retired.append((inst.key, inst.state)))
        self.sched_retired: list[tuple[str, str]] = []
        self.sched.bus.on_retire(lambda inst: self.sched_retired.append((inst.key, inst.state)))

    def _woken(self) -> None:
        self.wakes += 1

    def effects(self) -> list[object]:
        return [effect for _inst, effect in self.bus.drain_outbox()]

    def state(self, kind: Declaration[Any], key: str) -> str | None:
        inst = self.bus.get(kind, key)
        return None if inst is None else inst.state

    @property
    def now(self) -> float:
        return self.clock.now

    def hand_over(self) -> None:
        """build_connector_meta and start_load_kv at `now`."""
        self.worker.start_load_kv(self.sched.build_connector_meta(self.now), self.now)

    def finish(self, items: Iterable[WriterItem] = ()) -> PushWorkerOutput:
        """The writer's items, then get_finished, at `now`."""
        self.worker.take_writer_items(items, self.now)
        return self.worker.get_finished(self.now)

    def step(self, items: Iterable[WriterItem] = ()) -> PushConnectorOutput:
        """One engine step: meta, the writer's items, start_load_kv, get_finished, and the
        scheduler's aggregate."""
        meta = self.sched.build_connector_meta(self.now)
        self.worker.take_writer_items(items, self.now)
        self.worker.start_load_kv(meta, self.now)
        output = self.worker.get_finished(self.now)
        return self.sched.update_connector_output([output], self.now)


def writer(role: str, config: PushConfig = CONFIG, rank: int = 0) -> PushWriter:
    engine = P_ENGINE if role == "prefill" else D_ENGINE
    return PushWriter(role, engine.engine_id, config, rank=rank)  # type: ignore[arg-type]


def report(request_id: str, *events: Event) -> list[ReportToMain]:
    """What the writer thread tells the main thread happened to `request_id`."""
    return [ReportToMain(request_id, event) for event in events]


def world(
    topology: Topology | None = None, keyed: bool = False, **settings: Any
) -> SimulatedPushWorld:
    """A quiet world: no faults, both legs at once, no prefix hits or retries."""
    topology = topology or Topology()
    logging.getLogger("kvhandoff").setLevel(logging.CRITICAL)
    values: dict[str, Any] = {"leg_spread_s": 0.0, "prefix_hit": 0.0, "retry": 0.0, **settings}
    return SimulatedPushWorld(3, settings=SimSettings(**values), topology=topology, keyed=keyed)


class Spy:
    """Sees every notif and WRITE on the fabric, then lets the world check them."""

    def __init__(self, w: SimulatedPushWorld) -> None:
        self.world = w
        self.notifs: list[tuple[str, str, bytes]] = []
        self.writes: list[SimTransfer] = []
        w.network.observer = self

    def notif_sent(self, src: str, dst: str, message: bytes) -> None:
        self.notifs.append((src, dst, message))
        self.world.notif_sent(src, dst, message)

    def notif_delivered(self, dst_agent: str, message: bytes) -> None:
        self.world.notif_delivered(dst_agent, message)

    def write_posted(self, transfer: SimTransfer) -> None:
        self.writes.append(transfer)
        self.world.write_posted(transfer)

    def write_landed(self, transfer: SimTransfer) -> None:
        self.world.write_landed(transfer)

    def sent(self, prefix: bytes) -> list[bytes]:
        return [m for _s, _d, m in self.notifs if m.startswith(prefix)]


def hold(w: SimulatedPushWorld, role: str) -> Arrival:
    """Keep one side's leg back (it arrives when `release` says)."""
    return w.engine(role).arrivals.popleft()


def release(w: SimulatedPushWorld, role: str, arrival: Arrival) -> None:
    engine = w.engine(role)
    engine.arrivals.append(
        Arrival(arrival.key, arrival.client_id, arrival.num_blocks, arrival.cached, w.clock.now)
    )
    engine.dirty = True


def finish(w: SimulatedPushWorld) -> None:
    """Settle, probe and check the whole run: no violation, nothing leaked or hung."""
    w.settle()
    result = w.final_check()
    assert result.ok, (result.violations, result.leftovers)


def clean(w: SimulatedPushWorld) -> None:
    assert w.ledger.violations == []
