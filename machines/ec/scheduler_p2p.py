"""The P2P adapters' entry points of the encoder-cache scheduler (R-E07, R-E08, R-E11, S-06):
each forwards a ZMQ or NIXL report to the scheduler's P2P consumer or producer half."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    from kvhandoff.machines.ec.p2p import P2PConsumer, P2PProducer


class P2PAdapterEvents:
    """Mixed into `ECScheduler`: it sets `consumer` / `producer` (None without
    `ec_enable_nixl` or in the other role) and `_open` (raises after `shutdown`)."""

    consumer: P2PConsumer | None
    producer: P2PProducer | None

    def _open(self, call: str) -> None:
        raise NotImplementedError

    # -- P2P adapter events ----------------------------------------------------------------
    #
    # A message or completion that waited (a stalled process, a slow link) meets machines
    # in the state `now` decides, never one their deadlines would have left by then (an OK
    # ack arriving after the ack timeout, for a grant whose lease may be over, starts no
    # READ). Bad input raises `RemoteProtocolError` (counted) and changes nothing.

    def _need_consumer(self, call: str) -> P2PConsumer:
        self._open(call)
        if self.consumer is None:
            raise LocalProtocolError("this scheduler is not a P2P consumer (ec_enable_nixl)")
        return self.consumer

    def _need_producer(self, call: str) -> P2PProducer:
        self._open(call)
        if self.producer is None:
            raise LocalProtocolError("this scheduler is not a P2P producer (ec_enable_nixl)")
        return self.producer

    def on_xfer_ack(self, data: bytes, now: float, *, peer: str) -> None:
        """ZMQ: an `XferAck` arrived on the DEALER to producer `peer` (`host:port`)."""
        self._need_consumer("on_xfer_ack").on_xfer_ack(data, now, peer=peer)

    def on_read_done(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """NIXL: the READ of `transfer_id` completed and its handle was released."""
        self._need_consumer("on_read_done").on_read_done(mm_hash, transfer_id, now)

    def on_read_failed(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """NIXL: the READ of `transfer_id` failed and its handle was released."""
        self._need_consumer("on_read_failed").on_read_failed(mm_hash, transfer_id, now)

    def on_read_released(self, mm_hash: str, now: float) -> None:
        """NIXL: the handle of a quarantined READ (`ReleaseRead`) was released."""
        self._need_consumer("on_read_released").on_read_released(mm_hash, now)

    def on_peer_disconnected(self, peer_host: str, peer_port: int, now: float) -> None:
        """ZMQ: the DEALER to producer `peer_host:peer_port` lost its peer."""
        consumer = self._need_consumer("on_peer_disconnected")
        consumer.on_peer_disconnected(peer_host, peer_port, now)

    def on_consumer_disconnected(self, peer: bytes | str, now: float) -> None:
        """ZMQ: consumer identity `peer` left the ROUTER (its grants keep their lease)."""
        self._need_producer("on_consumer_disconnected").on_peer_disconnected(peer, now)

    def on_producer_message(
        self, peer: bytes | str, data: bytes, now: float, *, host: str = ""
    ) -> None:
        """ZMQ: an `XferReq`/`XferDone` arrived on the ROUTER from identity `peer`, over a
        connection from `host` (its IP address, '' when unknown)."""
        self._need_producer("on_producer_message").on_message(peer, data, now, host=host)

    def on_read_notif(self, sender: str, message: bytes, now: float) -> bool:
        """NIXL: a consumer's READ notif `<session_id>:<mm_hash>` arrived (C-03)."""
        return self._need_producer("on_read_notif").on_read_notif(sender, message, now)

    def register_nixl_agent(self, agent_name: str, agent_metadata: bytes, base_addr: int) -> None:
        """NIXL: the producer's agent registered the region at `base_addr`."""
        producer = self._need_producer("register_nixl_agent")
        producer.register_nixl_agent(agent_name, agent_metadata, base_addr)
