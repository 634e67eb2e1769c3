"""What the table view shows, the Markdown and JUnit outputs carry too: the Heads table
(per layer), the Tokens table, the optimizer steps' stream and attention tables, and a
sweep's coordinate check (its table, findings and gate)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from helpers import SP_WIDTH_SWEEP, make_report
from test_coord import LATE, WIDTHS
from test_coord import report as coord_report
from typer.testing import CliRunner

from actscan.cli import app
from actscan.compare.sweep import SweepPoint, run_sweep
from actscan.records import (
    AttentionRecord,
    Dynamics,
    Finding,
    HeadRecord,
    OptimizerInfo,
    Severity,
    StepRecord,
    TopValue,
)
from actscan.render.formats import coord_markdown, to_junit, to_markdown


def _rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_markdown_heads_one_row_per_layer_and_tokens() -> None:
    base = make_report()
    heads = tuple(
        HeadRecord(head=h, score_max=1.0 + h, score_std=0.5, entropy=e, sink=0.1 * h)
        for h, e in enumerate((0.02, 0.9, 0.95, None))
    )
    attention = (
        AttentionRecord(name="h.0.attn", block=0, heads=heads),
        AttentionRecord(name="h.1.attn", block=1, heads=heads[1:3]),
    )
    point = base.stream[1]
    tv = TopValue(value=-1.5e4, token=0, channel=5, sequence=0, token_id=7, text="<s>")
    stream = (base.stream[0], replace(point, top_values=(tv,), median_abs=0.5), *base.stream[2:])
    massive = Finding(
        check="massive-activations",
        severity=Severity.WARN,
        layers=(point.name,),
        value=3e4,
        threshold=1e3,
        message="a massive value",
        hint="look",
    )
    report = replace(base, attention=attention, stream=stream, findings=(massive,))
    text = to_markdown(report)
    assert "#### Attention heads" in text
    rows = _rows(text, "| block | layer | heads |")
    assert rows == [
        ["0", "`h.0.attn`", "4", "0.02", "0.9", "4", "0.3"],
        ["1", "`h.1.attn`", "2", "0.9", "0.925", "3", "0.2"],
    ]
    tokens = _rows(text, "| k | module | seq | token |")
    assert tokens == [
        [str(point.k), f"`{point.name}`", "0", "0", "`'<s>'`", "7", "5", "-1.5e+04", "0.5"]
    ]
    # without attention records or a massive-activations finding, no such sections
    plain = to_markdown(make_report())
    assert "Attention heads" not in plain and "massive-activations)" not in plain


def test_markdown_steps_show_the_stream_and_the_attention_layers() -> None:
    steps = tuple(
        StepRecord(
            t=t,
            loss=4.0 - t,
            lr=1e-3,
            stream=((0, 1.0), (2, 1.0 + t)),
            attn_max=2.0 * (t + 1),
            attn_layers=(("h.0.attn", 1.0), ("h.1.attn", 2.0 * (t + 1))),
        )
        for t in range(3)
    )
    dyn = Dynamics(optimizer=OptimizerInfo("adamw", 1e-3), steps=steps)
    text = to_markdown(replace(make_report(), dynamics=dyn))
    assert _rows(text, "| k | t=0 | t=1 | t=2 | Δ probe t=2 |") == [
        ["0", "1", "1", "1", "—"],
        ["2", "1", "2", "3", "—"],
    ]
    assert _rows(text, "| layer | t=0 | t=2 |") == [
        ["`h.0.attn`", "1", "1"],
        ["`h.1.attn`", "2", "6"],
    ]


def _sweep(exps: dict[str, float]):
    by_width = {w: coord_report(w, exps) for w in WIDTHS}
    points = [SweepPoint("a", None, w, (("d_model", str(w)),)) for w in WIDTHS]
    return run_sweep("x", points, lambda p: by_width[p.width], labels=[("a", "x")], widths=WIDTHS)


def test_coord_markdown_table_findings_and_gate() -> None:
    sw = _sweep(dict.fromkeys(LATE, 1.0))
    assert sw.coord is not None
    text = coord_markdown(sw.coord, sw.labels, fail_on="warn")
    assert "#### Coordinate check (widths 32→64→128→256, 2 steps, lr 0.01)" in text
    late = next(r for r in _rows(text, "| group |") if r[0] == "late")
    assert "**" not in late[1]  # t = 0: flat
    assert late[2] == "**+1.00 / +1.00**" and late[3].startswith("**+0.99")  # t = 1, 2
    (row,) = _rows(text, "| severity | check |")
    assert row[:2] == ["warn", "coord-check"]
    assert "**FAIL** at `--fail-on warn`: 1 coord-check finding(s)." in text
    assert "**PASS** at `--fail-on error`" in coord_markdown(sw.coord, fail_on="error")
    flat = _sweep({})
    assert flat.coord is not None
    assert "Coordinate check: flat." in coord_markdown(flat.coord)


def test_junit_has_a_coordinate_check_suite() -> None:
    sw = _sweep(dict.fromkeys(LATE, 1.0))
    assert sw.coord is not None
    reports = [r.report for r in sw.rows]
    root = ET.fromstring(to_junit(reports, fail_on="warn", coord=("x", sw.coord.findings)))
    suite = root.findall("testsuite")[-1]
    assert suite.get("name") == "x coordinate check" and suite.get("failures") == "1"
    (case,) = suite.findall("testcase")
    assert case.get("name") == "coord-check"
    assert "grow with width 32→256" in case.find("failure").text  # type: ignore[union-attr]
    passing = ET.fromstring(to_junit(reports, fail_on="error", coord=("x", sw.coord.findings)))
    suite = passing.findall("testsuite")[-1]
    assert suite.get("failures") == "0" and suite.find("testcase/system-out") is not None
    assert len(ET.fromstring(to_junit(reports)).findall("testsuite")) == len(reports)


@pytest.mark.parametrize("fmt", ["markdown", "junit"])
def test_sweep_cli_writes_the_coordinate_check(tmp_path, fmt: str) -> None:
    """The real SP sweep of tests/test_coord.py: its coord-check warning is in the file."""
    out = tmp_path / f"sweep.{fmt}"
    args = [
        *SP_WIDTH_SWEEP,
        "-q",
        "--format",
        fmt,
        "-o",
        str(out),
        "--fail-on",
        "warn",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    text = out.read_text()
    if fmt == "markdown":
        assert "#### Coordinate check (widths 32→64→128, 2 steps, lr 0.01)" in text
        assert "| warn | coord-check |" in text and "coord-check finding(s)" in text
    else:
        suite = ET.fromstring(text).findall("testsuite")[-1]
        assert suite.get("name") == "gpt-12-preln coordinate check"
        assert suite.get("failures") == "1"
