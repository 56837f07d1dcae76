"""Seeded fault injection around the real push transport, for soak runs and tests.

`FaultPlan.parse("write_fail=0.02,notif_drop=0.01,handshake_fail=0.05")` names the
probability of each fault; `faulty_transport_factory(plan, seed)` returns a factory that
builds a `NixlPushTransport` whose operations fail accordingly:

- `write_fail`: a WRITE fails to post (P reports write_submit_failed; D is told, B-06);
- `notif_drop`: an outgoing notif (PUSH_REG, heartbeat, WRITE-failed) or a WRITE's
  completion notif is silently lost (the watchdog and the lease must clean up);
- `handshake_fail`: a side-channel handshake fails (no retry loop; R-P12).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Self

from kvhandoff.adapters.nixl.agent import NixlTransferError
from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.adapters.push_transport import TransferHandle
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk


class ProbabilityPlan:
    """A frozen dataclass of fault probabilities, one field a fault, parsed from
    `name=p,name=p` (the `--faults` syntax of the roles)."""

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> Self:
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        return cls(**parse_probabilities(text, names))

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class FaultPlan(ProbabilityPlan):
    write_fail: float = 0.0
    notif_drop: float = 0.0
    handshake_fail: float = 0.0


def parse_probabilities(text: str, known: Sequence[str]) -> dict[str, float]:
    """`name=p,name=p` as {name: p}; `LocalProtocolError` for an unknown name or a
    probability outside [0, 1]."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, raw = part.partition("=")
        if name not in known:
            raise LocalProtocolError(f"unknown fault {name!r}; known: {sorted(known)}")
        try:
            values[name] = float(raw)
        except ValueError:
            raise LocalProtocolError(f"fault {name!r} needs a probability, got {raw!r}") from None
        if not 0.0 <= values[name] <= 1.0:
            raise LocalProtocolError(f"fault {name!r} probability {raw} is not in [0, 1]")
    return values


class Dice:
    """A seeded, thread-safe coin: the writer, main and executor threads all roll it."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}

    def roll(self, name: str, probability: float) -> bool:
        with self._lock:
            hit = probability > 0 and self._rng.random() < probability
            if hit:
                self.injected[name] = self.injected.get(name, 0) + 1
            return hit


def faulty_transport_factory(plan: FaultPlan, seed: int) -> Any:
    dice = Dice(seed)

    class FaultyNixlPushTransport(NixlPushTransport):
        injected = dice.injected

        def fetch_handshake(
            self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
        ) -> list[bytes]:
            if dice.roll("handshake_fail", plan.handshake_fail):
                raise NixlTransferError("handshake", "injected handshake failure")
            return super().fetch_handshake(host, port, timeout_s, ranks)

        def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
            if dice.roll("notif_drop", plan.notif_drop):
                return
            super().send_notif(engine_id, rank, message)

        def write_blocks(
            self,
            engine_id: str,
            rank: int,
            local_block_ids: Sequence[int],
            remote_block_ids: Sequence[int],
            notif: bytes,
            *,
            local_chunk: Chunk = WHOLE,
            remote_chunk: Chunk = WHOLE,
        ) -> TransferHandle:
            if dice.roll("write_fail", plan.write_fail):
                raise NixlTransferError("write", "injected post failure")
            if dice.roll("notif_drop", plan.notif_drop):
                notif = b""
            return super().write_blocks(
                engine_id,
                rank,
                local_block_ids,
                remote_block_ids,
                notif,
                local_chunk=local_chunk,
                remote_chunk=remote_chunk,
            )

    return FaultyNixlPushTransport
