"""The faults a simulated world can inject (deterministic simulation ONLY).

`SimFaults` names the probability of every fault the simulators can inject (the
`--faults` vocabulary of `kvhandoff simulate`); `SimFaults.select` parses that vocabulary
and `FAULT_NAMES` lists it. Both protocols' worlds and planes read it; each reads the
faults that apply to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["FAULT_NAMES", "SimFaults"]


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Fault probabilities; 0 turns one off. Names are the `--faults` vocabulary.

    Network faults are rolled per message or per call; `crash`, `partition`,
    `clock_jump`, `abort` and `eviction_pressure` are rates the simulator's scheduler
    reads per step. Each protocol's world reads the faults that apply to it: handshake
    and WRITE faults are push's (an encoder-cache consumer's `handshake_fail` is loading
    a producer's agent metadata), READ, eviction and save faults the encoder cache's.
    """

    drop: float = 0.0  # a notif is lost on the wire
    delay: float = 0.0  # a notif or transfer arrives late
    duplicate: float = 0.0  # a notif arrives twice
    reorder: float = 0.0  # a delivery picks any due message instead of the oldest
    handshake_fail: float = 0.0  # the side-channel fetch fails
    handshake_stall: float = 0.0  # the handshake job runs late (maybe past its timeout)
    write_fail: float = 0.0  # the WRITE fails to post
    write_error: float = 0.0  # the posted WRITE ends in ERR
    write_stall: float = 0.0  # the posted WRITE completes very late
    crash: float = 0.0  # an engine process dies (and restarts later)
    partition: float = 0.0  # P and D cannot reach each other for a while
    clock_jump: float = 0.0  # the clock leaps forward, every actor stalled meanwhile
    abort: float = 0.0  # D's engine aborts a request (client gone)
    read_fail: float = 0.0  # encoder cache: the consumer's NIXL READ ends in ERR
    read_stall: float = 0.0  # encoder cache: the READ completes very late
    eviction_pressure: float = 0.0  # encoder cache: a burst of saves fills the producer
    slow_save: float = 0.0  # encoder cache: a GPU->mmap save lands late (NACK_NOT_READY)
    hostile: float = 0.0  # encoder cache: a hostile producer or consumer acts (S-01..S-04)
    foreign_notif: float = 0.0  # push: a process of no known engine sends notifs
    spoofed_notif: float = 0.0  # push: a process sends notifs under a real agent's name

    @classmethod
    def none(cls) -> SimFaults:
        return cls()

    @classmethod
    def default(cls) -> SimFaults:
        """Every fault on, at rates that leave most requests completing."""
        return cls(
            drop=0.03,
            delay=0.1,
            duplicate=0.05,
            reorder=0.3,
            handshake_fail=0.05,
            handshake_stall=0.05,
            write_fail=0.04,
            write_error=0.03,
            write_stall=0.05,
            crash=0.0006,
            partition=0.0008,
            clock_jump=0.01,
            abort=0.004,
            read_fail=0.04,
            read_stall=0.04,
            eviction_pressure=0.01,
            slow_save=0.2,
            hostile=0.02,
            foreign_notif=0.004,
            spoofed_notif=0.004,
        )

    @classmethod
    def select(cls, names: Iterable[str]) -> SimFaults:
        """The default rates of the named faults only; `all` names every fault."""
        wanted = set(names)
        if "all" in wanted:
            return cls.default()
        unknown = sorted(wanted - set(FAULT_NAMES) - {"none"})
        if unknown:
            raise LocalProtocolError(f"unknown faults {unknown}; known: {', '.join(FAULT_NAMES)}")
        default = cls.default()
        return cls(**{name: getattr(default, name) for name in FAULT_NAMES if name in wanted})

    def enabled(self) -> list[str]:
        return [name for name in FAULT_NAMES if getattr(self, name) > 0]


FAULT_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SimFaults))
