"""docs/design.md's module tables cannot drift from the package: every module of actscan/
has its row, and every row names a file that exists.

The convention the tables follow: under "## Packages and modules", each row's first cell is
the module's path from the repository root in a code span (`actscan/layout/proof.py`). A
package's `__init__.py` has a row when it holds code; one that holds only its docstring is
documented by the package's heading instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "actscan"
DESIGN = REPO / "docs" / "design.md"
ROW = re.compile(r"^\| `(actscan/[^`]+)` \|", flags=re.M)


def modules_section() -> str:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("\n## Packages and modules\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def listed() -> list[str]:
    return ROW.findall(modules_section())


def docstring_only(path: Path) -> bool:
    """An `__init__.py` with nothing in it but its docstring (and `from __future__`)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(
        (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        for node in body
    )


def modules() -> set[str]:
    out = set()
    for path in PKG.rglob("*.py"):
        if path.name == "__init__.py" and docstring_only(path):
            continue
        out.add(path.relative_to(REPO).as_posix())
    return out


def test_every_module_has_a_row() -> None:
    missing = sorted(modules() - set(listed()))
    assert not missing, f"docs/design.md, 'Packages and modules', lacks rows for {missing}"


def test_every_row_names_a_file_that_exists() -> None:
    gone = sorted(p for p in listed() if not (REPO / p).is_file())
    assert not gone, f"docs/design.md lists modules that do not exist: {gone}"


def test_each_module_is_listed_once_under_its_package_heading() -> None:
    rows = listed()
    assert len(rows) == len(set(rows)), "a module is listed twice"
    heading = ""
    for line in modules_section().splitlines():
        if line.startswith("### "):
            heading = line
        elif m := ROW.match(line):
            package = m.group(1).rpartition("/")[0]
            assert f"`{package}`" in heading, f"{m.group(1)} is listed under {heading!r}"


def test_only_a_docstring_only_init_is_left_to_its_heading(tmp_path: Path) -> None:
    """The rule that lets a package heading stand for its `__init__.py` sees code."""
    bare = tmp_path / "bare.py"
    bare.write_text('"""Where the residual stream is."""\n\nfrom __future__ import annotations\n')
    code = tmp_path / "code.py"
    code.write_text('"""Checks."""\n\nCHECKS = {}\n')
    assert docstring_only(bare) and not docstring_only(code)
    assert "actscan/diagnose/__init__.py" in modules()  # the registry lives there
