"""The encoder-cache connector with a CUDA encoder cache under vLLM's calls (issue 28):
`bash bench/vllm_gpu.sh ec` runs it on the GPU machine, `--device cpu` here.

A producer and a consumer engine, each a scheduler-role and a worker-role
`KVHandoffECConnector` built by vLLM's `ECConnectorFactory` from a stub `VllmConfig` whose
`device_config.device` is `--device` (as `test_vllm_ec_connector.py` builds them: vLLM
measures encoder widths by running the model, which a config-only model cannot), move
`--encodings` encodings one after the other: the producer's worker saves each from a tensor
on the device into its `/dev/shm` region (CUDA: `CudaCopyEngine`'s pooled streams), its
scheduler publishes it, the consumer's scheduler READs it over NIXL into its own region and
its worker loads it into a tensor on the device; every byte compared on the device, every
grant released. Prints one JSON line: what moved, where, and the wall time per encoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--encodings", type=int, default=8)
    opts = parser.parse_args(argv)
    from test_vllm_ec_connector import ROWS, Engine, free_port, move_one_encoding

    os.environ["VLLM_EC_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_EC_SIDE_CHANNEL_PORT"] = str(free_port())

    producer = Engine("ec_producer", device=opts.device)
    consumer = Engine("ec_consumer", device=opts.device)
    times, copy_engines = [], set()
    try:
        for _ in range(opts.encodings):
            start = time.perf_counter()
            move_one_encoding(producer, consumer, opts.device)
            times.append((time.perf_counter() - start) * 1e3)
        for engine in (producer, consumer):
            side = engine.worker.worker_side
            copy_engines.add(type(side.copy_engine).__name__)
    finally:
        consumer.close()
        producer.close()
    result = {
        "device": opts.device,
        "encodings": opts.encodings,
        "rows_each": ROWS,
        "copy_engines": sorted(copy_engines),
        "verified": len(times) == opts.encodings,  # each move asserts every byte
        "ms_per_encoding_p50": round(sorted(times)[len(times) // 2], 3),
        "ms_first": round(times[0], 3),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
