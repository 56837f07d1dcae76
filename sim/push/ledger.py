"""What a simulated push run promised, and the invariants it must keep (simulation only).

`SimLedger` follows every client request through both legs: P's lease (pending ->
leased -> freed | lost) and D's registration (pending -> registered -> received | failed
| expired | aborted | lost). The engines and the fabric report to it as things happen;
it records a violation the moment a rule breaks:

- a WRITE is posted only for a P request whose lease is live and whose blocks it holds,
  into exactly the blocks D registered (and sent in a PUSH_REG) for the same request;
- a WRITE never lands in blocks D holds for another request, and reads only P blocks that
  are still leased (a DMA from freed memory would corrupt D). A WRITE landing after D
  gave up on the request (in quarantined or free blocks) is counted in `late_writes`: D
  cannot revoke P's access, so it keeps such blocks out of reuse for a while;
- `finished_sending` at most once per P request; a received request holds P's bytes;
- at the end every P lease was freed exactly once and every D registration ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.protocol.request_ids import get_base_request_id

P_FINAL = ("freed", "lost")
D_FINAL = ("received", "failed", "expired", "aborted", "lost")


@dataclass(slots=True)
class ClientRecord:
    client_id: str
    num_blocks: int
    probe: bool = False
    p_id: str | None = None
    d_id: str | None = None
    p: str = "pending"
    d: str = "pending"
    finished_sending: int = 0
    d_blocks: tuple[int, ...] = ()
    reg_sent_blocks: tuple[int, ...] | None = None

    @property
    def resolved(self) -> bool:
        return self.p in P_FINAL and self.d in D_FINAL

    @property
    def completed(self) -> bool:
        return self.d == "received"


class SimLedger:
    def __init__(self) -> None:
        self.clients: dict[str, ClientRecord] = {}
        self.violations: list[str] = []
        self.late_writes = 0
        self.now = 0.0

    def violation(self, message: str) -> None:
        self.violations.append(f"t={self.now:.4f} {message}")

    def add(self, client_id: str, num_blocks: int, *, probe: bool = False) -> ClientRecord:
        record = ClientRecord(client_id, num_blocks, probe=probe)
        self.clients[client_id] = record
        return record

    def of(self, request_id: str) -> ClientRecord | None:
        return self.clients.get(get_base_request_id(request_id))

    # -- P ----------------------------------------------------------------------------

    def leased(self, client_id: str, p_id: str) -> None:
        record = self.clients[client_id]
        record.p_id, record.p = p_id, "leased"

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

    def registered(self, client_id: str, d_id: str, blocks: tuple[int, ...]) -> None:
        record = self.clients[client_id]
        record.d_id, record.d, record.d_blocks = d_id, "registered", blocks

    def reg_sent(self, d_id: str, blocks: tuple[int, ...]) -> None:
        record = self.of(d_id)
        if record is None or record.d_id != d_id:
            self.violation(f"PUSH_REG sent for {d_id!r}, which D never registered")
            return
        if blocks != record.d_blocks:
            self.violation(f"PUSH_REG for {d_id!r} names {blocks}, D holds {record.d_blocks}")
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

    def lost(self, client_id: str, side: str) -> None:
        """An engine crash took this leg with it (the client sees an error)."""
        record = self.clients[client_id]
        if side == "prefill" and record.p not in P_FINAL:
            record.p = "lost"
        if side == "decode" and record.d not in D_FINAL:
            record.d = "lost"

    # -- summary ------------------------------------------------------------------------

    def unresolved(self) -> list[ClientRecord]:
        return [r for r in self.clients.values() if not r.resolved]
