"""A NIXL peer in its own OS process, driven line by line over stdin/stdout.

Started by the integration tests as `python nixl_peer.py NAME SIZE SEED PARENT_PORT`. It
creates an agent, registers a DRAM buffer of SIZE bytes filled with `pattern(SIZE, SEED)`,
serves its handshake on a side channel with an ephemeral port, prints `PORT <port>`,
fetches the parent's handshake and loads it, then prints `READY`.

Commands (one per line), each answered by exactly one line starting with `@@ ` (NIXL logs
to stdout too, so the parent skips lines without that prefix):
  FILL <seed>                  refill the buffer with pattern(SIZE, seed) -> `FILLED`
  NOTIFS <timeout_s> <count>   wait until <count> notifs arrived -> `NOTIFS <json list>`
  CHECK <json>                 {"seed", "block_len", "pairs": [[src_off, dst_off], ...]}:
                               compare local bytes at dst_off with pattern(seed) at src_off
                               -> `OK` or `FAIL <why>`
  SEND_NOTIF <text>            send_notif to the parent -> `SENT`
  EXIT                         -> `BYE`, then exit

numpy rather than torch keeps the start-up of this process short.
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import numpy as np
import numpy.typing as npt

from kvhandoff.adapters.nixl.agent import NixlAgent
from kvhandoff.adapters.zmq.side_channel import SideChannelServer, fetch_handshake

PREFIX = "@@ "
Bytes = npt.NDArray[np.uint8]


def pattern(size: int, seed: int) -> Bytes:
    """Deterministic pseudo-random bytes, the same in every process; zeros for seed < 0."""
    if seed < 0:
        return np.zeros(size, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def handshake_payload(agent: NixlAgent, buf: Bytes) -> bytes:
    """What a peer needs: agent metadata and where the buffer lives."""
    return msgspec.msgpack.encode(
        {"meta": agent.metadata(), "addr": buf.ctypes.data, "size": buf.nbytes}
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
        if len(got) < count:
            time.sleep(0.0005)  # poll interval, not synchronisation: the deadline bounds it
    return got


class CheckSpec(msgspec.Struct):
    """Which local bytes should equal which bytes of `pattern(len(buf), seed)`."""

    seed: int
    block_len: int
    pairs: list[tuple[int, int]]


def check(buf: Bytes, spec: CheckSpec) -> str:
    source = pattern(buf.nbytes, spec.seed)
    size = spec.block_len
    for src, dst in spec.pairs:
        if not np.array_equal(buf[dst : dst + size], source[src : src + size]):
            return f"FAIL bytes at {dst} differ from source {src}"
    return "OK"


def main() -> None:
    name, size, seed, parent_port = sys.argv[1], *map(int, sys.argv[2:5])
    buf = pattern(size, seed)
    agent = NixlAgent(name)
    agent.register_dram(buf.ctypes.data, buf.nbytes)
    server = SideChannelServer("127.0.0.1", 0, lambda pp, tp: handshake_payload(agent, buf))
    say(f"PORT {server.port}")
    parent = msgspec.msgpack.decode(fetch_handshake("127.0.0.1", parent_port, 20.0))
    parent_name = agent.add_remote(parent["meta"])
    say("READY")
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "FILL":
            buf[:] = pattern(size, int(arg))
            say("FILLED")
        elif cmd == "NOTIFS":
            timeout_s, count = arg.split()
            say("NOTIFS " + json.dumps(wait_notifs(agent, float(timeout_s), int(count))))
        elif cmd == "CHECK":
            say(check(buf, msgspec.json.decode(arg, type=CheckSpec)))
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
