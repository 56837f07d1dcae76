"""Every declared lifecycle of kvhandoff, in the order the docs present them.

`kvhandoff diagrams` renders each entry into `specs/`; the model-based tests walk it to
make sure no declared machine goes untested.
"""

from __future__ import annotations

from kvhandoff.machines.declaration import Declaration

DECLARATIONS: tuple[Declaration, ...] = ()
