"""`python -m kvhandoff.bench.probes.gather_launch_cost`: the host time of one CUDA IPC
gather-scatter launch (a GPU probe, one process, no peer: D's regions are local tensors).

The push bench's layer layout (64 regions of `--blocks` blocks of 32 KiB) on one GPU; each
launch carries one request of `--ids` block ids, as `ipc_launch_every=1` would. Times, in
µs of host time per call (median of `--reps` rounds of `--launches` back-to-back launches,
each round then synchronised and its slots given back):

- `launch`: `GatherLaunches.launch` as the transport calls it;
- `memcpy`, `wait_for`, `kernel`, `record`: each of its four CUDA calls alone, with the
  same arguments, so the sum against `launch` shows what its Python costs;
- `query`: one `cudaEventQuery` of a finished launch (what each poll of a launched handle
  costs P's main thread).

Prints one JSON object. Needs CUDA, cuda-python and cuda.core (the `gpu` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvhandoff.adapters.cuda.ipc_gather import GatherKernel, GatherLaunches
from kvhandoff.adapters.cuda.runtime import CudaRuntime

BLOCK_LEN = 32768
REGIONS = 64


def _per_call_us(call: Callable[[], object], calls: int, reps: int) -> float:
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return round(statistics.median(rounds) * 1e6, 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=512, help="blocks per region")
    parser.add_argument("--ids", type=int, default=16, help="block ids per launch")
    parser.add_argument("--launches", type=int, default=32, help="launches per round")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    kernel = GatherKernel.load(0)
    runtime = CudaRuntime.load()
    if isinstance(kernel, str) or isinstance(runtime, str):
        raise SystemExit(f"no gather kernel here: {kernel if isinstance(kernel, str) else runtime}")
    size = args.blocks * BLOCK_LEN
    src = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(REGIONS)]
    dst = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(REGIONS)]
    gl = GatherLaunches(
        kernel, runtime, [t.data_ptr() for t in src], [t.data_ptr() for t in dst], BLOCK_LEN
    )
    ids = list(range(args.ids))
    slots = []

    def launch() -> None:
        slots.append(gl.launch(ids, ids))

    def give_back() -> None:
        torch.cuda.synchronize()
        for slot in slots:
            gl.retire(slot)
        slots.clear()

    for _ in range(3):  # warm-up: the slot pool fills
        for _ in range(args.launches):
            launch()
        give_back()
    rounds = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.launches):
            launch()
        rounds.append((time.perf_counter() - start) / args.launches)
        give_back()
    slot = gl.launch(ids, ids)
    torch.cuda.synchronize()
    n, stream, calls, reps = len(ids), gl.stream, args.launches, args.reps
    result = {
        "device": torch.cuda.get_device_name(0),
        "ids_per_launch": n,
        "regions": REGIONS,
        "launch_us": round(statistics.median(rounds) * 1e6, 2),
        "memcpy_us": _per_call_us(
            lambda: runtime.memcpy(slot.device_ptr, slot.host_ptr, 8 * n, stream), calls, reps
        ),
        "wait_for_us": _per_call_us(
            lambda: runtime.wait_for(stream, 0, gl._wait_event), calls, reps
        ),
        "kernel_us": _per_call_us(
            lambda: gl.kernel.launch(n, REGIONS, stream, gl._params), calls, reps
        ),
        "record_us": _per_call_us(lambda: gl._record(slot.event, stream), calls, reps),
        "query_us": _per_call_us(lambda: gl.query(slot.event), calls, reps),
    }
    gl.retire(slot)
    gl.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
