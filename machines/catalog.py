"""Every declared lifecycle of kvhandoff, in the order the docs present them.

`kvhandoff diagrams` renders each entry into `specs/`; the model-based tests walk it to
make sure no declared machine goes untested.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.copy_batch import EC_COPY_BATCH
from kvhandoff.machines.ec.notices import EC_LANDED_COPY, EC_REQUEST_FAILURE
from kvhandoff.machines.ec.planned_save import EC_PLANNED_SAVE
from kvhandoff.machines.ec.producer_agent import EC_PRODUCER_AGENT
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT
from kvhandoff.machines.ec.publication_hold import EC_PUBLICATION_HOLD
from kvhandoff.machines.ec.read_handle import EC_READ_HANDLE
from kvhandoff.machines.ec.request import EC_REQUEST
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT
from kvhandoff.machines.ec.transfer import EC_TRANSFER
from kvhandoff.machines.ec.worker_region import EC_WORKER_REGION
from kvhandoff.machines.pull.d_read import D_READ
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.ipc_peer import IPC_PEER
from kvhandoff.machines.push.match import MATCH
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.p_request import P_REQUEST
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE
from kvhandoff.machines.push.write_batch import WRITE_BATCH
from kvhandoff.machines.runtime.declaration import Declaration

PUSH_DECLARATIONS: tuple[Declaration[Any], ...] = (
    D_REQUEST,
    P_REQUEST,
    D_REGISTRATION,
    P_LEASE,
    MATCH,
    REMOTE_ENGINE,
    WRITE_BATCH,
    IPC_PEER,
)

PULL_DECLARATIONS: tuple[Declaration[Any], ...] = (D_READ, PULL_P_LEASE)

EC_DECLARATIONS: tuple[Declaration[Any], ...] = (
    EC_CACHE_ENTRY,
    EC_TRANSFER,
    EC_COPY_BATCH,
    EC_PLANNED_SAVE,
    EC_LANDED_COPY,
    EC_CONSUMER_READ,
    EC_PRODUCER_GRANT,
    EC_PRODUCER_AGENT,
    EC_PUBLICATION_HOLD,
    EC_READ_HANDLE,
    EC_REQUEST,
    EC_REQUEST_FAILURE,
    EC_SETTLEMENT,
    EC_WORKER_REGION,
)

DECLARATIONS: tuple[Declaration[Any], ...] = PUSH_DECLARATIONS + PULL_DECLARATIONS + EC_DECLARATIONS
