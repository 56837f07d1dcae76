"""Counting and logging what peers send that we reject, at a bounded cost.

Every rejected input (bytes that do not decode, an event the current state does not
declare, a message for an unknown request, a sender that is not the bound peer) is
counted by peer and by reason and logged at WARNING, at most once per `interval`
seconds per peer; the next line logged for that peer says how many were suppressed.
Time is an argument, like everywhere in the machines. The tables are capped: past
`max_peers` distinct peer names, new names are counted under `OTHER_PEERS`, so a peer
that invents names cannot grow our memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvhandoff.protocol.errors import RemoteProtocolError

OTHER_PEERS = "<other peers>"


@dataclass(slots=True)
class _PeerLog:
    count: int = 0
    suppressed: int = 0
    next_log_at: float = float("-inf")
    reasons: dict[str, int] = field(default_factory=dict)


class RejectionLog:
    """Per-peer counters of rejected inputs and a rate-limited warning for each peer."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        what: str = "input",
        interval: float = 10.0,
        max_peers: int = 1024,
        max_reasons: int = 64,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.max_peers = max_peers
        self.max_reasons = max_reasons
        self.total = 0
        self._peers: dict[str, _PeerLog] = {}

    def reject(self, peer: str | None, error: RemoteProtocolError | str, now: float) -> None:
        """Count one rejected input from `peer` and log it unless this peer was logged
        less than `interval` seconds ago."""
        self.total += 1
        named = error.peer if isinstance(error, RemoteProtocolError) else None
        name = peer or named or "<unknown peer>"
        entry = self._peers.get(name)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                name = OTHER_PEERS
            entry = self._peers.setdefault(name, _PeerLog())
        entry.count += 1
        reason = _reason(error)
        if reason in entry.reasons or len(entry.reasons) < self.max_reasons:
            entry.reasons[reason] = entry.reasons.get(reason, 0) + 1
        if now < entry.next_log_at:
            entry.suppressed += 1
            return
        suppressed, entry.suppressed = entry.suppressed, 0
        entry.next_log_at = now + self.interval
        more = f" ({suppressed} more since the last warning)" if suppressed else ""
        self.logger.warning("rejected %s from %s: %s%s", self.what, name, error, more)

    def count(self, peer: str | None = None) -> int:
        """Rejections from `peer`, or from everyone when None."""
        if peer is None:
            return self.total
        entry = self._peers.get(peer)
        return 0 if entry is None else entry.count

    def reasons(self) -> dict[str, int]:
        """Rejections by reason, summed over peers."""
        out: dict[str, int] = {}
        for entry in self._peers.values():
            for reason, n in entry.reasons.items():
                out[reason] = out.get(reason, 0) + n
        return out


def _reason(error: RemoteProtocolError | str) -> str:
    """A short, bounded label for grouping: the message up to its first colon."""
    text = str(error)
    return text.split(":", 1)[0][:80]
