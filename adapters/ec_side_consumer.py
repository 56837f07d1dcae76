"""The consumer edges of `ECSide`: one ZMQ DEALER per producer peer and NIXL READs (R-E07).

`SendXferReq` and `SendXferDone` go out on the DEALER of their producer; its acks go to
`on_xfer_ack`, a lost connection to `on_peer_disconnected` (and the DEALER is dropped, so
the next request opens a fresh one). `IssueRead` goes to an `ECNixlReader`: a NIXL READ
of the producer's registered region into ours, with the producer agent metadata the
`XferAck` carried loaded first when the agent is new or changed, so a restarted producer
is read without another handshake (R-E11). Polling the READs reports `on_read_done` or
`on_read_failed` once the READ's handle is released; a quarantined READ whose time is up
is released on `ReleaseRead` before its destination is freed (R-E12). An agent whose peer
went away is forgotten once no READ uses it (B-08).

Bad bytes from a producer never raise out of a poll: they go to the side's
`RejectionLog`, counted per peer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq

from kvhandoff.adapters.nixl.ec_reader import ECNixlReader
from kvhandoff.adapters.zmq.control import ControlClient, Heartbeat
from kvhandoff.machines.ec.consumer_read import (
    EC_CONSUMER_READ,
    IssueRead,
    ReleaseRead,
    SendXferDone,
    SendXferReq,
)
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.ec_wire import encode_xfer_done, encode_xfer_req
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

__all__ = ["ConsumerEdges", "ReadOutcome"]

log = logging.getLogger("kvhandoff.ec.side")

_MAX_OUTCOMES = 4096


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """How a consumer read of one `mm_hash` ended (kept for the last few thousand)."""

    state: str
    """`done`, `fallback_local` or `released` (after a quarantine), for reports."""
    reason: str
    attempts: int
    not_ready: int
    """How many `NACK_NOT_READY`s it was answered before it ended."""


class ConsumerEdges:
    """Mixin of `ECSide`: the DEALERs, the READs and the outcomes of reads."""

    scheduler: ECScheduler
    heartbeat: Heartbeat
    reader: ECNixlReader | None
    rejections: RejectionLog
    read_outcomes: OrderedDict[str, ReadOutcome]
    _zmq: zmq.Context[zmq.Socket[bytes]] | None
    _clients: dict[tuple[str, int], ControlClient]

    def _frame_reject(self, peer: str, reason: str) -> None:
        raise NotImplementedError

    # -- control plane -------------------------------------------------------------------

    def _client(self, host: str, port: int) -> ControlClient:
        client = self._clients.get((host, port))
        if client is None:
            client = ControlClient(
                host,
                port,
                heartbeat=self.heartbeat,
                context=self._zmq,
                on_reject=self._frame_reject,
            )
            self._clients[(host, port)] = client
        return client

    def _send(self, host: str, port: int, data: bytes, what: str) -> None:
        try:
            sent = self._client(host, port).send(data)
        except (zmq.ZMQError, ValueError, OSError, RuntimeError) as exc:
            log.warning("%s to %s:%s not sent: %s", what, host, port, exc)
            return
        if not sent:  # the ack timeout settles it
            log.warning("%s to %s:%s not sent: send queue full", what, host, port)

    def send_xfer_req(self, inst: Instance[Any] | None, effect: SendXferReq) -> None:
        """Executor of `SendXferReq`: on the DEALER of the producer peer."""
        self._send(effect.peer_host, effect.peer_port, encode_xfer_req(effect.req), "XferReq")

    def send_xfer_done(self, inst: Instance[Any] | None, effect: SendXferDone) -> None:
        """Executor of `SendXferDone`: on the DEALER of the producer peer."""
        if (effect.peer_host, effect.peer_port) not in self._clients:
            return  # that peer is gone; its grant ends with its lease
        data = encode_xfer_done(effect.done)
        self._send(effect.peer_host, effect.peer_port, data, "XferDone")

    def _poll_clients(self, now: float) -> int:
        handled = 0
        for (host, port), client in list(self._clients.items()):
            peer = f"{host}:{port}"
            for data in client.poll_replies():
                handled += 1
                try:
                    self.scheduler.on_xfer_ack(data, now, peer=peer)
                except RemoteProtocolError as exc:  # bad bytes never stop the step
                    self.rejections.reject(peer, exc, now)
                except KvHandoffError as exc:
                    self.rejections.reject(peer, f"XferAck not applied: {exc}", now)
            before = client.disconnects
            client.poll_events()
            if client.disconnects > before:
                handled += 1
                log.warning("producer %s disconnected", peer)
                client.close()
                del self._clients[(host, port)]
                if self.reader is not None:
                    self.reader.peer_lost(host, port)
                self.scheduler.on_peer_disconnected(host, port, now)
        return handled

    # -- data plane ----------------------------------------------------------------------

    def issue_read(self, inst: Instance[Any] | None, effect: IssueRead) -> None:
        """Executor of `IssueRead`: NIXL READ of the granted blocks into ours (R-E11)."""
        try:
            if self.reader is None:
                raise LocalProtocolError("this side cannot READ (not a consumer, or closed)")
            self.reader.read(effect)
        except KvHandoffError as exc:  # the reader reports it failed at the next poll
            log.warning("READ of %s failed to post: %s", effect.mm_hash, exc)

    def release_read(self, inst: Instance[Any] | None, effect: ReleaseRead) -> None:
        """Executor of `ReleaseRead`: a quarantine ended; release the READ's handle (NIXL
        cancels the DMA), and only then tell the read, which frees its destination."""
        if self.reader is not None:
            self.reader.release(effect.transfer_id)
        self.scheduler.on_read_released(effect.mm_hash, self.scheduler.bus.now)

    def _awaited(self, mm_hash: str, transfer_id: str) -> bool:
        consumer = self.scheduler.consumer
        read = None if consumer is None else consumer.read(mm_hash)
        return read is not None and read.ctx.transfer_id == transfer_id

    def _poll_reads(self, now: float) -> int:
        if self.reader is None:
            return 0
        self.scheduler.poll(now)  # `_awaited` asks about reads as of now
        completions = self.reader.poll(self._awaited)
        for mm_hash, transfer_id, ok in completions:
            if ok:
                self.scheduler.on_read_done(mm_hash, transfer_id, now)
            else:
                self.scheduler.on_read_failed(mm_hash, transfer_id, now)
        return len(completions)

    def _retired(self, inst: Instance[Any]) -> None:
        if inst.machine.decl is not EC_CONSUMER_READ:
            return
        ctx = inst.ctx
        key = str(inst.key)
        self.read_outcomes[key] = ReadOutcome(inst.state, ctx.reason, ctx.attempt, ctx.not_ready)
        self.read_outcomes.move_to_end(key)
        while len(self.read_outcomes) > _MAX_OUTCOMES:
            self.read_outcomes.popitem(last=False)
