"""Encoder-cache P2P interop with vLLM 0.33.0's CPU EC connector (C-03, C-04).

Stock vLLM's `ECCPUScheduler` in P2P mode (its sessions, ZMQ transports and NIXL data
transport, unmodified; `stock_vllm_ec.py`) runs in child processes; kvhandoff's `ECSide`
runs here. Real ZMQ, real NIXL over UCX between DRAM regions in `/dev/shm`. Each
direction moves several encodings with their bytes verified, one answered
`NACK_NOT_READY` and then read, one answered `NACK_MISSING` and encoded locally, and
ends with no grant left pinned on the producer (a stock producer's grants are released
by the READ notif `<session_id>:<mm_hash>` kvhandoff's READ carries; kvhandoff's by the
notif vLLM's READ carries).
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from stock_vllm_ec import BLOCK_BYTES, DTYPE_NAME, HIDDEN, MODEL, digest, pattern

from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_loop import SaveGate
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_status import compatibility_hash

HARNESS = Path(__file__).with_name("stock_vllm_ec.py")
NUM_BLOCKS = 64
START_TIMEOUT_S = 240.0
STEP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stock:
    """One stock vLLM connector child: JSON lines in, JSON lines out (read by a thread)."""

    def __init__(self, role: str, tag: str) -> None:
        self.port = _free_port() if role == "ec_producer" else 0
        config = {
            "role": role,
            "engine_id": f"stock-{tag}",
            "instance_id": f"stock{tag}{self.port}{time.monotonic_ns() % 100000}",
            "port": self.port,
            "extra": {"ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES, "consumer_ack_timeout_s": 2.0},
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(HARNESS), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(
        self, event: str, step: Callable[[], Any] | None = None, timeout: float = STEP_TIMEOUT_S
    ) -> dict[str, Any]:
        """The next `event` line, stepping `step` (the kvhandoff side) while waiting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if step is not None:
                step()
            try:
                msg = self.events.get(timeout=0.002 if step is not None else 0.5)
            except queue.Empty:
                continue
            if msg["event"] == "eof":
                raise AssertionError(f"stock vLLM child exited waiting for {event}")
            if msg["event"] == event:
                return msg
        raise AssertionError(f"timed out waiting for {event} from stock vLLM")

    def state(self, step: Callable[[], Any] | None = None) -> dict[str, Any]:
        self.send(op="state")
        return self.wait("state", step)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def stock() -> Iterator[dict[str, Stock]]:
    """A stock producer and a stock consumer, started together (vLLM imports are slow)."""
    children = {"producer": Stock("ec_producer", "p"), "consumer": Stock("ec_consumer", "c")}
    try:
        for child in children.values():
            child.ready = child.wait("ready", timeout=START_TIMEOUT_S)
        yield children
    finally:
        for child in children.values():
            child.close()


def kv_side(role: str, stock_ready: dict[str, Any], gate: SaveGate | None = None) -> ECSide:
    config = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config={
            "ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES,
            "ec_enable_nixl": True,
            "consumer_ack_timeout_s": 5.0,
        },
        engine_id=f"kvhandoff-{role}-{time.monotonic_ns() % 1000000}",
    )
    layout = ECLayout(HIDDEN, 4, NUM_BLOCKS * BLOCK_BYTES)
    compat = compatibility_hash(stock_ready["vllm_version"], MODEL, DTYPE_NAME, BLOCK_BYTES)
    factory = None
    if gate is not None:
        release = gate.may_land

        def factory(region: torch.Tensor, size: int) -> CpuCopyEngine:
            return CpuCopyEngine(region, size, release=release)

    listen = ("127.0.0.1", 0) if role == "ec_producer" else None
    return ECSide(
        config,
        layout,
        compat_hash=compat,
        listen=listen,
        copy_engine_factory=factory,
        # A busy host may keep the stock child from landing its save for a while: the
        # NACK_NOT_READY retries are bounded by time here, not by their count.
        machine_config={"consumer_max_not_ready_retries": 1e9},
    )


def until(step: Callable[[], bool], what: str, timeout: float = STEP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def as_tensor(mm_hash: str, rows: int) -> torch.Tensor:
    raw = bytearray(pattern(mm_hash, rows))
    return torch.frombuffer(raw, dtype=torch.float32).view(rows, HIDDEN).clone()


# -- baseline ------------------------------------------------------------------------------


def test_C_03_baseline_stock_producer_to_stock_consumer(stock: dict[str, Stock]) -> None:
    producer, consumer = stock["producer"], stock["consumer"]
    assert producer.ready["compat"] == consumer.ready["compat"]
    producer.send(op="alloc", mm_hash="base-a", rows=3)
    producer.wait("allocated")
    producer.send(op="finish", mm_hash="base-a")
    params = producer.wait("params")["params"]
    assert params["base-a"]["shape"] == [3, HIDDEN]
    consumer.send(op="request", req_id="b1", mm_hash="base-a", rows=3, params=params)
    served = consumer.wait("served")
    assert served["via"] == "read" and served["sha256"] == digest(pattern("base-a", 3))


def test_C_03_compat_hash_equals_stock_vllm_for_the_same_inputs(stock: dict[str, Stock]) -> None:
    ready = stock["producer"].ready
    ours = compatibility_hash(ready["vllm_version"], MODEL, DTYPE_NAME, BLOCK_BYTES)
    assert ours == ready["compat"]
    assert compatibility_hash(ready["vllm_version"], MODEL, "torch.float32", 256) == ours


# -- kvhandoff consumer <- stock vLLM producer ----------------------------------------------


def _pull(side: ECSide, info: ECRequestInfo, rows: int, on_step: Callable[[], None]) -> str:
    """Step the kvhandoff consumer until `info` is admitted; load what it read. Returns
    `read` (bytes in `side.encoder_cache`) or the local-encode reason."""
    sched = side.scheduler
    mm_hash = info.mm_hashes[0]

    def admitted() -> bool:
        side.engine_step()
        on_step()
        return sched.ensure_cache_available(info, 0, side.clock())

    until(admitted, f"{mm_hash} admitted")
    if not sched.has_cache_item(mm_hash):
        reason = sched.local_reason(info.request_id, mm_hash)
        sched.request_finished(info, side.clock())
        return reason
    side.encoder_cache[mm_hash] = torch.empty(rows, HIDDEN, dtype=torch.float32)
    sched.update_state_after_alloc(info, 0, side.clock())
    until(lambda: mm_hash in side.engine_step().loaded, f"{mm_hash} loaded")
    sched.request_finished(info, side.clock())
    return "read"


def test_C_03_kvhandoff_consumer_reads_from_stock_vllm_producer(stock: dict[str, Stock]) -> None:
    producer = stock["producer"]
    with kv_side("ec_consumer", producer.ready) as side:
        published: dict[str, dict[str, Any]] = {}
        for mm_hash, rows, land in (("s2k-a", 3, True), ("s2k-b", 5, True), ("s2k-slow", 2, False)):
            producer.send(op="alloc", mm_hash=mm_hash, rows=rows, land=land)
            producer.wait("allocated")
            producer.send(op="finish", mm_hash=mm_hash)
            published.update(producer.wait("params")["params"])
        # Two ordinary reads, bytes verified.
        for mm_hash, rows in (("s2k-a", 3), ("s2k-b", 5)):
            info = ECRequestInfo(
                f"k-{mm_hash}", (mm_hash,), ec_transfer_params=published, mm_tokens=(rows,)
            )
            assert _pull(side, info, rows, lambda: None) == "read"
            got = side.encoder_cache.pop(mm_hash)
            assert bytes(got.numpy().tobytes()) == pattern(mm_hash, rows)
        # Published before its save landed: NACK_NOT_READY, retried, then read (R-E08).
        landed = False

        def land_after_not_ready() -> None:
            nonlocal landed
            if not landed and side.scheduler.bus.metrics.get("ec.consumer.not_ready", 0) >= 1:
                producer.send(op="land", mm_hash="s2k-slow")
                landed = True

        info = ECRequestInfo("k-slow", ("s2k-slow",), ec_transfer_params=published, mm_tokens=(2,))
        assert _pull(side, info, 2, land_after_not_ready) == "read"
        assert landed and side.read_outcomes["s2k-slow"].not_ready >= 1
        got = side.encoder_cache.pop("s2k-slow")
        assert bytes(got.numpy().tobytes()) == pattern("s2k-slow", 2)
        # A publication relayed under an encoding the producer never had: NACK_MISSING,
        # encoded locally (R-E08).
        stale = {"s2k-gone": dict(published["s2k-a"])}
        info = ECRequestInfo("k-gone", ("s2k-gone",), ec_transfer_params=stale, mm_tokens=(3,))
        assert _pull(side, info, 3, lambda: None) == "NACK_MISSING"
        # Every grant was released on the stock producer by the READ's notif.
        until(lambda: producer.state(side.poll)["grants"] == 0, "stock grants released", 30)
        assert producer.state()["held"] is False, "nothing pinned or unsaved on the producer"
        assert side.reads_in_flight() == 0
        assert side.rejected == 0, side.rejections.reasons()


# -- stock vLLM consumer <- kvhandoff producer ----------------------------------------------


def test_C_03_stock_vllm_consumer_reads_from_kvhandoff_producer(stock: dict[str, Stock]) -> None:
    consumer = stock["consumer"]
    gate = SaveGate()
    with kv_side("ec_producer", consumer.ready, gate) as side:
        sched = side.scheduler
        published: dict[str, dict[str, Any]] = {}

        def step() -> None:
            side.poll()
            side.engine_step()

        for mm_hash, rows in (("k2s-a", 3), ("k2s-b", 4), ("k2s-slow", 2)):
            if mm_hash == "k2s-slow":
                gate.held[mm_hash] = time.monotonic() + 600
            side.encoder_cache[mm_hash] = as_tensor(mm_hash, rows)
            info = ECRequestInfo(
                f"p-{mm_hash}",
                (mm_hash,),
                mm_metadata={mm_hash: {"image_grid_thw": [1, rows, 1]}},
                mm_tokens=(rows,),
                mm_modalities=("image",),
            )
            sched.update_state_after_alloc(info, 0, side.clock())
            step()
            published.update(sched.request_finished(info, side.clock()))
        assert published["k2s-a"]["shape"] == [3, HIDDEN]
        assert published["k2s-a"]["modality"] == "image"
        for mm_hash, rows in (("k2s-a", 3), ("k2s-b", 4)):
            consumer.send(
                op="request", req_id=f"s-{mm_hash}", mm_hash=mm_hash, rows=rows, params=published
            )
            served = consumer.wait("served", step)
            assert served["via"] == "read" and served["sha256"] == digest(pattern(mm_hash, rows))
        # NACK_NOT_READY while the save is held, then read once it lands.
        consumer.send(op="request", req_id="s-slow", mm_hash="k2s-slow", rows=2, params=published)

        def release_after_not_ready() -> None:
            step()
            if side.acks_sent["NACK_NOT_READY"] >= 1:
                gate.held.pop("k2s-slow", None)

        served = consumer.wait("served", release_after_not_ready)
        assert side.acks_sent["NACK_NOT_READY"] >= 1
        assert served["via"] == "read" and served["sha256"] == digest(pattern("k2s-slow", 2))
        # NACK_MISSING: the stock consumer drops the announcement and encodes locally.
        stale = {"k2s-gone": dict(published["k2s-a"])}
        consumer.send(op="request", req_id="s-gone", mm_hash="k2s-gone", rows=3, params=stale)
        served = consumer.wait("served", step)
        assert served["via"] == "local" and side.acks_sent["NACK_MISSING"] == 1
        # Each grant ended with the READ notif of the stock consumer, none by the lease.
        producer = sched.producer
        assert producer is not None

        def released() -> bool:
            step()
            return not any(grant.has("leased") for grant in producer.grants())

        until(released, "every grant released by its READ notif", 30)
        after = consumer.state(step)
        assert (after["in_flight"], after["held"]) == (0, False), after
        assert sched.bus.metrics.get("ec.producer.notif", 0) == 3
        assert sched.bus.metrics.get("ec.producer.lease_expired", 0) == 0
        assert side.rejected == 0, side.rejections.reasons()
