"""The verdict of one simulated run, whichever protocol it simulated (simulation only)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SimRunResult"]


@dataclass(slots=True)
class SimRunResult:
    """What one seed's run promised and kept: the report of `kvhandoff simulate` adds
    these up, and a run is clean when nothing leaked, hung or broke a rule."""

    protocol: str
    seed: int
    requests: int
    completed: int
    failed_cleanly: int
    leaked: int
    hung: int
    violations: list[str]
    actions: int = 0
    sim_seconds: float = 0.0
    leftovers: dict[str, dict[str, int]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.leaked or self.hung or self.violations)
