"""Harnesses of the push requirement tests (`test_push_requirements*.py`): one side's
main-thread halves on a bus with its effects collected, a bare writer core, and a whole
P/D pair over the simulated fabric with a spy on the wire. Time is an argument: the
halves take `now` from the harness's `VirtualClock`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvhandoff.machines.push.effects import ReportToMain, WakeWriter
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler, register_push_machines
from kvhandoff.machines.push.worker import PushWorker
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.legs import PrefillCoordinates
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.sim.push.engine import Arrival
from kvhandoff.sim.push.fabric import SimTransfer
from kvhandoff.sim.push.settings import SimSettings
from kvhandoff.sim.push.world import SimulatedPushWorld

P_ENGINE = LocalEngine("prefill-0", "10.0.0.1", 5600)
D_ENGINE = LocalEngine("decode-0", "10.0.0.2", 5700)
P_COORDS = PrefillCoordinates("prefill-0", "10.0.0.1", 5600, 1)
CONFIG = PushConfig()


def registration(request_id: str, blocks: tuple[int, ...] = (1, 2)) -> PushRegistration:
    return PushRegistration(
        request_id=request_id,
        decode_engine_id=D_ENGINE.engine_id,
        decode_host=D_ENGINE.host,
        decode_port=D_ENGINE.port,
        decode_tp_size=1,
        decode_tp_rank=0,
        block_ids=blocks,
        remote_engine_id=P_ENGINE.engine_id,
        remote_host=P_ENGINE.host,
        remote_port=P_ENGINE.port,
        remote_tp_size=1,
    )


# -- harnesses -----------------------------------------------------------------------------


class MainSide:
    """One side's main-thread bus with the scheduler and worker API, effects collected.
    Time is an argument: every call passes `clock.now`."""

    def __init__(self, role: str, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self.bus = EventBus()
        register_push_machines(self.bus, CONFIG)
        engine = P_ENGINE if role == "prefill" else D_ENGINE
        self.sched = PushScheduler(self.bus, role, engine, CONFIG)  # type: ignore[arg-type]
        self.worker = PushWorker(
            self.bus,
            role,  # type: ignore[arg-type]
            engine,
            CONFIG,
            now=self.clock.now,
        )
        self.wakes = 0
        self.bus.handle(WakeWriter, lambda _i, _e: self._woken())
        self.retired: list[tuple[str, str]] = []
        self.bus.on_retire(lambda inst: self.retired.append((inst.key, inst.state)))

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


def writer(role: str) -> PushWriter:
    return PushWriter(role, EventBus())  # type: ignore[arg-type]


def report(request_id: str, *events: Event) -> list[ReportToMain]:
    """What the writer thread tells the main thread happened to `request_id`."""
    return [ReportToMain(request_id, event) for event in events]


def world(**settings: Any) -> SimulatedPushWorld:
    logging.getLogger("kvhandoff").setLevel(logging.CRITICAL)
    return SimulatedPushWorld(3, settings=SimSettings(leg_spread_s=0.0, **settings))


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
    engine.arrivals.append(Arrival(arrival.client_id, arrival.num_blocks, w.clock.now))
    engine.dirty = True


def finish(w: SimulatedPushWorld) -> None:
    """Settle, probe and check the whole run: no violation, nothing leaked or hung."""
    w.settle()
    result = w.final_check()
    assert result.ok, (result.violations, result.leftovers)


def clean(w: SimulatedPushWorld) -> None:
    assert w.ledger.violations == []
