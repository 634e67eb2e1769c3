"""Report renderings for CI: Markdown (e.g. $GITHUB_STEP_SUMMARY) and JUnit XML.

Pure functions of a Report (and of a sweep's coordinate check): nothing here computes
statistics or imports torch. The Markdown carries what the table view shows, compactly:
findings, streams, heads (per layer, not per head), the massive-activation tokens, the
optimizer steps, and a sweep's coordinate check.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actscan.numfmt import NONE, as_float, num
from actscan.records import (
    CHECK_ORDER,
    AttentionRecord,
    CheckId,
    Dynamics,
    FailOn,
    Finding,
    LowPrecRecord,
    Severity,
    StepRecord,
    StreamPoint,
    TopValue,
    TraceOp,
    TraceRecord,
    finding_order,
)

if TYPE_CHECKING:
    from actscan.diagnose.coord import CoordCheck
    from actscan.report.report import Report

__all__ = ["coord_markdown", "fmt_count", "to_junit", "to_markdown"]

_MAX_LAYERS = 3
MAX_STEP_COLUMNS = 8  # steps shown as columns: t = 0, 1, … and the last ones


# -- shared with the table view (render.py) -------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def head_summary(
    a: AttentionRecord,
) -> tuple[float | None, float | None, float | None, float | None]:
    """A layer's heads in four numbers: (min, median) normalised entropy, the largest
    score and the largest sink."""
    ents = [e for h in a.heads if (e := as_float(h.entropy)) is not None and math.isfinite(e)]
    scores = [v for h in a.heads if (v := as_float(h.score_max)) is not None]
    sinks = [v for h in a.heads if (v := as_float(h.sink)) is not None]
    return (
        min(ents) if ents else None,
        _median(ents),
        max(scores) if scores else None,
        max(sinks) if sinks else None,
    )


@dataclass(frozen=True)
class LowPrecRow:
    """The low-precision table's row: one block (or one GEMM outside the blocks), one
    operand, one format; the worst figure of its GEMMs in each column, and the GEMM with
    the largest error."""

    block: int | None
    where: str  # the GEMM, outside the blocks; else ""
    operand: str
    format: str
    element: str
    underflow: float | None
    saturation: float | None
    error: float | None
    range_worst: float | None
    worst: str
    gemms: int
    gemm_error: float | None = None  # --gemm-error: the worst GEMM output error
    delayed_saturation: float | None = None  # fp8 over --steps: delayed scaling's worst


def _worst(values: Iterable[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def lowprec_rows(records: Sequence[LowPrecRecord]) -> list[LowPrecRow]:
    """Records grouped per block, operand and format, in order of first GEMM."""
    groups: dict[tuple[int | None, str, str, str], list[LowPrecRecord]] = {}
    for r in records:
        where = r.gemm if r.block is None else ""
        groups.setdefault((r.block, where, r.operand, r.format), []).append(r)
    out = []
    for (block, where, operand, fmt), rs in groups.items():
        worst = max(rs, key=lambda r: -1.0 if r.error is None else r.error)
        out.append(
            LowPrecRow(
                block,
                where,
                operand,
                fmt,
                rs[0].element,
                _worst(r.underflow for r in rs),
                _worst(r.saturation for r in rs),
                _worst(r.error for r in rs),
                _worst(r.range_worst for r in rs),
                worst.gemm,
                len(rs),
                _worst(r.gemm_error for r in rs),
                _worst(r.delayed_saturation for r in rs),
            )
        )
    return out


def pct_cell(x: float | None) -> str:
    """A fraction as a percentage for the tables: 0, 0.012%, 3.4%."""
    if x is None:
        return NONE
    return "0" if x == 0 else f"{100 * x:.2g}%"


def massive_rows(report: Report) -> list[tuple[StreamPoint, TopValue]]:
    """The stream points the massive-activations finding names, each with its largest |x|
    (the Tokens table)."""
    named = {
        n for f in report.findings if f.check == CheckId.MASSIVE_ACTIVATIONS.value for n in f.layers
    }
    points = [p for s in (report.streams or ()) for p in s.points if p.name in named] or [
        p for p in report.stream if p.name in named
    ]
    return [(p, p.top_values[0]) for p in points if p.top_values]


def shown_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """At most MAX_STEP_COLUMNS steps: t = 0, 1, 2, … and the last ones, in order."""
    if len(steps) <= MAX_STEP_COLUMNS:
        return list(steps)
    head = MAX_STEP_COLUMNS // 2
    return [*steps[:head], *steps[-(MAX_STEP_COLUMNS - head) :]]


# -- number formatting ----------------------------------------------------------------


def trace_rows(tr: TraceRecord) -> list[tuple[str, str]]:
    """(label, text) rows of the trace: what it reran, then the operation that broke (or
    the largest one when none did), where it ran and what fed it."""
    ceiling = f", {tr.dtype} max {num(tr.ceiling)}" if tr.ceiling else f", {tr.dtype}"
    rows = [
        (
            "rerun",
            f"batch {tr.batch} at step {tr.step} ({tr.reason}{ceiling}): {tr.ops} operations, "
            f"{tr.backward_ops} in the backward",
        )
    ]
    op = tr.first or tr.peak
    if op is None:
        return [*rows, ("result", "no floating-point operation ran")]
    label = "first out of range" if tr.first is not None else "none out of range; largest"
    out = f"max|x| {num(op.max_abs)}" + (f", {op.nonfinite} inf/nan" if op.nonfinite else "")
    if tr.first is None and tr.ceiling and op.max_abs:
        out += f" (headroom ×{num(tr.ceiling / op.max_abs)} to {tr.dtype}'s max)"
    rows += [
        (label, f"{op.op} (operation {op.index}, {op.phase})"),
        ("module", op.module or "outside every module (the loss)"),
        ("line", _trace_line(op)),
        ("output", out),
    ]
    if op.inputs:
        ins = "; ".join(
            f"{i.dtype}{list(i.shape)} max|x| {num(i.max_abs)}"
            + (f", {i.nonfinite} inf/nan" if i.nonfinite else "")
            for i in op.inputs
        )
        rows.append(("inputs", ins))
    return rows


def _trace_line(op: TraceOp) -> str:
    if op.source is None:
        return "not found (no frame of the model's code)"
    return op.source + (f": {op.code}" if op.code else "")


def _trace_markdown(report: Report) -> list[str]:
    if report.trace is None:
        return []
    out = ["", "#### Trace: the first operation that breaks", "", "| | |", "| --- | --- |"]
    return out + [f"| {label} | {_cell(text)} |" for label, text in trace_rows(report.trace)]


def fmt_count(n: int) -> str:
    """Parameter counts: 950, 12.3K, 124M, 1.5B."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


# -- markdown -------------------------------------------------------------------------
def _cell(text: str) -> str:
    """Make `text` safe inside a Markdown table cell (one line, no bare pipes)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    text = _cell(text)
    return f"`{text}`" if text and "`" not in text else text


def _layers_cell(layers: Sequence[str]) -> str:
    shown = ", ".join(_code(name) for name in layers[:_MAX_LAYERS])
    more = len(layers) - _MAX_LAYERS
    if more > 0:
        shown += f", … (+{more})"
    return shown or NONE


def _sorted_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Worst first, then in the one check order (what `run_checks` gives)."""
    return sorted(findings, key=finding_order)


def _gate_line(report: Report, gate: FailOn) -> str:
    if gate is FailOn.NEVER:
        return "**PASS** at `--fail-on never` (gate disabled)."
    bad = report.failed(gate)
    if bad:
        return f"**FAIL** at `--fail-on {gate.value}`: {len(bad)} finding(s) at or above {gate}."
    return f"**PASS** at `--fail-on {gate.value}`: no finding at or above {gate}."


def to_markdown(report: Report, fail_on: str | FailOn = FailOn.ERROR) -> str:
    """GitHub-flavoured Markdown: title, findings (worst first), residual stream, gate."""
    gate = FailOn(fail_on)
    model, run = report.model, report.run
    precision = run.dtype + (f", amp {run.amp}" if run.amp else "")
    precision += f", {run.mode} mode, dropout {'on' if run.dropout else 'off'}"
    out = [
        f"### actscan: {_code(model.source)} ({_cell(model.family)}, "
        f"{fmt_count(model.n_params)} params, {model.n_blocks} blocks, {_cell(precision)})",
        "",
        "#### Findings",
        "",
    ]
    if report.findings:
        out += _findings_table(report.findings)
    else:
        out.append(
            "No findings."
            if report.run.backward
            else "No findings (forward only: gradients not measured)."
        )
    if report.skipped:
        out += ["", "Not checked:", ""]
        out += [f"- {_code(sk.check)}: {_cell(sk.reason)}" for sk in report.skipped]
    # one section per residual stream when there are several (encoder, decoder)
    sections = [
        (f"Residual stream: {s.name}", s.points, s.summary, f"Stream {s.name}: ")
        for s in report.streams
    ] or [("Residual stream", report.stream, report.summary, "Stream: ")]
    for title, points, s, lead in sections:
        out += ["", f"#### {title}", ""]
        if points:
            out += ["| k | block | name | RMS | grad RMS |", "| ---: | ---: | --- | ---: | ---: |"]
            # blocks numbered within their stream when there are several
            first = next((p.block for p in points if p.block is not None), 0)
            first = first if report.streams else 0
            for p in points:
                block = NONE if p.block is None else str(p.block - first)
                out.append(
                    f"| {p.k} | {block} | {_code(p.name)} | {num(p.rms)} | {num(p.grad_rms)} |"
                )
        else:
            out.append("No residual stream found.")
        summary = [
            f"{label} {num(value)}"
            for value, label in (
                (s.growth_exponent, "growth exponent p ="),
                (s.gain_per_block, "gain per block"),
            )
            if value is not None
        ]
        if summary:
            out += ["", lead + ", ".join(summary) + "."]
    out += _trace_markdown(report)
    out += _heads_markdown(report)
    out += _lowprec_markdown(report)
    out += _tokens_markdown(report)
    if report.dynamics is not None:
        out += _dynamics_markdown(report.dynamics)
    if report.notes:
        out += ["", *(f"- {_cell(note)}" for note in report.notes)]
    out += ["", _gate_line(report, gate), ""]
    return "\n".join(out)


def _heads_markdown(report: Report) -> list[str]:
    """Per attention layer (not per head): entropy min/median, largest score and sink."""
    if not report.attention:
        return []
    out = [
        "",
        "#### Attention heads",
        "",
        "Per layer over its heads: normalised attention entropy (1 uniform over the "
        "allowed keys, 0 all mass on one key), the largest pre-softmax score, the largest "
        "mass on the first key (sink).",
        "",
        "| block | layer | heads | entropy min | entropy median | max score | max sink |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for a in report.attention:
        lo, med, score, sink = head_summary(a)
        block = NONE if a.block is None else str(a.block)
        out.append(
            f"| {block} | {_code(a.name)} | {len(a.heads)} | {num(lo)} | {num(med)} "
            f"| {num(score)} | {num(sink)} |"
        )
    return out


def _lowprec_markdown(report: Report) -> list[str]:
    """`--formats`: per block, operand and format, the worst GEMM's figures."""
    if not report.low_precision:
        return []
    rows = lowprec_rows(report.low_precision)
    gemm = any(r.gemm_error is not None for r in rows)
    dly = any(r.delayed_saturation is not None for r in rows)
    out = [
        "",
        "#### Low precision",
        "",
        "Per block, operand and format, the worst of its GEMMs: nonzero values flushed to 0, "
        "values saturated, relative error ‖Q(x) − x‖²/‖x‖², the worst scale block's "
        "range in bits"
        + ("; GEMM error: ‖Q(X)Q(W)ᵀ − XWᵀ‖/‖XWᵀ‖" if gemm else "")
        + ("; delayed saturation: fp8 over the steps, delayed scaling." if dly else "."),
        "",
        "| block | operand | format | underflow | saturation | error | worst range | "
        + ("GEMM error | " if gemm else "")
        + ("delayed saturation | " if dly else "")
        + "worst GEMM |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | "
        + ("---: | " if gemm else "")
        + ("---: | " if dly else "")
        + "--- |",
    ]
    for r in rows:
        block = _code(r.where) if r.block is None else str(r.block)
        out.append(
            f"| {block} | {r.operand} | {r.format} ({r.element}) | {pct_cell(r.underflow)} "
            f"| {pct_cell(r.saturation)} | {num(r.error)} | {num(r.range_worst)} "
            + (f"| {num(r.gemm_error)} " if gemm else "")
            + (f"| {pct_cell(r.delayed_saturation)} " if dly else "")
            + f"| {_code(r.worst)} |"
        )
    return out


def _tokens_markdown(report: Report) -> list[str]:
    """The massive-activations finding's values: where each sits against the median."""
    rows = massive_rows(report)
    if not rows:
        return []
    out = [
        "",
        "#### Tokens: the largest \\|x\\| per stream point (massive-activations)",
        "",
        "| k | module | seq | token | text | id | channel | value | median \\|x\\| |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for p, tv in rows:
        out.append(
            f"| {p.k} | {_code(p.name)} | {NONE if tv.sequence is None else tv.sequence} "
            f"| {tv.token} | {NONE if tv.text is None else _code(repr(tv.text))} "
            f"| {NONE if tv.token_id is None else tv.token_id} | {tv.channel} "
            f"| {num(tv.value)} | {num(p.median_abs)} |"
        )
    return out


def _dynamics_markdown(dyn: Dynamics) -> list[str]:
    """`--steps N`: the optimizer, one row per step (loss, lr, attention max, log Z, the
    probe's change at the last stream point) and the updates per block."""
    o = dyn.optimizer
    out = [
        "",
        f"#### Optimizer steps ({len(dyn.steps) - 1})",
        "",
        f"{o.name}, lr {num(o.lr)}"
        + (f", warmup {o.warmup}" if o.warmup else "")
        + (f", {o.parametrization}" if o.parametrization != "sp" else "")
        + ".",
        "",
        "| t | loss | lr | attn max | log Z | Δ probe (last k) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in dyn.steps:
        last = [c.rel for c in s.change if c.kind == "stream"]
        out.append(
            f"| {s.t} | {num(s.loss)} | {num(s.lr)} | {num(s.attn_max)} "
            f"| {num(s.logits.log_z_mean if s.logits else None)} "
            f"| {num(last[-1] if last else None)} |"
        )
    steps = shown_steps(dyn.steps)
    if steps and steps[0].stream:
        final = dyn.steps[-1]
        rel = {c.k: c.rel for c in final.change if c.kind == "stream"}
        out += [
            "",
            "Residual stream over the steps (RMS of each step's batch; Δ probe: "
            "‖x_t − x_0‖/‖x_0‖ on the probe batch):",
            "",
            "| k | " + " | ".join(f"t={s.t}" for s in steps) + f" | Δ probe t={final.t} |",
            "| ---: |" + " ---: |" * (len(steps) + 1),
        ]
        rows = [dict(s.stream) for s in steps]
        for k, _ in steps[0].stream:
            cells = " | ".join(num(r.get(k)) for r in rows)
            out.append(f"| {k} | {cells} | {num(rel.get(k))} |")
    layers = list(dict.fromkeys(n for s in dyn.steps for n, _ in s.attn_layers))
    if layers:
        first, last_t = dyn.steps[0], dyn.steps[-1]
        a, b = dict(first.attn_layers), dict(last_t.attn_layers)
        out += [
            "",
            "Attention score max per layer (largest \\|pre-softmax score\\| on the probe batch):",
            "",
            f"| layer | t={first.t} | t={last_t.t} |",
            "| --- | ---: | ---: |",
        ]
        for name in layers:
            out.append(f"| {_code(name)} | {num(a.get(name))} | {num(b.get(name))} |")
    if dyn.blocks:
        out += [
            "",
            "| block | role | median ‖ΔW‖/‖W‖ | max | median grad RMS |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for u in dyn.blocks:
            block = NONE if u.block is None else str(u.block)
            out.append(
                f"| {block} | {_cell(u.role)} | {num(u.ratio_median)} | {num(u.ratio_max)} "
                f"| {num(u.grad_rms_median)} |"
            )
    return out


def _findings_table(findings: Iterable[Finding]) -> list[str]:
    out = ["| severity | check | layers | message | hint |", "| --- | --- | --- | --- | --- |"]
    for f in _sorted_findings(findings):
        out.append(
            f"| {Severity(f.severity).value} | {_cell(f.check)} | {_layers_cell(f.layers)} "
            f"| {_cell(f.message)} | {_cell(f.hint)} |"
        )
    return out


def _slope(x: float | None) -> str:
    return NONE if x is None else f"{x:+.2f}"


def coord_markdown(
    cc: CoordCheck, labels: Sequence[tuple[str, str]] = (), fail_on: str | FailOn = FailOn.ERROR
) -> str:
    """A sweep's μP coordinate check: per module group and step the log–log slope of mean
    |x_t| (and of mean |x_t − x_0| after t = 0) against width, **bold** where the group
    left the flat band; then the coord-check findings (or the flat verdict) and the gate
    on them. `labels`: (side, label) of a sweep with two sides."""
    gate = FailOn(fail_on)
    widths = "→".join(map(str, cc.widths))
    lr = f", lr {num(cc.lr)}" if cc.lr is not None else ""
    out = [
        f"#### Coordinate check (widths {widths}, {cc.steps} steps{lr})",
        "",
        f"Log–log slope of mean \\|x\\| against width; flat: −{num(cc.shrink)}…"
        f"+{num(cc.bound)} (logits may shrink to −{num(0.5 + cc.bound)}); **bold**: not "
        "flat.",
        "",
    ]
    two = len(labels) > 1
    if two:
        out += [f"- {side.upper()}: {_cell(label)}" for side, label in labels] + [""]
    keys = list(dict.fromkeys((c.side, c.depth) for c in cc.curves))
    depths = any(d is not None for _, d in keys)
    steps = sorted({c.t for c in cc.curves})
    head = (["side"] if two else []) + (["depth"] if depths else []) + ["group"]
    head += [f"t={t} \\|x\\|" + (" / Δ" if t else "") for t in steps]
    out += [
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * (len(head) - len(steps)) + " ---: |" * len(steps),
    ]
    by = {(c.side, c.depth, c.group, c.t): c for c in cc.curves}
    for side, depth in keys:
        groups = dict.fromkeys(c.group for c in cc.curves if (c.side, c.depth) == (side, depth))
        for group in groups:
            cells = []
            for t in steps:
                c = by.get((side, depth, group, t))
                if c is None:
                    cells.append(NONE)
                    continue
                text = _slope(c.abs_slope) + (f" / {_slope(c.delta_slope)}" if t else "")
                cells.append(f"**{text}**" if c.beyond else text)
            lead = ([side.upper()] if two else []) + ([str(depth)] if depths else [])
            out.append("| " + " | ".join([*lead, _cell(group), *cells]) + " |")
    out.append("")
    if cc.findings:
        out += _findings_table(cc.findings)
    else:
        out.append(
            "Coordinate check: flat. Every module group's mean \\|x\\| stays in the flat "
            "band at every t: the parametrization transfers."
        )
    bad = [f for f in cc.findings if gate.trips(Severity(f.severity))]
    if gate is FailOn.NEVER:
        line = "**PASS** at `--fail-on never` (gate disabled)."
    elif bad:
        line = f"**FAIL** at `--fail-on {gate.value}`: {len(bad)} coord-check finding(s)."
    else:
        line = f"**PASS** at `--fail-on {gate.value}`: no coord-check finding at or above {gate}."
    out += ["", line, ""]
    return "\n".join(out)


# -- JUnit ----------------------------------------------------------------------------
# XML 1.0 forbids most control characters; ElementTree would write them anyway.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml_text(text: str) -> str:
    return _XML_INVALID.sub("\ufffd", text)


def _finding_text(f: Finding) -> str:
    line = f"[{Severity(f.severity).value}] {f.message}"
    if f.layers:
        line += f"\n  layers: {', '.join(f.layers)}"
    if f.value is not None or f.threshold is not None:
        line += f"\n  value: {num(f.value)}  threshold: {num(f.threshold)}"
    if f.hint:
        line += f"\n  hint: {f.hint}"
    return line


def _suite_names(reports: Sequence[Report]) -> list[str]:
    """Each report's source; reports that share one (a sweep, a compare of one target with
    itself) get the facts that tell them apart, so CI shows distinct suites."""
    facts = (
        lambda r: f"{r.model.n_blocks} blocks",
        lambda r: f"d={r.model.d_model}",
        lambda r: r.run.dtype + (f" amp {r.run.amp}" if r.run.amp else ""),
        lambda r: f"init {r.run.init}" if r.run.init else "as built",
    )
    names = [r.model.source for r in reports]
    for i, r in enumerate(reports):
        group = [o for o in reports if o.model.source == r.model.source]
        if len(group) > 1:
            differ = [f(r) for f in facts if len({f(o) for o in group}) > 1]
            names[i] = f"{r.model.source} [{', '.join(differ)}]" if differ else names[i]
    for i, name in enumerate(names):
        if names.count(name) > 1:
            names[i] = f"{name} #{names[:i].count(name) + 1}"
    return names


def to_junit(
    reports: Sequence[Report],
    fail_on: str | FailOn = FailOn.ERROR,
    coord: tuple[str, Sequence[Finding]] | None = None,
) -> str:
    """A JUnit XML <testsuites> document: one suite per report, one case per check id.

    Cases follow the one check order (`CHECK_ORDER`). A case fails when its check has a
    finding at or above `fail_on`; findings below the gate go into the case's
    <system-out>. Checks that did not run (`report.skipped`) are <skipped/> with the
    reason; checks that ran without a finding pass. Check ids that are not in `CheckId` but
    occur in findings get a case too, after the known ones.

    `coord`: a sweep's coordinate check, (target, its coord-check findings): one more suite,
    "<target> coordinate check", with one `coord-check` case judged the same way.
    """
    gate = FailOn(fail_on)
    root = ET.Element("testsuites", name="actscan")
    total_tests = total_failures = total_skipped = 0
    suites: list[tuple[str, dict[str, list[Finding]], dict[str, str]]] = []
    for report, source in zip(reports, _suite_names(reports), strict=True):
        checks: dict[str, list[Finding]] = {c.value: [] for c in CHECK_ORDER}
        for f in report.findings:
            checks.setdefault(str(f.check), []).append(f)
        suites.append((source, checks, {sk.check: sk.reason for sk in report.skipped}))
    if coord is not None:
        target, found = coord
        suites.append((f"{target} coordinate check", {"coord-check": list(found)}, {}))
    for source, by_check, why_skipped in suites:
        suite = ET.SubElement(root, "testsuite", name=_xml_text(source))
        failures = skips = 0
        for check, found in by_check.items():
            case = ET.SubElement(
                suite, "testcase", classname=_xml_text(f"actscan.{source}"), name=check
            )
            failing = [f for f in found if gate.trips(Severity(f.severity))]
            passing = [f for f in found if not gate.trips(Severity(f.severity))]
            if failing:
                failures += 1
                worst = max((Severity(f.severity) for f in failing), key=lambda s: s.rank)
                failure = ET.SubElement(
                    case,
                    "failure",
                    message=_xml_text("; ".join(f.message for f in failing)),
                    type=worst.value,
                )
                failure.text = _xml_text("\n".join(_finding_text(f) for f in failing))
            if passing:
                out = ET.SubElement(case, "system-out")
                out.text = _xml_text("\n".join(_finding_text(f) for f in passing))
            if not found and check in why_skipped:
                skips += 1
                ET.SubElement(case, "skipped", message=_xml_text(why_skipped[check]))
        suite.set("tests", str(len(by_check)))
        suite.set("failures", str(failures))
        suite.set("errors", "0")
        suite.set("skipped", str(skips))
        total_tests += len(by_check)
        total_failures += failures
        total_skipped += skips
    root.set("tests", str(total_tests))
    root.set("failures", str(total_failures))
    root.set("errors", "0")
    root.set("skipped", str(total_skipped))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
