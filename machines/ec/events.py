"""Events shared by several encoder-cache machines (part of the local tier: no msgspec).

The cache entry's events are delivered by the scheduler half and emitted by the machines
that hold or fill an entry (a consumer read, a producer grant, a request); the peer
disconnect is known to both P2P machines. Events of one machine live in its module.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.events import Event, PeerEvent

__all__ = [
    "Discard",
    "Evict",
    "PeerDisconnected",
    "Pin",
    "Publish",
    "ReadFellBack",
    "ReadLanded",
    "Saved",
    "Unpin",
]


# -- ec.cache_entry ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Saved(Event):
    """The entry's bytes landed: its save's end event was reported, or its READ completed."""


@dataclass(frozen=True, slots=True)
class Discard(Event):
    """The save was abandoned or failed, or the READ failed or its quarantine ended."""


@dataclass(frozen=True, slots=True)
class Pin(Event):
    """A load, a producer grant or a request holds the entry."""


@dataclass(frozen=True, slots=True)
class Unpin(Event):
    """One holder lets go; `consumed` when it reports a peer's completed READ."""

    consumed: bool = False


@dataclass(frozen=True, slots=True)
class Evict(Event):
    """FIFO eviction: the tier needs the entry's blocks."""


@dataclass(frozen=True, slots=True)
class Publish(Event):
    """The producer announced the entry in `ec_transfer_params`."""


# -- ec.settlement, from the consumer read it waits for -----------------------------------


@dataclass(frozen=True, slots=True)
class ReadLanded(Event):
    """The read this settlement waited for landed: its entry is in the tier."""


@dataclass(frozen=True, slots=True)
class ReadFellBack(Event):
    """The read this settlement waited for will not land (`reason`): encode locally."""

    reason: str


# -- the P2P machines ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerDisconnected(PeerEvent):
    """The control connection to the peer was lost (ZMQ heartbeat or a failed send)."""
