"""Hostile processes on the simulated fabric (deterministic simulation only, S-02..S-05).

A `Rogue` sends what a peer written from the wire format could send, at the live
requests of the world: completion notifs and `PUSH_FAIL`s to D ranks for requests D waits
on, heartbeats to P ranks, and `PUSH_REG`s to P ranks that name D's engine with blocks of
another request D holds. A foreign rogue names itself after no known engine; a spoofing
one uses a real agent's name (P's towards D, D's towards P), which only the cluster key
tells apart from the real agent: the world sends spoofed notifs only when its engines
share a key. A rogue has no key: in a keyed world it sends plain notifs or notifs sealed
with a key of its own. None of it may change what any request receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.protocol.auth import ClusterKey
from kvhandoff.protocol.notifs import (
    encode_completion_notif,
    encode_heartbeat,
    encode_write_failed,
)
from kvhandoff.protocol.push_wire import PushRegistration, encode_push_reg
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.protocol.tp_mapping import write_targets

if TYPE_CHECKING:
    from kvhandoff.sim.push.world import SimulatedPushWorld

_WRONG_KEY = ClusterKey(b"a rogue's own key, not the cluster's")


class Rogue:
    def __init__(self, world: SimulatedPushWorld) -> None:
        self.world = world
        self.serial = 0

    def strike(self, *, spoof: bool) -> bool:
        """Send one hostile notif; False when there was nothing to aim at."""
        world = self.world
        prefill, decode = world.prefill, world.decode
        if not (prefill.alive and decode.alive):
            return False
        kind = world.rng.choice(("completion", "push_fail", "heartbeat", "push_reg"))
        aimed = self._push_reg(spoof) if kind == "push_reg" else self._notif(kind, spoof)
        if aimed is None:
            return False
        claimed, target, message = aimed
        if world.keyed and world.rng.random() < 0.5:
            # The tag cannot verify under the cluster's key, whatever the nonce.
            message = _WRONG_KEY.seal(claimed, message, nonce=bytes(16), sealed_at=world.clock.now)
        world.note(f"ROGUE {kind} as {claimed} to {target}")
        return world.network.inject_notif(claimed, target, message)

    def _name(self) -> str:
        self.serial += 1
        return f"rogue-agent{self.serial}"

    def _notif(self, kind: str, spoof: bool) -> tuple[str, str, bytes] | None:
        world = self.world
        rng, prefill, decode = world.rng, world.prefill, world.decode
        waiting = sorted(decode.requests)
        if not waiting:
            return None
        d_id = rng.choice(waiting)
        if kind == "heartbeat":
            target = rng.choice(sorted(prefill.agents()))
            claimed = rng.choice(sorted(decode.agents())) if spoof else self._name()
            return claimed, target, encode_heartbeat([d_id])
        target = rng.choice(sorted(decode.agents()))
        claimed = rng.choice(sorted(prefill.agents())) if spoof else self._name()
        if kind == "completion":
            return claimed, target, encode_completion_notif(d_id, world.topology.p_tp)
        return claimed, target, encode_write_failed(d_id, "rogue")

    def _push_reg(self, spoof: bool) -> tuple[str, str, bytes] | None:
        """A registration that would make P write a live request's KV into blocks D holds
        for another one."""
        world = self.world
        rng, prefill, decode, topo = world.rng, world.prefill, world.decode, world.topology
        leased = sorted(prefill.requests)
        held = sorted(decode.requests)
        if not leased or not held:
            return None
        p_id = rng.choice(leased)
        victim = decode.requests[rng.choice(held)]
        p_rank = rng.randrange(len(prefill.transports))
        p_tp_rank = p_rank % topo.p_tp
        d_rank = rng.choice([t.d_rank for t in write_targets(topo.p_tp, p_tp_rank, topo.d_tp)])
        blocks = prefill.requests[p_id].blocks
        reg = PushRegistration(
            request_id=f"{get_base_request_id(p_id)}-{rng.getrandbits(32):08x}",
            decode_engine_id=decode.engine_id,
            decode_host=decode.host,
            decode_port=decode.port,
            decode_tp_size=topo.d_tp,
            decode_tp_rank=d_rank,
            block_ids=victim.blocks[: len(blocks)],
            remote_engine_id=prefill.engine_id,
            remote_host=prefill.host,
            remote_port=prefill.port,
            remote_tp_size=topo.p_tp,
            remote_pp_size=topo.p_pp,
        )
        claimed = decode.transports[d_rank].agent_name if spoof else self._name()
        target = prefill.transports[p_rank].agent_name
        return claimed, target, encode_push_reg(reg)
