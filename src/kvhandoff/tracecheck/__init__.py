"""Transition traces, read back: `kvhandoff check-trace` and `kvhandoff diagrams --journey`.

`read.py` loads and merges the JSON lines of several processes (format in
`docs/trace-format.md`, written by `kvhandoff.adapters.trace`); `check.py` replays them
against the declarations; `relations.py` states what P and D (producer and consumer) must
agree on; `journey.py` draws one request across the processes.
"""
