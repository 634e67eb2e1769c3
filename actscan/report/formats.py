"""Report renderings for CI: Markdown (e.g. $GITHUB_STEP_SUMMARY) and JUnit XML.

Pure functions of a Report: nothing here computes statistics or imports torch.
`write_atomic` (actscan.report.output) is re-exported here, where the CLI imports it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from actscan.report.numfmt import NONE, num
from actscan.report.output import write_atomic
from actscan.types import CHECK_ORDER, Dynamics, FailOn, Finding, Severity, finding_order

if TYPE_CHECKING:
    from actscan.report.report import Report

__all__ = ["fmt_count", "to_junit", "to_markdown", "write_atomic"]

_MAX_LAYERS = 3


# -- number formatting ----------------------------------------------------------------


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
        out += ["| severity | check | layers | message | hint |", "| --- | --- | --- | --- | --- |"]
        for f in _sorted_findings(report.findings):
            out.append(
                f"| {Severity(f.severity).value} | {_cell(f.check)} | {_layers_cell(f.layers)} "
                f"| {_cell(f.message)} | {_cell(f.hint)} |"
            )
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
    sections = [(f"Residual stream: {s.name}", s.points, s.summary, f"Stream {s.name}: ")
                for s in report.streams] or [
        ("Residual stream", report.stream, report.summary, "Stream: ")
    ]  # fmt: skip
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
    if report.dynamics is not None:
        out += _dynamics_markdown(report.dynamics)
    if report.notes:
        out += ["", *(f"- {_cell(note)}" for note in report.notes)]
    out += ["", _gate_line(report, gate), ""]
    return "\n".join(out)


def _dynamics_markdown(dyn: Dynamics) -> list[str]:
    """`--steps N`: the optimizer, one row per step (loss, lr, attention max, log Z, the
    probe's change at the last stream point) and the updates per block."""
    o = dyn.optimizer
    out = ["", f"#### Optimizer steps ({len(dyn.steps) - 1})", "",
           f"{o.name}, lr {num(o.lr)}" + (f", warmup {o.warmup}" if o.warmup else "")
           + (f", {o.parametrization}" if o.parametrization != "sp" else "") + ".", "",
           "| t | loss | lr | attn max | log Z | Δ probe (last k) |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for s in dyn.steps:
        last = [c.rel for c in s.change if c.kind == "stream"]
        out.append(
            f"| {s.t} | {num(s.loss)} | {num(s.lr)} | {num(s.attn_max)} "
            f"| {num(s.logits.log_z_mean if s.logits else None)} "
            f"| {num(last[-1] if last else None)} |"
        )
    if dyn.blocks:
        out += ["", "| block | role | median ‖ΔW‖/‖W‖ | max | median grad RMS |",
                "| ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
        for b in dyn.blocks:
            block = NONE if b.block is None else str(b.block)
            out.append(
                f"| {block} | {_cell(b.role)} | {num(b.ratio_median)} | {num(b.ratio_max)} "
                f"| {num(b.grad_rms_median)} |"
            )
    return out


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


def to_junit(reports: Sequence[Report], fail_on: str | FailOn = FailOn.ERROR) -> str:
    """A JUnit XML <testsuites> document: one suite per report, one case per check id.

    Cases follow the one check order (`CHECK_ORDER`). A case fails when its check has a
    finding at or above `fail_on`; findings below the gate go into the case's
    <system-out>. Checks that did not run (`report.skipped`) are <skipped/> with the
    reason; checks that ran without a finding pass. Check ids that are not in `CheckId` but
    occur in findings get a case too, after the known ones.
    """
    gate = FailOn(fail_on)
    root = ET.Element("testsuites", name="actscan")
    total_tests = total_failures = total_skipped = 0
    for report, source in zip(reports, _suite_names(reports), strict=True):
        suite = ET.SubElement(root, "testsuite", name=_xml_text(source))
        by_check: dict[str, list[Finding]] = {c.value: [] for c in CHECK_ORDER}
        for f in report.findings:
            by_check.setdefault(str(f.check), []).append(f)
        failures = skips = 0
        why_skipped = {sk.check: sk.reason for sk in report.skipped}
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
