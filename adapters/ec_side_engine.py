"""The scheduler-side calls of vLLM 0.33's `ECConnectorBase`, offered by `ECSide`.

The sans-IO `ECScheduler` takes `now` on every call; an engine calls
`ensure_cache_available(request, num_computed_tokens)`,
`update_state_after_alloc(request, index)`, `take_unavailable_requests()`,
`build_connector_meta(scheduler_output)`, `update_connector_output(connector_output)`,
`request_finished(request)` and `has_cache_item(identifier)` with no clock. This mixin
reads the side's injected clock once per call and passes `now` down (R-T01: the
scheduler's per-step metadata goes to the worker ranks, their outputs come back here).
After `close()` nothing is cached and every other call raises `LocalProtocolError`.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.machines.ec.meta import ECConnectorMeta, ECRequest, ECWorkerMeta
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["EngineCalls"]


class EngineCalls:
    """Mixin of `ECSide`: vLLM's scheduler-side call names and signatures."""

    scheduler: ECScheduler
    clock: Clock
    _closed: bool

    def _opened(self, call: str) -> float:
        if self._closed:
            raise LocalProtocolError(f"ECSide.{call}: the side was closed")
        return self.clock()

    def has_cache_item(self, identifier: str) -> bool:
        """True when `identifier` (an `mm_hash`) can be loaded from the tier; never after
        `close()`."""
        return not self._closed and self.scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: ECRequest, num_computed_tokens: int) -> bool:
        """False defers `request` (a read or save in flight) or means it failed (then
        `take_unavailable_requests` names it, B-05)."""
        now = self._opened("ensure_cache_available")
        return self.scheduler.ensure_cache_available(request, num_computed_tokens, now)

    def update_state_after_alloc(self, request: ECRequest, index: int) -> None:
        now = self._opened("update_state_after_alloc")
        self.scheduler.update_state_after_alloc(request, index, now)

    def update_state_after_free(self, request: ECRequest, index: int) -> None:
        """The engine released an encoder-cache entry: nothing to do (entries are unpinned
        when every rank reported its load, R-T06)."""
        self._opened("update_state_after_free")

    def take_unavailable_requests(self) -> set[str]:
        self._opened("take_unavailable_requests")
        return self.scheduler.take_unavailable_requests()

    def build_connector_meta(self, scheduler_output: object = None) -> ECConnectorMeta:
        """This step's plan for every worker rank (the same record for each)."""
        now = self._opened("build_connector_meta")
        self._poll(now)
        return self.scheduler.build_connector_meta(now)

    def update_connector_output(self, connector_output: object) -> None:
        """The ranks' aggregated `ECWorkerMeta` (or vLLM's `ECConnectorOutput` holding it
        as `ec_connector_worker_meta`); None when no rank reported."""
        now = self._opened("update_connector_output")
        output = connector_output
        if output is not None and not isinstance(output, ECWorkerMeta):
            output = getattr(output, "ec_connector_worker_meta", None)
        self.scheduler.update_connector_output(output, now)  # validated whole there (R-T02)

    def request_finished(self, request: ECRequest) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's answer: (False: nothing waits on the request's blocks, its
        `ec_transfer_params` on a producer, else None), R-E06."""
        now = self._opened("request_finished")
        params = self.scheduler.request_finished(request, now)
        return False, (params or None)

    def has_pending_push_work(self) -> bool:
        """vLLM's name for "keep stepping": true while a save or a load is unconfirmed, a
        read lives, or this is a P2P producer (`ECScheduler.has_pending_work`)."""
        return not self._closed and self.scheduler.has_pending_work()

    def _poll(self, now: float) -> int:
        raise NotImplementedError
