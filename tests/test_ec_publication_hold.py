"""R-E06's publication hold over the real roles: a `kvhandoff run producer` child serving
over real NIXL (UCX, DRAM) and ZMQ, and an in-process consumer `ECSide`.

A published encoding is pinned until its first completed READ (or for
`producer_publish_pin_s`), so pressure on the producer's tier evicts other entries
first and a consumer that asks promptly is served; the read ends the hold. Waits are
bounded polling of the engine step (the helpers of `test_ec_integration`).
"""

from __future__ import annotations

import pytest
from test_ec_integration import (
    PRODUCER_TIMEOUTS,
    make_side,
    poll_until,
    pull,
    start_child,
    status,
    stop,
    unique,
)
from test_ec_integration import encode as encode_on

from kvhandoff.demo.ec_requests import matches

pytestmark = pytest.mark.integration


def test_R_E06_B01_a_published_encoding_outlives_pressure_until_it_is_read_over_nixl() -> None:
    # The hold outlasts the body below; at `stop` the role settles, which waits out the
    # unread `press-*` publications' holds, so the summary gets the pin and a margin.
    pin_s = 30.0
    config = {**PRODUCER_TIMEOUTS, "producer_publish_pin_s": pin_s}
    proc = start_child("producer", unique("producer"), "--listen", "127.0.0.1:0", config=config)
    try:
        with make_side("ec_consumer") as consumer:
            params = encode_on(proc, "held-a", 6)
            # 60 more blocks into the 64-block tier: FIFO alone would evict held-a first.
            for i in range(10):
                encode_on(proc, f"press-{i}", 6)
            report = status(proc)
            assert report["entries"].get("held-a") == "pinned", report["entries"]
            assert len(report["entries"]) < 11, "the pressure evicted other entries"
            got = pull(consumer, "held-a", params, 6)
            assert got.via == "p2p", got.reason
            assert got.tensor is not None and matches("held-a", got.tensor)
            poll_until(
                lambda: status(proc)["entries"].get("held-a") == "ready",
                10,
                "the completed READ to end the publication hold",
            )
            metrics = status(proc)["metrics"]
            assert metrics.get("ec.producer.publication_held", 0) >= 1
    finally:
        stop(proc, timeout_s=pin_s + 90.0)
