"""Producer agent: a producer's NIXL agent as one consumer knows it (R-E11, B-08).

Keyed by the agent name. The consumer's NIXL reader loads a producer's agent from the
metadata an `XferAck` carried (no separate handshake, R-E11) and creates this machine:

- `read_posted`: a READ from this agent was posted: `loaded -> reading` (counted in
  `reads`); a fresh grant naming a `stale` agent with the same metadata revives it.
- `read_ended`: a READ ended (done, failed or released); the last one takes `reading ->
  loaded`, or `stale -> forgotten`.
- `peer_lost`: the control plane lost the producer, or NIXL said the remote
  disconnected: `loaded -> forgotten` at once; with READs outstanding `-> stale`, and
  forgotten once the last one ends (B-08: a dead agent is never used for ever, and never
  removed under a READ).
- `metadata_changed`: a grant names the agent with other metadata (the producer
  restarted under the same name): `-> forgotten`, and its READs in flight are failed
  (`FailReads`), since they cannot complete against the old agent.
- `close`: the reader shuts down.

Leaving for `forgotten` asks the adapter to remove the agent (`ForgetAgent`).

Tags: `usable` (a grant may be read through it), `draining` (stale, waiting for its
READs to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "EC_PRODUCER_AGENT",
    "AgentCtx",
    "Close",
    "FailReads",
    "ForgetAgent",
    "MetadataChanged",
    "PeerLost",
    "ReadEnded",
    "ReadPosted",
]


@dataclass(slots=True)
class AgentCtx:
    key: str
    """The producer's NIXL agent name."""
    metadata: bytes = b""
    """The agent metadata it was loaded from."""
    peer_host: str = ""
    peer_port: int = 0
    """The producer's side channel (its control-plane address)."""
    reads: int = 0
    """READs posted through it that have not ended."""
    prepped: dict[tuple[int, int], object] = field(default_factory=dict)
    """The NIXL adapter's descriptor lists prepared for the producer's region, by (base
    address, block length) (opaque here); they go when the agent goes."""


@dataclass(frozen=True, slots=True)
class ReadPosted(Event):
    """A READ through this agent was posted (for the producer at `peer_host:peer_port`)."""

    peer_host: str = ""
    peer_port: int = 0


@dataclass(frozen=True, slots=True)
class ReadEnded(Event):
    """A READ through this agent ended and its handle was released."""


@dataclass(frozen=True, slots=True)
class PeerLost(Event):
    """The producer behind this agent is gone (control plane or NIXL says so)."""


@dataclass(frozen=True, slots=True)
class MetadataChanged(Event):
    """A grant names this agent with other metadata: its producer restarted."""


@dataclass(frozen=True, slots=True)
class Close(Event):
    """The reader shuts down."""


@dataclass(frozen=True, slots=True)
class ForgetAgent(Effect):
    """NIXL adapter: remove the remote agent `name` (and its prepared descriptor lists)."""

    name: str


@dataclass(frozen=True, slots=True)
class FailReads(Effect):
    """NIXL adapter: release and report failed every READ through agent `name`."""

    name: str


def _last_read(ctx: AgentCtx, event: ReadEnded) -> bool:
    return ctx.reads <= 1


def _posted(ctx: AgentCtx, event: ReadPosted) -> None:
    ctx.reads += 1
    if event.peer_host:
        ctx.peer_host, ctx.peer_port = event.peer_host, event.peer_port


def _ended(ctx: AgentCtx, event: ReadEnded) -> None:
    ctx.reads -= 1


def _forget(ctx: AgentCtx) -> list[Effect]:
    return [ForgetAgent(ctx.key), Metric("ec.consumer.agents_forgotten")]


def _forget_after_last(ctx: AgentCtx, event: ReadEnded) -> list[Effect]:
    ctx.reads = 0
    return _forget(ctx)


def _forget_now(ctx: AgentCtx, event: PeerLost | Close) -> list[Effect]:
    return _forget(ctx)


def _replaced(ctx: AgentCtx, event: MetadataChanged) -> list[Effect]:
    return [FailReads(ctx.key), *_forget(ctx)]


EC_PRODUCER_AGENT: Declaration[AgentCtx] = Declaration(
    name="ec.producer_agent",
    context=AgentCtx,
    description=(
        "A producer's NIXL agent as a consumer knows it (R-E11, B-08): loaded from the "
        "metadata of an XferAck, reading while READs are outstanding, stale when its peer "
        "is lost under READs, forgotten when the last one ends or its metadata changes."
    ),
    states=[
        {"name": "loaded", "tags": ("usable",)},
        {"name": "reading", "tags": ("usable",)},
        {"name": "stale", "tags": ("draining",)},
        {"name": "forgotten", "final": True},
    ],
    initial="loaded",
    transitions=[
        {"trigger": ReadPosted, "source": "loaded", "dest": "reading", "after": "posted"},
        {"trigger": ReadPosted, "source": "reading", "dest": None, "after": "posted"},
        {"trigger": ReadPosted, "source": "stale", "dest": "reading", "after": "posted"},
        {
            "trigger": ReadEnded,
            "source": "reading",
            "dest": "loaded",
            "conditions": "last_read",
            "after": "ended",
        },
        {"trigger": ReadEnded, "source": "reading", "dest": None, "after": "ended"},
        {
            "trigger": ReadEnded,
            "source": "stale",
            "dest": "forgotten",
            "conditions": "last_read",
            "after": "forget_after_last",
        },
        {"trigger": ReadEnded, "source": "stale", "dest": None, "after": "ended"},
        {"trigger": PeerLost, "source": "loaded", "dest": "forgotten", "after": "forget_now"},
        {"trigger": PeerLost, "source": "reading", "dest": "stale"},
        {
            "trigger": MetadataChanged,
            "source": ["loaded", "reading", "stale"],
            "dest": "forgotten",
            "after": "replaced",
        },
        {
            "trigger": Close,
            "source": ["loaded", "reading", "stale"],
            "dest": "forgotten",
            "after": "forget_now",
        },
    ],
    ignore=[("stale", PeerLost)],
    callbacks={
        "last_read": _last_read,
        "posted": _posted,
        "ended": _ended,
        "forget_after_last": _forget_after_last,
        "forget_now": _forget_now,
        "replaced": _replaced,
    },
)
