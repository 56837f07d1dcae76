"""`ECCPUConnector`: the engine-facing entry point of the CPU encoder-cache tier.

An engine builds one scheduler half per instance (and DP rank) and one worker half per
TP/PCP rank:

    config = parse_ec_transfer_config('{"ec_connector": "ECCPUConnector", '
                                      '"ec_role": "ec_both", '
                                      '"ec_connector_extra_config": {"ec_cpu_bytes": 1073741824}}')
    layout = ECLayout.from_model(out_hidden_size, num_deepstack_layers, dtype,
                                 config.extra_config().ec_cpu_bytes)
    scheduler = ECCPUConnector.scheduler(config, layout, compat_hash=...)
    worker = ECCPUConnector.worker(config, layout, tp_rank=rank)

The local tier (no `ec_enable_nixl`) imports no nixl, zmq or msgspec; with
`ec_enable_nixl` both halves check that NIXL is importable first and raise
`RuntimeError` naming the fix otherwise (R-E02).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhandoff.machines.ec.nixl_gate import NIXL_MISSING_MESSAGE, require_nixl
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["CONNECTOR_NAME", "NIXL_MISSING_MESSAGE", "ECCPUConnector", "require_nixl"]

CONNECTOR_NAME = "ECCPUConnector"


class ECCPUConnector:
    """Builds the scheduler and worker halves for an `ec_transfer_config`."""

    @staticmethod
    def _check(config: ECTransferConfig) -> None:
        if config.ec_connector != CONNECTOR_NAME:
            raise LocalProtocolError(
                f"ec_connector is {config.ec_connector!r}; this connector is {CONNECTOR_NAME!r}"
            )

    @classmethod
    def scheduler(cls, config: ECTransferConfig, layout: ECLayout, **options: Any) -> ECScheduler:
        """The scheduler half (see `ECScheduler` for `options`)."""
        cls._check(config)
        return ECScheduler(config, layout, **options)

    @classmethod
    def worker(
        cls,
        config: ECTransferConfig,
        layout: ECLayout,
        *,
        tp_rank: int = 0,
        pcp_rank: int = 0,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> ECWorker:
        """The worker half of TP rank `tp_rank`, PCP rank `pcp_rank`."""
        cls._check(config)
        return ECWorker(
            config,
            layout,
            tp_rank=tp_rank,
            pcp_rank=pcp_rank,
            env=env,
            **options,
        )
