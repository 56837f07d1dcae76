"""What kvhandoff's vLLM connectors count and time, without importing vLLM (B-14, S-06).

One interval's observations are a plain dict (`StatsData`) that crosses vLLM's processes
as is: worker ranks and the scheduler each fill one, vLLM adds them up (`merge`) and hands
the sum to the Prometheus metrics (`metrics.py`). A value is a count (`int`, summed), a
count per label (`dict[str, int]`, summed per label) or a list of observations (`list`,
concatenated; a histogram's samples).

The keys (every one optional in a payload):

- each cause of `FAILURE_CAUSES`, `stale_reports`: counts (B-14);
- `transfers`: requests by outcome, `sent` (P: every rank reported the blocks sent; a
  lease that expired ends this way too), `received`, `failed` (a rank failed it; vLLM may
  have ended the request for it), `released` (D: vLLM ended the request before its KV
  arrived, and no rank holds it any more);
- `rejected_inputs`: peer inputs refused, by cause (S-06; `cause` keeps label values few);
- `lease_expiries` (P's ranks), `watchdog_expiries` (D's scheduler): counts;
- `bytes_transferred`: KV bytes of each finished request's blocks in this engine;
- `finish_to_receive_s`: P, from the prefill's end to every rank's report that the blocks
  reached D (push: the WRITE landed; pull: D's READ notif came back);
- `receive_wait_s`: D, from the decode leg's block allocation to every rank's receive
  (push: D registers while P still prefills, so P's prefill is inside it).

Each transfer is timed by its own machine in kvhandoff's `PushScheduler` (the one copy of
request state, issue 26): the machine keeps the `now` it was created at and reports the
seconds at the step it ends (`transfers`); the connector keeps no request of its own.

The encoder-cache connector's payload (`ec_*` keys) has the same shape.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.adapters.ec_side import ECSide
    from kvhandoff.adapters.push_rank import PushRank
    from kvhandoff.adapters.zmq.side_channel import SideChannelServer
    from kvhandoff.machines.push.meta import PushConnectorOutput
    from kvhandoff.machines.push.scheduler import PushScheduler

StatsData = dict[str, Any]

log = logging.getLogger("kvhandoff.integrations.vllm.stats")

HISTOGRAMS = ("bytes_transferred", "finish_to_receive_s", "receive_wait_s")
OUTCOMES = ("sent", "received", "failed", "released")


def merge(into: StatsData, other: Mapping[str, Any]) -> StatsData:
    """Add `other`'s observations to `into` (in place) and return it."""
    for name, value in other.items():
        mine = into.get(name)
        if isinstance(value, list | tuple):
            into[name] = [*(mine if isinstance(mine, list) else ()), *value]
        elif isinstance(value, int | float):  # before `Mapping`: a builtin check is cheap
            into[name] = (int(mine) if isinstance(mine, int | float) else 0) + int(value)
        elif isinstance(value, Mapping):
            counts = dict(mine) if isinstance(mine, Mapping) else {}
            for label, count in value.items():
                counts[str(label)] = int(counts.get(str(label), 0)) + int(count)
            into[name] = counts
        else:
            into[name] = (int(mine) if isinstance(mine, int | float) else 0) + int(value)
    return into


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One interval in a line of numbers: counts as they are, a count per label as
    `name.label`, a list as its count and mean (`name.count`, `name.avg`)."""
    out: dict[str, int | float] = {}
    for name, value in sorted(data.items()):
        if isinstance(value, list | tuple):
            out[f"{name}.count"] = len(value)
            if value:
                out[f"{name}.avg"] = round(sum(float(v) for v in value) / len(value), 6)
        elif isinstance(value, Mapping):
            for label, count in sorted(value.items()):
                out[f"{name}.{label}"] = int(count)
        else:
            out[name] = int(value)
    return out


def is_empty(data: Mapping[str, Any]) -> bool:
    """True when nothing was observed: every count zero, every list empty."""
    for value in data.values():
        if isinstance(value, list | tuple | int | float):  # builtin checks first: cheap
            if value:
                return False
        elif isinstance(value, Mapping) and any(value.values()):
            return False
    return True


def delta(totals: Mapping[str, Any], seen: dict[str, Any]) -> StatsData:
    """What moved in running totals since `seen` (updated in place): every count, zero
    included; of a count per label only the labels that moved."""
    out: StatsData = {}
    for name, value in totals.items():
        before = seen.get(name)
        if not isinstance(value, int | float) and isinstance(value, Mapping):
            old = before if isinstance(before, Mapping) else {}
            moved = {k: int(n) - int(old.get(k, 0)) for k, n in value.items()}
            moved = {k: n for k, n in moved.items() if n}
            if moved:
                out[name] = moved
            seen[name] = dict(value)
        else:
            out[name] = int(value) - (int(before) if isinstance(before, int | float) else 0)
            seen[name] = int(value)
    return out


def reasons(source: Callable[[], dict[str, int]]) -> dict[str, int]:
    """A `RejectionLog.reasons()` another thread may be adding to: a read that meets a
    resize is tried again, then given up for this interval (the totals catch up)."""
    for _ in range(3):
        try:
            return dict(source())
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    log.debug("rejection reasons changed during every read; skipped this interval")
    return {}


_SPECIFIC = re.compile(r"'[^']*'?|\"[^\"]*\"?|\[[^\]]*\]?|\([^)]*\)?|<[^>]*>?|\b[0-9a-f]{6,}\b|\d+")


def cause(reason: str) -> str:
    """A rejection reason as a metric label: what kind of input was refused, without the
    request ids, peer names, numbers and quoted values that make each message unique
    (a Prometheus label's values must stay few)."""
    text = " ".join(_SPECIFIC.sub(" ", reason).split())
    return text.rstrip(" :;,.")[:60] or "other"


def add_reasons(into: dict[str, int], more: Mapping[str, int]) -> None:
    """Add rejection counts by reason to `into`, by cause (`cause`)."""
    for reason, count in more.items():
        label = cause(reason)
        into[label] = into.get(label, 0) + int(count)


def transfers(result: PushConnectorOutput, block_bytes: int) -> StatsData:
    """One step's finished requests as observations, from what the scheduler's machines
    reported (`PushScheduler.update_connector_output`): each by outcome (a receive the
    engine ended after a rank failed it is `failed`, not `released`), each sent or
    received one with its bytes (its blocks times `block_bytes`) and its time, as its
    machine measured it from the `now` it began at (`PushConnectorOutput.timings`)."""
    out: StatsData = {}
    outcomes = {
        "sent": len(result.finished_sending),
        "received": len(result.finished_recving),
        "failed": len(result.failed_recving) + len(result.failed_released),
        "released": len(result.released) - len(result.failed_released),
    }
    if any(outcomes.values()):
        out["transfers"] = {name: n for name, n in outcomes.items() if n}
    timings = result.timings
    sizes: list[int] = []
    for histogram, ids in (
        ("finish_to_receive_s", result.finished_sending),
        ("receive_wait_s", result.finished_recving),
    ):
        seconds: list[float] = []
        for request_id in sorted(ids):
            timing = timings.get(request_id)
            if timing is not None:
                seconds.append(timing.seconds)
                sizes.append(timing.num_blocks * block_bytes)
        if seconds:
            out[histogram] = seconds
    if sizes:
        out["bytes_transferred"] = sizes
    return out


# -- collectors: running totals of kvhandoff's objects, as one interval's payload -----------


def scheduler_totals(scheduler: PushScheduler, side_channel: SideChannelServer | None) -> StatsData:
    """A KV scheduler's running totals: failures by cause (what the ranks reported,
    summed), the stale rank reports it ignored (late, repeated, or of a request that
    ended), watchdog expiries, and the side channel's refused requests by cause."""
    totals: StatsData = dict(scheduler.stats())
    totals["watchdog_expiries"] = int(scheduler.bus.metrics.get("push.d.watchdog_expired", 0))
    if side_channel is not None:
        rejected: dict[str, int] = {}
        add_reasons(rejected, reasons(side_channel.rejections.reasons))
        totals["rejected_inputs"] = rejected
    return totals


def scheduler_fingerprint(
    scheduler: PushScheduler, side_channel: SideChannelServer | None
) -> tuple[int, ...]:
    """What `scheduler_totals` counts, summed per source: every total only grows, so an
    equal fingerprint means nothing moved and the interval is empty (vLLM asks every step;
    this costs a few additions where the totals cost dicts and a regex per cause). Read it
    before the totals: a rejection counted meanwhile then moves the next one."""
    rejected = 0 if side_channel is None else side_channel.rejections.total
    return (
        sum(scheduler.failures.values()),
        scheduler.stale_reports,
        int(scheduler.bus.metrics.get("push.d.watchdog_expired", 0)),
        rejected,
    )


def rank_fingerprint(rank: PushRank) -> tuple[int, ...]:
    """`rank_totals`' fingerprint, as `scheduler_fingerprint`'s."""
    metrics = rank.bus.metrics
    return (
        int(metrics.get("push.p.lease_expired", 0) + metrics.get("pull.p.lease_expired", 0)),
        rank.worker.rejections.total,
        rank.writer.rejections.total,
    )


def rank_totals(rank: PushRank) -> StatsData:
    """A worker rank's running totals: lease expiries (push and pull leases live on its
    main-thread bus) and refused notifs by cause (its main thread's and its writer's)."""
    metrics = rank.bus.metrics
    expired = metrics.get("push.p.lease_expired", 0) + metrics.get("pull.p.lease_expired", 0)
    rejected: dict[str, int] = {}
    add_reasons(rejected, reasons(rank.worker.rejections.reasons))
    add_reasons(rejected, reasons(rank.writer.rejections.reasons))
    return {"lease_expiries": int(expired), "rejected_inputs": rejected}


def ec_totals(side: ECSide) -> StatsData:
    """An encoder-cache scheduler's running totals: its machines' events by name (grants,
    NACKs, reads, fallbacks), refused control messages by cause, expired grant leases and
    evictions."""
    counters = side.counters()
    rejected: dict[str, int] = {}
    add_reasons(rejected, dict(counters.get("rejected_by_reason", {})))
    events = {
        name.removeprefix("ec."): int(count)
        for name, count in dict(counters.get("metrics", {})).items()
    }
    return {
        "ec_events": events,
        "ec_rejected_inputs": rejected,
        "ec_lease_expiries": events.get("producer.lease_expired", 0),
        "ec_evictions": int(counters.get("evictions", 0)),
    }


def block_bytes(kv_cache_config: Any) -> int:
    """KV bytes of one block of a worker rank, from vLLM's `KVCacheConfig`: each group's
    page size times its layers (0 when the config is absent, as in a bare test)."""
    total = 0
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        page = int(getattr(group.kv_cache_spec, "page_size_bytes", 0) or 0)
        total += page * len(group.layer_names)
    return total
