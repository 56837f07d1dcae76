"""The producer edges of `ECSide`: the ZMQ ROUTER at the side channel (R-E09) and B-01.

Requests are handed to `on_producer_message` when the side polls, i.e. from the
producer's own scheduler step. The wire is vLLM 0.33.0's (C-03): a stock vLLM consumer's
`XferReq` is answered with vLLM's ack fields, and the NIXL notif its READ carries
(`<session_id>:<mm_hash>`, drained by `ECSide._progress`) releases its grant; a kvhandoff
consumer releases it with `XferDone` instead (C-04). `SendXferAck` becomes a reply; a
reply that finds its consumer gone is reported with `on_consumer_disconnected` at the next
poll (ZMQ tells a ROUTER nothing else about who left). `EncodingEvicted` is logged and handed to the
eviction observers (an orchestrator's hook). Bad bytes from a consumer never raise out
of a poll: they go to the side's `RejectionLog`, counted per peer.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from kvhandoff.adapters.zmq.control import ControlServer
from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.producer_grant import SendXferAck
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.ec_wire import XferAck, encode_xfer_ack
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError

__all__ = ["ProducerEdges"]

log = logging.getLogger("kvhandoff.ec.side")


class ProducerEdges:
    """Mixin of `ECSide`: the ROUTER, its replies, and eviction announcements."""

    scheduler: ECScheduler
    server: ControlServer | None
    rejections: RejectionLog
    acks_sent: Counter[str]
    acks_undelivered: int
    ack_observers: list[Callable[[XferAck], None]]
    eviction_observers: list[Callable[[EncodingEvicted], None]]
    _gone_consumers: list[bytes]

    def _poll_server(self, now: float) -> int:
        server = self.server
        if server is None:
            return 0
        handled = 0
        while self._gone_consumers:
            self.scheduler.on_consumer_disconnected(self._gone_consumers.pop(0), now)
            handled += 1
        for peer, payload, host in server.poll_messages():
            handled += 1
            try:
                self.scheduler.on_producer_message(peer, payload, now, host=host)
            except RemoteProtocolError as exc:  # bad bytes never stop the producer's step
                self.rejections.reject(peer.hex(), exc, now)
            except KvHandoffError as exc:
                self.rejections.reject(peer.hex(), f"control message not applied: {exc}", now)
        return handled

    def send_ack(self, inst: Instance[Any] | None, effect: SendXferAck) -> None:
        """Executor of `SendXferAck`: reply on the ROUTER to the consumer identity."""
        self.acks_sent[str(effect.ack.status)] += 1
        for observer in self.ack_observers:
            observer(effect.ack)
        server, peer = self.server, effect.peer
        sent = False
        if server is not None and isinstance(peer, bytes):
            try:
                sent = self._reply(server, peer, encode_xfer_ack(effect.ack))
            except (KvHandoffError, RuntimeError, zmq.ZMQError) as exc:
                log.warning("XferAck %s not sent: %s", effect.ack.transfer_id, exc)
        if not sent:
            self.acks_undelivered += 1
            if isinstance(peer, bytes):
                self._gone_consumers.append(peer)  # delivered at the next poll

    def _reply(self, server: ControlServer, peer: bytes, data: bytes) -> bool:
        """The bytes of one `XferAck` onto the wire (fault injection overrides this)."""
        return server.reply(peer, data)

    def _evicted(self, inst: Instance[Any] | None, effect: EncodingEvicted) -> None:
        log.info("published encoding %s left the tier (%s)", effect.mm_hash, effect.reason)
        for observer in self.eviction_observers:
            observer(effect)
