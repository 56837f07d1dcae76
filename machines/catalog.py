"""Every declared lifecycle of kvhandoff, in the order the docs present them.

`kvhandoff diagrams` renders each entry into `specs/`; the model-based tests walk it to
make sure no declared machine goes untested.
"""

from __future__ import annotations

from kvhandoff.machines.declaration import Declaration
from kvhandoff.machines.push_d_registration import D_REGISTRATION
from kvhandoff.machines.push_handshake import HANDSHAKE
from kvhandoff.machines.push_p_lease import P_LEASE

PUSH_DECLARATIONS: tuple[Declaration, ...] = (D_REGISTRATION, P_LEASE, HANDSHAKE)

DECLARATIONS: tuple[Declaration, ...] = PUSH_DECLARATIONS
