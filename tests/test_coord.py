"""The μP coordinate check (actscan/diagnose/coord.py) on synthetic dynamics: the slope
fit against numpy, the finding's direction and the flat band, the sweep document."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from helpers import SP_WIDTH_SWEEP

from actscan.compare.sweep import Sweep, SweepPoint, run_sweep
from actscan.diagnose.coord import (
    LOGIT_SHRINK,
    allowed,
    block_group,
    coord_check,
    fit_slope,
)
from actscan.diagnose.thresholds import DEFAULT
from actscan.records import (
    ChangeRecord,
    CheckId,
    Dynamics,
    ModelInfo,
    OptimizerInfo,
    RunInfo,
    Severity,
    StepRecord,
    StreamPoint,
    UpdateRecord,
)
from actscan.report.report import Report
from actscan.settings import Ignore

WIDTHS = (32, 64, 128, 256)
N_BLOCKS = 4


def modules() -> list[tuple[str, str, int | None, int | None]]:
    """(name, kind, k, block): stream points, branches, head, in execution order."""
    out: list[tuple[str, str, int | None, int | None]] = [("blocks.0.in", "stream", 0, None)]
    for b in range(N_BLOCKS):
        out += [(f"blocks.{b}.attn", "attn", None, b), (f"blocks.{b}.mlp", "mlp", None, b)]
        out.append((f"blocks.{b}", "stream", 2 * (b + 1), b))
    out.append(("head", "head", None, None))
    return out


def report(width: int, exps: dict[str, float], steps: int = 2, head_exp: float = -0.5) -> Report:
    """A report whose module `name` has mean |x_t| = c·width^p, p = exps.get(name, 0) at
    t ≥ 1 (0 at t = 0; the head −0.5 at t = 0), and mean |x_t − x_0| the same law."""
    rng = np.random.default_rng(width)
    steps_rec = []
    for t in range(steps + 1):
        change = []
        for name, kind, k, block in modules():
            if t == 0:
                p = head_exp if kind == "head" else 0.0
            else:
                p = exps.get(name, head_exp if kind == "head" else 0.0)
            c = 1.0 + 0.02 * rng.standard_normal()  # small per-width noise
            change.append(
                ChangeRecord(
                    name,
                    kind,
                    k,
                    block,
                    rel=0.0 if t == 0 else 0.1,
                    abs_mean=c * width**p,
                    delta_mean=0.0 if t == 0 else c * width**p,
                )
            )
        steps_rec.append(StepRecord(t=t, loss=1.0, lr=1e-2, change=tuple(change)))
    dyn = Dynamics(OptimizerInfo("adamw", 1e-2), tuple(steps_rec))
    stream = tuple(
        StreamPoint(k=k, block=block, name=name, rms=1.0)
        for name, kind, k, block in modules()
        if kind == "stream" and k is not None
    )
    info = ModelInfo(source="synthetic", family="actscan-gpt", n_params=1, n_blocks=N_BLOCKS)
    return Report(info, RunInfo(), (), stream, dynamics=dyn)


def rows(exps: dict[str, float], side: str = "a", **kw) -> list:
    return [(side, None, w, report(w, exps, **kw)) for w in WIDTHS]


def test_fit_slope_matches_numpy_polyfit() -> None:
    rng = np.random.default_rng(0)
    xs = [16, 32, 64, 128, 256]
    ys = [float(x**0.73 * math.exp(0.1 * rng.standard_normal())) for x in xs]
    expected = np.polyfit(np.log(xs), np.log(ys), 1)[0]
    assert fit_slope(xs, ys, 3) == pytest.approx(expected, rel=1e-12)
    # non-positive / missing values are dropped, then too few points give None
    assert fit_slope(xs, [None, 0.0, -1.0, ys[3], ys[4]], 3) is None
    assert fit_slope(xs, [None, ys[1], ys[2], ys[3], float("nan")], 3) == pytest.approx(
        np.polyfit(np.log(xs[1:4]), np.log(ys[1:4]), 1)[0], rel=1e-12
    )


def test_flat_modules_give_no_finding_and_slopes_near_zero() -> None:
    cc = coord_check(rows({}), DEFAULT)
    assert cc is not None and cc.widths == WIDTHS and cc.steps == 2
    assert cc.findings == ()
    body = [s for s in cc.slopes if s.kind != "head"]
    assert all(abs(s.abs_slope) < 0.05 for s in body)
    assert all(s.delta_slope is None for s in cc.slopes if s.t == 0)
    heads = [s for s in cc.slopes if s.kind == "head"]
    assert all(s.abs_slope == pytest.approx(-LOGIT_SHRINK, abs=0.05) for s in heads)


LATE = ("blocks.3.attn", "blocks.3.mlp", "blocks.3")


def test_growing_group_is_named_with_its_direction_and_slope() -> None:
    cc = coord_check(rows({**dict.fromkeys(LATE, 1.0), "head": 0.6}), DEFAULT)
    assert cc is not None
    (f,) = cc.findings
    assert f.check == CheckId.COORD_CHECK and f.severity is Severity.WARN
    assert f.layers == (*LATE, "head")  # execution order: branches, the block's output, head
    assert "grow with width 32→256" in f.message and "late |x| +1.00" in f.message
    assert "head |x| +0.60" in f.message
    assert f.value == pytest.approx(1.0, abs=0.05) and f.threshold == DEFAULT.coord_slope
    late = [c for c in cc.curves if c.group == "late" and c.t == 1]
    assert late and late[0].beyond and late[0].abs_slope == pytest.approx(1.0, abs=0.05)
    assert not any(c.beyond for c in cc.curves if c.group in ("early", "mid", "embedding"))


def test_one_module_alone_does_not_flag_its_group_but_is_named_when_the_group_moves() -> None:
    # a single scattered module (μP at a large lr): its group's line stays flat
    cc = coord_check(rows({"blocks.3.mlp": 0.6}), DEFAULT)
    assert cc.findings == ()
    assert any(s.abs_slope > 0.55 for s in cc.slopes if s.name == "blocks.3.mlp")
    # the group moves: only the module that leaves the band is named
    (f,) = coord_check(rows({"blocks.3.mlp": 1.5}), DEFAULT).findings
    assert f.layers == ("blocks.3.mlp",)


def test_shrinking_group_is_a_separate_finding_and_logits_may_shrink_like_inverse_sqrt() -> None:
    early = ("blocks.0.attn", "blocks.0.mlp", "blocks.0")
    cc = coord_check(rows({**dict.fromkeys(early, -1.0), "head": 0.6}), DEFAULT)
    assert cc is not None
    grow, shrink = cc.findings
    assert "grow" in grow.message and grow.layers == ("head",)
    assert "shrink" in shrink.message and shrink.layers == early
    assert shrink.threshold == -DEFAULT.coord_shrink and shrink.value == pytest.approx(-1, abs=0.05)
    # the head shrinking like 1/√width is flat for logits, like 1/width it is not
    assert coord_check(rows({}, head_exp=-0.5), DEFAULT).findings == ()
    (f,) = coord_check(rows({}, head_exp=-1.2), DEFAULT).findings
    assert f.layers == ("head",) and "shrink" in f.message
    th = DEFAULT.with_overrides({"coord-slope": 0.4, "coord-shrink": 0.7})
    assert allowed("head", th) == (-0.9, 0.4) and allowed("mlp", th) == (-0.7, 0.4)


def driven(rs: list, narrow_ratio: float, wide_ratio: float = 0.01) -> list:
    """The rows with weight-matrix update ratios: `narrow_ratio` per step at the narrowest
    width, `wide_ratio` elsewhere (plus a norm gain far above both, which must not count)."""
    out = []
    for side, depth, w, rep in rs:
        r = narrow_ratio if w == min(WIDTHS) else wide_ratio
        gain = UpdateRecord("blocks.0.norm1.weight", 0, "norm", "norm-gain", (9.0, 9.0), (1.0, 1.0))
        ups = (
            *(
                UpdateRecord(f"blocks.{b}.mlp.up.weight", b, "mlp", "weight", (r, r), (1.0, 1.0))
                for b in range(N_BLOCKS)
            ),
            gain,
        )
        out.append((side, depth, w, replace(rep, dynamics=replace(rep.dynamics, updates=ups))))
    return out


def test_a_shrink_at_an_overdriven_narrowest_width_is_info_and_growth_still_warns() -> None:
    """Where the narrowest width moves its matrices by ≥ update-ratio-warn per step, mup's
    own μP shrinks past the band (tests/test_mup_reference.py): the shrink is reported
    at info with the ratio; below it, and for growth, the severity is warn as before."""
    early = ("blocks.0.attn", "blocks.0.mlp", "blocks.0")
    exps = {**dict.fromkeys(early, -1.0), "head": 0.6}
    warm = DEFAULT.update_ratio_warn
    calm = coord_check(driven(rows(exps), 0.5 * warm), DEFAULT)
    assert [f.severity for f in calm.findings] == [Severity.WARN, Severity.WARN]
    grow, shrink = coord_check(driven(rows(exps), 2.2 * warm), DEFAULT).findings
    assert grow.severity is Severity.WARN and "grow" in grow.message
    assert shrink.severity is Severity.INFO and shrink.layers == early
    assert f"narrowest width ({min(WIDTHS)})" in shrink.message
    assert f"median {2.2 * warm:.2f} of their norm" in shrink.message
    assert "--lr 0.002" in shrink.hint  # lr 1e-2 × 0.2 / 0.44 / 2
    # the narrowest width decides: the same ratio at a wider one is not overdrive
    wide_only = coord_check(driven(rows(exps), 0.01, wide_ratio=2.2 * warm), DEFAULT)
    assert [f.severity for f in wide_only.findings] == [Severity.WARN, Severity.WARN]


def test_bound_is_a_threshold_and_two_widths_do_not_judge() -> None:
    grows = rows(dict.fromkeys(LATE, 0.25))
    assert coord_check(grows, DEFAULT).findings == ()
    assert coord_check(grows, DEFAULT.with_overrides({"coord-slope": 0.2})).findings
    two = grows[:2]
    cc = coord_check(two, DEFAULT)  # coord-min-widths 3: slopes None, nothing judged
    assert cc is not None and cc.findings == () and all(s.abs_slope is None for s in cc.slopes)
    assert coord_check(grows[:1], DEFAULT) is None


def test_groups_thirds_of_the_stack() -> None:
    assert [block_group(b, 2) for b in range(2)] == ["early", "late"]
    assert [block_group(b, 3) for b in range(3)] == ["early", "mid", "late"]
    assert [block_group(b, 6) for b in range(6)] == ["early"] * 2 + ["mid"] * 2 + ["late"] * 2
    cc = coord_check(rows({}), DEFAULT)
    groups = {s.name: s.group for s in cc.slopes}
    assert groups["blocks.0.in"] == "embedding" and groups["head"] == "head"
    assert groups["blocks.0.attn"] == "early" and groups["blocks.3"] == "late"


def test_sweep_carries_the_check_in_json_and_ignores_apply() -> None:
    by_width = {w: report(w, dict.fromkeys(LATE, 1.2)) for w in WIDTHS}
    points = [SweepPoint("a", None, w, (("d_model", str(w)),)) for w in WIDTHS]

    def scan_point(p: SweepPoint) -> Report:
        return by_width[p.width]

    sw = run_sweep("x", points, scan_point, labels=[("a", "x")], widths=WIDTHS)
    assert isinstance(sw, Sweep) and sw.coord is not None
    assert [f.layers for f in sw.findings] == [LATE]
    doc = json.loads(sw.to_json())
    coord = doc["coord"]
    assert coord["widths"] == list(WIDTHS) and coord["steps"] == 2 and coord["lr"] == 1e-2
    assert (coord["bound"], coord["shrink"]) == (DEFAULT.coord_slope, DEFAULT.coord_shrink)
    row = next(s for s in coord["slopes"] if s["name"] == "blocks.3" and s["t"] == 1)
    assert row["abs_slope"] == pytest.approx(1.2, abs=0.05) and row["group"] == "late"
    assert len(row["abs_mean"]) == len(WIDTHS)
    assert coord["findings"][0]["check"] == "coord-check"
    assert {c["group"] for c in coord["curves"]} == {"embedding", "early", "mid", "late", "head"}
    ignored = run_sweep(
        "x",
        points,
        scan_point,
        labels=[("a", "x")],
        widths=WIDTHS,
        ignores=(Ignore("coord-check", "known"),),
    )
    assert ignored.findings == () and ignored.coord is not None
    # without steps (or without a width axis) there is no coordinate check
    plain = {w: Report(r.model, r.run, (), r.stream) for w, r in by_width.items()}
    sw0 = run_sweep("x", points, lambda p: plain[p.width], labels=[("a", "x")], widths=WIDTHS)
    assert sw0.coord is None and json.loads(sw0.to_json())["coord"] is None


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plot_draws_one_panel_per_step_and_one_line_per_group(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from actscan.render import plot

    cc = coord_check(rows(dict.fromkeys(LATE, 1.0)) + rows({}, side="b"), DEFAULT)
    drawn: list[Figure] = []
    save = plot._save
    monkeypatch.setattr(
        plot, "_save", lambda fig, out, fmt: drawn.append(fig) or save(fig, out, fmt)
    )
    out = plot.plot_coord(cc.curves, cc.widths, tmp_path / "coord.png", title="x")
    assert out.read_bytes()[:8] == PNG_MAGIC
    (fig,) = drawn
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["t = 0", "t = 1", "t = 2"]
    assert all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in axes)
    lines = axes[1].get_lines()
    assert len(lines) == 2 * 5  # two sides × embedding, early, mid, late, head
    assert list(lines[0].get_xdata()) == list(WIDTHS)
    assert {ln.get_linestyle() for ln in lines} == {"-", "--"}


def test_plot_bad_input_is_one_clear_error(tmp_path, monkeypatch) -> None:
    import sys

    from actscan.errors import ActscanError, UsageError
    from actscan.render.plot import check_plot, plot_coord

    cc = coord_check(rows({}), DEFAULT)
    with pytest.raises(UsageError, match=r"does not exist"):
        check_plot(tmp_path / "no" / "x.png")
    with pytest.raises(UsageError, match="unsupported image type"):
        plot_coord(cc.curves, cc.widths, tmp_path / "x.gif")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ActscanError, match=r"actscan\[plot\]"):
        plot_coord(cc.curves, cc.widths, tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


# -- the real thing: a small width sweep with steps through the CLI ---------------------------
def _sweep(isolated, *extra: str):
    from typer.testing import CliRunner

    from actscan.cli import app

    args = [
        *SP_WIDTH_SWEEP,
        "--json",
        "-",
        *extra,
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code in (0, 1), res.output
    return res, json.loads(res.stdout)


@pytest.mark.slow
def test_real_sweep_flags_sp_at_the_readout_and_last_blocks(tmp_path, monkeypatch) -> None:
    """Widths 32/64/128, 2 blocks, 2 AdamW steps at lr 1e-2, seed 0 (measured over seeds
    0–3: SP's groups ≥ +0.6, μP's ≤ +0.22; docs/checks.md#coord-check)."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    res, doc = _sweep(tmp_path, "--plot", "coord.png", "--fail-on", "warn")
    assert res.exit_code == 1  # the coord-check warning trips --fail-on warn
    (f,) = doc["coord"]["findings"]
    assert f["check"] == "coord-check" and "grow with width 32→128" in f["message"]
    assert "head" in f["layers"] and "blocks.1" in f["layers"] and "blocks.1.mlp" in f["layers"]
    late = [c for c in doc["coord"]["curves"] if c["group"] == "late" and c["t"] >= 1]
    assert all(c["beyond"] and c["abs_slope"] > 0.6 for c in late)
    assert [r["report"]["dynamics"]["optimizer"]["parametrization"] for r in doc["rows"]] == [
        "sp"
    ] * 3
    assert (tmp_path / "coord.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_real_sweep_passes_mup(tmp_path) -> None:
    res, doc = _sweep(tmp_path, "--set", "parametrization=mup")
    assert res.exit_code == 0 and doc["coord"]["findings"] == []
    body = [c for c in doc["coord"]["curves"] if c["group"] != "head"]
    assert all(
        abs(v) < DEFAULT.coord_slope
        for c in body
        for v in (c["abs_slope"], c["delta_slope"])
        if v is not None
    )
    head0 = next(c for c in doc["coord"]["curves"] if c["group"] == "head" and c["t"] == 0)
    assert head0["abs_slope"] == pytest.approx(-0.5, abs=0.05)  # logits ∝ 1/√width at init
    opt = doc["rows"][0]["report"]["dynamics"]["optimizer"]
    assert opt["parametrization"] == "mup" and opt["lr"] == 1e-2


def test_render_shows_the_group_table_and_the_verdict() -> None:
    import io

    from rich.console import Console

    from actscan.render.compare import render_sweep

    points = [SweepPoint("a", None, w, ()) for w in WIDTHS]

    def text(exps: dict[str, float], quiet: bool = False) -> str:
        by_width = {w: report(w, exps) for w in WIDTHS}
        sw = run_sweep("x", points, lambda p: by_width[p.width], labels=[("a", "x")], widths=WIDTHS)
        buf = io.StringIO()
        render_sweep(sw, Console(file=buf, width=160, color_system=None), quiet=quiet)
        return buf.getvalue()

    grows = text(dict.fromkeys(LATE, 1.0))
    assert "Coordinate check (lr 0.01)" in grows and "t=2 |x|  Δ" in grows
    late = next(line for line in grows.splitlines() if line.strip().startswith("late"))
    assert late.split()[2:4] == ["+1.00", "+1.00"]  # t=0 noise-flat, then |x| and Δ at t=1
    assert "WARN  coord-check" in grows and "late |x| +1.00" in grows
    flat = text({})
    assert "Coordinate check: flat" in flat and "coord-check" not in flat
    quiet = text(dict.fromkeys(LATE, 1.0), quiet=True)
    assert "Coordinate check (lr" not in quiet and "WARN  coord-check" in quiet


@pytest.mark.parametrize(
    ("plot", "needle"),
    [
        ("no/such/folder/c.png", "does not exist"),
        ("c.gif", "unsupported image type '.gif'"),
        ("c.png", "actscan[plot]"),  # matplotlib missing
    ],
)
def test_sweep_plot_bad_input_is_one_line_exit_2_before_any_scan(
    tmp_path, monkeypatch, plot: str, needle: str
) -> None:
    import sys

    from helpers import one_line_error
    from typer.testing import CliRunner

    import actscan.api
    from actscan.cli import app

    monkeypatch.chdir(tmp_path)
    if needle == "actscan[plot]":
        monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    scans: list[object] = []
    monkeypatch.setattr(actscan.api, "scan_target", lambda *a, **k: scans.append(a))
    res = CliRunner().invoke(
        app, ["sweep", "gpt-12-preln", "--width", "32,64,128", "--steps", "2", "--plot", plot]
    )
    one_line_error(res, needle)
    assert scans == [] and not list(tmp_path.iterdir())
