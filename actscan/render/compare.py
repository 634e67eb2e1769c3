"""Rich rendering of a Comparison (compare) and a Sweep (sweep). Formatting only."""

from __future__ import annotations

import math

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from actscan.compare.pairs import Comparison, Divergence, FindingDiff
from actscan.compare.sweep import LrBracket, Sweep
from actscan.numfmt import NONE, as_float, num
from actscan.records import Finding
from actscan.render.formats import lowprec_rows, pct_cell
from actscan.render.sparks import spark
from actscan.render.steps import render_steps_comparison
from actscan.render.terminal import SEVERITY_STYLE, findings_panel, titled_table
from actscan.report.report import Report

A_STYLE, B_STYLE = "cyan", "magenta"


def ratio_text(x: float | None) -> Text:
    """×1 plain; far from 1 (beyond ×1.25 either way) highlighted."""
    if x is None:
        return Text(NONE)
    if isinstance(x, float) and math.isfinite(x) and x > 0:
        far = abs(math.log(x)) > math.log(1.25)
        return Text(f"×{num(x)}", style="bold yellow" if far else "")
    return Text(f"×{num(x)}", style="bold red")


def run_details(report: Report) -> str:
    m, r = report.model, report.run
    bits = [m.family, f"{m.n_params / 1e6:.2f}M params"]
    if m.n_blocks:
        bits.append(f"{m.n_blocks} blocks")
    if m.d_model:
        bits.append(f"d={m.d_model}")
    bits += [
        r.dtype + (f" amp {r.amp}" if r.amp else ""),
        r.device,
        r.inputs or f"batch {r.batch}×{r.seq_len}",
    ]
    return " · ".join(bits)  # the init scheme is in the side's label


def legend(cmp: Comparison) -> Group:
    lines = []
    for tag, label, report, style in (
        ("A", cmp.label_a, cmp.a, A_STYLE),
        ("B", cmp.label_b, cmp.b, B_STYLE),
    ):
        t = Text(f"{tag}: ", style=f"bold {style}")
        t.append(label, style="bold")
        t.append(f"  {run_details(report)}", style="dim")
        lines.append(t)
    return Group(*lines)


def stream_table(cmp: Comparison) -> Table | None:
    if not cmp.stream:
        return None
    t = Table(
        title="Residual stream (ratio = B ÷ A)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for col in ("k", "block", "RMS A", "RMS B", "ratio", "grad RMS A", "grad RMS B", "grad ratio"):
        t.add_column(col, justify="right")
    for p in cmp.stream:
        t.add_row(
            str(p.k),
            NONE if p.block is None else str(p.block),
            num(p.rms_a),
            num(p.rms_b),
            ratio_text(p.ratio),
            num(p.grad_rms_a),
            num(p.grad_rms_b),
            ratio_text(p.grad_ratio),
        )
    return t


def branch_table(cmp: Comparison) -> Table | None:
    if not cmp.branches:
        return None
    t = Table(
        title="Branches",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    cols = ["block", "branch", "÷stream A", "÷stream B", "RMS B÷A"]
    # behind a post-branch norm or gain the stream receives the write, not the branch
    writes = any(b.write_ratio_a is not None or b.write_ratio_b is not None for b in cmp.branches)
    if writes:
        cols += ["write÷stream A", "write÷stream B", "write B÷A"]
    for col in cols:
        t.add_column(col, justify="left" if col == "branch" else "right")
    for b in cmp.branches:
        row: list[str | Text] = [str(b.block), b.kind, num(b.ratio_a), num(b.ratio_b)]
        row.append(ratio_text(b.rms_ratio))
        if writes:
            row += [num(b.write_ratio_a), num(b.write_ratio_b), ratio_text(b.write_rms_ratio)]
        t.add_row(*row)
    return t


def lowprec_table(cmp: Comparison) -> Table | None:
    """`--formats` on both sides: per block, operand and format, the worst GEMM's
    underflow and error of A and of B (rows of one side only are left out)."""
    if not (cmp.a.low_precision and cmp.b.low_precision):
        return None
    t = titled_table("Low precision: worst GEMM per block, operand and format")
    for col in ("blk", "operand", "format", "underflow A", "underflow B", "error A", "error B"):
        t.add_column(col, justify="left" if col in ("operand", "format") else "right")
    t.add_column("error B÷A", justify="right")
    b_rows = {(r.block, r.where, r.operand, r.format): r for r in lowprec_rows(cmp.b.low_precision)}
    for ra in lowprec_rows(cmp.a.low_precision):
        rb = b_rows.get((ra.block, ra.where, ra.operand, ra.format))
        if rb is None:
            continue
        ratio = rb.error / ra.error if ra.error and rb.error is not None else None
        t.add_row(
            ra.where if ra.block is None else str(ra.block),
            ra.operand,
            f"{ra.format} {ra.element}",
            pct_cell(ra.underflow),
            pct_cell(rb.underflow),
            num(ra.error),
            num(rb.error),
            ratio_text(ratio),
        )
    return t


def fit_table(cmp: Comparison) -> Table:
    """The growth fit of each side: Var ≈ a + b·k, RMS ∝ k^p, γ per block, total growth."""
    t = Table(title="Growth fit", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("")
    t.add_column("A", justify="right", style=A_STYLE)
    t.add_column("B", justify="right", style=B_STYLE)
    t.add_column("stream RMS vs k (own scale)", justify="left")
    sa, sb = cmp.a.summary, cmp.b.summary
    rows = (
        ("a (Var intercept)", "var_intercept"),
        ("b (Var slope per k)", "var_slope"),
        ("p (RMS ∝ k^p)", "growth_exponent"),
        ("γ (gain per block)", "gain_per_block"),
        ("growth over embedding", "growth"),
        ("grad RMS first/last", "grad_ratio"),
    )
    # Each side on its own scale: the shape of the growth is what compares.
    sparks = [
        Text("A " + spark([p.rms_a for p in cmp.stream if p.name_a]), style=A_STYLE),
        Text("B " + spark([p.rms_b for p in cmp.stream if p.name_b]), style=B_STYLE),
    ]
    for i, (label, key) in enumerate(rows):
        t.add_row(label, num(sa[key]), num(sb[key]), sparks[i] if i < len(sparks) else "")
    return t


def layers_table(cmp: Comparison) -> Table:
    t = Table(
        title=f"Matched layers (by {cmp.match})",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for col in ("A", "B", "role", "blk", "RMS A", "RMS B", "ratio", "grad ratio"):
        t.add_column(col, justify="left" if col in ("A", "B", "role") else "right")
    for p in cmp.layers:
        t.add_row(
            p.name_a,
            "=" if p.name_b == p.name_a else p.name_b,
            p.role,
            "" if p.block is None else str(p.block),
            num(p.rms_a),
            num(p.rms_b),
            ratio_text(p.ratio),
            ratio_text(p.grad_ratio),
        )
    return t


def divergence_table(d: Divergence, *, all_layers: bool) -> Table:
    """Per block: the stream's divergence and its branches' (every layer with --all)."""
    title = f"Divergence of {d.other} from {d.reference} (one batch, forward)"
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    mark = lambda x: "bold red" if x is None or not x <= d.threshold else ""  # noqa: E731
    if all_layers or d.scope == "all":
        for col in ("module", "role", "blk", "rel err", "cos", "RMS"):
            t.add_column(col, justify="left" if col in ("module", "role") else "right")
        for x in d.layers:
            t.add_row(
                x.name,
                x.role,
                "" if x.block is None else str(x.block),
                Text(num(x.rel_err), style=mark(x.rel_err)),
                _cos(x.cosine),
                num(x.rms),
            )
        return t
    branch = {(x.block, x.role): x for x in d.layers if x.role in ("attn", "mlp")}
    for col in ("module", "blk", "rel err", "cos", "attn rel err", "mlp rel err"):
        t.add_column(col, justify="left" if col == "module" else "right")
    for x in d.layers:
        if x.role in ("attn", "mlp"):
            continue
        at, ml = branch.get((x.block, "attn")), branch.get((x.block, "mlp"))
        is_block = x.role == "stream" and not x.name.endswith(":input")
        t.add_row(
            x.name,
            "" if x.block is None else str(x.block),
            Text(num(x.rel_err), style=mark(x.rel_err)),
            _cos(x.cosine),
            Text(num(at.rel_err), style=mark(at.rel_err)) if at and is_block else "",
            Text(num(ml.rel_err), style=mark(ml.rel_err)) if ml and is_block else "",
        )
    return t


def _cos(x: float | None) -> str:
    v = as_float(x)
    if v is None or not math.isfinite(v):
        return num(x)
    return f"{v:.6f}"


def _finding_line(f: Finding, other: Finding | None = None) -> Text:
    line = Text()
    line.append(f"{f.severity.value.upper():5}", style=SEVERITY_STYLE[f.severity])
    if other is not None and other.severity is not f.severity:
        line.append(" → ")
        line.append(other.severity.value.upper(), style=SEVERITY_STYLE[other.severity])
    line.append(f" {f.check}", style="bold")
    line.append(f"  {(other or f).message}")
    return line


def findings_diff(fd: FindingDiff) -> Panel:
    if not (fd.a_only or fd.b_only or fd.both):
        return findings_panel((), title="Findings (A only / B only / both)")
    body: list[Text] = []
    for title, items, style in (
        ("A only", [(f, None) for f in fd.a_only], A_STYLE),
        ("B only", [(f, None) for f in fd.b_only], B_STYLE),
        ("both (A → B)", list(fd.both), "bold"),
    ):
        body.append(Text(f"{title}: {len(items)}", style=f"bold {style}"))
        body += [_finding_line(a, b) for a, b in items]
    return Panel(Group(*body), title="Findings", title_align="left", box=box.ROUNDED)


def render_comparison(
    cmp: Comparison, console: Console, *, quiet: bool = False, all_layers: bool = False
) -> None:
    """Legend, stream, branches, fit, (matched layers), divergence, findings, verdict."""
    if not quiet:
        console.print(legend(cmp))
        for note in (*cmp.notes, *cmp.a.notes, *cmp.b.notes):
            console.print(Text(f"note: {note}", style="yellow"))
        for table in (stream_table(cmp), branch_table(cmp), lowprec_table(cmp)):
            if table is not None:
                console.print(table)
        if all_layers or not cmp.stream:
            console.print(layers_table(cmp))
        if cmp.unmatched_a or cmp.unmatched_b:
            for tag, names in (("A", cmp.unmatched_a), ("B", cmp.unmatched_b)):
                if names:
                    shown = ", ".join(names[:8]) + (
                        f" (+{len(names) - 8} more)" if len(names) > 8 else ""
                    )
                    console.print(Text(f"no partner in {tag}: {shown}", style="dim"))
        console.print(fit_table(cmp))
        if cmp.divergence is not None:
            console.print(divergence_table(cmp.divergence, all_layers=all_layers))
        if cmp.steps is not None:
            for part in render_steps_comparison(cmp.steps):
                console.print(part)
    console.print(findings_diff(cmp.findings))
    console.print(Text("Verdict: ", style="bold").append(cmp.verdict, style=""))
    if cmp.steps is not None:
        console.print(Text("Steps verdict: ", style="bold").append(cmp.steps.verdict, style=""))


# -- sweep --------------------------------------------------------------------------------
def sweep_table(sw: Sweep) -> Table:
    t = Table(
        title=f"Sweep of {sw.target} (flat rows: the parameterization transfers across size)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    two = len(sw.sides) > 1
    cols = (["side"] if two else []) + [
        "size",
        "final RMS",
        "growth",
        "p",
        "γ/block",
        "grad first/last",
        "findings",
        "worst",
        "stream RMS vs k",
    ]
    for col in cols:
        t.add_column(col, justify="left" if col in ("side", "size", "worst", cols[-1]) else "right")
    finite = [
        p.rms
        for r in sw.rows
        for p in r.report.stream
        if isinstance(p.rms, float) and math.isfinite(p.rms) and p.rms > 0
    ]
    lo, hi = (min(finite), max(finite)) if finite else (None, None)
    for i, r in enumerate(sw.rows):
        counts = dict(r.counts)
        found = " ".join(f"{n}{s[0]}" for s, n in counts.items() if n) or "0"
        sev = r.report.worst()
        worst = (
            Text(r.worst_check, style=SEVERITY_STYLE.get(sev, "") if sev is not None else "")
            if r.worst_check
            else Text(NONE)
        )
        cells: list[Text | str] = [
            r.size,
            num(r.final_rms),
            f"×{num(r.growth)}",
            num(r.growth_exponent),
            num(r.gain_per_block),
            f"×{num(r.grad_ratio)}",
            found,
            worst,
            spark(_thin([p.rms for p in r.report.stream]), lo, hi),
        ]
        style = A_STYLE if r.side == "a" else B_STYLE  # read only when two
        if two and i and sw.rows[i - 1].side != r.side:
            t.add_section()
        t.add_row(*([Text(r.side.upper(), style=style)] if two else []), *cells)
    return t


def _thin(values: list[float | None], most: int = 16) -> list[float | None]:
    """At most `most` evenly spaced points (first and last kept) for a sparkline."""
    if len(values) <= most:
        return values
    step = (len(values) - 1) / (most - 1)
    return [values[round(i * step)] for i in range(most)]


def trend_lines(sw: Sweep) -> list[Text]:
    labels = dict(sw.labels)
    axis = " × ".join(
        f"{name} {'→'.join(str(v) for v in vals)}"
        for name, vals in (
            ("depth", sw.depths),
            ("width", sw.widths),
            ("lr", tuple(num(x) for x in sw.lrs)),
        )
        if vals
    )
    out = []
    for tr in sw.trends():
        t = Text(f"{tr.side.upper()}: {labels.get(tr.side, tr.side)}  ", style="bold")
        t.append(
            f"growth ×{num(tr.growth_first)} → ×{num(tr.growth_last)} over {axis} "
            f"(max/min ×{num(tr.growth_spread)}); final RMS max/min ×{num(tr.final_rms_spread)}",
            style="",
        )
        out.append(t)
    return out


def sweep_lowprec_table(sw: Sweep) -> Table | None:
    """`--formats`: per sweep row and format, the worst underflow and error of any GEMM
    operand, and where the worst error is: how readiness moves with depth and width."""
    rows = [r for r in sw.rows if r.report.low_precision]
    if not rows:
        return None
    t = titled_table("Low precision across the sweep: worst GEMM operand per format")
    two = len(sw.sides) > 1
    for col in (*(("side",) if two else ()), "size", "format", "underflow", "error", "worst"):
        t.add_column(col, justify="left" if col in ("format", "worst") else "right")
    for r in rows:
        for fmt in dict.fromkeys(x.format for x in r.report.low_precision):
            recs = [x for x in r.report.low_precision if x.format == fmt]
            worst = max(recs, key=lambda x: -1.0 if x.error is None else x.error)
            underflow = max((x.underflow for x in recs if x.underflow is not None), default=None)
            t.add_row(
                *((r.side.upper(),) if two else ()),
                r.size,
                fmt,
                pct_cell(underflow),
                num(worst.error),
                f"{worst.gemm} {worst.operand}",
            )
    return t


def render_sweep(sw: Sweep, console: Console, *, quiet: bool = False) -> None:
    if not quiet:
        for note in sw.notes:
            console.print(Text(f"note: {note}", style="yellow"))
        console.print(sweep_table(sw))
        lowprec = sweep_lowprec_table(sw)
        if lowprec is not None:
            console.print(lowprec)
    for line in trend_lines(sw):
        console.print(line)
    for r in sw.rows:
        if not r.report.findings:
            continue
        t = Text(f"{r.side.upper()} {r.size}: ", style="bold")
        for i, f in enumerate(r.report.findings):
            t.append(", " if i else "")
            t.append(f"{f.check} ({f.severity.value})", style=SEVERITY_STYLE[f.severity])
        console.print(t)
    for b in sw.brackets:
        if not quiet:
            console.print(lr_table(sw, b))
        console.print(lr_verdict(sw, b))
    if sw.coord is not None:
        if not quiet:
            console.print(coord_table(sw))
        if sw.coord.findings:
            console.print(findings_panel(sw.coord.findings, title="Coordinate check"))
        else:
            widths = "→".join(map(str, sw.coord.widths))
            console.print(
                Text(
                    f"Coordinate check: flat. Every module group's mean |x| stays within a "
                    f"slope of −{num(sw.coord.shrink)}…+{num(sw.coord.bound)} against width "
                    f"{widths} at every t (logits may shrink like 1/√width): the "
                    "parametrization transfers.",
                    style="green",
                )
            )


def _bracket_name(sw: Sweep, b: LrBracket) -> str:
    bits = [f"{b.side.upper()} "] if len(sw.sides) > 1 else []
    bits += [f"depth {b.depth} " if b.depth is not None else ""]
    bits += [f"width {b.width} " if b.width is not None else ""]
    return "".join(bits).strip()


def lr_table(sw: Sweep, b: LrBracket) -> Table:
    """Per learning rate: do its first steps look like a run that trained, and why."""
    name = _bracket_name(sw, b)
    t = Table(
        title=f"Learning rates{f' ({name})' if name else ''}: the first steps of each",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for col in ("lr", "looks like", "loss 0 → N", "evidence (warn/error step findings)"):
        t.add_column(col, justify="right" if col == "lr" else "left")
    for pt in b.points:
        t.add_row(
            f"{pt.lr:g}",
            Text("trains", style="green") if pt.trains else Text("fails", style="red"),
            f"{num(pt.loss_first)} → {num(pt.loss_last)}",
            "; ".join(pt.evidence) or NONE,
        )
    return t


def lr_verdict(sw: Sweep, b: LrBracket) -> Text:
    """The bracket in one line: the highest lr that looks safe and the one above it."""
    name = _bracket_name(sw, b)
    head = f"{name}: " if name else ""
    if b.safe is None:
        quiet = [pt.lr for pt in b.points if pt.trains]
        if quiet:  # flagged at the bottom, not above: not an lr too large
            return Text(
                f"{head}the lowest lr, {b.points[0].lr:g}, has a warn/error step finding, so "
                "no lr is called safe; yet "
                + ", ".join(f"{lr:g}" for lr in quiet)
                + f" {'looks' if len(quiet) == 1 else 'look'} like runs that trained. A "
                "finding at small lrs alone is not an lr too large: read its evidence "
                "(an init the first steps have not corrected is one).",
                style="yellow",
            )
        return Text(
            f"{head}even the lowest lr, {b.points[0].lr:g}, has a warn/error step finding: "
            "try lower learning rates.",
            style="red",
        )
    above = f"; {b.flagged:g} does not" if b.flagged is not None else " (the highest tried)"
    return Text(
        f"{head}highest lr whose first steps look like runs that trained: {b.safe:g}{above}. "
        f"On the ground truth the best lr of 300-step runs lay in [safe/30, safe], here "
        f"[{b.safe / 30:.2g}, {b.safe:g}] (docs/calibration-dynamics.md"
        "#the-learning-rate-that-trains).",
        style="green",
    )


def coord_table(sw: Sweep) -> Table:
    """Per module group and step: the log–log slope of the group's mean |x_t| against
    width (and of mean |x_t − x_0| after Δ); bold red where a module of the group left
    the flat band."""
    cc = sw.coord
    assert cc is not None
    lr = f" (lr {num(cc.lr)})" if cc.lr is not None else ""
    t = Table(
        title=f"Coordinate check{lr}: log–log slope of mean |x| vs width",
        caption=(
            f"flat: −{num(cc.shrink)}…+{num(cc.bound)}, logits −{num(0.5 + cc.bound)}…"
            f"+{num(cc.bound)}; red: not flat"
        ),
        box=box.SIMPLE_HEAD,
        title_justify="left",
        caption_justify="left",
        pad_edge=False,
    )
    keys = list(dict.fromkeys((c.side, c.depth) for c in cc.curves))
    two, depths = len(sw.sides) > 1, any(d is not None for _, d in keys)
    steps = sorted({c.t for c in cc.curves})
    for col in (["side"] if two else []) + (["depth"] if depths else []) + ["group"]:
        t.add_column(col)
    for step in steps:
        t.add_column(f"t={step}" + (" |x|  Δ" if step else " |x|"), justify="right")
    by = {(c.side, c.depth, c.group, c.t): c for c in cc.curves}
    for i, (side, depth) in enumerate(keys):
        if i:
            t.add_section()
        groups = list(
            dict.fromkeys(c.group for c in cc.curves if (c.side, c.depth) == (side, depth))
        )
        for group in groups:
            cells: list[Text | str] = []
            for step in steps:
                c = by.get((side, depth, group, step))
                if c is None:
                    cells.append(Text(NONE))
                    continue
                text = _slope(c.abs_slope) + (f"  {_slope(c.delta_slope)}" if step else "")
                cells.append(Text(text, style="bold red" if c.beyond else ""))
            lead: list[Text | str] = (
                [Text(side.upper(), style=A_STYLE if side == "a" else B_STYLE)] if two else []
            )
            lead += [str(depth)] if depths else []
            t.add_row(*lead, group, *cells)
    return t


def _slope(x: float | None) -> str:
    return NONE if x is None else f"{x:+.2f}"
