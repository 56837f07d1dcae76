"""The event bus: the kinds registered on it, their instances, and the API around them.

The bus owns every live instance of the kinds registered on it, keyed by (declaration,
key); the declaration object is the kind's handle (`bus.get(D_REQUEST, key)` returns an
`Instance[DRequestCtx]`). How events, effects and timeouts reach instances is
`delivery.py` (`dispatch`, `dispatch_many`, `fire_due`), which `EventBus` extends with
registration, creation, queries, effect handlers and recording.

Time is an argument (aioquic's `handle_timer(now)`): the bus never reads a clock. Every
entry point that changes state takes `now`; before it applies anything the bus delivers
every timeout due at `now`, in deadline order. `now` never goes backwards (an earlier
value is taken as the latest seen); `next_deadline()` says when to come back. Code
outside the machines asks declared state tags (`has_tag`, `tagged`), never state names.

Timers live in one FIFO per timeout duration (`timers.py`): arming is an append, and
`fire_due` merges the heads of the few queues in deadline order. The bus is
single-threaded: one thread owns it; other threads hand work over through the inboxes of
the adapters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from kvhandoff.machines.runtime.compiled import CompiledMachine, Instance, KindCounters
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.delivery import Delivery
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.recording import TransitionRecorder
from kvhandoff.protocol.errors import LocalProtocolError

C = TypeVar("C")
E = TypeVar("E", bound=Effect)


class EventBus(Delivery):
    """Instances of declared machines, their timers, and the execution of their effects."""

    def __init__(self) -> None:
        super().__init__()
        self._by_name: dict[str, CompiledMachine[Any]] = {}
        self._serials = itertools.count()

    @property
    def now(self) -> float:
        """The latest time this bus was given (-inf before the first)."""
        return self._now

    # -- kinds and instances -------------------------------------------------------------

    def register(
        self, decl: Declaration[C], config: Mapping[str, float] | None = None
    ) -> CompiledMachine[C]:
        """Compile `decl` under `config` once; every instance of the kind shares it."""
        if decl in self._machines or decl.name in self._by_name:
            raise LocalProtocolError(f"machine {decl.name!r} is already registered")
        machine = CompiledMachine(decl, config)
        for node in machine.nodes.values():
            if node.timeout_seconds is not None:
                node.timer_queue = self._timer_queue(node.timeout_seconds)
        machine.set_fast_path(self._recorder is None)
        self._machines[decl] = machine
        self._by_name[decl.name] = machine
        self._index[decl] = machine.index
        return machine

    def machine(self, kind: Declaration[C]) -> CompiledMachine[C]:
        try:
            return self._machines[kind]
        except KeyError:
            raise LocalProtocolError(f"machine {kind.name!r} is not registered") from None

    def machine_named(self, name: str) -> CompiledMachine[Any]:
        try:
            return self._by_name[name]
        except KeyError:
            raise LocalProtocolError(f"machine {name!r} is not registered") from None

    def create(self, kind: Declaration[C], ctx: C, now: float) -> Instance[C]:
        """A new instance of `kind` for `ctx` (keyed by `ctx.key`) in its initial state."""
        if now > self._now:
            self.advance(now)
        machine = self._machines.get(kind) or self.machine(kind)
        key: Hashable = ctx.key  # type: ignore[attr-defined]  # checked by the declaration
        index = machine.index
        if key in index:
            raise LocalProtocolError(f"machine {kind.name!r}: instance {key!r} already exists")
        inst = Instance(machine, key, ctx, next(self._serials))
        machine.admit(inst)
        # `_arm`, inlined as in `dispatch`: a call here costs 5 calls per pushed request
        # (`push_writer_pass --count`: 588.5 against 583.4).
        queue = machine.initial.timer_queue
        if queue is not None:
            deadline = self._now + machine.initial.timeout_seconds  # type: ignore[operator]
            inst.timer = entry = (deadline, inst)
            queue.append(entry)
            if deadline < self._next_due:
                self._next_due = deadline
            if len(queue) > self._compact_at:
                self._compact()
        if self._recorder is not None:
            self._recorder.created(self._now, inst)
        return inst

    def get(self, kind: Declaration[C], key: Hashable) -> Instance[C] | None:
        machine = self._machines.get(kind)
        return None if machine is None else machine.index.get(key)

    def instances(self, kind: Declaration[C]) -> list[Instance[C]]:
        """A snapshot of the live instances of `kind`, in creation order."""
        return list(self.machine(kind).index.values())

    def tagged(self, kind: Declaration[C], tag: str) -> list[Instance[C]]:
        """The live instances of `kind` whose state carries the declared `tag`, in creation
        order (a watched tag's members only, else one test per live instance)."""
        kind.check_tag(tag)
        machine = self.machine(kind)
        members = machine.watched.get(tag)
        if members is not None:
            return sorted(members.values(), key=_serial)
        return [inst for inst in machine.index.values() if tag in inst.node.tags]

    def watch(self, kind: Declaration[Any], tag: str) -> None:
        """Keep `tag`'s members as instances enter and leave it: `tagged(kind, tag)` then
        costs what it returns. Only routes that change membership leave the fast path."""
        self.machine(kind).watch(tag)

    def alias(self, kind: Declaration[Any], alias_of: Callable[[Hashable], Hashable]) -> None:
        """Keep a second key per live instance of `kind`, `alias_of(key)` (how a peer names
        it: a base request id, say); `by_alias` then finds it without a scan. When two
        live instances share an alias, the newer one answers."""
        self.machine(kind).alias(alias_of)

    def by_alias(self, kind: Declaration[C], alias: Hashable) -> Instance[C] | None:
        """The live instance of `kind` whose alias is `alias` (see `alias`)."""
        machine = self._machines.get(kind)
        return None if machine is None else machine.aliases.get(alias)

    def has_tag(self, kind: Declaration[C], key: Hashable, tag: str) -> bool:
        """Whether (kind, key) is live and its state carries the declared `tag`."""
        inst = self.get(kind, key)
        if inst is None:
            kind.check_tag(tag)
            return False
        return inst.has(tag)

    def live(self, kind: Declaration[Any]) -> int:
        return len(self.machine(kind).index)

    def on_retire(self, hook: Callable[[Instance[Any]], None]) -> None:
        """Call `hook(instance)` when an instance reaches a final state and leaves the bus."""
        self._retire_hooks.append(hook)

    # -- effects -------------------------------------------------------------------------

    def handle(self, effect_type: type[E], handler: Callable[[Any, E], None]) -> None:
        """Execute effects of `effect_type` with `handler(instance, effect)`."""
        self._handlers[effect_type] = handler

    def execute(self, *effects: Effect) -> None:
        """Execute effects that no instance emitted (an API call's own, e.g. a wake-up)."""
        self._execute(None, effects)

    def drain_outbox(self) -> list[tuple[Instance[Any] | None, Effect]]:
        """Effects no handler was registered for, in emission order."""
        out, self.outbox = self.outbox, []
        return out

    def deadline_of(self, kind: Declaration[Any], key: Hashable) -> float | None:
        inst = self.get(kind, key)
        return None if inst is None or inst.timer is None else float(inst.timer[0])

    # -- observation ---------------------------------------------------------------------

    def record(self, sink: Callable[[str], None] | None) -> None:
        """Write every creation and transition as a JSON line to `sink`; None turns it off."""
        self._recorder = None if sink is None else TransitionRecorder(sink)
        for machine in self._machines.values():
            machine.set_fast_path(sink is None)

    def counters(self, kind: Declaration[Any]) -> KindCounters:
        return self.machine(kind).counters()

    def kinds(self) -> list[str]:
        return sorted(self._by_name)


def _serial(inst: Instance[Any]) -> int:
    return inst.serial
