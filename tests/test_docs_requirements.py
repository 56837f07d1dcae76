"""Docs in the repository: every requirement ID cited anywhere is defined in
docs/requirements.md, and the glossary defines the project's terms."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "docs" / "requirements.md"
GLOSSARY = ROOT / "docs" / "glossary.md"
CITING = (
    "protocol",
    "machines",
    "adapters",
    "sim",
    "src",
    "bench",
    "tests",
    "fuzz",
    "docs",
    "specs",
)

# R-P04 / R_P04, B-02 / B_02, C-01, S-06, R-T03 in prose and names; the compact form
# (`test_B02_...`, `test_RP04_...`) only between underscores, so "B64" or "C10" in prose
# are not citations.
_CITATION = re.compile(r"(?<![A-Za-z0-9])(R[-_][PET]|[BCS][-_])(\d{2})(?![0-9])")
_COMPACT = re.compile(r"(?<=_)(R[PET]|[BCS])(\d{2})(?=_)")
_DEFINITION = re.compile(r"^\| (R-[PET]\d{2}|[BCS]-\d{2}) \|", re.MULTILINE)


def defined_ids() -> set[str]:
    return set(_DEFINITION.findall(REQUIREMENTS.read_text()))


def cited_ids(text: str) -> set[str]:
    out = set()
    for family, number in _CITATION.findall(text) + _COMPACT.findall(text):
        letters = family.replace("-", "").replace("_", "")
        out.add(f"R-{letters[1]}{number}" if len(letters) == 2 else f"{letters}-{number}")
    return out


def _sources() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in CITING:
        files += [
            p
            for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in {".py", ".md", ".sh"} and "__pycache__" not in p.parts
        ]
    # This file cites undefined IDs on purpose, to test the checker.
    return [p for p in files if p != Path(__file__).resolve()]


def test_docs_every_cited_requirement_id_is_defined() -> None:
    defined = defined_ids()
    undefined = {
        f"{path.relative_to(ROOT)}: {ident}"
        for path in _sources()
        for ident in cited_ids(path.read_text(errors="replace"))
        if ident not in defined
    }
    assert sorted(undefined) == []


def test_docs_checker_catches_an_undefined_citation() -> None:
    assert cited_ids("see R-P99 and test_B02_reap, S_01, R_T03, C-04, test_RE07_x") == {
        "R-E07",
        "R-P99",
        "B-02",
        "S-01",
        "R-T03",
        "C-04",
    }
    assert "R-P99" not in defined_ids()
    assert cited_ids("sha256 B64 RB02x dtype=bf16 C10 C-10") == {"C-10"}, "only IDs count"


def test_docs_every_family_is_complete_and_defined_once() -> None:
    found = _DEFINITION.findall(REQUIREMENTS.read_text())
    assert len(found) == len(set(found)), "an ID is defined twice"
    expected = (
        {f"R-P{i:02}" for i in range(1, 16)}
        | {f"R-E{i:02}" for i in range(1, 14)}
        | {f"R-T{i:02}" for i in range(1, 7)}
        | {f"B-{i:02}" for i in range(1, 15)}
        | {f"C-{i:02}" for i in range(1, 6)}
        | {f"S-{i:02}" for i in range(1, 7)}
    )
    assert set(found) == expected


def test_docs_glossary_defines_the_project_terms() -> None:
    text = GLOSSARY.read_text().lower()
    terms = ["legs", "member-major", "pcp", "hb, heartbeat", "lease", "watchdog", "grant"]
    terms += ["quarantine", "seed", "base id", "tag", "peer event", "deadline"]
    missing = [term for term in terms if f"**{term}" not in text and f", {term}" not in text]
    assert missing == []
