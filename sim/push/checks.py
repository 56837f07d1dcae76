"""The invariants of a simulated push run, checked as they happen and at its end
(deterministic simulation only).

`RunChecks` is mixed into `SimulatedPushWorld`: the fabric reports every notif sent and
delivered, WRITE posted and WRITE landed (`SimObserver`), and each is checked against the
ledger and the engines' block pools at that moment; at the end of a run it tells the
shared `final_check` what must be empty (every lease freed exactly once, every
registration ended, every table empty) and what the run counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.p_request import P_REQUEST
from kvhandoff.protocol.auth import is_sealed, peek_sealed
from kvhandoff.protocol.blocks import expand_to_physical
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.notifs import decode_completion_notif
from kvhandoff.protocol.push_wire import PUSH_REG_PREFIX, decode_push_reg
from kvhandoff.sim.push.engine import SimEngine
from kvhandoff.sim.push.fabric import SimNetwork, SimTransfer
from kvhandoff.sim.push.ledger import ClientRecord, SimLedger
from kvhandoff.sim.push.memory import physical_ids
from kvhandoff.sim.push.settings import SimSettings


def unsealed(message: bytes) -> bytes:
    """The notif inside a sealed one (the simulator reads it without the key)."""
    if not is_sealed(message):
        return message
    inner = peek_sealed(message)
    return b"" if inner is None else inner


class RunChecks:
    """The ledger's checks of one world (a mixin of `SimulatedPushWorld`)."""

    # Owned by the world.
    settings: SimSettings
    network: SimNetwork
    ledger: SimLedger
    prefill: SimEngine
    decode: SimEngine
    engines: tuple[SimEngine, SimEngine]

    hang_tables: ClassVar[frozenset[str]] = frozenset(
        {
            "live_push.d_request",
            "live_push.p_request",
            "live_push.d_registration",
            "live_push.p_lease",
            "live_pull.d_read",
            "live_pull.p_lease",
            "engine_requests",
        }
    )

    actions: int

    def check_invariants(self) -> None:
        """Every 64 actions: nothing is held past every deadline (a hang a later crash
        would hide)."""
        if self.actions % 64 == 0:
            self.ledger.check_overdue(self.settings.hang_bound_s)

    def leftovers(self) -> dict[str, dict[str, int]]:
        leftovers: dict[str, dict[str, int]] = {e.role: e.leftovers() for e in self.engines}
        in_flight = len(self.network.in_flight)
        if in_flight:
            leftovers.setdefault("network", {})["in_flight"] = in_flight
        return leftovers

    def leaked_by(self, client: ClientRecord) -> int:
        """A P request that ended without freeing its blocks leaks them."""
        p_id = client.p_id
        scheduler = self.prefill.side.scheduler.bus
        if client.p == "leased" and p_id is not None and scheduler.get(P_REQUEST, p_id) is None:
            self.ledger.violation(f"P request {p_id!r} ended but was never freed")
            return 1
        return 0

    def state_of(self, client: ClientRecord) -> str:
        return f"P={client.p} D={client.d}"

    def clients_seen(self) -> Iterable[ClientRecord]:
        return self.ledger.clients.values()

    def counters(self) -> dict[str, int]:
        counters = dict(self.network.counters)
        for engine in self.engines:
            counters[f"{engine.role}.rejected_notifs"] = engine.side.rejected_notifs()
            for cause, count in engine.side.stats().items():
                if count:
                    counters[f"{engine.role}.{cause}"] = count
        counters["late_writes"] = self.ledger.late_writes
        counters["stale_reads"] = self.ledger.stale_reads
        counters["retries"] = self.ledger.retries
        return counters

    # -- what the fabric tells us (SimObserver) ------------------------------------------------

    def notif_sent(self, src_engine: str, dst_engine: str, message: bytes) -> None:
        message = unsealed(message)
        if src_engine == self.decode.engine_id and message.startswith(PUSH_REG_PREFIX):
            reg = decode_push_reg(message)
            self.ledger.reg_sent(reg.request_id, reg.block_ids)

    def notif_delivered(self, dst_agent: str, message: bytes) -> None:
        message = unsealed(message)
        if dst_agent in self.prefill.agents() and message.startswith(PUSH_REG_PREFIX):
            try:
                reg = decode_push_reg(message)
            except KvHandoffError:
                return
            if reg.decode_tp_rank is not None:  # kvhandoff D ranks always name theirs
                self.ledger.reg_delivered(dst_agent, reg.request_id, reg.decode_tp_rank)

    def _posted_request(
        self, transfer: SimTransfer, initiator: SimEngine, peer: SimEngine
    ) -> str | None:
        """The request a posted WRITE or READ names in its completion notif, once it goes
        from the engine that must start it to the other one (else a violation, None)."""
        op = transfer.op
        if transfer.src_engine != initiator.engine_id or transfer.dst_engine != peer.engine_id:
            self.ledger.violation(f"{op} by {transfer.src_engine} to {transfer.dst_engine}")
            return None
        try:
            return decode_completion_notif(unsealed(transfer.notif)).request_id
        except KvHandoffError as exc:
            self.ledger.violation(f"{op} with a bad completion notif: {exc}")
            return None

    def write_posted(self, transfer: SimTransfer) -> None:
        """A WRITE needs both a live lease on the blocks and D's registration of its target."""
        ledger = self.ledger
        prefill, decode = self.prefill, self.decode
        d_id = self._posted_request(transfer, prefill, decode)
        if d_id is None:
            return
        ratio = self.settings.ratio
        owners = {prefill.pool.owner.get(b // ratio) for b in transfer.local_ids}
        p_id = next(iter(owners)) if len(owners) == 1 else None
        held = prefill.requests.get(p_id) if p_id is not None else None
        if p_id is None or held is None:
            ledger.violation(f"WRITE for {d_id!r} from P blocks no single request holds")
            return
        rank = next(r for r in prefill.side.ranks if r.transport.agent_name == transfer.src_agent)
        if rank.bus.get(P_LEASE, p_id) is None:
            ledger.violation(f"WRITE for {p_id!r} after rank {rank.rank}'s lease ended")
        physical = physical_ids(prefill.transports[0], held.blocks)
        tail = tuple(physical[len(physical) - len(transfer.local_ids) :])
        if tail != transfer.local_ids:
            ledger.violation(f"WRITE for {p_id!r} reads blocks other than its lease's tail")
        record = ledger.of(d_id)
        if record is None or record.d_id != d_id or record.p_id != p_id:
            ledger.violation(f"WRITE pairs P {p_id!r} with D {d_id!r}: not one client request")
            return
        if record.reg_sent_blocks is None:
            ledger.violation(f"WRITE for {d_id!r} before D sent its registration")
            return
        wanted = tuple(expand_to_physical(record.reg_sent_blocks, ratio))
        if wanted != transfer.remote_ids:
            ledger.violation(
                f"WRITE for {d_id!r} targets {transfer.remote_ids}, D registered {wanted}"
            )

    def write_landed(self, transfer: SimTransfer) -> None:
        """The bytes land: P still holds the source, D still holds the target for it."""
        ledger = self.ledger
        ratio = self.settings.ratio
        try:
            d_id = decode_completion_notif(unsealed(transfer.notif)).request_id
        except KvHandoffError:
            return  # already reported when posted
        record = ledger.of(d_id)
        p_id = record.p_id if record is not None else None
        for block in transfer.local_ids:
            if self.prefill.pool.owner.get(block // ratio) != p_id:
                ledger.violation(f"WRITE for {d_id!r} read P block {block} after it was freed")
                break
        late = False
        for block in transfer.remote_ids:
            holder = self.decode.pool.held_by(block // ratio)
            if holder == d_id and self.decode.pool.owner.get(block // ratio) == d_id:
                continue
            if holder is None or holder == d_id:
                late = True  # D gave up on it; the block is quarantined or free: no harm
                continue
            ledger.violation(
                f"WRITE for {d_id!r} landed in D block {block}, which D holds for {holder!r}"
            )
            break
        if late:
            ledger.late_writes += 1

    # -- pull mode (B-09): D READs from P ------------------------------------------------------

    def read_posted(self, transfer: SimTransfer) -> None:
        """A READ goes from the P blocks of the same attempt (the tail D lacks) into exactly
        the blocks D holds for it and lacks. One posted after P's lease ended (D cannot
        know; P may have reused the blocks) is counted in `stale_reads`: what it reads
        must never be taken as received (the pattern check of every receive says so)."""
        ledger = self.ledger
        prefill, decode = self.prefill, self.decode
        p_id = self._posted_request(transfer, decode, prefill)
        if p_id is None:
            return
        record = ledger.of(p_id)
        if record is None or record.p_id != p_id or record.d_id is None:
            ledger.violation(f"READ names P request {p_id!r}, which no D request was sent")
            return
        d_id = record.d_id
        held = prefill.requests.get(p_id)
        rank = next(
            (r for r in prefill.side.ranks if r.transport.agent_name == transfer.dst_agent), None
        )
        if held is None or rank is None or rank.bus.get(PULL_P_LEASE, p_id) is None:
            ledger.stale_reads += 1
            return
        lacking = record.d_blocks[record.cached :]
        source = physical_ids(prefill.transports[0], held.blocks[len(held.blocks) - len(lacking) :])
        if tuple(source) != transfer.remote_ids:
            ledger.violation(
                f"READ for {d_id!r} reads P blocks {transfer.remote_ids}, not {source}"
            )
        target = physical_ids(decode.transports[0], lacking)
        if tuple(target) != transfer.local_ids:
            ledger.violation(f"READ for {d_id!r} into {transfer.local_ids}, D lacks {target}")
        ratio = self.settings.ratio
        if any(decode.pool.owner.get(b // ratio) != d_id for b in transfer.local_ids):
            ledger.violation(f"READ for {d_id!r} into D blocks it does not hold")

    def read_landed(self, transfer: SimTransfer) -> None:
        """The bytes land: D still holds the target for the request (else it is late, and
        harmless only in blocks D holds for no one else). Bytes read from P blocks P no
        longer holds for the request count in `stale_reads`."""
        ledger = self.ledger
        ratio = self.settings.ratio
        try:
            p_id = decode_completion_notif(unsealed(transfer.notif)).request_id
        except KvHandoffError:
            return  # already reported when posted
        record = ledger.of(p_id)
        d_id = record.d_id if record is not None else None
        if any(self.prefill.pool.owner.get(b // ratio) != p_id for b in transfer.remote_ids):
            ledger.stale_reads += 1
        late = False
        for block in transfer.local_ids:
            holder = self.decode.pool.held_by(block // ratio)
            if holder == d_id and self.decode.pool.owner.get(block // ratio) == d_id:
                continue
            if holder is None or holder == d_id:
                late = True
                continue
            ledger.violation(f"READ for {d_id!r} landed in D block {block}, held for {holder!r}")
            break
        if late:
            ledger.late_writes += 1
