"""A receive one worker rank was given, as vLLM's worker connector must report it (R-P12).

One instance per request whose blocks this rank receives (a push registration or a pull
READ in the step's metadata), keyed by vLLM's request id, on the worker-role connector's
own bus. It ends when the rank reports the receive finished or dropped. A failed receive
keeps its block ids until vLLM asks for the blocks with load errors
(`get_block_ids_with_load_errors`), once: vLLM then ends the request or recomputes it.

Tags: `receiving` (the rank may still report it), `load_errors_owed` (failed; its blocks
are the next load-error report).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "VLLM_RANK_RECEIVE",
    "LoadErrorsOwed",
    "LoadErrorsTaken",
    "RankReceiveCtx",
    "ReceiveEnded",
    "ReceiveFailed",
]


@dataclass(slots=True)
class RankReceiveCtx:
    key: str
    """vLLM's request id."""
    block_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReceiveEnded(Event):
    """The rank reported the receive finished, or dropped it (abort, watchdog)."""


@dataclass(frozen=True, slots=True)
class ReceiveFailed(Event):
    """The rank reported the receive failed: its blocks hold no valid KV."""


@dataclass(frozen=True, slots=True)
class LoadErrorsTaken(Event):
    """vLLM took the failed receive's blocks as load errors."""


@dataclass(frozen=True, slots=True)
class LoadErrorsOwed(Effect):
    """The next load-error report carries these blocks (the connector takes it from the
    bus's outbox and answers `LoadErrorsTaken`)."""

    request_id: str
    block_ids: tuple[int, ...]


def owe_load_errors(ctx: RankReceiveCtx, event: ReceiveFailed) -> list[Effect]:
    return [LoadErrorsOwed(ctx.key, ctx.block_ids)]


VLLM_RANK_RECEIVE: Declaration[RankReceiveCtx] = Declaration(
    name="vllm.rank_receive",
    context=RankReceiveCtx,
    description=(
        "A receive one worker rank was given, until the rank reports it finished or "
        "dropped; a failed one keeps its blocks until vLLM takes them as load errors."
    ),
    states=[
        {"name": "receiving", "tags": ("receiving",)},
        {"name": "failed", "tags": ("load_errors_owed",)},
        {"name": "ended", "final": True},
    ],
    initial="receiving",
    transitions=[
        {"trigger": ReceiveEnded, "source": "receiving", "dest": "ended"},
        {
            "trigger": ReceiveFailed,
            "source": "receiving",
            "dest": "failed",
            "after": "owe_load_errors",
        },
        {"trigger": LoadErrorsTaken, "source": "failed", "dest": "ended"},
    ],
    callbacks={"owe_load_errors": owe_load_errors},
)
