"""What `agent.NixlAgent` hands out: registered memory, prepared descriptor lists and
posted transfers, with the literal types of its arguments and transfer statuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvhandoff.adapters.nixl.layout import BlockLayout

__all__ = ["MemKind", "PreppedBlocks", "Registration", "ThreadSync", "XferHandle", "XferState"]

MemKind = Literal["DRAM", "VRAM"]
XferState = Literal["DONE", "PROC", "ERR"]
ThreadSync = Literal["NONE", "STRICT", "RW", "DEFAULT"]


@dataclass(eq=False, slots=True)
class Registration:
    """Memory registered with the agent; pass it to `NixlAgent.deregister`."""

    addr: int
    size: int
    mem: MemKind
    raw: Any = field(repr=False)
    active: bool = True


@dataclass(eq=False, slots=True)
class PreppedBlocks:
    """A descriptor list prepared once for a layout; `agent_name` is "" for the local side."""

    agent_name: str
    mem: MemKind
    layout: BlockLayout
    raw: Any = field(repr=False)
    released: bool = False

    @property
    def is_local(self) -> bool:
        """True for a list prepared with `prep_local_blocks`."""
        return self.agent_name == ""


@dataclass(eq=False, slots=True)
class XferHandle:
    """A posted WRITE or READ; `xfer_status` is the last NIXL transfer status ("DONE",
    "PROC" or "ERR") seen by `post` or `poll`."""

    op: Literal["WRITE", "READ"]
    remote: str
    notif: bytes
    raw: Any = field(repr=False)
    xfer_status: XferState = "PROC"
    released: bool = False
    error: str | None = None
