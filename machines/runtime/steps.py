"""Each declared route compiled into one Python function: the bus's general step,
specialised to what the declaration says about one trigger in one state.

`EventBus._step` reads the route, tries its guarded alternatives in order, changes the
state, keeps the watched tags' members, cancels and arms timers, runs the action and
executes its effects: about five Python frames and a loop per guard list for every event
that is not a plain route. `compile_step` writes, for one `(node, event class)` of the
table, a function `step(bus, inst, event)` that does the same in one frame:

- the guards called one after the other in the declared order, with `Route.choose`'s
  short-circuit (the conditions until one fails, then the `unless` guards until one
  holds);
- then the chosen route's changes, each spelled out for that route (no timer code for a
  route that keeps or never arms one, no watch code for one that enters or leaves no
  watched tag);
- then the action, and its effects' handlers inline.

A machine writes each step the first time its route is taken (`CompiledMachine.step_for`),
so a bus pays only for the routes it runs (the simulator builds thousands of buses), and
the code of equal sources is compiled once. The functions are generated from the compiled
table and nothing else: the declaration stays the one truth, and
`tests/test_runtime_steps.py` checks them against the general step, event by event and
seed for seed in the simulators. They run only while the bus records nothing
(`set_fast_path`); a recording bus takes the general step, which reports each transition
to the recorder.
"""

from __future__ import annotations

import functools
import linecache
import zlib
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.events import Event

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.compiled import Instance, Node, Route

Step = Callable[[Any, "Instance[Any]", Event], None]
"""`step(bus, instance, event)`: what `EventBus._step` does for one trigger in one state."""

__all__ = ["Step", "compile_step"]


def compile_step(machine: str, node: Node, event: type[Event], route: Route) -> Step:
    """The generated step of `route`, the route `node` declares for `event`."""
    names: dict[str, object] = {}

    def name(prefix: str, value: object) -> str:
        key = f"{prefix}{len(names)}"
        names[key] = value
        return key

    lines = ["def step(bus, inst, event):", "    ctx = inst.ctx"]
    if route.alternatives:
        for conditions, unless, option in route.alternatives:
            tests = [f"{name('g', guard)}(ctx, event)" for guard in conditions]
            tests += [f"not {name('u', guard)}(ctx, event)" for guard in unless]
            if tests:
                lines.append(f"    if {' and '.join(tests)}:")
                lines += _apply(option, name, "        ")
                lines.append("        return")
            else:  # an unguarded last option: always taken
                lines += _apply(option, name, "    ")
                lines.append("    return")
                break
        else:
            lines.append("    bus._refuse_unadmitted(inst, event)")
    else:
        lines += _apply(route, name, "    ")
    namespace: dict[str, Any] = dict(names)
    source = "\n".join(lines) + "\n"
    # Named by state and trigger, and by the source's checksum: buses that watch different
    # tags write different sources for one route, and each keeps its own lines.
    checksum = zlib.crc32(source.encode())
    filename = f"<kvhandoff step {machine}.{node.name}.{event.trigger} {checksum:08x}>"
    code = _code(source, filename)
    exec(code, namespace)  # the source above, built from the compiled table only
    step: Step = namespace["step"]
    return step


@functools.lru_cache(maxsize=4096)
def _code(source: str, filename: str) -> CodeType:
    """Compiled once per distinct source: every bus registering a kind binds the same code
    to its own nodes (a simulation builds thousands of buses). The source is registered
    with `linecache` under its file name, so tracebacks and debuggers show the lines of a
    generated step."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    return compile(source, filename, "exec")


def _apply(route: Route, name: Callable[[str, object], str], pad: str) -> list[str]:
    """The lines that take `route`: `EventBus._step` after its choice, for this route."""
    lines = [f"{pad}{name('r', route)}.taken = True"]
    dest = route.dest
    if dest is not None:
        lines.append(f"{pad}inst.node = {name('n', dest)}")
        for members, entering in route.watch:
            watched = name("w", members)
            if entering:
                lines.append(f"{pad}{watched}[inst.key] = inst")
            else:
                lines.append(f"{pad}{watched}.pop(inst.key, None)")
        if not route.keeps_timer:
            if dest.timeout_seconds is not None:  # arming replaces (cancels) the old timer
                lines.append(f"{pad}bus._arm(inst, {name('s', dest.timeout_seconds)})")
            else:  # clearing `inst.timer` cancels it (`timers.py`)
                lines.append(f"{pad}inst.timer = None")
    if route.action is not None:
        lines += [
            f"{pad}inst.busy = True",
            f"{pad}try:",
            f"{pad}    effects = {name('a', route.action)}(ctx, event)",
            f"{pad}    if effects:",
            f"{pad}        handlers = bus._handlers",
            f"{pad}        for effect in effects:",
            f"{pad}            handler = handlers.get(type(effect))",
            f"{pad}            if handler is None:",
            f"{pad}                bus.outbox.append((inst, effect))",
            f"{pad}            else:",
            f"{pad}                handler(inst, effect)",
            f"{pad}finally:",
            f"{pad}    inst.busy = False",
        ]
    return lines
