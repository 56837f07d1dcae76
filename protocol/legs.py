"""R-P01, C-01: the two legs a disaggregating proxy sends for one client request.

The prefill leg goes to P with `do_remote_decode=True` and `max_tokens=1`; the decode leg
goes to D with `do_remote_prefill=True` and P's coordinates, which D's registration names
as `remote_*`. Both legs carry the same client request id (the proxy's X-Request-Id), so
P's and D's engine ids differ only by their random suffix (see `request_ids`).

The params use vLLM 0.33's names, so either engine may be a stock vLLM: P's TP and PP
sizes are `tp_size` and `pp_size` (kvhandoff's older `remote_tp_size` / `remote_pp_size`
are still read), and `remote_request_id` is P's own id for the request: D's heartbeats
name it, and a stock vLLM P matches heartbeat ids exactly (a stock vLLM D requires it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.protocol.errors import RemoteProtocolError


@dataclass(frozen=True, slots=True)
class PrefillCoordinates:
    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int = 1
    request_id: str = ""
    """P's own id for the request (vLLM's `remote_request_id`); empty when not known."""


def _coordinates(prefill: PrefillCoordinates) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.port,
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
    }
    if prefill.request_id:
        params["remote_request_id"] = prefill.request_id
    return params


def prefill_leg(request: dict[str, Any]) -> dict[str, Any]:
    """The request P receives: generate one token, keep the KV for a remote decoder."""
    leg = dict(request)
    leg["max_tokens"] = 1
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return leg


def decode_leg(request: dict[str, Any], prefill: PrefillCoordinates) -> dict[str, Any]:
    """The request D receives: its KV arrives from P, whose coordinates it carries."""
    leg = dict(request)
    leg["kv_transfer_params"] = _coordinates(prefill)
    return leg


def push_decode_params(
    prefill: PrefillCoordinates, block_ids: Sequence[int], request_id: str = ""
) -> dict[str, Any]:
    """What P's request_finished returns in push mode (as a stock vLLM P does): the
    decode leg's params, with P's request id and blocks (D does not need the blocks).
    A non-empty `request_id` is P's id for the request in place of `prefill.request_id`
    (so a scheduler builds its own coordinates once)."""
    params = _coordinates(prefill)
    if request_id:
        params["remote_request_id"] = request_id
    params["remote_block_ids"] = [list(block_ids)]  # one list per KV cache group, as vLLM's
    params["transfer_mode"] = "push"
    return params


def _size(params: Mapping[str, Any], name: str, old: str) -> int:
    """A size under vLLM's name or kvhandoff's older one; both present must agree."""
    if name in params and old in params and params[name] != params[old]:
        raise RemoteProtocolError(
            f"decode leg says {name} {params[name]!r} but {old} {params[old]!r}"
        )
    return int(params.get(name, params.get(old, 1)))


COORDINATE_KEYS = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_tp_size",
    "pp_size",
    "remote_pp_size",
)
"""The decode leg's params that make up P's engine coordinates (not the request's id)."""


def prefill_request_id(params: Mapping[str, Any]) -> str:
    """P's own id for the request on a decode leg (`remote_request_id`), checked; empty
    when the leg names none."""
    request_id = str(params.get("remote_request_id") or "")
    if "," in request_id or len(request_id) > 1024:
        raise RemoteProtocolError(
            f"decode leg has an invalid remote_request_id {request_id[:80]!r}"
        )
    return request_id


def prefill_coordinates(params: Mapping[str, Any] | None) -> PrefillCoordinates:
    """P's coordinates from a decode leg's kv_transfer_params (which came over the wire);
    `params` is only read."""
    if not params or params.get("do_remote_prefill") is not True:
        raise RemoteProtocolError("decode leg lacks do_remote_prefill=True")
    try:
        coords = PrefillCoordinates(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            tp_size=_size(params, "tp_size", "remote_tp_size"),
            pp_size=_size(params, "pp_size", "remote_pp_size"),
            request_id=str(params.get("remote_request_id") or ""),
        )
        if "tp_size" not in params and "remote_tp_size" not in params:
            raise KeyError("tp_size")
    except (KeyError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"decode leg has malformed prefill coordinates: {exc}") from None
    if (
        not coords.engine_id
        or not coords.host
        or not 0 < coords.port < 65536
        or not 0 < coords.tp_size <= 1 << 16
        or not 0 < coords.pp_size <= 1 << 16
        or "," in coords.request_id
        or len(coords.request_id) > 1024
    ):
        raise RemoteProtocolError(f"decode leg has invalid prefill coordinates {coords}")
    return coords


@dataclass(frozen=True, slots=True)
class PullSource:
    """Pull mode (B-09): where D reads the KV from — P's coordinates, request and blocks."""

    prefill: PrefillCoordinates
    request_id: str
    block_ids: tuple[int, ...]
    lease_expires_at: float | None = None
    """P's wall-clock time at which its lease may end at the earliest (a kvhandoff P names
    it, `kv_lease_expires_at`; a stock vLLM P does not): a READ done after it, less the
    clocks' skew, may have read blocks P freed, and fails."""


LEASE_EXPIRES_KEY = "kv_lease_expires_at"
"""kvhandoff's pull params key for `PullSource.lease_expires_at` (vLLM ignores it)."""


def pull_params(
    prefill: PrefillCoordinates,
    request_id: str,
    block_ids: list[int],
    lease_expires_at: float | None = None,
) -> dict[str, Any]:
    """What P's request_finished returns in pull mode; the proxy puts it on the decode leg."""
    params = {
        **_coordinates(prefill),
        "remote_request_id": request_id,
        "remote_block_ids": [list(block_ids)],  # one list per KV cache group, as vLLM's
        "transfer_mode": "pull",
    }
    if lease_expires_at is not None:
        params[LEASE_EXPIRES_KEY] = lease_expires_at
    return params


def pull_source(params: Mapping[str, Any] | None, *, max_blocks: int = 65536) -> PullSource:
    """Validate a pull-mode decode leg's params (they came over the wire)."""
    prefill = prefill_coordinates(params)
    assert params is not None
    request_id = params.get("remote_request_id")
    block_ids: Any = params.get("remote_block_ids")
    if (
        isinstance(block_ids, list | tuple)
        and len(block_ids) == 1
        and isinstance(block_ids[0], list | tuple)
    ):  # vLLM's shape: one list per KV cache group
        block_ids = list(block_ids[0])
    if isinstance(block_ids, tuple):
        block_ids = list(block_ids)
    if not isinstance(request_id, str) or not request_id:
        raise RemoteProtocolError("pull decode leg lacks remote_request_id")
    if (
        not isinstance(block_ids, list)
        or len(block_ids) > max_blocks
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids)
    ):
        raise RemoteProtocolError("pull decode leg has malformed remote_block_ids")
    expires: Any = params.get(LEASE_EXPIRES_KEY)
    if expires is not None and (
        not isinstance(expires, int | float)
        or isinstance(expires, bool)
        or not math.isfinite(expires)
    ):
        raise RemoteProtocolError(f"pull decode leg has a malformed {LEASE_EXPIRES_KEY}")
    lease = None if expires is None else float(expires)
    return PullSource(prefill, request_id, tuple(block_ids), lease)
