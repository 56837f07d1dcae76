"""What a simulated push run promised, and the invariants it must keep (simulation only).

`SimLedger` follows every attempt of every client request through both legs: P's lease
(pending -> leased -> freed | lost) and D's registration (pending -> registered ->
received | failed | expired | aborted | lost). A failed attempt may be retried by the
proxy under the same client id (the same base request id, new per-engine suffixes): each
attempt is its own record, found by the exact P and D request ids. The engines and the
fabric report to the ledger as things happen; it records a violation the moment a rule
breaks:

- a WRITE is posted only for a P request whose lease is live and whose blocks it holds,
  into exactly the blocks D registered (and sent in a PUSH_REG) for the same attempt;
- a WRITE never lands in blocks D holds for another request, and reads only P blocks that
  are still leased (a DMA from freed memory would corrupt D). A WRITE landing after D
  gave up on the request (in quarantined or free blocks) is counted in `late_writes`: D
  cannot revoke P's access, so it keeps such blocks out of reuse for a while;
- `finished_sending` at most once per P request; a received request holds P's bytes;
- P drops a `PUSH_REG` as a duplicate only when the same D rank's registration of the
  same D request reached that P rank before (a retry is never a duplicate);
- at the end every P lease was freed exactly once and every D registration ended.
"""

from __future__ import annotations

from dataclasses import dataclass

P_FINAL = ("freed", "lost")
D_FINAL = ("received", "failed", "expired", "aborted", "lost")


@dataclass(slots=True)
class ClientRecord:
    client_id: str
    num_blocks: int
    attempt: int = 0
    cached: int = 0  # logical blocks D already holds (a partial prefix hit, R-T05)
    probe: bool = False
    p_id: str | None = None
    d_id: str | None = None
    p: str = "pending"
    d: str = "pending"
    finished_sending: int = 0
    d_blocks: tuple[int, ...] = ()
    reg_sent_blocks: tuple[int, ...] | None = None
    leased_at: float = 0.0
    registered_at: float = 0.0
    overdue: bool = False

    @property
    def resolved(self) -> bool:
        return self.p in P_FINAL and self.d in D_FINAL

    @property
    def completed(self) -> bool:
        return self.d == "received"

    @property
    def key(self) -> str:
        return f"{self.client_id}#{self.attempt}"


class SimLedger:
    def __init__(self) -> None:
        self.clients: dict[str, ClientRecord] = {}  # by attempt key
        self.by_id: dict[str, ClientRecord] = {}  # by exact P or D request id
        self.violations: list[str] = []
        self.late_writes = 0
        self.stale_reads = 0  # pull: READs posted or landed after P's lease ended
        self.retries = 0
        self.now = 0.0
        # (P agent, D request id, D rank) -> PUSH_REG deliveries to that agent
        self.reg_deliveries: dict[tuple[str, str, int], int] = {}

    def violation(self, message: str) -> None:
        self.violations.append(f"t={self.now:.4f} {message}")

    def add(
        self, client_id: str, num_blocks: int, *, cached: int = 0, probe: bool = False
    ) -> ClientRecord:
        attempt = sum(1 for r in self.clients.values() if r.client_id == client_id)
        record = ClientRecord(client_id, num_blocks, attempt, cached, probe=probe)
        self.clients[record.key] = record
        if attempt:
            self.retries += 1
        return record

    def of(self, request_id: str) -> ClientRecord | None:
        return self.by_id.get(request_id)

    # -- P ----------------------------------------------------------------------------

    def leased(self, key: str, p_id: str) -> None:
        record = self.clients[key]
        record.p_id, record.p, record.leased_at = p_id, "leased", self.now
        self.by_id[p_id] = record

    def finished_sending(self, p_id: str) -> ClientRecord | None:
        record = self.of(p_id)
        if record is None or record.p_id != p_id:
            self.violation(f"finished_sending for {p_id!r}, which P never leased")
            return None
        record.finished_sending += 1
        if record.finished_sending > 1:
            self.violation(f"finished_sending reported twice for {p_id!r} (double free)")
            return None
        record.p = "freed"
        return record

    # -- D ----------------------------------------------------------------------------

    def registered(self, key: str, d_id: str, blocks: tuple[int, ...]) -> None:
        record = self.clients[key]
        record.d_id, record.d, record.d_blocks = d_id, "registered", blocks
        record.registered_at = self.now
        self.by_id[d_id] = record

    def reg_sent(self, d_id: str, blocks: tuple[int, ...]) -> None:
        record = self.of(d_id)
        if record is None or record.d_id != d_id:
            self.violation(f"PUSH_REG sent for {d_id!r}, which D never registered")
            return
        wanted = record.d_blocks[record.cached :]
        if blocks != wanted:
            self.violation(f"PUSH_REG for {d_id!r} names {blocks}, D lacks {wanted}")
        record.reg_sent_blocks = blocks

    def d_outcome(self, d_id: str, outcome: str) -> None:
        record = self.of(d_id)
        if record is None or record.d_id != d_id:
            self.violation(f"D reported {outcome} for {d_id!r}, which it never registered")
            return
        if record.d in D_FINAL:
            self.violation(f"D reported {outcome} for {d_id!r}, already {record.d}")
            return
        record.d = outcome

    def lost(self, key: str, side: str) -> None:
        """An engine crash took this leg with it (the client sees an error)."""
        record = self.clients[key]
        if side == "prefill" and record.p not in P_FINAL:
            record.p = "lost"
        if side == "decode" and record.d not in D_FINAL:
            record.d = "lost"

    # -- P's matching --------------------------------------------------------------------

    def reg_delivered(self, agent: str, d_id: str, d_rank: int) -> None:
        key = (agent, d_id, d_rank)
        self.reg_deliveries[key] = self.reg_deliveries.get(key, 0) + 1

    def dropped_as_duplicate(self, agent: str, d_id: str, d_rank: int) -> None:
        if self.reg_deliveries.get((agent, d_id, d_rank), 0) < 2:
            self.violation(
                f"P agent {agent} dropped the first PUSH_REG of {d_id!r} (D rank {d_rank}) as"
                " a duplicate"
            )

    def check_overdue(self, bound: float) -> None:
        """A lease or a registration held longer than every deadline allows is hung, even
        if a later crash would take it away."""
        for record in self.clients.values():
            if record.overdue:
                continue
            if record.p == "leased" and self.now - record.leased_at > bound:
                record.overdue = True
                self.violation(f"P request {record.p_id!r} held its blocks past every deadline")
            elif record.d == "registered" and self.now - record.registered_at > bound:
                record.overdue = True
                self.violation(f"D request {record.d_id!r} waited past every deadline")

    # -- summary ------------------------------------------------------------------------

    def unresolved(self) -> list[ClientRecord]:
        return [r for r in self.clients.values() if not r.resolved]
