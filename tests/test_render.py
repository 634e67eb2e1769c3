"""Golden files for the rendered profile tables (from a hand-built Report, so they do not
move with torch), the golden helper itself, and the `profile` command end to end."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import check_golden, make_report
from rich.console import Console
from typer.testing import CliRunner

from actscan.cli import app
from actscan.render.sparks import spark
from actscan.render.terminal import num, render_report
from actscan.report.report import Report

Golden = Callable[[str, str], None]
SMALL = dict(n_layers=3, d_model=32, n_heads=2, vocab_size=64, seq_len=8)


def _render(report, **kw) -> str:
    buf = io.StringIO()
    render_report(report, Console(file=buf, width=120, color_system=None), **kw)
    return buf.getvalue()


def _report() -> Report:
    # the findings panel has its own golden files; here the tables are under test
    return make_report("tiny.yaml", findings=False)


def test_profile_tables_golden(golden: Golden) -> None:
    text = _render(_report())
    assert "Branches" in text and "1.23e+05" in text and "×1.20e+05" in text
    golden("profile_tables.txt", text)


def test_all_modules_table_golden(golden: Golden) -> None:
    text = _render(_report(), all_modules=True)
    assert "All modules" in text and "h.0.mlp.act" in text
    golden("profile_all.txt", text)


def test_profile_tables_from_nonfinite_json(golden: Golden) -> None:
    """A report read back from JSON carries "nan"/"inf" strings: they print as such."""
    data = json.loads(make_report("tiny.yaml", nonfinite=True, findings=False).to_json())
    text = _render(Report.from_dict(data), all_modules=True)
    assert "inf" in text and "nan" in text
    golden("profile_nonfinite.txt", text)


def test_golden_helper_fails_on_missing_file_and_writes_only_when_asked(
    tmp_path: Path,
) -> None:
    with pytest.raises(pytest.fail.Exception, match="missing"):
        check_golden("new.txt", "x\n", update=False, folder=tmp_path)
    assert not (tmp_path / "new.txt").exists()
    check_golden("new.txt", "x\n", update=True, folder=tmp_path)
    assert (tmp_path / "new.txt").read_text() == "x\n"
    check_golden("new.txt", "x\n", update=False, folder=tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)differs.*-x.*\+y"):
        check_golden("new.txt", "y\n", update=False, folder=tmp_path)


def test_quiet_prints_only_findings() -> None:
    text = _render(_report(), quiet=True)
    assert "Residual stream" not in text and "Findings" in text


def test_number_and_sparkline_formatting() -> None:
    assert [num(x) for x in (None, 0.0, 1.23456, 0.0123456, 123456.0, 120000, float("nan"))] == [
        "—",
        "0",
        "1.23",
        "0.0123",
        "1.23e+05",
        "1.20e+05",
        "nan",
    ]
    assert spark([1, 2, 3, 4]) == "▁▃▆█"
    assert spark([1e-6, 1.0])[0] == "▁" and spark([0.0, 1.0])[0] == "·"


runner = CliRunner()


def test_profile_config_json_contract(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in SMALL.items()))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["profile", str(cfg), "--json", str(out), "--batch", "2"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1
    assert data["model"]["family"] == "actscan-gpt" and data["model"]["n_blocks"] == 3
    assert data["run"] == {**data["run"], "batch": 2, "seq_len": 8, "dtype": "fp32", "batches": 1}
    assert [p["k"] for p in data["stream"]] == [0, 2, 4, 6]
    layer = next(r for r in data["layers"] if r["name"] == "blocks.1.mlp")
    assert layer["role"] == "mlp" and layer["block"] == 1 and layer["calls"] == 1
    for key in (
        "mean",
        "std",
        "rms",
        "max_abs",
        "zero_frac",
        "nonfinite",
        "channel_max_ratio",
        "outlier_channels",
        "grad_rms",
        "grad_norm",
        "param_grad_norm",
    ):
        assert key in layer
    assert "growth_exponent" in data["summary"] and "gain_per_block" in data["summary"]
    assert "Residual stream" in res.output


def test_profile_options_reach_the_run(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("".join(f"{k} = {v}\n" for k, v in SMALL.items()))
    res = runner.invoke(
        app,
        [
            "profile",
            str(cfg),
            "--json",
            "-",
            "--dtype",
            "bf16",
            "--batches",
            "2",
            "--seed",
            "3",
            "--set",
            "n_layers=2",
            "--init",
            "fan-in",
            "--modules",
            r"^blocks\.\d+$",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["run"]["dtype"] == "bf16" and data["run"]["batches"] == 2
    assert data["run"]["seed"] == 3 and data["run"]["init"] == "fan-in"
    assert data["model"]["n_blocks"] == 2
    assert {r["name"] for r in data["layers"]} == {"blocks.0", "blocks.1"}


def test_profile_by_shipped_name_and_configs_command() -> None:
    res = runner.invoke(app, ["configs"])
    assert res.exit_code == 0 and "gpt-48-naive" in res.output and "fan-in" in res.output
    res = runner.invoke(app, ["profile", "gpt-12-preln", "--set", "n_layers=2", "--no-backward"])
    assert res.exit_code == 0, res.output
    assert "forward only" in res.output


def test_usage_errors_exit_2() -> None:
    res = runner.invoke(app, ["profile", "no/such/file.yaml"])
    assert res.exit_code == 2 and "no such file" in res.output
    res = runner.invoke(app, ["profile", "gpt-12-preln", "--set", "n_layerz=2"])
    assert res.exit_code == 2 and "unknown key 'n_layerz'" in res.output
    res = runner.invoke(app, ["profile", "gpt-12-preln", "--dtype", "fp64"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_does_not_import_torch(args: list[str]) -> None:
    code = (
        f"import sys, runpy; sys.argv = ['actscan', *{args!r}]\n"
        "try:\n    runpy.run_module('actscan', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "print('IMPORTED', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "IMPORTED []" in out.stdout, out.stdout + out.stderr


# -- heat-map row labels (profile --plot) ---------------------------------------------------
def _label_boxes(ax: Any, renderer: Any) -> list[Any]:
    labels = [t for t in ax.get_yticklabels() if t.get_visible() and t.get_text()]
    return [t.get_window_extent(renderer) for t in labels]


def _overlapping(boxes: list[Any]) -> int:
    return sum(a.overlaps(b) for a, b in itertools.pairwise(boxes))


def test_heat_map_labels_never_overlap_at_48_layers() -> None:
    """48 blocks: 49 stream points and 48 attention layers; every n-th row is labelled,
    n from the figure height, and the drawn labels do not touch (all 49 would)."""
    pytest.importorskip("matplotlib")
    from actscan.render import plot

    assert [plot.label_step(n) for n in (4, 12, 24, 48, 96)] == [1, 1, 1, 2, 4]
    assert plot.label_step(48, height_in=2 * plot.PROFILE_SIZE[1]) == 1
    points = ["blocks.0:input", *(f"blocks.{i}" for i in range(48))]
    assert plot.row_ticks(points)[1][:3] == ["blocks.0:input", "blocks.1", "blocks.3"]
    data = plot.ProfileFigure(
        stream=plot.Series("stream", tuple(range(49)), tuple(1.0 + k for k in range(49))),
        channel_maxima=[(n, (1.0, 2.0, 30.0, 4.0)) for n in points],
        heads=[(f"blocks.{i}.attn", [0.5] * 12) for i in range(48)],
    )
    fig = plot.canvas(plot.PROFILE_SIZE)
    plot.draw_profile(fig, data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    assert isinstance(fig.canvas, FigureCanvasAgg)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    _, a_ch, a_head = fig.axes[:3]
    for ax, n_rows in ((a_ch, 49), (a_head, 48)):
        boxes = _label_boxes(ax, renderer)
        assert len(boxes) == len(range(0, n_rows, 2)) and _overlapping(boxes) == 0
    a_ch.set_yticks(range(49), points)  # what the plot did before: a label per row
    fig.canvas.draw()
    assert _overlapping(_label_boxes(a_ch, renderer)) > 0
