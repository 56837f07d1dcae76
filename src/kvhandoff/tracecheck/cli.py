"""The command-line front of `check-trace`: load, check, print, exit status."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvhandoff.machines.catalog import DECLARATIONS
from kvhandoff.tracecheck.check import check
from kvhandoff.tracecheck.read import iter_streams, load


def run_check(files: Sequence[str], *, verbose: bool = False) -> int:
    """Print the findings of `files` (0: the traces are a legal run; 1: findings)."""
    trace = load(files)
    report = check(trace, DECLARATIONS)
    counts = Counter(f"{s.proc}/{s.bus}" for s in iter_streams(trace))
    streams = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(counts.items()))
    print(
        f"check-trace: {trace.files} files, {trace.lines} lines, {len(trace.streams)} streams "
        f"({streams}), {report.instances} instances, {report.transitions} transitions, "
        f"{report.rules_checked} P/D rules checked"
    )
    for note in report.notes if verbose else ():
        print(f"note: {note}")
    for finding in report.findings:
        print(finding.render())
    if not trace.records:
        print("check-trace: no transitions found")
        return 1
    print(f"check-trace: {len(report.findings)} findings")
    return 1 if report.findings else 0
