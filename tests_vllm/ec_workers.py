"""Worker-role `KVHandoffECConnector`s in processes of their own, for the EC tier's TP
tests (R-T01, R-T06, R-E03): vLLM's factory builds each rank's connector from a config
that names its TP rank; each step the scheduler's `ECConnectorMeta` comes down as msgpack
bytes and the rank's `ECWorkerMeta` goes back up as bytes. The encoder cache is the
process's own dict of tensors (DRAM)."""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

HIDDEN = 64
ROWS = 5
MODULE = "kvhandoff.integrations.vllm"
EXTRA = {
    "ec_cpu_bytes": 64 * HIDDEN * 4,
    "ec_enable_nixl": True,
    "consumer_ack_timeout_s": 5.0,
    "nixl_read_timeout_s": 10.0,
    "pin_lease_s": 10.0,
}
CALL_TIMEOUT_S = 240.0


def stub_config(
    role: str, engine_id: str, tp: int = 1, rank: int = 0, model: str = "kvhandoff-test/tiny-mm"
) -> Any:
    """The fields of a `VllmConfig` the EC connector reads, vLLM's `ECTransferConfig`
    inside (a config-only text model is refused as an `ec_producer` by vLLM's checks)."""
    import torch
    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="KVHandoffECConnector",
        ec_connector_module_path=MODULE,
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config=dict(EXTRA),
        engine_id=engine_id,
    )
    ec.mm_encoder_output_widths = {"image": HIDDEN}
    model_config = SimpleNamespace(
        dtype=torch.float32, model=model, get_inputs_embeds_size=lambda: HIDDEN
    )
    parallel = SimpleNamespace(
        data_parallel_index=0,
        tensor_parallel_size=tp,
        prefill_context_parallel_size=1,
        rank=rank,
    )
    return SimpleNamespace(
        ec_transfer_config=ec, model_config=model_config, parallel_config=parallel
    )


def _main(conn: Connection, role: str, engine_id: str, tp: int, rank: int) -> None:
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import msgspec
    import torch
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from kvhandoff.integrations.vllm import KVHandoffECConnectorMetadata
    from kvhandoff.machines.ec.meta import ECConnectorMeta

    worker = ECConnectorFactory.create_connector(
        stub_config(role, engine_id, tp, rank), ECConnectorRole.WORKER
    )
    cache: dict[str, torch.Tensor] = {}
    conn.send(("ready", worker._ranks))
    while True:
        cmd, *args = conn.recv()
        if cmd == "step":
            meta = msgspec.msgpack.decode(args[0], type=ECConnectorMeta)
            worker.bind_connector_metadata(KVHandoffECConnectorMetadata(meta))
            worker.start_load_caches(cache)
            for mm_hash, raw in args[1].items():  # the encoder's output, then the save
                cache[mm_hash] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                cache[mm_hash] = cache[mm_hash].reshape(ROWS, HIDDEN)
                worker.save_caches(cache, mm_hash)
            out = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            conn.send(None if out is None else msgspec.msgpack.encode(out.meta))
        elif cmd == "forget":  # the engine evicted the entry from its encoder cache
            cache.pop(args[0], None)
            conn.send(None)
        elif cmd == "read":
            tensor = cache.get(args[0])
            conn.send(None if tensor is None else tensor.contiguous().numpy().tobytes())
        elif cmd == "stop":
            worker.shutdown()
            conn.send("stopped")
            return


class ECWorkerProc:
    """The test's end of one EC worker rank's process."""

    def __init__(self, role: str, engine_id: str, tp: int, rank: int) -> None:
        from stock_vllm_common import worker_context

        context = worker_context()
        self.conn, child = context.Pipe()
        self.proc = context.Process(
            target=_main, args=(child, role, engine_id, tp, rank), daemon=True
        )
        self.proc.start()
        child.close()
        self.rank = rank

    def _recv(self) -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"EC worker rank {self.rank} did not answer")
        return self.conn.recv()

    def ready(self) -> tuple[int, int]:
        tag, ranks = self._recv()
        assert tag == "ready"
        return tuple(ranks)  # type: ignore[return-value]

    def call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, *args))
        return self._recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError, TimeoutError):
            if self.proc.is_alive():
                self.call("stop")
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
