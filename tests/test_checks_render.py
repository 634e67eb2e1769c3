"""Golden files for the findings panel, from checks run on hand-built measurements
(regenerate deliberately: pytest --update-goldens, then review the diff)."""

from __future__ import annotations

import io
from collections.abc import Callable

from helpers import (
    act,
    ctx,
    flat_stream,
    geometric,
    head,
    outlier_rec,
    stream,
    with_gains,
)
from rich.console import Console

from actscan.diagnose import run_checks
from actscan.records import Severity
from actscan.render.terminal import findings_panel


def render(findings) -> str:
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(findings_panel(findings))
    return buf.getvalue()


def test_findings_panel_empty(golden: Callable[[str, str], None]) -> None:
    text = render(())
    assert "No findings" in text
    golden("findings_empty.txt", text)


def test_findings_panel_worst_first(golden: Callable[[str, str], None]) -> None:
    layers = [
        act("blocks.0.mlp.act", 600, order=3),
        act("blocks.1.mlp.act", 100, order=9),
        outlier_rec("tok_emb", 100.0, role="embed", type="Embedding", order=0),
        head(17.8, 219.0),
    ]
    found = run_checks(ctx(points=stream(geometric(24, 1.2)), layers=layers, at_init=True))
    text = render(found)
    order = [text.index(f.check) for f in found]
    assert order == sorted(order)  # the panel keeps run_checks' order
    assert text.index("ERROR") < text.index("WARN")
    assert "(+" in text or all(len(f.layers) <= 4 for f in found)
    golden("findings_mixed.txt", text)


def test_findings_panel_info_only(golden: Callable[[str, str], None]) -> None:
    layers, params = with_gains(4, 0.0, 0.0)
    found = run_checks(ctx(points=flat_stream(4), layers=layers, params=params, at_init=True))
    assert [f.severity for f in found] == [Severity.INFO]
    text = render(found)
    assert "INFO" in text and "ReZero" in text and "+4 more" in text
    golden("findings_rezero.txt", text)
