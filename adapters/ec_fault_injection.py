"""Seeded fault injection around the real encoder-cache P2P tier, for soak runs and tests.

`ECFaultPlan.parse("read_fail=0.02,req_drop=0.01,ack_drop=0.01,garble=0.01,slow_save=0.05")`
names the probability of each fault; `FaultyECSide(..., faults=ECFaults(plan, seed))` is
an `ECSide` whose edges misbehave accordingly. The protocol machines are untouched: each
fault is something the network, NIXL or a slow GPU could do to a real deployment.

- `read_fail` (consumer): a NIXL READ fails to post; the read falls back to local
  encoding and the producer is told with `XferDone(ok=False)` (R-E08);
- `req_drop` (consumer): an outgoing `XferReq` or `XferDone` is lost. A lost request ends
  with the ack wait (R-E12); a lost done leaves the pin to the producer's pin lease;
- `ack_drop` (producer): an outgoing `XferAck` is lost: the consumer's ack wait settles
  its request locally; a lost `OK` leaves a grant the pin lease must release;
- `garble` (both): an outgoing control message is cut short on the wire, so the peer's
  decoder rejects it (counted in `rejected`, never raised): a lost message with noise;
- `slow_save` (producer, rolled by the role that encodes): a save's end event is held
  until the producer has answered `NACK_NOT_READY` for it, so the consumer retries
  (R-E08, B-04).

A NACK that is not retryable is not injected here: evictions under memory pressure (a
small `ec_cpu_bytes`) answer `NACK_MISSING` for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.fault_injection import Dice, ProbabilityPlan
from kvhandoff.adapters.zmq.control import ControlServer
from kvhandoff.machines.ec.consumer_read import IssueRead
from kvhandoff.machines.runtime.compiled import Instance

__all__ = ["ECFaultPlan", "ECFaults", "FaultyECSide"]


@dataclass(frozen=True, slots=True)
class ECFaultPlan(ProbabilityPlan):
    read_fail: float = 0.0
    req_drop: float = 0.0
    ack_drop: float = 0.0
    garble: float = 0.0
    slow_save: float = 0.0


class ECFaults:
    """A plan and its seeded dice; `injected` counts what was done, by name."""

    def __init__(self, plan: ECFaultPlan, seed: int) -> None:
        self.plan = plan
        self._dice = Dice(seed)

    @property
    def injected(self) -> dict[str, int]:
        return self._dice.injected

    def roll(self, name: str) -> bool:
        probability: float = getattr(self.plan, name)
        return self._dice.roll(name, probability)


def _garbled(data: bytes) -> bytes:
    """The message cut to its first half: never a valid message (strict decoders)."""
    return data[: len(data) // 2]


class FaultyECSide(ECSide):
    """An `ECSide` whose control-plane sends and READ posts fail as `faults` rolls."""

    def __init__(self, *args: Any, faults: ECFaults, **kwargs: Any) -> None:
        self.faults = faults
        super().__init__(*args, **kwargs)

    def _send(self, host: str, port: int, data: bytes, what: str) -> None:
        if self.faults.roll("req_drop"):
            return  # lost on the way: the sender's timeouts and the pin lease settle it
        if self.faults.roll("garble"):
            data = _garbled(data)
        super()._send(host, port, data, what)

    def _reply(self, server: ControlServer, peer: bytes, data: bytes) -> bool:
        if self.faults.roll("ack_drop"):
            return True  # it left this host and was lost: nobody here can tell
        if self.faults.roll("garble"):
            data = _garbled(data)
        return super()._reply(server, peer, data)

    def issue_read(self, inst: Instance[Any] | None, effect: IssueRead) -> None:
        if self.faults.roll("read_fail"):
            # As when NIXL refuses the post: reported at the next poll (R-E08).
            if self.reader is not None:
                self.reader.refused(effect)
            return
        super().issue_read(inst, effect)
