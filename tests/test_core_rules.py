"""Architecture rules that hold for every module: the table is the truth (no state-name
comparisons outside declarations), time is an argument (no clock reads in machines/),
and every declared callback is typed without Any."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from kvhandoff.machines.catalog import DECLARATIONS

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("protocol", "machines", "adapters", "sim", "src", "bench")

# The same pattern the review used: `.state == "x"`, `.state in ("a", "b")`, ...
STATE_COMPARISON = re.compile(r"\.state\s*(==|!=|not in|in)\s*[\(\[\{\"']")
CLOCK_READ = re.compile(
    r"\b(time\.(monotonic|time|perf_counter)(_ns)?|datetime\.(now|utcnow)|real_clock)\b"
)


def _scan(folders: tuple[str, ...], pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_core_no_state_name_comparisons_outside_declarations() -> None:
    """Code asks declared tags (`has_tag`, `tagged`, `inst.has`), never state names."""
    assert _scan(SHIPPED, STATE_COMPARISON) == []


def test_core_rule_checkers_catch_what_they_forbid() -> None:
    assert STATE_COMPARISON.search('if inst.state not in ("stashed", "waiting"):')
    assert STATE_COMPARISON.search("return inst.state == 'connected'")
    assert not STATE_COMPARISON.search('if bus.has_tag(D, key, "drainable"):')
    assert CLOCK_READ.search("deadline = time.monotonic() + ttl")
    assert CLOCK_READ.search("now = real_clock()")
    assert not CLOCK_READ.search("def fire_due(self, now: float) -> int:")


def test_core_machines_never_read_a_clock() -> None:
    """Every entry point under machines/ takes `now`; only adapters read time."""
    assert _scan(("machines",), CLOCK_READ) == []


def _mentions_any(hint: object) -> bool:
    return hint is Any or any(_mentions_any(arg) for arg in typing.get_args(hint))


def test_core_every_declared_callback_is_typed_without_any() -> None:
    """(ctx: Context, event: Event) -> list[Effect] | None | bool, for every machine."""
    untyped = []
    for decl in DECLARATIONS:
        for name, fn in decl.callbacks.items():
            hints = typing.get_type_hints(fn)
            if len(hints) != 3 or any(_mentions_any(h) for h in hints.values()):
                untyped.append(f"{decl.name}.{name}: {hints}")
            elif not issubclass(decl.context, next(iter(hints.values()))):
                untyped.append(f"{decl.name}.{name}: ctx is not {decl.context.__name__}")
    assert untyped == []
