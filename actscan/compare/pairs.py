"""Two Reports side by side: a pure comparison, no torch.

It matches the layers, stream points and branches of two Reports, takes ratios (always
B ÷ A), splits findings into A only / B only / both and words a one-line verdict. The
divergence records (`Divergence`) are filled by the precision-divergence pass, which runs
a model and lives in compare/precision.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from actscan.compare.steps import StepsComparison, compare_steps
from actscan.numfmt import num
from actscan.records import Finding, LayerRecord, StreamPoint, json_as
from actscan.report.codec import to_json_obj
from actscan.report.output import dumps
from actscan.report.report import SCHEMA_VERSION, Report
from actscan.version import __version__


# -- records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerPair:
    """One layer of A and its partner in B (matched by name, else by structure)."""

    name_a: str
    name_b: str
    role: str
    block: int | None
    matched_by: str  # "name" | "structure"
    rms_a: float | None
    rms_b: float | None
    ratio: float | None  # rms_b / rms_a
    grad_rms_a: float | None
    grad_rms_b: float | None
    grad_ratio: float | None


@dataclass(frozen=True)
class StreamPair:
    """The residual stream at the same k in A and B (None where one side has no point)."""

    k: int
    block: int | None
    name_a: str | None
    name_b: str | None
    rms_a: float | None
    rms_b: float | None
    ratio: float | None
    grad_rms_a: float | None
    grad_rms_b: float | None
    grad_ratio: float | None


@dataclass(frozen=True)
class BranchPair:
    block: int
    kind: str  # "attn" | "mlp"
    name_a: str | None
    name_b: str | None
    ratio_a: float | None  # branch RMS ÷ entering stream RMS, side A
    ratio_b: float | None
    rms_ratio: float | None  # branch RMS B ÷ A
    # What the stream receives when that is not the branch's own output (a post-branch
    # norm or gain, as the layout proof found): its RMS ÷ the entering stream, and B ÷ A.
    # None on a side whose stream receives the branch itself.
    write_ratio_a: float | None = None
    write_ratio_b: float | None = None
    write_rms_ratio: float | None = None


@dataclass(frozen=True)
class FindingDiff:
    a_only: tuple[Finding, ...] = ()
    b_only: tuple[Finding, ...] = ()
    both: tuple[tuple[Finding, Finding], ...] = field(default=(), metadata=json_as(keys=("a", "b")))


@dataclass(frozen=True)
class LayerDivergence:
    """Outputs of one module in the lower precision against the higher one (one batch)."""

    name: str
    role: str
    block: int | None
    order: int  # first-call index in execution order
    rel_err: float | None  # ‖a − b‖ / ‖a‖, a = higher precision
    cosine: float | None  # ⟨a, b⟩ / (‖a‖ ‖b‖)
    rms: float | None  # RMS of the reference output


@dataclass(frozen=True)
class Divergence:
    reference: str  # label of the higher-precision side ("fp32")
    other: str  # label of the lower-precision side ("bf16")
    reference_side: str  # "a" | "b"
    threshold: float
    scope: str  # "stream+branches" | "all"
    first: str | None  # first layer (execution order) whose rel_err exceeds threshold
    layers: tuple[LayerDivergence, ...]

    @property
    def worst(self) -> LayerDivergence | None:
        finite = [d for d in self.layers if d.rel_err is not None]
        return max(finite, key=lambda d: _sortable(d.rel_err), default=None)

    def layer(self, name: str) -> LayerDivergence:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(name)


@dataclass(frozen=True)
class Comparison:
    a: Report
    b: Report
    label_a: str
    label_b: str
    layers: tuple[LayerPair, ...]
    stream: tuple[StreamPair, ...]
    branches: tuple[BranchPair, ...]
    unmatched_a: tuple[str, ...]
    unmatched_b: tuple[str, ...]
    findings: FindingDiff
    divergence: Divergence | None = None
    verdict: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (stream name, its points paired by k) per residual stream both sides have, when a
    # side has several (encoder-decoder); `stream` is the primary (decoder) one's
    streams: tuple[tuple[str, tuple[StreamPair, ...]], ...] = ()
    # both sides took optimizer steps (`--steps N`): their dynamics side by side
    steps: StepsComparison | None = None

    @property
    def match(self) -> str:
        return "name" if all(p.matched_by == "name" for p in self.layers) else "name+structure"

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document of `actscan compare` (docs/interface-extensions.md)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "compare",
            "tool": {"name": "actscan", "version": __version__},
            "labels": {"a": self.label_a, "b": self.label_b},
            "match": self.match,
            "stream": to_json_obj(self.stream),
            "streams": [
                {"name": name, "points": to_json_obj(pairs)} for name, pairs in self.streams
            ],
            "branches": to_json_obj(self.branches),
            "layers": to_json_obj(self.layers),
            "unmatched": {"a": list(self.unmatched_a), "b": list(self.unmatched_b)},
            "summary": {"a": to_json_obj(self.a.summary), "b": to_json_obj(self.b.summary)},
            "findings": to_json_obj(self.findings),
            "divergence": to_json_obj(self.divergence),
            **({"steps": to_json_obj(self.steps)} if self.steps is not None else {}),
            "verdict": self.verdict,
            "notes": list(self.notes),
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)


# -- numbers --------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    """b ÷ a; 1 when both are 0 (nothing changed), inf when only a is 0, None if missing."""
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return float("nan")
    if a == 0:
        return 1.0 if b == 0 else math.copysign(math.inf, b)
    return b / a


def _sortable(x: float | None) -> float:
    if x is None or math.isnan(x):
        return math.inf  # non-finite divergence is the worst there is
    return x


# -- matching ---------------------------------------------------------------------------------
_LINEAR_TYPES = ("Linear", "Conv1D", "Conv1d")


def _kind(rec: LayerRecord) -> str:
    """Coarse module kind that survives renaming: projections meet projections."""
    if rec.type.endswith(_LINEAR_TYPES):
        return "linear"
    return "dropout" if "Dropout" in rec.type else "module"


def _structural_keys(layers: Sequence[LayerRecord]) -> dict[str, tuple[Any, ...]]:
    """(role, block, nesting depth inside the block, kind, position) per layer name.

    Positions follow execution order, so `blocks.3.mlp.down` in one model meets
    `transformer.h.3.mlp.c_proj` in another: both the 2nd projection, one level inside
    block 3's MLP branch.
    """
    block_names = {r.block: r.name for r in layers if r.role == "stream" and r.block is not None}
    groups: dict[tuple[Any, ...], list[tuple[int, int, str]]] = defaultdict(list)
    for i, r in enumerate(layers):
        prefix = block_names.get(r.block) if r.block is not None else None
        depth = None
        if prefix is not None and r.name.startswith(prefix + "."):
            depth = r.name[len(prefix) + 1 :].count(".") + 1
        groups[(r.role, r.block, depth, _kind(r))].append(
            (r.order if r.order >= 0 else 10**9, i, r.name)
        )
    keys: dict[str, tuple[Any, ...]] = {}
    for group, items in groups.items():
        for pos, (_, _, name) in enumerate(sorted(items)):
            keys[name] = (*group, pos)
    return keys


def match_layers(
    a: Sequence[LayerRecord], b: Sequence[LayerRecord]
) -> tuple[tuple[LayerPair, ...], tuple[str, ...], tuple[str, ...]]:
    """Pairs by exact name first; the rest by structure (role, block, nesting, kind,
    position); leftovers are unmatched."""
    by_name_b = {r.name: r for r in b}
    pairs: list[tuple[LayerRecord, LayerRecord, str]] = []
    left_a: list[LayerRecord] = []
    for r in a:
        partner = by_name_b.pop(r.name, None)
        if partner is None:
            left_a.append(r)
        else:
            pairs.append((r, partner, "name"))
    keys_a, keys_b = _structural_keys(a), _structural_keys(b)
    left_b = {keys_b[r.name]: r for r in b if r.name in by_name_b}
    unmatched_a: list[str] = []
    for r in left_a:
        partner = left_b.pop(keys_a[r.name], None)
        if partner is None:
            unmatched_a.append(r.name)
        else:
            pairs.append((r, partner, "structure"))
    order_a = {r.name: i for i, r in enumerate(a)}
    pairs.sort(key=lambda t: order_a[t[0].name])
    out = tuple(
        LayerPair(
            name_a=x.name,
            name_b=y.name,
            role=x.role,
            block=x.block,
            matched_by=how,
            rms_a=x.rms,
            rms_b=y.rms,
            ratio=ratio(x.rms, y.rms),
            grad_rms_a=x.grad_rms,
            grad_rms_b=y.grad_rms,
            grad_ratio=ratio(x.grad_rms, y.grad_rms),
        )
        for x, y, how in pairs
    )
    unmatched_b = tuple(r.name for r in b if r.name in {v.name for v in left_b.values()})
    return out, tuple(unmatched_a), unmatched_b


def match_stream(a: Sequence[StreamPoint], b: Sequence[StreamPoint]) -> tuple[StreamPair, ...]:
    """Stream points paired by k (residual additions so far): the depth axis both share."""
    pa, pb = {p.k: p for p in a}, {p.k: p for p in b}
    out = []
    for k in sorted(pa.keys() | pb.keys()):
        x, y = pa.get(k), pb.get(k)
        out.append(
            StreamPair(
                k=k,
                block=pa[k].block if k in pa else pb[k].block,
                name_a=x.name if x else None,
                name_b=y.name if y else None,
                rms_a=x.rms if x else None,
                rms_b=y.rms if y else None,
                ratio=ratio(x.rms, y.rms) if x and y else None,
                grad_rms_a=x.grad_rms if x else None,
                grad_rms_b=y.grad_rms if y else None,
                grad_ratio=ratio(x.grad_rms, y.grad_rms) if x and y else None,
            )
        )
    return tuple(out)


def match_streams(a: Report, b: Report) -> tuple[tuple[str, tuple[StreamPair, ...]], ...]:
    """Each residual stream both reports have, its points paired by (stream, k)."""
    sb = {s.name: s for s in b.streams}
    return tuple(
        (s.name, match_stream(s.points, sb[s.name].points)) for s in a.streams if s.name in sb
    )


def match_branches(a: Report, b: Report) -> tuple[BranchPair, ...]:
    ba = {(r.block, r.kind): r for r in a.branches}
    bb = {(r.block, r.kind): r for r in b.branches}
    out = []
    for key in sorted(ba.keys() | bb.keys(), key=lambda t: (t[0], t[1] != "attn")):
        x, y = ba.get(key), bb.get(key)
        out.append(
            BranchPair(
                block=key[0],
                kind=key[1],
                name_a=x.name if x else None,
                name_b=y.name if y else None,
                ratio_a=x.ratio if x else None,
                ratio_b=y.ratio if y else None,
                rms_ratio=ratio(x.rms, y.rms) if x and y else None,
                write_ratio_a=x.write_ratio if x and x.write else None,
                write_ratio_b=y.write_ratio if y and y.write else None,
                write_rms_ratio=(
                    ratio(x.write_rms, y.write_rms) if x and y and x.write and y.write else None
                ),
            )
        )
    return tuple(out)


def diff_findings(
    a: Sequence[Finding], b: Sequence[Finding], a_to_b: Mapping[str, str]
) -> FindingDiff:
    """Same check on both sides = "both" (severity may differ). Within a check, findings
    whose layers map onto each other pair first, the rest in order."""
    paired: dict[int, Finding] = {}  # index in a → its partner in b
    b_left = list(b)
    for exact in (True, False):  # all exact layer matches first, then any of the check
        for i, fa in enumerate(a):
            if i in paired:
                continue
            mapped = tuple(a_to_b.get(n, n) for n in fa.layers)
            hit = next(
                (
                    fb
                    for fb in b_left
                    if fb.check == fa.check and (fb.layers == mapped or not exact)
                ),
                None,
            )
            if hit is not None:
                b_left.remove(hit)
                paired[i] = hit
    both = [(fa, paired[i]) for i, fa in enumerate(a) if i in paired]
    a_only = [fa for i, fa in enumerate(a) if i not in paired]
    return FindingDiff(a_only=tuple(a_only), b_only=tuple(b_left), both=tuple(both))


def compare_reports(
    a: Report,
    b: Report,
    *,
    label_a: str = "A",
    label_b: str = "B",
    divergence: Divergence | None = None,
) -> Comparison:
    """Everything the compare table shows, computed once."""
    layers, un_a, un_b = match_layers(a.layers, b.layers)
    stream = match_stream(a.stream, b.stream)
    streams = match_streams(a, b)
    a_to_b = {p.name_a: p.name_b for p in layers}
    for pairs in (stream, *(ps for _, ps in streams)):
        a_to_b.update({p.name_a: p.name_b for p in pairs if p.name_a and p.name_b})
    findings = diff_findings(a.findings, b.findings, a_to_b)
    notes: list[str] = []
    if un_a or un_b:
        notes.append(
            f"{len(un_a)} layer(s) of A and {len(un_b)} of B have no partner "
            "(matched by name, then by role, block and position in the block)"
        )
    cmp = Comparison(
        a=a,
        b=b,
        label_a=label_a,
        label_b=label_b,
        layers=layers,
        stream=stream,
        branches=match_branches(a, b),
        unmatched_a=un_a,
        unmatched_b=un_b,
        findings=findings,
        divergence=divergence,
        notes=tuple(notes),
        streams=streams,
        steps=compare_steps(a.dynamics, b.dynamics, label_a=label_a, label_b=label_b)
        if a.dynamics is not None and b.dynamics is not None
        else None,
    )
    return replace(cmp, verdict=verdict(cmp))


# -- verdict ---------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    if x is None or isinstance(x, str) or not math.isfinite(x):
        return num(x)
    return f"{100 * x:.2g}%"


def _badness(findings: Sequence[Finding]) -> tuple[int, int]:
    """(worst severity rank, count at that rank); (-1, 0) without findings."""
    if not findings:
        return -1, 0
    worst = max(f.severity.rank for f in findings)
    return worst, sum(1 for f in findings if f.severity.rank == worst)


def verdict(cmp: Comparison) -> str:
    """One line: what changed from A to B, in the terms a user acts on."""
    d = cmp.divergence
    if d is not None:
        lo, hi = d.other, d.reference
        if d.first is not None:
            rec = d.layer(d.first)
            return (
                f"{lo} departs from {hi} by more than {_pct(d.threshold)} (relative RMS error) "
                f"from {d.first} on ({_pct(rec.rel_err)}, cos {num(rec.cosine)}): "
                f"run it in the precision you will actually train in."
            )
        w = d.worst
        where = f" (largest {_pct(w.rel_err)} at {w.name})" if w else ""
        return (
            f"{lo} stays within {_pct(d.threshold)} of {hi} (relative RMS error) at every "
            f"measured layer{where}; still, run it in the precision you will actually train in."
        )
    same = all(p.ratio == 1.0 for p in cmp.stream) and all(
        p.ratio == 1.0 for p in cmp.layers if p.ratio is not None
    )
    fd = cmp.findings
    if same and not fd.a_only and not fd.b_only and not cmp.unmatched_a and not cmp.unmatched_b:
        return "A and B measure the same: every matched ratio is 1 and the findings agree."
    ga, gb = cmp.a.summary.growth, cmp.b.summary.growth
    parts = []
    if isinstance(ga, float) and isinstance(gb, float) and ga > 0 and gb > 0:
        flatter = "B" if abs(math.log(gb)) < abs(math.log(ga)) else "A"
        parts.append(
            f"{flatter} keeps the stream flatter (growth over the embedding "
            f"×{num(ga)} in A, ×{num(gb)} in B)"
        )
    last = next((p for p in reversed(cmp.stream) if p.ratio is not None), None)
    if last is not None:
        parts.append(f"final stream RMS B/A ×{num(last.ratio)}")
    checks = lambda fs: ", ".join(dict.fromkeys(f.check for f in fs))  # noqa: E731
    if fd.a_only:
        parts.append(f"B clears {len(fd.a_only)} finding(s) of A ({checks(fd.a_only)})")
    if fd.b_only:
        parts.append(f"B adds {len(fd.b_only)} ({checks(fd.b_only)})")
    if not fd.a_only and not fd.b_only:
        parts.append("same findings on both sides" if fd.both else "no findings on either side")
    ba, bb = _badness(cmp.a.findings), _badness(cmp.b.findings)
    if ba != bb:
        parts.append(f"{'B' if bb < ba else 'A'} is the healthier side")
    return "; ".join(parts) + "."
