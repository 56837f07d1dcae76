"""Logical-to-physical block expansion and D's capacity check (R-P06).

D registers *logical* block ids; P expands them at WRITE time with D's
``physical_blocks_per_logical`` ratio learned in the handshake, as pull mode does:
logical id ``L`` with ratio ``r`` covers physical ids ``r*L .. r*L + r - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["check_within_capacity", "expand_to_physical"]


def expand_to_physical(logical_ids: Sequence[int], physical_per_logical: int) -> list[int]:
    """Expand logical block ids to physical ones, keeping their order.

    The ratio and the ids come from already-decoded (validated) peer data, so a ratio
    below 1 or a negative id here is a local bug: `LocalProtocolError`.
    """
    if physical_per_logical < 1:
        raise LocalProtocolError(f"physical_per_logical must be >= 1, got {physical_per_logical}")
    if logical_ids and min(logical_ids) < 0:
        raise LocalProtocolError(f"logical block ids must be >= 0, got {min(logical_ids)}")
    if physical_per_logical == 1:
        return list(logical_ids)
    r = physical_per_logical
    return [r * block + k for block in logical_ids for k in range(r)]


def check_within_capacity(
    request_id: str,
    physical_ids: Sequence[int],
    capacity: int,
    *,
    engine_id: str | None = None,
    peer: str | None = None,
) -> None:
    """Fail when a registration names a block beyond D's registered capacity.

    ``capacity`` is the number of physical blocks D registered for the region(s) being
    written (the smallest ``num_blocks`` among them). Raises `RemoteProtocolError`
    naming the request, the offending block and the capacity.
    """
    if not physical_ids:
        return
    owner = f" of engine {engine_id!r}" if engine_id is not None else ""
    lowest = min(physical_ids)
    if lowest < 0:
        raise RemoteProtocolError(
            f"request {request_id!r} names negative physical block {lowest}", peer=peer
        )
    highest = max(physical_ids)
    if highest >= capacity:
        raise RemoteProtocolError(
            f"request {request_id!r} names physical block {highest}, beyond the registered"
            f" capacity{owner} of {capacity} blocks",
            peer=peer,
        )
