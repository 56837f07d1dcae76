"""CUDA IPC peer lifecycle: one D rank's KV regions as P's IPC transport sees them
(issue 18; a D that goes away is unmapped without crashing P, B-08).

One instance per (D engine, rank) on the IPC transport's own bus, created when a WRITE
to that rank finds an export D sent (a notif, never trusted further than its checks).

- `offered`: D's export is known, nothing is mapped; the transport tries to open it.
  Opened, WRITEs go through IPC (`opened`); refused (another host, no peer access,
  regions that differ, no CUDA), they go through NIXL (`refused`) until D sends a new
  export.
- `opened`: WRITEs of whole blocks launch the gather-scatter kernel. When D is forgotten
  (lost, restarted, evicted), the transport waits for its kernels, fails their requests
  and unmaps (`closing`, then `closed`).

Tags: `openable` (try to open), `ipc_ready` (write through IPC), `nixl_only` (fall
back), `draining` (unmapping).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent


@dataclass(slots=True)
class IpcPeerCtx:
    key: str
    export: bytes = b""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ExportOffered(PeerEvent):
    """D sent (again) the IPC handles of its KV allocations."""

    export: bytes = b""


@dataclass(frozen=True, slots=True)
class MappingsOpened(Event):
    """Every allocation of the export is mapped here and matches our regions."""


@dataclass(frozen=True, slots=True)
class MappingsRefused(Event):
    """The export cannot be used here: NIXL carries this rank's WRITEs."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class PeerForgotten(Event):
    """The transport forgot D's engine (lost, restarted or evicted)."""


@dataclass(frozen=True, slots=True)
class MappingsClosed(Event):
    """D's kernels finished and its allocations are unmapped."""


@dataclass(frozen=True, slots=True)
class CloseMappings(Effect):
    """Wait for the rank's kernels, fail their requests, unmap its allocations."""

    key: str


def remember(ctx: IpcPeerCtx, event: ExportOffered) -> None:
    ctx.export = event.export
    ctx.reason = ""


def count_opened(ctx: IpcPeerCtx, event: MappingsOpened) -> list[Effect]:
    return [Metric("push.ipc.opened")]


def note_refusal(ctx: IpcPeerCtx, event: MappingsRefused) -> list[Effect]:
    ctx.reason = event.reason
    return [Metric("push.ipc.refused")]


def close(ctx: IpcPeerCtx, event: PeerForgotten) -> list[Effect]:
    return [CloseMappings(ctx.key)]


IPC_PEER: Declaration[IpcPeerCtx] = Declaration(
    name="push.ipc_peer",
    description=__doc__ or "",
    states=[
        {"name": "offered", "tags": ("openable",)},
        {"name": "opened", "tags": ("ipc_ready",)},
        {"name": "refused", "tags": ("nixl_only",)},
        {"name": "closing", "tags": ("draining",)},
        {"name": "closed", "final": True},
    ],
    initial="offered",
    transitions=[
        {"trigger": ExportOffered, "source": "offered", "dest": None, "after": "remember"},
        {"trigger": ExportOffered, "source": "refused", "dest": "offered", "after": "remember"},
        {
            "trigger": MappingsOpened,
            "source": "offered",
            "dest": "opened",
            "after": "count_opened",
        },
        {
            "trigger": MappingsRefused,
            "source": "offered",
            "dest": "refused",
            "after": "note_refusal",
        },
        {"trigger": PeerForgotten, "source": "opened", "dest": "closing", "after": "close"},
        {"trigger": PeerForgotten, "source": "offered", "dest": "closed"},
        {"trigger": PeerForgotten, "source": "refused", "dest": "closed"},
        {"trigger": MappingsClosed, "source": "closing", "dest": "closed"},
    ],
    # A D that is mapped or being unmapped re-sending its export changes nothing: a
    # restarted D is forgotten first (B-08), which closes this instance.
    ignore=[("opened", ExportOffered), ("closing", ExportOffered)],
    callbacks={
        "remember": remember,
        "count_opened": count_opened,
        "note_refusal": note_refusal,
        "close": close,
    },
    context=IpcPeerCtx,
)
