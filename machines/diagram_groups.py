"""Reader's labels for groups of states, per machine, kept beside the declarations.

`kvhandoff diagrams` draws each group as a composite state (`machines/runtime/diagrams.py`).
A declaration's own `groups=` wins; these entries serve the machines that do not declare
any yet (they belong in the declarations: move an entry there, where it is validated
strictly, and delete it here). Each entry selects states by a tag, by the config key of
the timeout they share, or by name; as the declarations change under them, an entry
takes only the states no earlier entry took and one that selects nothing is skipped.
Machines with no entry here are drawn with the states that share a timeout as a group.

`MAIN_PATH_TO` names the final state a machine's main path (drawn in bold, emitted first)
leads to, where the longest path from the initial state would pick a failure.
"""

from __future__ import annotations

from typing import Any

GROUPS: dict[str, list[dict[str, Any]]] = {
    "push.p_lease": [
        {"label": "lease running (D's heartbeats extend it)", "timeout": "kv_lease_duration"},
        {"label": "lease suspended: WRITE in flight", "tag": "pollable"},
    ],
    "push.d_registration": [
        {"label": "waiting for P's KV (watchdog armed)", "timeout": "push_registration_timeout"},
        {"label": "PUSH_REG not sent yet", "tag": "reg_unsent"},
    ],
    "pull.d_read": [
        {"label": "waiting to READ (watchdog armed)", "timeout": "push_registration_timeout"},
        {"label": "READ in flight", "tag": "pollable"},
    ],
    "ec.consumer_read": [
        {"label": "READ posted: its destination stays reserved", "tag": "read_posted"},
        {"label": "asking the producer", "tag": "in_flight"},
    ],
    "ec.producer_grant": [{"label": "refused: a NACK was sent", "tag": "refused"}],
    "ec.cache_entry": [{"label": "bytes in the tier", "tag": "loadable"}],
}

MAIN_PATH_TO: dict[str, str] = {
    "push.p_lease": "sent",
    "push.d_registration": "received",
    "push.d_request": "received",
    "pull.d_read": "received",
    "ec.consumer_read": "done",
    "ec.producer_grant": "released",
}
