"""The rendered diagrams (`make docs`): page-width and label checks, and the README's SVGs.

`make docs` renders every `specs/*.md` to `build/docs/<name>.svg` with mermaid-cli on
chromium, then `kvhandoff diagrams --svg build/docs` checks what came out and refreshes
the SVGs the README embeds under `specs/svg/`. Each of those carries the SHA-256 of the
mermaid text it was drawn from, so `kvhandoff diagrams --check` finds it stale when the
declaration changes (without needing a browser).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from kvhandoff.machines.catalog import DECLARATIONS
from kvhandoff.machines.runtime.diagrams import safe_id, timeout_label
from kvhandoff.specs import mermaid_of

MAX_WIDTH_PX = 1250
"""About 1,200 px at scale 1 (with room for font metrics): a page column is about 880 px
wide, so a wider drawing shrinks its labels below reading size."""
README_DIAGRAMS = ("push.p_lease", "ec.consumer_read")
SVG_DIR = "svg"
_SOURCE = re.compile(r"<!-- kvhandoff diagram source sha256:([0-9a-f]{64}) -->")
_WIDTH = re.compile(r"max-width:\s*([0-9.]+)px")
_EDGE_LABEL = re.compile(r'<span class="edgeLabel">(.*?)</span>', re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def source_hash(name: str) -> str:
    decl = next(d for d in DECLARATIONS if d.name == name)
    return hashlib.sha256(mermaid_of(decl).encode()).hexdigest()


def svg_width(svg: str) -> float | None:
    match = _WIDTH.search(svg)
    return float(match.group(1)) if match else None


def edge_labels(svg: str) -> list[str]:
    """The text of every edge label drawn (empty ones left out)."""
    out = []
    for body in _EDGE_LABEL.findall(svg):
        text = " ".join(_TAG.sub(" ", body).split())
        if text:
            out.append(text.replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&"))
    return out


def repeated_labels(name: str, labels: list[str]) -> list[str]:
    """Timeouts and aborts of machine `name` whose label is drawn more than once."""
    decl = next(d for d in DECLARATIONS if d.name == name)
    watched = {
        timeout_label(s.timeout.event.trigger, s.timeout.after)
        for s in decl.state_decls
        if s.timeout is not None
    } | {t for t in decl.triggers if t == "abort"}
    parts = [part.strip() for label in labels for part in label.split(" | ")]
    # An abort is drawn once per state it leads to (drop-then-release and release-now are
    # two outcomes); a timeout once.
    allowed = {w: 1 for w in watched}
    if "abort" in watched:
        allowed["abort"] = len(
            {t.dest for t in decl.transition_decls if t.trigger == "abort" and t.dest is not None}
        )
    return sorted(
        w for w in watched if sum(p == w or p.startswith(w + " [") for p in parts) > allowed[w]
    )


def check_svgs(build: Path) -> list[str]:
    """Problems of the rendered diagrams in `build` (one per line; none: all good)."""
    problems = []
    for decl in DECLARATIONS:
        path = build / f"{safe_id(decl.name)}.svg"
        if not path.is_file():
            problems.append(f"{path}: not rendered")
            continue
        svg = path.read_text()
        width = svg_width(svg)
        if width is None or width > MAX_WIDTH_PX:
            problems.append(f"{path}: {width} px wide (at most {MAX_WIDTH_PX})")
        for label in repeated_labels(decl.name, edge_labels(svg)):
            problems.append(f"{path}: the label {label!r} is drawn more than once")
    return problems


def publish_svgs(build: Path, specs: Path) -> list[str]:
    """Copy the README's diagrams from `build` into `specs/svg/` when their source changed."""
    written = []
    (specs / SVG_DIR).mkdir(parents=True, exist_ok=True)
    for name in README_DIAGRAMS:
        digest = source_hash(name)
        target = specs / SVG_DIR / f"{safe_id(name)}.svg"
        if target.is_file() and _committed_hash(target) == digest:
            continue
        svg = (build / f"{safe_id(name)}.svg").read_text()
        target.write_text(f"<!-- kvhandoff diagram source sha256:{digest} -->\n{svg}\n")
        written.append(str(target))
    return written


def stale_svgs(specs: Path) -> list[str]:
    """README SVGs under `specs/svg/` drawn from another version of their diagram."""
    return [
        f"{SVG_DIR}/{safe_id(name)}.svg"
        for name in README_DIAGRAMS
        if _committed_hash(specs / SVG_DIR / f"{safe_id(name)}.svg") != source_hash(name)
    ]


def _committed_hash(path: Path) -> str | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as handle:
        match = _SOURCE.match(handle.readline())
    return match.group(1) if match else None
