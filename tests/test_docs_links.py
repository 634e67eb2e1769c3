"""The documents cannot drift: docs/report-format.md documents every field the shipped
schema lists, in the section for that schema object, and every relative link and cited
section in the README, docs/ and the package's docstrings points at something that exists."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actscan.report.schema import load_schema

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
REPORT_FORMAT = DOCS / "report-format.md"


def schema_objects(node: Any, pointer: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, properties) of every object in the schema that lists properties."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get("properties"), dict):
        yield pointer, node["properties"]
        for name, sub in node["properties"].items():
            yield from schema_objects(sub, f"{pointer}/properties/{name}")
    for name, sub in node.get("$defs", {}).items():
        yield from schema_objects(sub, f"{pointer}/$defs/{name}")


def sections(text: str) -> dict[str, str]:
    """Heading line → the text under it, up to the next heading of any level."""
    out: dict[str, str] = {}
    heading, body, fenced = "", [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("#") and not fenced:
            out[heading] = "\n".join(body)
            heading, body = line, []
        else:
            body.append(line)
    out[heading] = "\n".join(body)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_report_format_documents_every_schema_property() -> None:
    doc = sections(REPORT_FORMAT.read_text(encoding="utf-8"))
    objects = list(schema_objects(load_schema()))
    assert {p for p, _ in objects} >= {"#", "#/$defs/layer", "#/$defs/finding"}
    missing = []
    for pointer, props in objects:
        where = [h for h in doc if f"`{pointer}`" in h]
        assert len(where) == 1, f"docs/report-format.md needs one heading naming `{pointer}`"
        rows = set(re.findall(r"^\| `([^`]+)` \|", doc[where[0]], flags=re.MULTILINE))
        missing += [f"{pointer}/properties/{name}" for name in props if name not in rows]
    assert not missing, f"schema properties not documented in report-format.md: {missing}"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.name)
def test_relative_links_resolve(md: Path) -> None:
    text = md.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            anchors = {slug(h) for h in sections(dest.read_text(encoding="utf-8")) if h}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{md.name}: broken links {broken}"


def test_readme_links_the_docs() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for doc in ("docs/design.md", "docs/report-format.md", "docs/checks.md"):
        assert f"]({doc})" in text, doc


def test_cited_sections_exist() -> None:
    """Docstrings cite `docs/NAME.md, "Section"`: that section must be a heading there."""
    cited = []
    for py in sorted((REPO / "actscan").rglob("*.py")):
        for doc, section in re.findall(r'(docs/[\w-]+\.md), "([^"]+)"', py.read_text("utf-8")):
            cited.append((py.name, REPO / doc, section))
    assert cited
    missing = []
    for py, doc, section in cited:
        headings = [h.lstrip("#").strip().strip("`") for h in sections(doc.read_text("utf-8"))]
        if section not in headings:
            missing.append(f'{py}: {doc.name}, "{section}"')
    assert not missing, missing
