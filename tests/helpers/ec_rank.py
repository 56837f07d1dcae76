"""One encoder-cache worker rank in its own process:
`python ec_rank.py CONFIG_JSON REGION_NAME TP_RANK PCP_RANK`.

Builds an `ECWorkerSide` on the region the scheduler's process created, prints
`@@ READY`, then answers commands, one line each (msgpack as hex, as an engine would
serialise the records between its processes):
  STEP <hex ECConnectorMeta>  -> `@@ <hex ECWorkerMeta>` (or `@@ -` when nothing to report)
  CHECK <mm_hash> <tokens>    -> `@@ MATCH` / `@@ DIFFER` / `@@ MISSING`
On end of stdin it shuts the worker down and exits.
"""

from __future__ import annotations

import json
import sys

import msgspec
import torch

from kvhandoff.adapters.ec_worker_side import ECWorkerSide
from kvhandoff.demo.ec_requests import DTYPE, HIDDEN, matches
from kvhandoff.machines.ec.meta import ECConnectorMeta
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig


def say(line: str) -> None:
    sys.stdout.write("@@ " + line + "\n")
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.argv[1])
    region_name, tp_rank, pcp_rank = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    config = ECTransferConfig.from_dict(spec["config"])
    layout = ECLayout(HIDDEN, 2, spec["ec_cpu_bytes"])
    side = ECWorkerSide(
        config, layout, region_name=region_name, tp_rank=tp_rank, pcp_rank=pcp_rank, dtype=DTYPE
    )
    encoder_cache: dict[str, torch.Tensor] = {}
    say("READY")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "STEP":
            meta = msgspec.msgpack.decode(bytes.fromhex(args[0]), type=ECConnectorMeta)
            side.bind_connector_metadata(meta)
            side.start_load_caches(encoder_cache)
            out = side.build_connector_worker_meta()
            side.clear_connector_metadata()
            say("-" if out is None else msgspec.msgpack.encode(out).hex())
        elif cmd == "CHECK":
            tensor = encoder_cache.get(args[0])
            if tensor is None:
                say("MISSING")
            else:
                ok = tuple(tensor.shape) == (int(args[1]), HIDDEN) and matches(args[0], tensor)
                say("MATCH" if ok else "DIFFER")
    side.shutdown()


if __name__ == "__main__":
    main()
