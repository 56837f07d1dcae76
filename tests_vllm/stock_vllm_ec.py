"""A stock vLLM 0.33.0 CPU EC connector (P2P mode, `ec_enable_nixl`) in a child process.

`python stock_vllm_ec.py '<json config>'` builds vLLM's own `ECCPUConnector` in the
scheduler role — its `ECCPUScheduler`, `ProducerSession` or `ConsumerSession`, ZMQ
ROUTER/DEALER transports, NIXL data transport over its `/dev/shm` region, all
unmodified — and steps it through the connector's own entry points like an engine
(`build_connector_meta` every couple of milliseconds), taking JSON-line commands on stdin
and answering JSON lines on stdout. Used by `test_interop_ec.py` against kvhandoff's
`ECSide` in the test process.

What is not stock: the `VllmConfig` is a stub carrying exactly the fields the connector
reads (its `ECTransferConfig` is vLLM's real one): a config-only text model is refused as
an `ec_producer`, and vLLM measures encoder widths by running the model. The worker
half's GPU->mmap copy (`ECCPUWorker`, `swap_blocks_batch` on CUDA streams) is replaced by
writing the encoding's bytes into the same shared region and reporting the save with
vLLM's own `ECCPUWorkerMetadata` through `update_connector_output`, as the worker would.

Commands (producer): `alloc {mm_hash, rows, land}` (allocate, save; `land=false` keeps
the save unreported, so reads are answered `NACK_NOT_READY`), `land {mm_hash}`,
`finish {mm_hash}` (-> `ec_transfer_params`), `state`. Consumer: `request {req_id,
mm_hash, rows, params}` (-> later `{"event": "served", "via": "read"|"local", sha256}`),
`state`. Both: `quit`.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sys
import time
from types import SimpleNamespace
from typing import Any

HIDDEN = 64
"""Encoder output width (and the model's embedding size): 256-byte float32 rows."""
DTYPE_NAME = "float32"
MODEL = "kvhandoff-interop/tiny-mm"
BLOCK_BYTES = HIDDEN * 4


def pattern(mm_hash: str, rows: int) -> bytes:
    """The bytes of the encoding `mm_hash`: what a producer saves and a reader checks."""
    seed = hashlib.sha256(mm_hash.encode()).digest()
    size = rows * BLOCK_BYTES
    return (seed * (size // len(seed) + 1))[:size]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_OUT: Any = None
"""The answer channel: the real stdout, while fd 1 goes to stderr (NIXL and UCX print)."""


def _emit(**fields: Any) -> None:
    _OUT.write(json.dumps(fields) + "\n")
    _OUT.flush()


def _config(role: str, engine_id: str, instance_id: str, extra: dict[str, Any]) -> Any:
    import torch
    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config={"ec_enable_nixl": True, **extra},
        engine_id=engine_id,
    )
    ec.mm_encoder_output_widths = {"image": HIDDEN}
    model = SimpleNamespace(dtype=torch.float32, model=MODEL, get_inputs_embeds_size=lambda: HIDDEN)
    parallel = SimpleNamespace(
        data_parallel_index=0,
        tensor_parallel_size=1,
        prefill_context_parallel_size=1,
        distributed_executor_backend=None,
    )
    return SimpleNamespace(
        ec_transfer_config=ec,
        model_config=model,
        parallel_config=parallel,
        instance_id=instance_id,
        use_v2_model_runner=True,
    )


def _request(req_id: str, mm_hash: str, rows: int, params: Any, with_media: bool) -> Any:
    from vllm.multimodal.inputs import PlaceholderRange

    # Media on the request lets vLLM fall back to a local encode (its `_fail_or_fallback`).
    data = {"pixel_values": SimpleNamespace(data=1)} if with_media else None
    feature = SimpleNamespace(
        identifier=mm_hash,
        modality="image",
        mm_position=PlaceholderRange(offset=0, length=rows),
        data=data,
    )
    return SimpleNamespace(request_id=req_id, mm_features=[feature], ec_transfer_params=params)


class Stock:
    def __init__(self, config: dict[str, Any]) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.cpu.connector import ECCPUConnector

        self.role = config["role"]
        vllm_config = _config(
            self.role, config["engine_id"], config["instance_id"], config.get("extra", {})
        )
        self.conn = ECCPUConnector(vllm_config, ECConnectorRole.SCHEDULER)  # type: ignore[arg-type]
        self.sched: Any = self.conn.connector_scheduler  # read for state reports only
        self.region = self.sched._region
        self.unlanded: set[str] = set()
        self.landed: set[str] = set()
        self.requests: dict[str, tuple[Any, str]] = {}
        self.requests_by_mm: dict[str, Any] = {}

    # -- engine step -----------------------------------------------------------------------

    def step(self) -> None:
        from vllm.distributed.ec_transfer.ec_connector.cpu.common import ECCPUWorkerMetadata
        from vllm.v1.outputs import ECConnectorOutput

        if self.role == "ec_consumer":
            self._admit()
        meta = self.conn.build_connector_meta(None)  # type: ignore[arg-type]
        saved = []
        for mm_hash, blocks in meta.saves.items():  # the worker's GPU->mmap copy
            rows = len(blocks)
            source = _as_int8(pattern(mm_hash, rows)).view(rows, -1)
            self.region.blocks.index_copy_(0, _index(blocks), source)
            if mm_hash in self.unlanded:
                continue
            saved.append(mm_hash)
        if saved:
            out = ECConnectorOutput(
                ec_connector_worker_meta=ECCPUWorkerMetadata(completed_saves=saved)
            )
            self.conn.update_connector_output(out)

    def _admit(self) -> None:
        for req_id, (req, mm_hash) in list(self.requests.items()):
            if not self.conn.ensure_cache_available(req, 0):
                continue
            del self.requests[req_id]
            if self.conn.has_cache_item(mm_hash):
                entry = self.sched._cache.get(mm_hash)
                data = bytes(self.region.blocks[list(entry.block_ids)].numpy().tobytes())
                _emit(event="served", req_id=req_id, via="read", sha256=digest(data))
            else:  # the announcement was dropped: the media is encoded locally
                _emit(event="served", req_id=req_id, via="local", sha256="")

    # -- commands --------------------------------------------------------------------------

    def command(self, cmd: dict[str, Any]) -> bool:
        op = cmd["op"]
        if op == "quit":
            return False
        if op == "alloc":
            mm_hash, rows = cmd["mm_hash"], int(cmd["rows"])
            if not cmd.get("land", True):
                self.unlanded.add(mm_hash)
            req = _request(f"p-{mm_hash}", mm_hash, rows, None, with_media=False)
            self.requests_by_mm[mm_hash] = req
            self.conn.update_state_after_alloc(req, 0)
            self.step()
            _emit(event="allocated", mm_hash=mm_hash)
        elif op == "land":
            from vllm.distributed.ec_transfer.ec_connector.cpu.common import (
                ECCPUWorkerMetadata,
            )
            from vllm.v1.outputs import ECConnectorOutput

            self.unlanded.discard(cmd["mm_hash"])
            meta = ECCPUWorkerMetadata(completed_saves=[cmd["mm_hash"]])
            self.conn.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=meta))
            _emit(event="landed", mm_hash=cmd["mm_hash"])
        elif op == "finish":
            _, params = self.conn.request_finished(self.requests_by_mm[cmd["mm_hash"]])
            _emit(event="params", params=params)
        elif op == "request":
            req = _request(
                cmd["req_id"], cmd["mm_hash"], int(cmd["rows"]), cmd["params"], with_media=True
            )
            self.requests[cmd["req_id"]] = (req, cmd["mm_hash"])
        elif op == "state":
            session = self.sched._producer_session
            grants = 0 if session is None else len(session._active_xfers)
            cache = self.sched._cache
            _emit(
                event="state",
                grants=grants,
                held=bool(cache.has_held_entries()),
                in_flight=len(self.sched._in_flight),
                sessions=len(self.sched._sessions),
            )
        return True

    def close(self) -> None:
        self.conn.shutdown()


def _index(blocks: list[int]) -> Any:
    import torch

    return torch.tensor(blocks, dtype=torch.long)


def _as_int8(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.int8)


def main() -> None:
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    config = json.loads(sys.argv[1])
    if config["role"] == "ec_producer":
        os.environ["VLLM_EC_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_EC_SIDE_CHANNEL_PORT"] = str(config["port"])
    stock = Stock(config)
    from vllm.version import __version__

    _emit(
        event="ready",
        compat=stock.sched._compat_hash,
        vllm_version=__version__,
        block_size_bytes=stock.region.block_size_bytes,
        region=stock.region._mmap_path,
    )
    running = True
    try:
        while running:
            readable, _, _ = select.select([sys.stdin], [], [], 0.002)
            if readable:
                line = sys.stdin.readline()
                if not line:
                    break
                running = stock.command(json.loads(line))
            stock.step()
            time.sleep(0)
    finally:
        stock.close()
        _emit(event="closed")


if __name__ == "__main__":
    main()
