"""What the shared seeded world asks of a protocol's simulator (simulation only).

`SeededWorld` (in `kvhandoff.sim.world`) is generic over a protocol's settings, its
client requests and its broken variants; these are the shapes it relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypedDict, TypeVar

from kvhandoff.sim.faults import SimFaults

__all__ = [
    "Choices",
    "ClientT",
    "SettingsT",
    "SimClient",
    "VariantT",
    "WorldOptions",
    "WorldSettings",
]

Choices = list[tuple[float, Callable[[], None]]]
"""Weighted actions due now: the scheduler picks one in proportion to its weight."""


class WorldSettings(Protocol):
    """What the shared scheduler reads from a protocol's settings."""

    @property
    def requests(self) -> int: ...  # client requests a run sends
    @property
    def mean_interarrival_s(self) -> float: ...  # they arrive as a Poisson process
    @property
    def max_actions(self) -> int: ...  # a run stops taking random actions after these
    @property
    def probes(self) -> int: ...  # fresh requests at the end, one of which must complete
    @property
    def settle_span_s(self) -> float: ...  # past every deadline of the protocol


class SimClient(Protocol):
    """One client request as the world tracks it."""

    @property
    def client_id(self) -> str: ...
    @property
    def probe(self) -> bool: ...
    @property
    def resolved(self) -> bool: ...
    @property
    def completed(self) -> bool: ...


SettingsT = TypeVar("SettingsT", bound=WorldSettings)
ClientT = TypeVar("ClientT", bound=SimClient)
VariantT = TypeVar("VariantT")


class WorldOptions(TypedDict, Generic[SettingsT, VariantT], total=False):
    """How a world is built, whichever protocol it simulates."""

    settings: SettingsT  # the shape of the run (the protocol's defaults if absent)
    variant: VariantT | None  # a deliberately broken variant of a machine (self-check)
    faults: SimFaults | None  # none if absent
    record: bool  # keep a log of every note and transition (`simulate` explains with it)
    log_limit: int | None  # the log's bound (None: unbounded)
