"""Framework core: compiled runtime, event bus, time as an argument, timers, tags, peer
events (runtime v2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, ExtendDeadline
from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.recording import read_log, replay
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

from core_example import (
    LEASE,
    Chain,
    Heartbeat,
    LeaseCtx,
    Released,
    StartWrite,
    WriteDone,
)


def make_bus(**config: float) -> EventBus:
    bus = EventBus()
    bus.register(LEASE, config or None)
    return bus


def new(bus: EventBus, key: Any, now: float = 0.0, blocks: list[int] | None = None) -> Any:
    return bus.create(LEASE, LeaseCtx(key, list(blocks or [])), now)


def test_core_instances_share_one_table() -> None:
    bus = make_bus()
    a = new(bus, "a")
    b = new(bus, "b")
    assert a.node is b.node
    assert a.machine is b.machine
    assert not hasattr(a, "__dict__"), "an instance is a slotted record"


def test_core_undeclared_local_event_names_machine_state_and_event() -> None:
    bus = make_bus()
    new(bus, "r1")
    with pytest.raises(LocalProtocolError, match=r"'example.lease'.*'chain'.*'finished'"):
        bus.dispatch(LEASE, "r1", Chain(), 0.0)
    assert bus.get(LEASE, "r1") is not None
    assert bus.counters(LEASE).errors == 1


def test_core_undeclared_peer_event_is_a_remote_error_that_changes_nothing() -> None:
    """A peer provoking an event the state does not declare cannot crash the engine with
    a local error, and the instance, its timer and its counters of transitions stay put."""
    bus = make_bus()
    inst = new(bus, "r1")
    deadline = bus.deadline_of(LEASE, "r1")
    with pytest.raises(RemoteProtocolError, match=r"'write_done'.*'finished'"):
        bus.dispatch(LEASE, "r1", WriteDone(), 1.0)
    with pytest.raises(RemoteProtocolError, match="no live instance 'ghost'"):
        bus.dispatch(LEASE, "ghost", WriteDone(), 1.0)
    assert inst.state == "finished" and bus.deadline_of(LEASE, "r1") == deadline
    counters = bus.counters(LEASE)
    assert (counters.rejected, counters.errors) == (2, 0)
    assert bus.machine(LEASE).taken_edges() == frozenset(), "no transition was taken"


def test_core_guard_picks_alternative_and_action_returns_effects() -> None:
    bus = make_bus()
    new(bus, "with", blocks=[1, 2])
    new(bus, "without")
    bus.dispatch(LEASE, "with", StartWrite(), 0.0)
    bus.dispatch(LEASE, "without", StartWrite(), 0.0)
    assert bus.has_tag(LEASE, "with", "in_flight")
    assert bus.get(LEASE, "without") is None, "dropped is final: the instance retired"
    bus.dispatch(LEASE, "with", WriteDone(), 0.0)
    effects = [effect for _, effect in bus.drain_outbox()]
    assert effects == [Released((1, 2))]
    assert bus.metrics == {"released": 1.0}


def test_core_registered_handler_executes_effects() -> None:
    bus = make_bus()
    seen: list[tuple[Any, Released]] = []
    bus.handle(Released, lambda inst, effect: seen.append((inst.key, effect)))
    new(bus, "r", blocks=[7])
    bus.dispatch(LEASE, "r", StartWrite(), 0.0)
    bus.dispatch(LEASE, "r", WriteDone(), 0.0)
    assert seen == [("r", Released((7,)))]
    assert bus.outbox == []


def test_core_timeout_armed_on_entry_and_cancelled_on_exit() -> None:
    bus = make_bus(kv_lease_duration=10.0)
    new(bus, "r", blocks=[1])
    assert bus.deadline_of(LEASE, "r") == 10.0
    bus.dispatch(LEASE, "r", StartWrite(), 4.0)
    assert bus.deadline_of(LEASE, "r") == 9.0, "writing arms its own 5 s timeout"
    bus.dispatch(LEASE, "r", WriteDone(), 4.0)
    assert bus.fire_due(104.0) == 0, "the exited state's timers are cancelled"


def test_core_dispatch_fires_due_timeouts_before_applying_the_event() -> None:
    """Time is an argument: an event arriving after a deadline meets the expired state,
    never the state the timeout should already have left."""
    bus = make_bus(kv_lease_duration=10.0)
    retired: list[str] = []
    bus.on_retire(lambda inst: retired.append(f"{inst.key}:{inst.state}"))
    new(bus, "late", blocks=[1])
    new(bus, "other", now=5.0)
    with pytest.raises(LocalProtocolError, match="no live instance 'late'"):
        bus.dispatch(LEASE, "late", StartWrite(), 10.5)
    assert retired == ["late:expired"], "the lease expired at 10.0, before the write"
    new(bus, "fresh", now=12.0)
    assert retired == ["late:expired"], "create fires only what is due"
    assert bus.deadline_of(LEASE, "fresh") == 22.0
    assert bus.now == 12.0


def test_core_time_never_goes_backwards() -> None:
    bus = make_bus(kv_lease_duration=10.0)
    new(bus, "a", now=5.0)
    new(bus, "b", now=3.0)  # an older `now` counts as the latest seen
    assert bus.deadline_of(LEASE, "b") == 15.0
    assert bus.now == 5.0


def test_core_timers_fire_in_deadline_order_not_arming_order() -> None:
    bus = make_bus()
    order: list[str] = []
    bus.on_retire(lambda inst: order.append(f"{inst.key}:{inst.state}"))
    new(bus, "late")  # deadline 30
    new(bus, "early", now=1.0, blocks=[1])
    bus.dispatch(LEASE, "early", StartWrite(), 1.0)  # deadline 6
    new(bus, "renewed", now=1.0)  # deadline 31, renewed below to 21 + 20
    bus.dispatch(LEASE, "renewed", Heartbeat(), 5.9)  # max(31, 25.9) = 31
    assert bus.next_deadline() == 6.0
    assert bus.fire_due(5.9) == 0
    bus.dispatch(LEASE, "renewed", Heartbeat(), 21.0)  # early expired first; 41
    assert order == ["early:expired"]
    assert bus.fire_due(121.0) == 2
    assert order == ["early:expired", "late:expired", "renewed:expired"]


def test_core_extend_deadline_keeps_the_later_deadline() -> None:
    bus = make_bus(kv_lease_duration=30.0)
    new(bus, "r")
    bus.dispatch(LEASE, "r", Heartbeat(), 0.0)  # max(30, 0 + 20) = 30
    assert bus.deadline_of(LEASE, "r") == 30.0
    bus.dispatch(LEASE, "r", Heartbeat(), 25.0)
    assert bus.deadline_of(LEASE, "r") == 45.0


def test_core_ignored_event_changes_nothing() -> None:
    bus = make_bus()
    new(bus, "r", blocks=[1])
    bus.dispatch(LEASE, "r", StartWrite(), 0.0)
    bus.dispatch(LEASE, "r", Heartbeat(), 0.0)
    assert bus.has_tag(LEASE, "r", "in_flight")
    assert bus.counters(LEASE).ignored == 1


def test_core_tags_answer_queries_and_unknown_tags_raise() -> None:
    bus = make_bus()
    new(bus, "a", blocks=[1])
    new(bus, "b")
    bus.dispatch(LEASE, "a", StartWrite(), 0.0)
    assert [i.key for i in bus.tagged(LEASE, "in_flight")] == ["a"]
    assert [i.key for i in bus.tagged(LEASE, "leased")] == ["b"]
    assert not bus.has_tag(LEASE, "gone", "leased"), "no live instance: no tag"
    assert LEASE.states_tagged("in_flight") == {"writing"}
    for query in (
        lambda: bus.tagged(LEASE, "leasd"),
        lambda: bus.has_tag(LEASE, "a", "leasd"),
        lambda: bus.has_tag(LEASE, "gone", "leasd"),
    ):
        with pytest.raises(LocalProtocolError, match="declares no state tag 'leasd'"):
            query()


@pytest.mark.parametrize("recording", [False, True])
def test_core_watched_tags_answer_as_the_scan_does(recording: bool) -> None:
    """A watched tag's members follow creation, guarded and plain routes, timeouts and
    retirement, in creation order, as the scan over every live instance answers."""
    watched, scanned = make_bus(), make_bus()
    watched.watch(LEASE, "leased")
    new(watched, "early")  # created before the watch of `in_flight` below: picked up
    watched.watch(LEASE, "in_flight")
    if recording:
        watched.record(lambda _line: None)
    new(scanned, "early")

    def both(step: Any) -> None:
        step(watched)
        step(scanned)
        for tag in ("leased", "in_flight"):
            assert [i.key for i in watched.tagged(LEASE, tag)] == [
                i.key for i in scanned.tagged(LEASE, tag)
            ]

    both(lambda bus: new(bus, "a", blocks=[1]))
    both(lambda bus: new(bus, "b", blocks=[2]))
    both(lambda bus: new(bus, "c"))
    both(lambda bus: bus.dispatch(LEASE, "b", StartWrite(), 1.0))  # guarded: into writing
    both(lambda bus: bus.dispatch(LEASE, "a", StartWrite(), 1.0))
    assert [i.key for i in watched.tagged(LEASE, "in_flight")] == ["a", "b"]  # creation order
    both(lambda bus: bus.dispatch(LEASE, "c", StartWrite(), 1.0))  # no blocks: dropped, final
    both(lambda bus: bus.dispatch(LEASE, "b", WriteDone(), 2.0))  # final: retired
    both(lambda bus: bus.fire_due(7.0))  # a's write timeout
    assert [i.key for i in watched.tagged(LEASE, "leased")] == ["early"]
    assert not watched.tagged(LEASE, "in_flight")
    with pytest.raises(LocalProtocolError, match="declares no state tag"):
        watched.watch(LEASE, "leasd")


def test_core_run_to_completion_queues_self_events() -> None:
    bus = make_bus()
    new(bus, "r", blocks=[1])
    bus.dispatch(LEASE, "r", StartWrite(), 0.0)
    bus.dispatch(LEASE, "r", Chain(), 0.0)  # emits WriteDone to itself while busy
    assert bus.get(LEASE, "r") is None
    assert [e for _, e in bus.drain_outbox()] == [Released((1,))]


def test_core_one_instances_error_never_touches_another() -> None:
    bus = make_bus()
    errors: list[tuple[Any, str, str]] = []
    bus.on_error = lambda inst, event, exc: errors.append(
        (inst.key, event.trigger, type(exc).__name__)
    )
    new(bus, "good", blocks=[1])
    new(bus, "bad", blocks=[1])
    bus.dispatch(LEASE, "good", StartWrite(), 0.0)
    bus.dispatch(LEASE, "bad", StartWrite(), 0.0)
    bad = bus.get(LEASE, "bad")
    assert bad is not None
    # Queue an illegal event behind a legal one on "bad" by delivering while busy.
    bad.busy = True
    bus.dispatch(LEASE, "bad", StartWrite(), 0.0)  # illegal in writing: queued
    bus.dispatch(LEASE, "bad", WriteDone(), 0.0)
    bus.dispatch(LEASE, "bad", WriteDone(), 0.0)  # a peer's duplicate, after the end
    bad.busy = False
    bus.dispatch(LEASE, "bad", Heartbeat(), 0.0)  # ignored in writing; drains the queue
    assert errors == [
        ("bad", "start_write", "LocalProtocolError"),
        ("bad", "write_done", "RemoteProtocolError"),
    ]
    assert bus.has_tag(LEASE, "good", "in_flight")
    assert bus.get(LEASE, "bad") is None


def test_core_counters_per_kind() -> None:
    bus = make_bus()
    for key in range(3):
        new(bus, key, blocks=[key + 1])
    bus.dispatch(LEASE, 0, StartWrite(), 0.0)
    bus.dispatch(LEASE, 0, WriteDone(), 0.0)
    bus.fire_due(31.0)
    c = bus.counters(LEASE)
    assert (c.created, c.retired, c.live) == (3, 3, 0)
    assert (c.ignored, c.rejected, c.errors) == (0, 0, 0)
    assert bus.machine(LEASE).taken_edges() == {
        ("finished", "start_write", "writing"),
        ("writing", "write_done", "sent"),
        ("finished", "lease_expired", "expired"),
    }


def test_core_unknown_instance_or_kind_is_local_error() -> None:
    bus = make_bus()
    with pytest.raises(LocalProtocolError, match="no live instance 'x'"):
        bus.dispatch(LEASE, "x", StartWrite(), 0.0)
    other = _span_declaration()
    with pytest.raises(LocalProtocolError, match=r"'t\.span' is not registered"):
        bus.dispatch(other, "x", Next(), 0.0)
    new(bus, "x")
    with pytest.raises(LocalProtocolError, match="already exists"):
        new(bus, "x")


def test_core_recording_is_json_lines_and_replays() -> None:
    bus = make_bus()
    lines: list[str] = []
    bus.record(lines.append)
    new(bus, "r")
    bus.dispatch(LEASE, "r", Heartbeat(), 25.0)  # the lease now ends at 45
    bus.fire_due(50.0)
    records = read_log(lines)
    assert [(r["t"], r["event"], r["from"], r["to"]) for r in records] == [
        (0.0, "__create__", "finished", "finished"),
        (25.0, "heartbeat", "finished", "finished"),
        (45.0, "lease_expired", "finished", "expired"),
    ], "a timeout is recorded at its deadline, not when the caller came back"
    assert set(json.loads(lines[1])) == {
        "t",
        "kind",
        "key",
        "event",
        "fields",
        "from",
        "to",
        "effects",
    }
    fresh = EventBus()
    fresh.register(LEASE)
    assert replay(records, fresh, [LEASE]) == []
    assert fresh.counters(LEASE).retired == 1
    tampered = [dict(r) for r in records]
    tampered[1]["event"] = "start_write"  # no blocks: the guard sends it to dropped
    assert replay(tampered, make_bus(), [LEASE]) == [
        "example.lease 'r': 'start_write' led to dropped, log says finished",
        "example.lease 'r': cannot deliver 'lease_expired'",
    ]


def test_core_recording_off_by_default_and_fast_path_restored() -> None:
    bus = make_bus()
    machine = bus.machine(LEASE)
    plain_before = [r.plain for r in machine.routes]
    bus.record(lambda line: None)
    assert not any(r.plain for r in machine.routes)
    bus.record(None)
    assert [r.plain for r in machine.routes] == plain_before


def test_core_timer_compaction_keeps_live_timers() -> None:
    bus = make_bus()
    live: list[Instance[LeaseCtx]] = []
    for key in range(5000):
        inst = new(bus, key, blocks=[1])
        bus.dispatch(LEASE, key, StartWrite(), 0.0)  # cancels lease timer, arms 5 s
        if key % 2:
            bus.dispatch(LEASE, key, WriteDone(), 0.0)
        else:
            live.append(inst)
    queued = sum(len(queue) for queue in bus._timer_queues.values())
    assert queued < 3 * len(live) + 2048, "cancelled timers are dropped, not kept forever"
    assert bus.fire_due(6.0) == len(live)
    assert all(inst.state == "expired" for inst in live)


@dataclass(slots=True)
class KeyCtx:
    key: Any


@dataclass(frozen=True, slots=True)
class Next(Event):
    pass


@dataclass(frozen=True, slots=True)
class Watchdog(Event):
    pass


@dataclass(frozen=True, slots=True)
class Other(Event):
    pass


def _span_declaration() -> Declaration[KeyCtx]:
    watchdog = Timeout("ttl", "expired", Watchdog)
    return Declaration(
        name="t.span",
        context=KeyCtx,
        states=[
            {"name": "a", "timeout": watchdog},
            {"name": "b", "timeout": watchdog},
            {"name": "c", "timeout": Timeout(100.0, "expired", Other)},
            {"name": "expired", "final": True},
        ],
        initial="a",
        transitions=[
            {"trigger": Next, "source": "a", "dest": "b"},
            {"trigger": Next, "source": "b", "dest": "c"},
        ],
        config_defaults={"ttl": 10.0},
    )


def test_core_equal_timeout_spans_states() -> None:
    """A transition between states declaring an equal Timeout keeps the armed deadline."""
    decl = _span_declaration()
    bus = EventBus()
    bus.register(decl)
    bus.create(decl, KeyCtx(1), 0.0)
    bus.dispatch(decl, 1, Next(), 6.0)
    assert bus.deadline_of(decl, 1) == 10.0, "the watchdog is not re-armed"
    bus.dispatch(decl, 1, Next(), 6.0)
    assert bus.deadline_of(decl, 1) == 106.0, "a different timeout is armed afresh"


@dataclass(frozen=True, slots=True)
class GoLong(Event):
    pass


@dataclass(frozen=True, slots=True)
class GoShort(Event):
    pass


@dataclass(frozen=True, slots=True)
class Extend(Event):
    seconds: float


@dataclass(frozen=True, slots=True)
class Expire(Event):
    pass


def extend(ctx: KeyCtx, event: Extend) -> list[Effect]:
    return [ExtendDeadline(event.seconds)]


def test_core_timers_of_different_durations_fire_in_deadline_order() -> None:
    """One queue per duration: `fire_due` merges their heads, so a short timeout armed
    after a long one still fires first, and ExtendDeadline moves a timer between queues."""
    fired: list[str] = []
    decl = Declaration(
        name="t.durations",
        context=KeyCtx,
        states=[
            "idle",
            {"name": "long", "timeout": Timeout(10.0, "done", Expire)},
            {"name": "short", "timeout": Timeout(1.0, "done", Expire)},
            {"name": "done", "final": True},
        ],
        initial="idle",
        transitions=[
            {"trigger": GoLong, "source": "idle", "dest": "long"},
            {"trigger": GoShort, "source": "idle", "dest": "short"},
            {"trigger": Extend, "source": "short", "dest": None, "after": "extend"},
        ],
        callbacks={"extend": extend},
    )
    bus = EventBus()
    bus.register(decl)
    bus.on_retire(lambda inst: fired.append(inst.key))
    now = 0.0
    for key, event in (("a", GoLong()), ("b", GoShort()), ("c", GoShort())):
        bus.create(decl, KeyCtx(key), now)
        bus.dispatch(decl, key, event, now)
        now += 0.1
    bus.dispatch(decl, "c", Extend(20.0), now)  # c: now 20 s from t=0.3
    assert bus.next_deadline() == pytest.approx(1.1)  # b (short, armed at 0.1)
    assert bus.fire_due(100.0) == 3
    assert fired == ["b", "a", "c"], "deadline order: 1.1, 10.0, 20.3"
    assert bus.next_deadline() is None


def test_core_alias_finds_a_live_instance_by_its_second_key_until_it_retires() -> None:
    """`alias` keeps a second key per live instance (how a peer names it), without a scan:
    created instances answer, a newer one sharing an alias wins, retired ones never do."""
    bus = make_bus()
    new(bus, "cmpl-a-0-aaaa1111", blocks=[1])
    bus.alias(LEASE, lambda key: str(key).rsplit("-", 1)[0])  # instances already live count
    assert bus.by_alias(LEASE, "cmpl-a-0").key == "cmpl-a-0-aaaa1111"  # type: ignore[union-attr]
    newer = new(bus, "cmpl-a-0-bbbb2222", blocks=[1])
    assert bus.by_alias(LEASE, "cmpl-a-0") is newer
    bus.dispatch(LEASE, "cmpl-a-0-aaaa1111", StartWrite(), 0.0)  # the older one moves on ...
    bus.dispatch(LEASE, "cmpl-a-0-aaaa1111", WriteDone(), 0.0)  # ... and retires
    assert bus.get(LEASE, "cmpl-a-0-aaaa1111") is None
    assert bus.by_alias(LEASE, "cmpl-a-0") is newer, "retiring the older leaves the newer"
    bus.dispatch(LEASE, "cmpl-a-0-bbbb2222", StartWrite(), 0.0)
    bus.dispatch(LEASE, "cmpl-a-0-bbbb2222", WriteDone(), 0.0)
    assert bus.by_alias(LEASE, "cmpl-a-0") is None
