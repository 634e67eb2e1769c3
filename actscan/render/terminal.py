"""Rich rendering of a Report: stream table, branch table, all-modules table, findings.

Formatting only: every number shown was computed before it got here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from actscan.numfmt import NONE, as_float, num
from actscan.records import (
    AttentionRecord,
    Finding,
    Severity,
    Skip,
    StreamPoint,
    Summary,
    finding_order,
)
from actscan.render.formats import (
    head_summary,
    lowprec_rows,
    massive_rows,
    pct_cell,
    trace_rows,
)
from actscan.render.sparks import is_flat, spark
from actscan.render.steps import render_dynamics
from actscan.report.report import Report

SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARN: "yellow", Severity.INFO: "cyan"}


def bar(value: float | None, top: float, width: int = 16) -> str:
    value = as_float(value)
    if value is None or not math.isfinite(value) or top <= 0:
        return ""
    n = value / top * width
    full = int(n)
    rest = "▏▎▍▌▋▊▉"[min(6, int((n - full) * 7))] if n - full > 1 / 7 and full < width else ""
    return "█" * full + rest


def header(report: Report) -> Text:
    m, r = report.model, report.run
    text = Text()
    text.append("actscan ", style="bold")
    text.append(f"{m.source}", style="bold cyan")
    bits = [m.family, f"{m.n_params / 1e6:.2f}M params"]
    if m.n_blocks:
        bits.append(f"{m.n_blocks} blocks")
    if m.d_model:
        bits.append(f"d={m.d_model}")
    run = [
        r.dtype + (f" amp {r.amp}" if r.amp else ""),
        r.device,
        r.inputs or f"{r.batch}×{r.seq_len} tokens",
    ]
    if r.batches > 1:
        run.append(f"{r.batches} batches")
    if not r.backward:
        run.append("forward only")
    if r.init:
        run.append(f"init {r.init}")
    run.append(f"{r.mode} mode, dropout {'on' if r.dropout else 'off'}")
    text.append("\n" + " · ".join(bits) + "  │  " + " · ".join(run), style="dim")
    return text


def stream_table(report: Report) -> Table | None:
    if not report.stream:
        return None
    return _stream_table(report.stream, "Residual stream")


def stream_tables(report: Report) -> list[Table]:
    """One table per residual stream (an encoder-decoder's encoder and decoder; blocks
    numbered within each), else the one stream's."""
    if not report.streams:
        table = stream_table(report)
        return [] if table is None else [table]
    return [
        _stream_table(
            s.points,
            f"Residual stream: {s.name}" + (f" ({s.container})" if s.container else ""),
            local=True,
        )
        for s in report.streams
        if s.points
    ]


def block_labels(report: Report) -> dict[int, str]:
    """Global block index → 'decoder 1' (its stream, its index there) with several streams."""
    out: dict[int, str] = {}
    for s in report.streams:
        blocks = [p.block for p in s.points if p.block is not None]
        out.update({b: f"{s.name} {i}" for i, b in enumerate(blocks)})
    return out


def _stream_table(points: Sequence[StreamPoint], title: str, *, local: bool = False) -> Table:
    rms = [as_float(p.rms) for p in points]
    top = max((v for v in rms if v is not None and math.isfinite(v)), default=0.0)
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    cols = ("k", "block", "module", "RMS", "max|x|", "grad RMS", "RMS vs depth")
    for col in cols:
        t.add_column(col, justify="left" if col in ("module", "RMS vs depth") else "right")
    first = next((p.block for p in points if p.block is not None), 0) if local else 0
    for p in points:
        t.add_row(
            str(p.k),
            NONE if p.block is None else str(p.block - first),
            p.name,
            num(p.rms),
            num(p.max_abs),
            num(p.grad_rms),
            bar(p.rms, top),
        )
    return t


def tokens_table(report: Report) -> Table | None:
    """The largest |x| of each stream point the massive-activations finding names: where
    it sits (token, its text, channel) against the point's median |x|. None without one."""
    rows = massive_rows(report)
    if not rows:
        return None
    t = Table(
        title="Tokens: the largest |x| per stream point (massive-activations)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for col in ("k", "module", "seq", "token", "text", "id", "channel", "value", "median|x|"):
        t.add_column(col, justify="left" if col in ("module", "text") else "right")
    for p, tv in rows:
        t.add_row(
            str(p.k),
            p.name,
            NONE if tv.sequence is None else str(tv.sequence),
            str(tv.token),
            NONE if tv.text is None else repr(tv.text),
            NONE if tv.token_id is None else str(tv.token_id),
            str(tv.channel),
            num(tv.value),
            num(p.median_abs),
        )
    return t


def branch_table(report: Report) -> Table | None:
    if not report.branches:
        return None
    t = Table(title="Branches", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in (
        "block",
        "branch",
        "module",
        "RMS",
        "÷stream",
        "max|x|",
        "ch ratio",
        "grad RMS",
        "‖∇θ‖",
    ):
        t.add_column(col, justify="left" if col in ("branch", "module") else "right")
    labels = block_labels(report)
    for b in report.branches:
        # what reaches the stream: a proven write (post-branch norm, gain), as in JSON's
        # write_rms / write_ratio; the module column names it
        written = b.write is not None and b.write_rms is not None
        module = f"{b.name} → {b.write.rsplit('.', 1)[-1]}" if written and b.write else b.name
        t.add_row(
            labels.get(b.block, str(b.block)),
            b.kind,
            module,
            num(b.write_rms if written else b.rms),
            num(b.write_ratio if written else b.ratio),
            num(b.max_abs),
            num(b.channel_max_ratio),
            num(b.grad_rms),
            num(b.param_grad_norm),
        )
    return t


# Heads table: one glyph per head, its height the normalised entropy (█ uniform over the
# allowed keys, ▁ all mass on one key), coloured by band; heads are grouped (the cell
# shows the group's lowest entropy) when a layer has more than HEAD_CELLS heads.
HEAD_GLYPHS = "▁▂▃▄▅▆▇█"
HEAD_CELLS = 48
HEAD_BANDS = ((0.1, "bold red"), (0.5, "yellow"), (0.9, "green"), (math.inf, "dim green"))


def head_cell(entropy: float | None) -> Text:
    """One head as a glyph: height = entropy (8 levels), colour = band; `·` not measured."""
    e = as_float(entropy)
    if e is None or not math.isfinite(e):
        return Text("·", style="dim")
    level = min(len(HEAD_GLYPHS) - 1, max(0, int(e * len(HEAD_GLYPHS))))
    style = next(st for top, st in HEAD_BANDS if e < top)
    return Text(HEAD_GLYPHS[level], style=style)


def head_cells(entropies: Sequence[float | None], group: int) -> Text:
    """The layer's heads, `group` per cell (the lowest of each group), a space every 8
    cells."""
    text = Text()
    cells = [
        min((v for v in entropies[i : i + group] if v is not None), default=None)
        for i in range(0, len(entropies), group)
    ]
    for i, v in enumerate(cells):
        if i and i % 8 == 0:
            text.append(" ")
        text.append_text(head_cell(v))
    return text


def heads_table(report: Report) -> Table | None:
    """Layer × head normalised attention entropy, one glyph per head (grouped past
    HEAD_CELLS), with each layer's min/median entropy, max score and max sink."""
    if not report.attention:
        return None
    most = max(len(a.heads) for a in report.attention)
    group = max(1, math.ceil(most / HEAD_CELLS))
    what = "head" if group == 1 else f"lowest of {group} heads"
    t = Table(
        title=f"Heads: normalised attention entropy, one cell per {what}",
        caption="█ 1 uniform … ▁ 0 one key · red < 0.1 · yellow < 0.5 · green < 0.9",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    t.add_column("blk", justify="right", no_wrap=True)
    t.add_column("layer", no_wrap=True, overflow="ellipsis", max_width=36)
    t.add_column("heads", no_wrap=True)
    for col in ("ent min", "ent med", "max s", "sink max"):
        t.add_column(col, justify="right", no_wrap=True)
    labels = block_labels(report)
    for a in report.attention:
        t.add_row(*_heads_row(a, group, labels))
    return t


def _heads_row(a: AttentionRecord, group: int, labels: dict[int, str]) -> tuple[str | Text, ...]:
    ents = [as_float(h.entropy) for h in a.heads]
    block = NONE if a.block is None else labels.get(a.block, str(a.block))
    return (block, a.name, head_cells(ents, group), *(num(v) for v in head_summary(a)))


def titled_table(title: str, **kw: Any) -> Table:
    """The tables' common frame: a left-aligned title over a rule under the header."""
    return Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, **kw)


def lowprec_table(report: Report) -> Table | None:
    """`--formats`: per block, operand and format, the worst of its GEMMs."""
    if not report.low_precision:
        return None
    rows = lowprec_rows(report.low_precision)
    gemm = any(r.gemm_error is not None for r in rows)
    dly = any(r.delayed_saturation is not None for r in rows)
    t = titled_table(
        "Low precision: worst GEMM per block, operand and format",
        caption="underflow: nonzero values flushed to 0 · error: ‖Q(x)−x‖²/‖x‖² · range: "
        "log2(amax/min|x|) of the worst scale block, bits"
        + (" · GEMM err: ‖Q(X)Q(W)ᵀ−XWᵀ‖/‖XWᵀ‖" if gemm else "")
        + (" · dly sat.: fp8 saturation under delayed scaling over the steps" if dly else ""),
        caption_justify="left",
    )
    cols = ["blk", "operand", "format", "underflow", "satur.", "error", "range"]
    extra = [*(["GEMM err"] if gemm else []), *(["dly sat."] if dly else [])]
    for col in [*cols, *extra, "worst"]:
        left = col in ("operand", "format", "worst")
        t.add_column(col, justify="left" if left else "right", no_wrap=True)
    labels = block_labels(report)
    for r in rows:
        block = r.where if r.block is None else labels.get(r.block, str(r.block))
        t.add_row(
            block,
            r.operand,
            f"{r.format} {r.element}",
            pct_cell(r.underflow),
            pct_cell(r.saturation),
            num(r.error),
            num(r.range_worst),
            *([num(r.gemm_error)] if gemm else []),
            *([pct_cell(r.delayed_saturation)] if dly else []),
            r.worst,
        )
    return t


def modules_table(report: Report) -> Table:
    t = Table(
        title="All modules",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
        collapse_padding=True,
        padding=(0, 1),
    )
    t.add_column("module", no_wrap=True)
    t.add_column("role", no_wrap=True)
    for col in (
        "blk",
        "calls",
        "mean",
        "RMS",
        "max|x|",
        "zero%",
        "nonfin",
        "ch ratio",
        "grad RMS",
        "‖∇θ‖",
    ):
        t.add_column(col, justify="right", no_wrap=True)
    for r in report.layers:
        t.add_row(
            r.name,
            r.role,
            "" if r.block is None else str(r.block),
            str(r.calls),
            num(r.mean),
            num(r.rms),
            num(r.max_abs),
            NONE if r.zero_frac is None else f"{100 * r.zero_frac:.1f}",
            str(r.nonfinite) if r.nonfinite else "",
            num(r.channel_max_ratio),
            num(r.grad_rms),
            num(r.param_grad_norm),
        )
    return t


def no_findings_line(skipped: Sequence[Skip] = (), backward: bool = True) -> str:
    """The all-clear, naming what it does not cover: skipped checks, and gradients when
    none were measured."""
    what = "activations and gradients" if backward else "activations"
    line = f"No findings: {what} keep a sane scale"
    if not backward:
        line += " (forward only: gradients not measured)"
    if skipped:
        names = ", ".join(s.check for s in skipped)
        line += f" in the checks that ran; not checked: {names} (reasons below)"
    return line + "."


def findings_panel(
    findings: Iterable[Finding],
    title: str = "Findings",
    *,
    skipped: Sequence[Skip] = (),
    backward: bool = True,
) -> Panel:
    items = sorted(findings, key=finding_order)  # worst first, then CHECK_ORDER
    if not items:
        ok = Text(no_findings_line(skipped, backward), style="green")
        return Panel(ok, title=title, title_align="left", box=box.ROUNDED)
    # Two columns so wrapped messages and hints stay indented under their finding.
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for f in items:
        line = Text()
        line.append(f.check, style="bold")
        line.append(f"  {f.message}")
        if f.layers:
            shown = ", ".join(f.layers[:4]) + (
                f" (+{len(f.layers) - 4} more)" if len(f.layers) > 4 else ""
            )
            line.append(f"\nat {shown}", style="dim")
        if f.hint:
            line.append(f"\n→ {f.hint}", style="italic")
        grid.add_row(Text(f"{f.severity.value.upper():5}", style=SEVERITY_STYLE[f.severity]), line)
    return Panel(grid, title=title, title_align="left", box=box.ROUNDED)


def trace_panel(report: Report) -> Panel:
    """The trace (`--trace`, or automatic when the run broke): the first operation out of
    range, its module, line, output and inputs."""
    assert report.trace is not None
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    broke = report.trace.first is not None
    for label, text in trace_rows(report.trace):
        style = "bold red" if broke and label == "first out of range" else ""
        grid.add_row(label, Text(text, style=style))
    return Panel(grid, title="Trace: the first operation that breaks", title_align="left")


def summary_line(report: Report) -> Text | None:
    if not report.stream:
        return None
    return _summary_line("Stream: ", report.stream, report.summary)


def summary_lines(report: Report) -> list[Text]:
    """The stream summary, one line per residual stream when there are several."""
    if not report.streams:
        line = summary_line(report)
        return [] if line is None else [line]
    return [_summary_line(f"Stream {s.name}: ", s.points, s.summary) for s in report.streams]


def _summary_line(title: str, points: Sequence[StreamPoint], s: Summary) -> Text:
    text = Text(title, style="bold")
    rms = [p.rms for p in points]
    flat = " (flat: within ×1.05)" if is_flat(rms) and len(rms) > 1 else ""
    text.append(f"RMS {spark(rms)}{flat}  ")
    parts = [
        f"growth ×{num(s.growth)} over the embedding",
        f"RMS ∝ k^{num(s.growth_exponent)}",
        f"gain/block γ={num(s.gain_per_block)}",
        f"Var ≈ {num(s.var_intercept)} + {num(s.var_slope)}·k",
    ]
    if s.grad_ratio is not None:
        parts.append(f"grad RMS first/last ×{num(s.grad_ratio)}")
    text.append(" · ".join(parts), style="dim")
    return text


def render_report(
    report: Report,
    console: Console,
    *,
    all_modules: bool = False,
    quiet: bool = False,
    ignored: Sequence[tuple[Finding, str]] = (),
) -> None:
    """Print a profile: header, stream, branches, (all modules), summary, findings."""
    if not quiet:
        console.print(header(report))
        for note in report.notes:
            console.print(Text(f"note: {note}", style="yellow"))
        tables = (*stream_tables(report), branch_table(report), heads_table(report))
        tables = (*tables, lowprec_table(report))
        for table in (*tables, tokens_table(report)):
            if table is not None:
                console.print(table)
        if all_modules or not report.stream:
            console.print(modules_table(report))
        for line in summary_lines(report):
            console.print(line)
        if report.dynamics is not None:
            for part in render_dynamics(report.dynamics):
                console.print(part)
    if report.trace is not None:
        console.print(trace_panel(report))
    console.print(
        findings_panel(report.findings, skipped=report.skipped, backward=report.run.backward)
    )
    by_reason: dict[str, list[str]] = {}  # one line per reason, its checks in order
    for sk in report.skipped:
        by_reason.setdefault(sk.reason, []).append(sk.check)
    for reason, checks in by_reason.items():
        console.print(Text(f"skipped {', '.join(checks)}: {reason}", style="dim"))
    for f, reason in ignored:
        console.print(Text(f"ignored {f.check} ({f.severity.value}): {reason}", style="dim"))
