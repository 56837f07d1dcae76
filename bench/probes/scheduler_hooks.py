"""`python -m kvhandoff.bench.probes.scheduler_hooks`: what `PushScheduler`, the scheduler
half the vLLM connector hands vLLM, costs per request in each of its engine hooks (a probe:
no vLLM, no rank, one process).

Per rep, `requests` requests go through one engine step on each side, as the workers would
report them at once:

- D: `update_state_after_alloc` for each (`alloc`), `build_connector_meta` (`meta`), and
  `update_connector_output` with one rank's `finished_recving` naming all of them (`out`);
- P: `request_finished` for each (`finish`), `build_connector_meta`, and
  `update_connector_output` with the rank's `finished_sending`.

Prints one JSON line: the median over the reps of each hook's µs per request, by side.
`kvhandoff bench vllm` measures the same hooks inside vLLM's scheduler, against vLLM's own
connector; this probe isolates kvhandoff's share for A/B runs between trees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvhandoff.machines.push.meta import PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg


def _decode(requests: int, reps: int) -> dict[str, float]:
    sched = PushScheduler("decode", LocalEngine("probe-decode", "127.0.0.1", 5700))
    prefill = PrefillCoordinates("probe-prefill", "127.0.0.1", 5600, 1)
    phases: dict[str, list[float]] = {"alloc": [], "meta": [], "out": []}
    now = 1.0
    for rep in range(reps):
        ids = [f"cmpl-{rep}-{q}-0" for q in range(requests)]
        legs = [decode_leg({"request_id": i}, prefill)["kv_transfer_params"] for i in ids]
        t0 = time.perf_counter()
        for request_id, leg in zip(ids, legs, strict=True):
            sched.update_state_after_alloc(request_id, [1, 2], leg, now)
        t1 = time.perf_counter()
        meta = sched.build_connector_meta(now)
        t2 = time.perf_counter()
        report = PushWorkerOutput(rank=0, step=meta.step, finished_recving=tuple(ids))
        out = sched.update_connector_output([report], now)
        t3 = time.perf_counter()
        if len(out.finished_recving) != requests:
            raise RuntimeError(f"{len(out.finished_recving)} of {requests} received")
        for name, spent in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[name].append(spent * 1e6 / requests)
        now += 0.001
    return {name: round(statistics.median(v), 3) for name, v in phases.items()}


def _prefill(requests: int, reps: int) -> dict[str, float]:
    sched = PushScheduler("prefill", LocalEngine("probe-prefill", "127.0.0.1", 5600))
    phases: dict[str, list[float]] = {"finish": [], "meta": [], "out": []}
    now = 1.0
    for rep in range(reps):
        ids = [f"cmpl-{rep}-{q}-0" for q in range(requests)]
        t0 = time.perf_counter()
        for request_id in ids:
            sched.request_finished(request_id, [1, 2], {"do_remote_decode": True}, now)
        t1 = time.perf_counter()
        meta = sched.build_connector_meta(now)
        t2 = time.perf_counter()
        report = PushWorkerOutput(rank=0, step=meta.step, finished_sending=tuple(ids))
        out = sched.update_connector_output([report], now)
        t3 = time.perf_counter()
        if len(out.finished_sending) != requests:
            raise RuntimeError(f"{len(out.finished_sending)} of {requests} sent")
        for name, spent in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[name].append(spent * 1e6 / requests)
        now += 0.001
    return {name: round(statistics.median(v), 3) for name, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="requests per engine step")
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    result = {
        "decode": _decode(args.requests, args.reps),
        "prefill": _prefill(args.requests, args.reps),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
