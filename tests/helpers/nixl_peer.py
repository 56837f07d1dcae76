"""A NIXL peer in its own OS process, driven line by line over stdin/stdout.

Started by the integration tests as `python nixl_peer.py NAME SIZE SEED PARENT_PORT`. It
creates an agent, registers a DRAM buffer of SIZE bytes filled with `pattern(SIZE, SEED)`
(SEED < 0: zeros), serves its handshake on a side channel with an ephemeral port, prints
`PORT <port>`, fetches the parent's handshake and loads it, then prints `READY`.

Commands (one per line), each answered by exactly one line starting with `@@ ` (NIXL logs
to stdout too, so the parent skips lines without that prefix):
  NOTIFS <timeout_s> <count>   wait until <count> notifs arrived -> `NOTIFS <json list>`
  CHECK <json>                 {"seed", "block_len", "pairs": [[src_off, dst_off], ...]}:
                               compare local bytes at dst_off with pattern(seed) at src_off
                               -> `OK` or `FAIL <why>`
  SEND_NOTIF <text>            send_notif to the parent -> `SENT`
  EXIT                         -> `BYE`, then exit
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import torch
from kvhandoff.adapters.nixl_agent import NixlAgent
from kvhandoff.adapters.zmq_side_channel import SideChannelServer, fetch_handshake

PREFIX = "@@ "


def pattern(size: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes, the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def handshake_payload(agent: NixlAgent, buf: torch.Tensor) -> bytes:
    """What a peer needs: agent metadata and where the buffer lives."""
    return msgspec.msgpack.encode(
        {"meta": agent.metadata(), "addr": buf.data_ptr(), "size": buf.numel()}
    )


def say(line: str) -> None:
    """One protocol line; the prefix sets it apart from NIXL's own stdout logging."""
    sys.stdout.write(PREFIX + line + "\n")
    sys.stdout.flush()


def wait_notifs(agent: NixlAgent, timeout_s: float, count: int) -> list[list[str]]:
    """Bounded polling for `count` notifications."""
    got: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend([sender, msg.decode()] for sender, msg in agent.get_new_notifs())
    return got


def check(buf: torch.Tensor, spec: dict[str, object]) -> str:
    seed = int(spec["seed"])  # type: ignore[call-overload]
    block_len = int(spec["block_len"])  # type: ignore[call-overload]
    pairs: list[list[int]] = spec["pairs"]  # type: ignore[assignment]
    source = pattern(max(src for src, _ in pairs) + block_len, seed)
    for src, dst in pairs:
        if not torch.equal(buf[dst : dst + block_len], source[src : src + block_len]):
            return f"FAIL bytes at {dst} differ from source {src}"
    return "OK"


def main() -> None:
    name, size, seed, parent_port = sys.argv[1], *map(int, sys.argv[2:5])
    buf = pattern(size, seed) if seed >= 0 else torch.zeros(size, dtype=torch.uint8)
    agent = NixlAgent(name)
    agent.register_tensor(buf)
    server = SideChannelServer("127.0.0.1", 0, lambda: handshake_payload(agent, buf))
    say(f"PORT {server.port}")
    parent = msgspec.msgpack.decode(fetch_handshake("127.0.0.1", parent_port, 10.0))
    parent_name = agent.add_remote(parent["meta"])
    say("READY")
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "NOTIFS":
            timeout_s, count = arg.split()
            say("NOTIFS " + json.dumps(wait_notifs(agent, float(timeout_s), int(count))))
        elif cmd == "CHECK":
            say(check(buf, json.loads(arg)))
        elif cmd == "SEND_NOTIF":
            agent.send_notif(parent_name, arg.encode())
            say("SENT")
        elif cmd == "EXIT":
            break
        else:
            say(f"UNKNOWN {cmd}")
    server.close()
    agent.close()
    say("BYE")


if __name__ == "__main__":
    main()
