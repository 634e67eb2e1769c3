"""docs/checks.md cannot drift from the code: every check id has its section with the same
sub-headings, and every threshold is documented with its current default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actscan.diagnose.thresholds import DEFAULT
from actscan.records import CheckId

DOC = Path(__file__).resolve().parents[1] / "docs" / "checks.md"
SUBHEADINGS = [
    "What it measures",
    "Theory",
    "Thresholds",
    "Severity, and when it is silent",
    "Remedy",
    "Example",
]


def sections() -> dict[str, str]:
    """`## ` heading → the text up to the next `## ` heading."""
    parts = re.split(r"^## (.+)$", DOC.read_text(encoding="utf-8"), flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def check_sections() -> dict[str, str]:
    """Sections whose heading is a single code span: one per check id."""
    return {
        m.group(1): body
        for title, body in sections().items()
        if (m := re.fullmatch(r"`([a-z-]+)`", title))
    }


@pytest.mark.parametrize("check", [c.value for c in CheckId])
def test_every_check_id_has_a_section_with_the_common_subheadings(check: str) -> None:
    body = check_sections().get(check)
    assert body is not None, f"docs/checks.md has no '## `{check}`' section"
    found = re.findall(r"^#### (.+)$", body, flags=re.M)
    assert found == SUBHEADINGS, f"{check}: sub-headings {found}"
    assert "```console\n$ actscan " in body, f"{check}: no example command with its output"


def test_no_section_for_a_check_the_code_does_not_emit() -> None:
    assert set(check_sections()) == {c.value for c in CheckId}


def test_every_threshold_is_listed_with_its_default_and_explained() -> None:
    text = DOC.read_text(encoding="utf-8")
    listed = sections()["All thresholds"]
    table = dict(re.findall(r"^\| `([a-z-]+)` \| ([^|]+?) \|", listed, flags=re.M))
    for name, default in DEFAULT.as_dict().items():
        assert name in table, f"threshold {name} missing from the 'All thresholds' table"
        assert float(table[name]) == pytest.approx(default), f"{name}: doc {table[name]}"
        # explained where it acts, not only listed
        assert text.count(f"`{name}`") >= 2, f"threshold {name} is not explained"
    assert set(table) == set(DEFAULT.as_dict()), "the table lists a threshold the code lacks"
