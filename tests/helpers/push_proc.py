"""One process of a push engine, as an engine lays it out (R-T01): its scheduler, or one
worker rank with its own NIXL agent, KV memory, writer thread and handshake executor.

    python push_proc.py rank ROLE ENGINE_ID RANK CONFIG_JSON
    python push_proc.py scheduler ROLE ENGINE_ID CONFIG_JSON

The processes share nothing: the test relays the msgspec records between them (msgpack as
hex, one line each, as an engine serialises them between its processes). Answers start
with `@@ ` (NIXL may log to stdout).

A rank prints `@@ READY <hex HandshakePayload>`, then answers:
  STEP <hex PushConnectorMeta>   -> `@@ <hex PushWorkerOutput>`
  FILL <client> <ids>            -> `@@ OK` (P: its layers and heads of the KV, patterned)
The config JSON may name `"mode": "pull"` (B-09; default push) and `peer_tp`, the other
engine's TP size.
  CLEAR <ids>                    -> `@@ OK`
  VERIFY <client> <ids>          -> `@@ OK` / `@@ BAD` (D: P's pattern of its heads, every byte)
  STATS                          -> `@@ <json counters>`
A scheduler prints `@@ READY`, then answers:
  SERVE <hex payload> ...        -> `@@ <port>` (serves the ranks' `EngineHandshake`)
  ALLOC <id> <ids> <json params> -> `@@ OK` (D: update_state_after_alloc)
  FINISHED <id> <ids> <json>     -> `@@ OK <json params>` (P: request_finished's params)
  META                           -> `@@ <hex PushConnectorMeta>`
  OUTPUTS <hex> ...              -> `@@ <hex PushConnectorOutput>`
  PENDING                        -> `@@ 1` / `@@ 0`
On end of stdin the process shuts down.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

import msgspec

from kvhandoff.adapters.clock import real_clock
from kvhandoff.machines.push.meta import PushConnectorMeta, PushWorkerOutput

COMPAT = ("kvhandoff-topology-test", "demo-model", "uint8")


def say(line: str) -> None:
    sys.stdout.write("@@ " + line + "\n")
    sys.stdout.flush()


def ids(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i]


LAYERS = 4
BLOCK_LEN = 16 * 1024  # one engine's block: a rank holds its TP share of it
NUM_BLOCKS = 256


def _pattern(client: str, member: str, ordinal: int, chunk: int, size: int) -> Any:
    import hashlib

    import numpy as np

    digest = hashlib.blake2b(f"{client}/{member}/{ordinal}/{chunk}".encode(), digest_size=8)
    return np.full(size // 8, int.from_bytes(digest.digest(), "little"), dtype=np.uint64)


class RankMemory:
    """One rank's KV: a region per member it owns (a PP stage owns its layers' slice),
    blocks of its TP share of the heads. Head chunk `c` of a block of a request holds its
    own pattern, so a receiver can tell which P rank's heads landed where (R-T03)."""

    def __init__(self, members: list[str], block_len: int) -> None:
        import numpy as np

        self.members = members
        self.block_len = block_len
        self.arrays = [np.zeros(NUM_BLOCKS * block_len, dtype=np.uint8) for _ in members]

    def local_regions(self) -> list[Any]:
        from kvhandoff.protocol.member_routing import LocalRegion

        return [
            LocalRegion(int(a.ctypes.data), (m,), self.block_len, NUM_BLOCKS)
            for a, m in zip(self.arrays, self.members, strict=True)
        ]

    def _part(self, member: int, block: int, chunks: int, k: int) -> Any:
        size = self.block_len // chunks
        start = block * self.block_len + k * size
        return self.arrays[member][start : start + size].view("<u8")

    def fill(self, client: str, blocks: list[int], chunks: int, first: int) -> None:
        for i, member in enumerate(self.members):
            for ordinal, block in enumerate(blocks):
                for k in range(chunks):
                    part = self._part(i, block, chunks, k)
                    part[:] = _pattern(client, member, ordinal, first + k, part.nbytes)

    def clear(self, blocks: list[int]) -> None:
        for i in range(len(self.members)):
            for block in blocks:
                self._part(i, block, 1, 0)[:] = 0

    def verify(self, client: str, blocks: list[int], chunks: int, first: int) -> bool:
        """Every byte as `fill(client, blocks, chunks, first)` on the writers would leave it
        (D's block of `chunks` P ranks' head shares when P's TP is larger)."""
        for i, member in enumerate(self.members):
            for ordinal, block in enumerate(blocks):
                for k in range(chunks):
                    part = self._part(i, block, chunks, k)
                    want = _pattern(client, member, ordinal, first + k, part.nbytes)
                    if not (part == want).all():
                        return False
        return True


def rank_main(role: str, engine_id: str, rank: int, raw: dict[str, Any]) -> None:
    from kvhandoff.adapters.nixl.agent import NixlAgent
    from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
    from kvhandoff.adapters.push_rank import PushRank
    from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
    from kvhandoff.protocol.handshake import compatibility_hash, encode_handshake
    from kvhandoff.protocol.push_config import PushConfig
    from kvhandoff.protocol.tp_mapping import split_rank

    peer_tp = int(raw.pop("peer_tp", 1))
    mode = raw.pop("mode", "push")
    config = PushConfig.from_mapping(raw)
    pp_rank, tp_rank = split_rank(rank, config.tp_size)
    members = [f"layers.{i}.{kv}" for i in range(LAYERS) for kv in ("k", "v")]
    per_stage = len(members) // config.pp_size
    memory = RankMemory(
        members[pp_rank * per_stage : (pp_rank + 1) * per_stage], BLOCK_LEN // config.tp_size
    )
    # The finer TP split's shares: P rank t holds head chunks t*c .. t*c + c - 1 of D's
    # split when D's TP is larger (c = D.tp / P.tp), D rank t those of P's when P's is.
    chunks = max(1, peer_tp // config.tp_size)
    agent = NixlAgent(f"{engine_id}-r{rank}-{secrets.token_hex(4)}", config.nixl_backend)
    transport = NixlPushTransport(
        engine_id,
        agent,
        memory.local_regions(),
        compatibility_hash=compatibility_hash(*COMPAT, BLOCK_LEN),
        tp_size=config.tp_size,
        tp_rank=tp_rank,
        pp_size=config.pp_size,
        pp_rank=pp_rank,
        is_decoder=role == "decode",
    )
    executor = HandshakeExecutor()
    side = PushRank(
        role,  # type: ignore[arg-type]
        engine_id,
        transport,
        executor.submit,
        config=config,
        clock=real_clock,
        rank=rank,
        mode=mode,
    )
    writer = PushWriterThread(side).start()
    say("READY " + encode_handshake(transport.handshake_payload()).hex())
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "STEP":
            meta = msgspec.msgpack.decode(bytes.fromhex(args[0]), type=PushConnectorMeta)
            say(msgspec.msgpack.encode(side.step(meta)).hex())
        elif cmd == "FILL":
            memory.fill(args[0], ids(args[1]), chunks, tp_rank * chunks)
            say("OK")
        elif cmd == "CLEAR":
            memory.clear(ids(args[0]))
            say("OK")
        elif cmd == "VERIFY":
            good = memory.verify(args[0], ids(args[1]), chunks, tp_rank * chunks)
            say("OK" if good else "BAD")
        elif cmd == "STATS":
            stats = {
                "rejected_notifs": side.rejected_notifs(),
                "failed_transfers": side.failed_transfers,
                "writer_errors": writer.errors,
                "writer_alive": writer.alive,
                "live": sum(side.bus.counters(k).live for k in _rank_kinds()),
            }
            say(json.dumps(stats))
        else:
            say(f"ERROR unknown command {cmd}")
    writer.stop()
    executor.shutdown()
    agent.close()


def _rank_kinds() -> tuple[Any, ...]:
    from kvhandoff.machines.rank.worker import RANK_KINDS

    return RANK_KINDS


def scheduler_main(role: str, engine_id: str, raw: dict[str, Any]) -> None:
    from kvhandoff.adapters.zmq.side_channel import SideChannelServer
    from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
    from kvhandoff.protocol.handshake import (
        HANDSHAKE_PROTOCOL_VERSION,
        EngineHandshake,
        decode_handshake,
        encode_engine_handshake,
    )
    from kvhandoff.protocol.push_config import PushConfig

    raw.pop("peer_tp", None)
    mode = raw.pop("mode", "push")
    config = PushConfig.from_mapping(raw)
    say("READY")
    server: SideChannelServer | None = None
    scheduler: PushScheduler | None = None
    for line in sys.stdin:
        cmd, *args = line.strip().split(" ", 3)
        if cmd == "SERVE":
            payloads = tuple(decode_handshake(bytes.fromhex(a)) for a in args[0].split(","))
            engine = EngineHandshake(
                protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id=engine_id, ranks=payloads
            )
            encoded = encode_engine_handshake(engine)
            server = SideChannelServer("127.0.0.1", 0, lambda served=encoded: served)
            local = LocalEngine(engine_id, "127.0.0.1", server.port)
            scheduler = PushScheduler(role, local, config, mode, now=real_clock())  # type: ignore[arg-type]
            say(str(server.port))
            continue
        assert scheduler is not None, "SERVE comes first"
        now = real_clock()
        if cmd == "ALLOC":
            scheduler.update_state_after_alloc(args[0], ids(args[1]), json.loads(args[2]), now)
            say("OK")
        elif cmd == "FINISHED":
            _delay, params = scheduler.request_finished(
                args[0], ids(args[1]), json.loads(args[2]), now
            )
            say("OK " + json.dumps(params or {}, separators=(",", ":")))
        elif cmd == "META":
            say(msgspec.msgpack.encode(scheduler.build_connector_meta(now)).hex())
        elif cmd == "OUTPUTS":
            outputs = [
                msgspec.msgpack.decode(bytes.fromhex(a), type=PushWorkerOutput)
                for a in args[0].split(",")
            ]
            say(msgspec.msgpack.encode(scheduler.update_connector_output(outputs, now)).hex())
        elif cmd == "PENDING":
            say("1" if scheduler.has_pending_push_work() else "0")
        else:
            say(f"ERROR unknown command {cmd}")
    if server is not None:
        server.close()


def main() -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    kind, role, engine_id = sys.argv[1:4]
    if kind == "rank":
        rank_main(role, engine_id, int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        scheduler_main(role, engine_id, json.loads(sys.argv[4]))


if __name__ == "__main__":
    main()
