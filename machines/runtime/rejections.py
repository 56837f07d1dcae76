"""Counting and logging what peers send that we reject, at a bounded cost (S-06).

Every rejected input (bytes that do not decode, an event the current state does not
declare, a message for an unknown request, a sender that is not the bound peer, a frame
the socket dropped) is counted by peer and by cause and logged at WARNING, at most once
per `interval` seconds per peer and at most `max_lines` lines per `interval` in all; the
next line logged for a peer says how many were suppressed. Each line is at most
`max_line_chars` characters, whatever the peer sent. Time is an argument, like everywhere
in the machines.

The tables are bounded and never fill for good: the per-peer table keeps the
`max_peers` peers seen most recently (a peer that invents names pushes out only the
names it invented: their counts move to `OTHER_PEERS`, and a real peer seen again gets a
row again), and past `max_reasons` distinct causes new ones are counted under
`OTHER_CAUSES`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from kvhandoff.protocol.errors import RemoteProtocolError

__all__ = ["OTHER_CAUSES", "OTHER_PEERS", "RejectionLog"]

OTHER_PEERS = "<other peers>"
OTHER_CAUSES = "<other causes>"
DEFAULT_MAX_LINE_CHARS = 512


@dataclass(slots=True)
class _PeerLog:
    count: int = 0
    suppressed: int = 0
    next_log_at: float = float("-inf")


class RejectionLog:
    """Per-peer and per-cause counters of rejected inputs and a rate-limited warning."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        what: str = "input",
        interval: float = 10.0,
        max_peers: int = 1024,
        max_reasons: int = 64,
        max_lines: int = 32,
        max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.max_peers = max_peers
        self.max_reasons = max_reasons
        self.max_lines = max_lines
        self.max_line_chars = max_line_chars
        self.total = 0
        self.other_peers = 0
        """Rejections of peers pushed out of the table (and of `OTHER_PEERS` itself)."""
        self.suppressed_lines = 0
        """Warnings not logged because of the rate limits (every rejection is counted)."""
        self._peers: OrderedDict[str, _PeerLog] = OrderedDict()
        self._causes: dict[str, int] = {}
        self._window_end = float("-inf")
        self._window_lines = 0
        self._window_suppressed = 0

    def reject(self, peer: str | None, error: RemoteProtocolError | str, now: float) -> None:
        """Count one rejected input from `peer` and log it unless this peer was logged
        less than `interval` seconds ago or `max_lines` lines were logged this interval.
        `total` moves last: a reader on another thread that sees it has seen the cause."""
        named = error.peer if isinstance(error, RemoteProtocolError) else None
        name = (peer or named or "<unknown peer>")[:128]
        cause = _reason(error)
        if cause not in self._causes and len(self._causes) >= self.max_reasons:
            cause = OTHER_CAUSES
        self._causes[cause] = self._causes.get(cause, 0) + 1
        self.total += 1
        entry = self._peers.get(name)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                _, gone = self._peers.popitem(last=False)  # the peer seen longest ago
                self.other_peers += gone.count
            entry = self._peers[name] = _PeerLog()
        else:
            self._peers.move_to_end(name)
        entry.count += 1
        if now < entry.next_log_at:
            entry.suppressed += 1
            self.suppressed_lines += 1
            return
        if now >= self._window_end:
            self._window_end, self._window_lines = now + self.interval, 0
        if self._window_lines >= self.max_lines:
            entry.suppressed += 1
            self._window_suppressed += 1
            self.suppressed_lines += 1
            return
        self._window_lines += 1
        suppressed, entry.suppressed = entry.suppressed, 0
        others, self._window_suppressed = self._window_suppressed, 0
        entry.next_log_at = now + self.interval
        more = f" ({suppressed} more since the last warning)" if suppressed else ""
        if others:
            more += f" ({others} warnings of other peers suppressed)"
        head, text = f"rejected {self.what} from {name}: ", str(error)
        if len(head) + len(text) + len(more) > self.max_line_chars:
            marker = f"... ({len(text)} chars)"
            room = max(self.max_line_chars - len(head) - len(more) - len(marker), 0)
            text = text[:room] + marker
        self.logger.warning("%s%s%s", head, text, more)

    def count(self, peer: str | None = None) -> int:
        """Rejections from `peer` (`OTHER_PEERS`: of peers no longer in the table), or
        from everyone when None."""
        if peer is None:
            return self.total
        if peer == OTHER_PEERS:
            return self.other_peers
        entry = self._peers.get(peer)
        return 0 if entry is None else entry.count

    def reasons(self) -> dict[str, int]:
        """Rejections by cause, summed over peers."""
        return dict(self._causes)


def _reason(error: RemoteProtocolError | str) -> str:
    """A short, bounded label for grouping: the message up to its first colon or quote
    (what follows a quote is usually the peer's own text)."""
    text = str(error).split(":", 1)[0]
    for quote in ("'", '"'):
        text = text.split(quote, 1)[0]
    return text.strip()[:80]
