"""The scheduler and two worker ranks of one consumer in separate processes, over real NIXL
and ZMQ (R-T01, R-T02, R-T06).

A `kvhandoff run producer` child encodes and publishes; the test process is the
consumer's scheduler (`ECSide` with two ranks, TP=2 or PCP=2, and no local worker: it owns
the region, the NIXL agent that READs into it and the ZMQ DEALER); each rank is an
`ECWorkerSide` in its own process (`helpers/ec_rank.py`), attached to the region. The
scheduler's per-step `ECConnectorMeta` goes down and each rank's `ECWorkerMeta` comes up
as msgpack bytes, as an engine would carry them. Every byte each rank loaded is checked.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from test_ec_integration import (
    CONSUMER_TIMEOUTS,
    NUM_BLOCKS,
    encode,
    poll_until,
    start_producer,
    stop,
    unique,
)

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_requests import BLOCK_BYTES, COMPAT, HIDDEN
from kvhandoff.demo.launcher import RoleProcess
from kvhandoff.machines.ec.meta import ECConnectorMeta, ECRequestInfo, ECWorkerMeta
from kvhandoff.machines.ec.transfer import EC_TRANSFER
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.errors import LocalProtocolError

pytestmark = pytest.mark.integration

HELPERS = Path(__file__).resolve().parent / "helpers"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvh_helpers_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child_mod = _load("child")


@pytest.fixture(scope="module")
def producer() -> Iterator[RoleProcess]:
    proc = start_producer()
    yield proc
    if proc.proc.poll() is None:
        stop(proc)


def consumer_config() -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role="ec_consumer",
        ec_connector_extra_config={
            "ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES,
            "ec_enable_nixl": True,
            **CONSUMER_TIMEOUTS,
        },
        engine_id=unique("consumer-tp2"),
    )


class Ranks:
    """The worker ranks' processes, stepped with the scheduler's metadata."""

    def __init__(
        self, config: ECTransferConfig, region_name: str, tmp: Path, tp_size: int, pcp_size: int
    ) -> None:
        spec = json.dumps(
            {"config": config.to_dict(), "ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES},
            separators=(",", ":"),
        )
        self.children: list[Any] = []
        for rank in range(tp_size * pcp_size):
            tp_rank, pcp_rank = rank % tp_size, rank // tp_size
            err = tmp / f"rank{rank}-{uuid.uuid4().hex[:6]}.err"
            child = child_mod.Child(
                "ec_rank.py", spec, region_name, str(tp_rank), str(pcp_rank), stderr_path=err
            )
            self.children.append(child)
            assert child.expect(120.0) == "READY", child.stderr()

    def step(self, meta: ECConnectorMeta) -> list[ECWorkerMeta | None]:
        """Each rank runs the step's plan; its own report, in rank order."""
        line = "STEP " + msgspec.msgpack.encode(meta).hex()
        for child in self.children:
            child.send(line)
        outputs: list[ECWorkerMeta | None] = []
        for child in self.children:
            answer = child.expect(60.0)
            raw = None if answer == "-" else bytes.fromhex(answer)
            outputs.append(None if raw is None else msgspec.msgpack.decode(raw, type=ECWorkerMeta))
        return outputs

    def check(self, mm_hash: str, tokens: int) -> list[str]:
        return [child.request(f"CHECK {mm_hash} {tokens}", 60.0) for child in self.children]

    def close(self) -> None:
        for child in self.children:
            child.close()


def aggregate(outputs: list[ECWorkerMeta | None]) -> ECWorkerMeta | None:
    present = [out for out in outputs if out is not None]
    if not present:
        return None
    total = present[0]
    for out in present[1:]:
        total = total.aggregate(out)
    return total


@pytest.mark.parametrize(("tp_size", "pcp_size"), [(2, 1), (1, 2)])
def test_R_T01_R_T02_R_T06_scheduler_and_two_ranks_in_processes_load_every_byte(
    producer: RoleProcess, tmp_path: Path, tp_size: int, pcp_size: int
) -> None:
    config = consumer_config()
    layout = ECLayout(HIDDEN, 2, NUM_BLOCKS * BLOCK_BYTES)
    sizes = {"tp_size": tp_size, "pcp_size": pcp_size}
    with ECSide(config, layout, compat_hash=COMPAT, local_worker=False, **sizes) as side:
        assert side.region is not None
        region_path = side.region_path
        ranks = Ranks(config, side.region.name, tmp_path, tp_size, pcp_size)
        try:
            mm_hash, tokens = f"img-tp{tp_size}-pcp{pcp_size}", 9
            params = encode(producer, mm_hash, tokens)
            info = ECRequestInfo(
                f"req-{mm_hash}", (mm_hash,), ec_transfer_params=params, mm_tokens=(tokens,)
            )

            def available() -> bool:
                side.update_connector_output(aggregate(ranks.step(side.build_connector_meta())))
                return side.ensure_cache_available(info, 0)

            poll_until(available, 60, "the READ from the producer into the region")
            assert side.has_cache_item(mm_hash)
            assert side.take_unavailable_requests() == set()
            side.update_state_after_alloc(info, 0)
            meta = side.build_connector_meta()
            assert [item.mm_hash for item in meta.loads] == [mm_hash] and not meta.saves
            transfer_id = meta.loads[0].transfer_id
            first, second = ranks.step(meta)
            assert first is not None and second is not None
            assert [r.loaded for r in first.reports + second.reports] == [(transfer_id,)] * 2
            bus, cache = side.scheduler.bus, side.scheduler.cache
            # Rank 0's report alone lands nothing: the entry stays pinned (R-T02).
            side.update_connector_output(first)
            assert bus.has_tag(EC_TRANSFER, transfer_id, "in_flight")
            assert not cache.has(mm_hash, "evictable")
            # A duplicate of rank 0's report is counted and ignored, never raised.
            side.update_connector_output(first)
            assert side.scheduler.report_counts["duplicate"] == 1
            side.update_connector_output(second)
            assert not bus.has_tag(EC_TRANSFER, transfer_id, "in_flight")  # landed
            assert cache.has(mm_hash, "evictable")
            # A late copy of rank 1's report is stale: counted, ignored.
            side.update_connector_output(second)
            assert side.scheduler.report_counts["stale"] == 1
            assert ranks.check(mm_hash, tokens) == ["MATCH", "MATCH"]
            assert side.request_finished(info) == (False, None)
            assert side.reads_in_flight() == 0
        finally:
            ranks.close()
    # R-E03: the scheduler's process owned the region; closing the side unlinks it.
    assert not Path(region_path).exists()
    assert not side.has_cache_item(mm_hash)
    with pytest.raises(LocalProtocolError, match="closed"):
        side.ensure_cache_available(info, 0)
