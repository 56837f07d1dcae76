"""A control-plane ROUTER in its own process: `python control_server.py IVL_MS TIMEOUT_MS TTL_MS`.

Prints `@@ PORT <port>`, then echoes every request back with a `re:` prefix until stdin
closes. The tests SIGSTOP it to play a peer that is alive at the TCP level but silent,
which only ZMQ heartbeats can detect.
"""

from __future__ import annotations

import selectors
import sys

from kvhandoff.adapters.zmq.control import ControlServer, Heartbeat


def main() -> None:
    ivl, timeout, ttl = map(int, sys.argv[1:4])
    server = ControlServer("127.0.0.1", 0, heartbeat=Heartbeat(ivl, timeout, ttl))
    sys.stdout.write(f"@@ PORT {server.port}\n")
    sys.stdout.flush()
    stdin = selectors.DefaultSelector()
    stdin.register(sys.stdin, selectors.EVENT_READ)
    while True:
        if stdin.select(0) and not sys.stdin.readline():
            break
        server.wait_readable(50)
        for peer, payload in server.poll_requests():
            server.reply(peer, b"re:" + payload)
    server.close()


if __name__ == "__main__":
    main()
