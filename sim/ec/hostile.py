"""A hostile producer and a hostile consumer in the simulated encoder-cache world
(simulation only; S-01..S-04).

`SimFaults.hostile` is the rate at which one of them acts between engine steps:

- the hostile producer (`evil.sim:5601`, agent `agent-evil`), to which the consumer also
  talks (it publishes encodings of its own):
  - answers a read the consumer sent to the honest producer, with a forged `OK` grant of
    its own blocks, as if it had learnt the transfer id (an ack must only count from the
    producer the request went to, S-02);
  - answers with an id an older kvhandoff would have used (`engine:serial:attempt`), or
    with bytes nested thousands deep (S-01);
  - publishes an honest encoding with an inflated `size_bytes` (the consumer must check
    the size against the request and its layout before it reserves or evicts, S-04);
- the hostile consumer (identity `mallory`) sends the honest producer bytes nested
  thousands deep, `XferReq`s for published encodings it never reads (it must hit its
  pin cap, S-03), and `XferDone`s for transfer ids it guesses (it must release nothing).

Whatever they send is answered by the honest peers with a `RemoteProtocolError`, counted
and ignored, or a NACK; the world's invariants (no READ from another agent, every read's
destination exactly its encoding's size, pins within their caps) catch what gets
through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.protocol.ec_grants import grant_ack
from kvhandoff.protocol.ec_status import XferStatus
from kvhandoff.protocol.ec_wire import (
    XferAck,
    XferDone,
    XferReq,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.sim.ec.engine import COMPAT

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld

__all__ = [
    "EVIL_AGENT",
    "EVIL_PEER",
    "MALLORY",
    "act",
    "inflate_sizes",
]

EVIL_PEER = "evil.sim:5601"
EVIL_AGENT = "agent-evil"
MALLORY = b"mallory"
DEEP = b"\x91" * 3000 + b"\xc0"


def act(world: SimulatedECWorld) -> None:
    """One hostile action, drawn from the world's generator."""
    pick = world.rng.random()
    if pick < 0.45:
        _forged_grant(world)
    elif pick < 0.55:
        _junk_ack(world)
    elif pick < 0.85:
        _mallory_requests(world)
    else:
        _mallory_junk(world)


def _deliver_ack(world: SimulatedECWorld, data: bytes) -> None:
    consumer = world.plane.consumer
    if not consumer.alive:
        return
    try:
        consumer.scheduler.on_xfer_ack(data, world.clock.now, peer=EVIL_PEER)
    except RemoteProtocolError:
        world.plane.count("hostile_acks_refused")


def _forged_grant(world: SimulatedECWorld) -> None:
    """An `OK` for a read the consumer sent to the honest producer, from `evil`."""
    consumer = world.plane.consumer
    if not consumer.alive:
        return
    reads = consumer.scheduler.bus.tagged(EC_CONSUMER_READ, "awaiting_ack")
    if not reads:
        return
    read = world.rng.choice(reads)
    world.note(f"HOSTILE producer forges a grant of {read.key}")
    forged = grant_ack(
        read.ctx.request(),  # the id leaked: the worst case
        producer_agent_name=EVIL_AGENT,
        producer_agent_metadata=b"md-evil",
        block_indices=list(range(len(read.ctx.dest_blocks))),
        block_size_bytes=8,
        size_bytes=read.ctx.size_bytes,
        region_base_addr=4096,
        lease_s=30.0,
    )
    world.plane.count("hostile_forged_grants")
    _deliver_ack(world, encode_xfer_ack(forged))


def _junk_ack(world: SimulatedECWorld) -> None:
    """A guessed old-style id, or an ack nested thousands deep."""
    consumer = world.plane.consumer
    world.note("HOSTILE producer sends junk")
    if world.rng.random() < 0.5:
        guess = f"{consumer.name}-{consumer.epoch}:1:1"
        ack = XferAck(
            "mm00", XferStatus.NACK_MISSING, transfer_id=guess, producer_agent_name="evil"
        )
        _deliver_ack(world, encode_xfer_ack(ack))
        return
    valid = encode_xfer_ack(XferAck("mm00", XferStatus.OK, transfer_id="x"))
    _deliver_ack(world, bytes([valid[0] + 1]) + valid[1:] + b"\xa3zzz" + DEEP)


def _to_producer(world: SimulatedECWorld, data: bytes) -> None:
    producer = world.plane.producer
    if not producer.alive:
        return
    try:
        producer.scheduler.on_producer_message(MALLORY, data, world.clock.now)
    except RemoteProtocolError:
        world.plane.count("hostile_requests_refused")


def _mallory_requests(world: SimulatedECWorld) -> None:
    """Grants for published encodings, never read: only the pin cap stops them."""
    producer = world.plane.producer
    world.note("HOSTILE consumer asks for grants it never reads")
    for _ in range(world.rng.randint(1, 4)):
        world.hostile_serial += 1
        mm_hash = f"mm{world.rng.randrange(world.settings.encodings):02d}"
        entry = producer.scheduler.cache.entry(mm_hash)
        blocks = 1 if entry is None else len(entry.ctx.blocks)
        size = 8 if entry is None else entry.ctx.size_bytes
        req = XferReq(
            mm_hash,
            COMPAT,
            session_id="mallory",
            transfer_id=f"mallory-{world.hostile_serial}",
            consumer_engine_id="mallory",
            consumer_agent_name="mallory",
            num_blocks=blocks,
            size_bytes=size,
        )
        _to_producer(world, encode_xfer_req(req))


def _mallory_junk(world: SimulatedECWorld) -> None:
    """Deep bytes, or an `XferDone` for an id the honest consumer might have used."""
    world.note("HOSTILE consumer sends junk")
    if world.rng.random() < 0.5:
        head = encode_xfer_done(XferDone("mm00", "t", True))
        _to_producer(world, bytes([head[0] + 1]) + head[1:] + b"\xa3zzz" + DEEP[:1500])
        return
    producer = world.plane.producer.scheduler.producer
    grants = [] if producer is None else producer.grants()
    if grants:  # the honest consumer's transfer id, leaked: from mallory it frees nothing
        grant = world.rng.choice(grants)
        done = XferDone(grant.ctx.mm_hash, grant.ctx.key[1], True)
        _to_producer(world, encode_xfer_done(done))


def inflate_sizes(world: SimulatedECWorld, params: dict[str, dict[str, object]]) -> None:
    """The hostile producer's relay: a servable encoding announced bigger than it is."""
    for entry in params.values():
        size = entry.get("size_bytes")
        if isinstance(size, int) and world.rng.random() < 0.5:
            entry["size_bytes"] = size * world.rng.randint(2, 8)
            world.plane.count("hostile_inflated_sizes")
