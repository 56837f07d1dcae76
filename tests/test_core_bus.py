"""Framework core: compiled runtime, event bus, clock and timers (issue 2, items 4-6)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.effects import ExtendDeadline
from kvhandoff.machines.runtime.recording import read_log, replay
from kvhandoff.protocol.errors import LocalProtocolError

from core_example import LEASE, Released

KIND = LEASE.name


def make_bus(**config: float) -> tuple[EventBus, VirtualClock]:
    clock = VirtualClock()
    bus = EventBus(clock)
    bus.register(LEASE, config or None)
    return bus, clock


def test_core_instances_share_one_table() -> None:
    bus, _ = make_bus()
    a = bus.create(KIND, "a")
    b = bus.create(KIND, "b")
    assert a.node is b.node
    assert a.machine is b.machine
    assert not hasattr(a, "__dict__"), "an instance is a slotted record"


def test_core_undeclared_event_names_machine_state_and_event() -> None:
    bus, _ = make_bus()
    bus.create(KIND, "r1")
    with pytest.raises(LocalProtocolError, match=r"'example.lease'.*'write_done'.*'finished'"):
        bus.dispatch(KIND, "r1", "write_done")
    assert bus.get(KIND, "r1") is not None
    assert bus.counters(KIND).errors == 1


def test_core_guard_picks_alternative_and_action_returns_effects() -> None:
    bus, _ = make_bus()
    bus.create(KIND, "with", blocks=[1, 2])
    bus.create(KIND, "without")
    bus.dispatch(KIND, "with", "start_write")
    bus.dispatch(KIND, "without", "start_write")
    assert bus.get(KIND, "with").state == "writing"  # type: ignore[union-attr]
    assert bus.get(KIND, "without") is None, "dropped is final: the instance retired"
    bus.dispatch(KIND, "with", "write_done")
    effects = [effect for _, effect in bus.drain_outbox()]
    assert effects == [Released((1, 2))]
    assert bus.metrics == {"released": 1.0}


def test_core_registered_handler_executes_effects() -> None:
    bus, _ = make_bus()
    seen: list[tuple[Any, Released]] = []
    bus.handle(Released, lambda inst, effect: seen.append((inst.key, effect)))
    bus.create(KIND, "r", blocks=[7])
    bus.dispatch(KIND, "r", "start_write")
    bus.dispatch(KIND, "r", "write_done")
    assert seen == [("r", Released((7,)))]
    assert bus.outbox == []


def test_core_timeout_armed_on_entry_and_cancelled_on_exit() -> None:
    bus, clock = make_bus(kv_lease_duration=10.0)
    bus.create(KIND, "r", blocks=[1])
    assert bus.deadline_of(KIND, "r") == 10.0
    clock.advance(4.0)
    bus.dispatch(KIND, "r", "start_write")
    assert bus.deadline_of(KIND, "r") == 9.0, "writing arms its own 5 s timeout"
    bus.dispatch(KIND, "r", "write_done")
    clock.advance(100.0)
    assert bus.fire_due() == 0, "the exited state's timers are cancelled"


def test_core_timers_fire_in_deadline_order_not_arming_order() -> None:
    bus, clock = make_bus()
    order: list[str] = []
    bus.on_retire(lambda inst: order.append(f"{inst.key}:{inst.state}"))
    bus.create(KIND, "late")  # deadline 30
    clock.advance(1.0)
    bus.create(KIND, "early", blocks=[1])
    bus.dispatch(KIND, "early", "start_write")  # deadline 6
    bus.create(KIND, "renewed")  # deadline 31, renewed below to 1 + 20 + 20
    clock.advance(20.0)
    bus.dispatch(KIND, "renewed", "heartbeat")  # max(31, 21 + 20) = 41
    assert bus.next_deadline() == 6.0
    clock.advance(100.0)
    assert bus.fire_due() == 3
    assert order == ["early:expired", "late:expired", "renewed:expired"]


def test_core_extend_deadline_keeps_the_later_deadline() -> None:
    bus, clock = make_bus(kv_lease_duration=30.0)
    bus.create(KIND, "r")
    bus.dispatch(KIND, "r", "heartbeat")  # max(30, 0 + 20) = 30
    assert bus.deadline_of(KIND, "r") == 30.0
    clock.advance(25.0)
    bus.dispatch(KIND, "r", "heartbeat")
    assert bus.deadline_of(KIND, "r") == 45.0


def test_core_ignored_event_changes_nothing() -> None:
    bus, _ = make_bus()
    bus.create(KIND, "r", blocks=[1])
    bus.dispatch(KIND, "r", "start_write")
    bus.dispatch(KIND, "r", "heartbeat")
    assert bus.get(KIND, "r").state == "writing"  # type: ignore[union-attr]
    assert bus.counters(KIND).ignored == 1


def test_core_run_to_completion_queues_self_events() -> None:
    bus, _ = make_bus()
    bus.create(KIND, "r", blocks=[1])
    bus.dispatch(KIND, "r", "start_write")
    bus.dispatch(KIND, "r", "chain")  # emits write_done to itself while busy
    assert bus.get(KIND, "r") is None
    assert [e for _, e in bus.drain_outbox()] == [Released((1,))]


def test_core_one_instances_error_never_touches_another() -> None:
    bus, _ = make_bus()
    errors: list[tuple[Any, str]] = []
    bus.on_error = lambda inst, event, exc: errors.append((inst.key, event))
    bus.create(KIND, "good", blocks=[1])
    bus.create(KIND, "bad", blocks=[1])
    bus.dispatch(KIND, "good", "start_write")
    bus.dispatch(KIND, "bad", "start_write")
    bad = bus.get(KIND, "bad")
    assert bad is not None
    # Queue an illegal event behind a legal one on "bad" by delivering while busy.
    bad.busy = True
    bus.dispatch(KIND, "bad", "start_write")  # illegal in writing: queued
    bus.dispatch(KIND, "bad", "write_done")
    bad.busy = False
    bus.dispatch(KIND, "bad", "heartbeat")  # ignored in writing; drains the queue
    assert errors == [("bad", "start_write")]
    assert bus.get(KIND, "good").state == "writing"  # type: ignore[union-attr]
    assert bus.get(KIND, "bad") is None


def test_core_counters_per_kind() -> None:
    bus, clock = make_bus()
    for key in range(3):
        bus.create(KIND, key, blocks=[key + 1])
    bus.dispatch(KIND, 0, "start_write")
    bus.dispatch(KIND, 0, "write_done")
    clock.advance(31.0)
    bus.fire_due()
    c = bus.counters(KIND)
    assert (c.created, c.retired, c.live) == (3, 3, 0)
    assert c.transitions == 4 and c.events == 4


def test_core_unknown_instance_or_kind_is_local_error() -> None:
    bus, _ = make_bus()
    with pytest.raises(LocalProtocolError, match="no live instance 'x'"):
        bus.dispatch(KIND, "x", "start_write")
    with pytest.raises(LocalProtocolError, match="'nope' is not registered"):
        bus.dispatch("nope", "x", "start_write")
    bus.create(KIND, "x")
    with pytest.raises(LocalProtocolError, match="already exists"):
        bus.create(KIND, "x")


def test_core_recording_is_json_lines_and_replays() -> None:
    bus, clock = make_bus()
    lines: list[str] = []
    bus.record(lines.append)
    bus.create(KIND, "r")
    clock.advance(31.0)
    bus.fire_due()
    records = read_log(lines)
    assert [(r["event"], r["from"], r["to"]) for r in records] == [
        ("__create__", "finished", "finished"),
        ("lease_expired", "finished", "expired"),
    ]
    assert set(json.loads(lines[1])) == {"t", "kind", "key", "event", "from", "to", "effects"}
    fresh_clock = VirtualClock()
    fresh = EventBus(fresh_clock)
    fresh.register(LEASE)
    assert replay(records, fresh, fresh_clock) == []
    assert fresh.counters(KIND).retired == 1


def test_core_recording_off_by_default_and_fast_path_restored() -> None:
    bus, _ = make_bus()
    machine = bus.machine(KIND)
    plain_before = [r.plain for r in machine.routes]
    bus.record(lambda line: None)
    assert not any(r.plain for r in machine.routes)
    bus.record(None)
    assert [r.plain for r in machine.routes] == plain_before


def test_core_timer_compaction_keeps_live_timers() -> None:
    bus, clock = make_bus()
    live: list[Instance] = []
    for key in range(5000):
        inst = bus.create(KIND, key, blocks=[1])
        bus.dispatch(KIND, key, "start_write")  # cancels lease timer, arms 5 s
        if key % 2:
            bus.dispatch(KIND, key, "write_done")
        else:
            live.append(inst)
    queued = sum(len(queue) for queue in bus._timer_queues.values())
    assert queued < 3 * len(live) + 2048, "cancelled timers are dropped, not kept forever"
    clock.advance(6.0)
    assert bus.fire_due() == len(live)
    assert all(inst.state == "expired" for inst in live)


def test_core_equal_timeout_spans_states() -> None:
    """A transition between states declaring an equal Timeout keeps the armed deadline."""
    from kvhandoff.machines.runtime.declaration import Declaration, Timeout

    watchdog = Timeout("ttl", "expired", "watchdog")
    decl = Declaration(
        name="t.span",
        states=[
            {"name": "a", "timeout": watchdog},
            {"name": "b", "timeout": watchdog},
            {"name": "c", "timeout": Timeout(100.0, "expired", "other")},
            {"name": "expired", "final": True},
        ],
        initial="a",
        transitions=[
            {"trigger": "next", "source": "a", "dest": "b"},
            {"trigger": "next", "source": "b", "dest": "c"},
        ],
        config_defaults={"ttl": 10.0},
    )
    clock = VirtualClock()
    bus = EventBus(clock)
    bus.register(decl)
    bus.create("t.span", 1)
    clock.advance(6.0)
    bus.dispatch("t.span", 1, "next")
    assert bus.deadline_of("t.span", 1) == 10.0, "the watchdog is not re-armed"
    bus.dispatch("t.span", 1, "next")
    assert bus.deadline_of("t.span", 1) == 106.0, "a different timeout is armed afresh"


def test_core_timers_of_different_durations_fire_in_deadline_order() -> None:
    """One queue per duration: `fire_due` merges their heads, so a short timeout armed
    after a long one still fires first, and ExtendDeadline moves a timer between queues."""
    from kvhandoff.machines.runtime.declaration import Declaration, Timeout

    fired: list[str] = []
    decl = Declaration(
        name="t.durations",
        states=[
            "idle",
            {"name": "long", "timeout": Timeout(10.0, "done", "timeout")},
            {"name": "short", "timeout": Timeout(1.0, "done", "timeout")},
            {"name": "done", "final": True},
        ],
        initial="idle",
        transitions=[
            {"trigger": "go_long", "source": "idle", "dest": "long"},
            {"trigger": "go_short", "source": "idle", "dest": "short"},
            {"trigger": "extend", "source": "short", "dest": None, "after": "extend"},
        ],
        callbacks={"extend": lambda inst, payload: [ExtendDeadline(payload)]},
    )
    clock = VirtualClock()
    bus = EventBus(clock)
    bus.register(decl)
    bus.on_retire(lambda inst: fired.append(inst.key))
    for key, event in (("a", "go_long"), ("b", "go_short"), ("c", "go_short")):
        bus.create("t.durations", key)
        bus.dispatch("t.durations", key, event)
        clock.advance(0.1)
    bus.dispatch("t.durations", "c", "extend", 20.0)  # c: now 20 s from t=0.3
    assert bus.next_deadline() == pytest.approx(1.1)  # b (short, armed at 0.1)
    clock.advance(100.0)
    assert bus.fire_due() == 3
    assert fired == ["b", "a", "c"], "deadline order: 1.1, 10.0, 20.3"
    assert bus.next_deadline() is None
