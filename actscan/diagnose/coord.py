"""The μP coordinate check: how each module's activations scale with width, step by step.

Tensor Programs V (Yang et al. 2022) judges a parametrization by its coordinate check:
train the same architecture at several widths for a few steps and plot mean |x_t| of every
module against width. Under μP every curve is flat at every t (the activations and their
updates stay Θ(1) coordinate-wise); under SP with Adam the updates of the hidden layers
and the readout grow like a power of the width, so the learning rate that is safe at the
small width blows up the large one. This module fits that power, the log–log slope of
mean |x_t| (and of mean |x_t − x_0| for t ≥ 1) against width, per module, per module
group (the plot's lines) and per t, and turns group lines outside the flat band
(`coord-slope`, `coord-shrink`) into the `coord-check` finding.

Input: the sweep's rows, each a scan (a Report, read as a StepsRun) whose `dynamics` holds
the probe batch's ChangeRecords (abs_mean, delta_mean) per step. Pure: no torch, no
printing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from actscan.diagnose.thresholds import Thresholds
from actscan.records import CheckId, Dynamics, Finding, ModelInfo, Severity, StreamPoint, json_as


class StepsRun(Protocol):
    """What the check reads of one row's scan (a Report has it): its model, its stream
    points and its steps. A protocol, so this pure module needs no report."""

    @property
    def model(self) -> ModelInfo: ...

    @property
    def stream(self) -> Sequence[StreamPoint]: ...

    @property
    def dynamics(self) -> Dynamics | None: ...


# Logits (the readout's, and attention scores) are sums of d_model (d_head) products of
# independent factors at init: under μP's 1/width readout multiplier and 1/d_head attention
# scale they shrink like 1/√width, the allowed slope −0.5 (measured −0.49 at t = 0); they
# become Θ(1) only once training correlates the factors. Attention-score records, where a
# change record carries them, keep their slopes but join no group line (not judged).
LOGIT_SHRINK = 0.5
LOGIT_KINDS = frozenset({"head", "attn_logits", "scores", "attn_scores"})

GROUPS = ("embedding", "early", "mid", "late", "head")


@dataclass(frozen=True)
class CoordSlope:
    """One module at step t: its mean |x_t| (and mean |x_t − x_0|) per width, and the
    log–log slopes against width (None: fewer than coord-min-widths positive values)."""

    side: str
    depth: int | None
    name: str
    kind: str  # ChangeRecord.kind: "stream" | a branch role | "head" | …
    k: int | None
    block: int | None
    group: str  # one of GROUPS
    t: int
    abs_mean: tuple[float | None, ...]  # per width, in the sweep's width order
    delta_mean: tuple[float | None, ...]
    abs_slope: float | None
    delta_slope: float | None  # None at t = 0 (x_0 − x_0 = 0)


@dataclass(frozen=True)
class CoordCurve:
    """One module group's line in the coordinate-check plot: the geometric mean of its
    modules' mean |x_t| (and mean |x_t − x_0|) per width, the slopes of those lines, and
    whether either slope leaves the flat band (what `coord-check` judges)."""

    side: str
    depth: int | None
    group: str
    t: int
    abs_mean: tuple[float | None, ...]
    # none at t = 0; written as null then
    delta_mean: tuple[float | None, ...] = field(default=(), metadata=json_as(empty_null=True))
    abs_slope: float | None = None
    delta_slope: float | None = None
    beyond: bool = False


@dataclass(frozen=True)
class CoordCheck:
    """The coordinate check of a width sweep with steps."""

    widths: tuple[int, ...]
    steps: int
    lr: float | None
    bound: float  # coord-slope: the largest slope that is flat (growth side)
    shrink: float  # coord-shrink: the most negative slope that is flat is −shrink
    slopes: tuple[CoordSlope, ...]
    curves: tuple[CoordCurve, ...]
    findings: tuple[Finding, ...]


# -- fitting --------------------------------------------------------------------------------
def fit_slope(xs: Sequence[float], ys: Sequence[float | None], min_points: int) -> float | None:
    """Least-squares slope of log y against log x over the pairs with finite y > 0; None
    with fewer than `min_points` such pairs or a single distinct x."""
    pts = [
        (math.log(x), math.log(y))
        for x, y in zip(xs, ys, strict=True)
        if x > 0 and isinstance(y, int | float) and math.isfinite(y) and y > 0
    ]
    if len(pts) < max(2, min_points):
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def block_group(block: int, n_blocks: int) -> str:
    """Thirds of the stack by block centre: 2 blocks are early, late; 3 early, mid, late."""
    pos = (block + 0.5) / max(n_blocks, 1)
    return "early" if pos < 1 / 3 else "late" if pos > 2 / 3 else "mid"


def _stream_blocks(report: StepsRun) -> dict[int, int | None]:
    return {p.k: p.block for p in report.stream}


def _group(kind: str, k: int | None, block: int | None, n_blocks: int) -> str:
    """head; embedding (the stream at k = 0, as the first block sees it); else the
    third of the stack the module's block is in."""
    if kind == "head":
        return "head"
    if (kind == "stream" and k == 0) or kind in ("embed", "embedding") or block is None:
        return "embedding"
    return block_group(block, n_blocks)


def _geomean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, float) and math.isfinite(v) and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def coord_slopes(
    rows: Sequence[tuple[str, int | None, int, StepsRun]], min_widths: int, th: Thresholds
) -> tuple[tuple[int, ...], tuple[CoordSlope, ...], tuple[CoordCurve, ...]]:
    """Slopes per (side, depth) × module × t from rows (side, depth, width, report).

    Rows without dynamics are left out; a module is fitted over the widths that measured
    it. Modules keep the order of the first row's change records (execution order)."""
    widths = tuple(sorted({w for _, _, w, r in rows if r.dynamics is not None}))
    series: dict[tuple[str, int | None], dict[int, StepsRun]] = {}
    for side, depth, width, report in rows:
        if report.dynamics is not None:
            series.setdefault((side, depth), {})[width] = report
    slopes: list[CoordSlope] = []
    curves: list[CoordCurve] = []
    for (side, depth), by_width in series.items():
        first = by_width[min(by_width)]
        assert first.dynamics is not None
        n_blocks = first.model.n_blocks or 1 + max(
            (c.block for s in first.dynamics.steps for c in s.change if c.block is not None),
            default=0,
        )
        blocks = _stream_blocks(first)
        n_steps = max(len(r.dynamics.steps) for r in by_width.values() if r.dynamics)
        keys: dict[tuple[str, str, int | None, int | None], None] = {}
        for st in first.dynamics.steps[:1]:
            for c in st.change:
                keys[(c.name, c.kind, c.k, c.block)] = None
        for t in range(n_steps):
            table: dict[tuple[str, str, int | None, int | None], dict[int, tuple]] = {}
            for w, r in by_width.items():
                assert r.dynamics is not None
                if t >= len(r.dynamics.steps):
                    continue
                for c in r.dynamics.steps[t].change:
                    key = (c.name, c.kind, c.k, c.block)
                    keys.setdefault(key, None)
                    table.setdefault(key, {})[w] = (c.abs_mean, c.delta_mean)
            group_vals: dict[str, list[tuple[tuple, tuple]]] = {}
            for key in keys:
                name, kind, k, block = key
                got = table.get(key, {})
                absv = tuple(got.get(w, (None, None))[0] for w in widths)
                delv = tuple(got.get(w, (None, None))[1] for w in widths)
                blk = block if block is not None else blocks.get(k) if k is not None else None
                group = _group(kind, k, blk, n_blocks)
                slope = CoordSlope(
                    side=side,
                    depth=depth,
                    name=name,
                    kind=kind,
                    k=k,
                    block=blk,
                    group=group,
                    t=t,
                    abs_mean=absv,
                    delta_mean=delv,
                    abs_slope=fit_slope(widths, absv, min_widths),
                    delta_slope=fit_slope(widths, delv, min_widths) if t else None,
                )
                slopes.append(slope)
                if kind not in LOGIT_KINDS or kind == "head":
                    group_vals.setdefault(group, []).append((absv, delv))
            for group in GROUPS:
                if group not in group_vals:
                    continue
                vals = group_vals[group]
                absc = tuple(_geomean([a[i] for a, _ in vals]) for i in range(len(widths)))
                delc = tuple(_geomean([d[i] for _, d in vals]) for i in range(len(widths)))
                a_slope = fit_slope(widths, absc, min_widths)
                d_slope = fit_slope(widths, delc, min_widths) if t else None
                low, high = allowed("head" if group == "head" else "stream", th)
                out = any(v is not None and not low <= v <= high for v in (a_slope, d_slope))
                curves.append(
                    CoordCurve(
                        side=side,
                        depth=depth,
                        group=group,
                        t=t,
                        abs_mean=absc,
                        delta_mean=delc if t else (),
                        abs_slope=a_slope,
                        delta_slope=d_slope,
                        beyond=out,
                    )
                )
    return widths, tuple(slopes), tuple(curves)


def narrow_drive(
    rows: Sequence[tuple[str, int | None, int, StepsRun]],
) -> dict[tuple[str, int | None], tuple[int, float]]:
    """Per side (and depth): its narrowest width with steps, and how hard the steps drove
    it: the median over its weight matrices of each one's median update ratio
    ‖W_t − W_{t−1}‖/‖W_{t−1}‖ (UpdateRecord.ratio). A side whose narrowest row recorded
    no weight updates is left out."""
    narrow: dict[tuple[str, int | None], tuple[int, StepsRun]] = {}
    for side, depth, width, report in rows:
        key = (side, depth)
        if report.dynamics is not None and (key not in narrow or width < narrow[key][0]):
            narrow[key] = (width, report)
    out: dict[tuple[str, int | None], tuple[int, float]] = {}
    for key, (width, report) in narrow.items():
        assert report.dynamics is not None
        per = []
        for u in report.dynamics.updates:
            ratios = [r for r in u.ratio if isinstance(r, float) and math.isfinite(r)]
            if u.kind == "weight" and ratios:
                per.append(statistics.median(ratios))
        if per:
            out[key] = (width, statistics.median(per))
    return out


# -- judging ----------------------------------------------------------------------------------
def allowed(kind: str, th: Thresholds) -> tuple[float, float]:
    """The slope interval that counts as flat: [−coord-shrink, coord-slope]; logits may
    shrink like 1/√width, [−0.5 − coord-slope, coord-slope]."""
    if kind in LOGIT_KINDS:
        return -LOGIT_SHRINK - th.coord_slope, th.coord_slope
    return -th.coord_shrink, th.coord_slope


def _over(value: float | None, low: float, high: float, up: bool) -> float:
    """How far `value` lies beyond the band on one side (≤ 0: inside, or no value)."""
    if value is None:
        return 0.0
    return value - high if up else low - value


def _module_key(s: CoordSlope) -> tuple[str, str, int | None, int | None]:
    return (s.name, s.kind, s.k, s.block)


def _exec_key(s: CoordSlope, first: dict[tuple, int]) -> tuple[float, int, int]:
    """Execution order: the stream's input, each block's branches then its output, the
    head (the engine records stream points first)."""
    idx = first[_module_key(s)]
    if s.kind == "head":
        return (math.inf, 0, idx)
    if s.block is None:
        return (-1, 0, idx)
    return (s.block, 1 if s.kind == "stream" else 0, idx)


def _fmt_slope(s: CoordSlope | CoordCurve, quantity: str, value: float) -> str:
    what = "Δ" if quantity == "delta" else "|x|"
    return f"{what} {value:+.2f} at t={s.t}"


def _texts(
    up: bool,
    head: str,
    span: str,
    glist: str,
    mlist: str,
    th: Thresholds,
    drove: tuple[int, float] | None,
    lr: float | None,
) -> tuple[Severity, str, str]:
    """A finding's severity, message and hint: growth, or shrink (info when `drove`, the
    narrowest width and its median update ratio, says that width was overdriven)."""
    if up:
        message = (
            f"{head} grow with {span} beyond the flat band (slope ≤ {th.coord_slope:g}; "
            f"log–log slope of the group's mean |x|): {glist}. Worst modules: {mlist}. Under "
            "μTransfer the learning rate tuned at the small width makes these blow up at the "
            "large one."
        )
        hint = (
            "Use μP (Tensor Programs V, Table 3, Adam): hidden matrices' learning rate "
            "and init variance ∝ 1/width, readout ×1/width (or zero-initialised), "
            "attention 1/d_head; built-in configs: --set parametrization=mup."
        )
        return Severity.WARN, message, hint
    message = (
        f"{head} shrink with {span} beyond the flat band (slope ≥ −{th.coord_shrink:g}; "
        f"logits may shrink like 1/√width): {glist}. Worst modules: {mlist}. Their updates "
        "vanish at width (or the narrow models are overdriven at this learning rate), so "
        "tuned rates do not transfer."
    )
    hint = (
        "Check those layers' learning-rate and init scaling against μP (a rate or "
        "multiplier divided by width once too often shrinks the updates; vectors "
        "and embeddings keep lr η under Adam), and that the learning rate is sane "
        "at the smallest width (update-size)."
    )
    if drove is None or drove[1] < th.update_ratio_warn:
        return Severity.WARN, message, hint
    narrow, ratio = drove
    message += (
        f" Weak evidence: the narrowest width ({narrow}) moves its weight matrices by a "
        f"median {ratio:.2f} of their norm per step (≥ update-ratio-warn "
        f"{th.update_ratio_warn:g}), where the narrow model saturates first and the "
        "reference μP (the mup package) shrinks as far."
    )
    # Adam's step is ≈ lr per coordinate: the ratio scales with lr
    lower = f", e.g. --lr {lr * th.update_ratio_warn / ratio / 2:.1g}" if lr else ""
    hint = (
        "To judge the parametrization, rerun the sweep at a learning rate the narrowest "
        f"width takes (its median update ratio below {th.update_ratio_warn:g}{lower}); if "
        f"the groups still shrink there: {hint[0].lower()}{hint[1:]}"
    )
    return Severity.INFO, message, hint


def coord_findings(
    slopes: Sequence[CoordSlope],
    curves: Sequence[CoordCurve],
    th: Thresholds,
    *,
    labels: Mapping[str, str] | None = None,
    widths: Sequence[int] = (),
    drive: Mapping[tuple[str, int | None], tuple[int, float]] | None = None,
    lr: float | None = None,
) -> tuple[Finding, ...]:
    """One finding per side (and depth) and direction.

    A shrink is info, not warn, when `drive` (narrow_drive) says the side's narrowest
    width moved its weight matrices by a median of at least `update-ratio-warn` of their
    norm per step: there the narrow model saturates first and every group line bends
    down, and Microsoft's `mup` package's own μP of the same architecture shrinks to
    −0.80 (docs/checks.md, "μP against the reference"), so the slope cannot tell a
    parametrization error from an overdriven narrow model. Growth stays warn at any
    drive: SP's block groups grow by +1.4…+2.2 there, far past the band (the reference's
    logits reach +0.29, at its edge: the docs give the margin).

    Judged per module group, as the coordinate-check plot is read: a group whose line
    (geometric mean of its modules' mean |x_t|, or mean |x_t − x_0|) has a slope beyond
    the band at some t. One module's slope alone is not enough: at a large learning rate
    the narrowest model's trajectory is chaotic and single modules scatter by ±0.5 under
    μP (docs/checks.md#coord-check). The finding names the flagged groups' modules whose
    own slope leaves the band the same way (all of the group's when none does alone)."""
    span = f"width {widths[0]}→{widths[-1]}" if widths else "width"
    out: list[Finding] = []
    first = {_module_key(s): i for i, s in reversed(list(enumerate(slopes)))}
    sides = list(dict.fromkeys((c.side, c.depth) for c in curves))
    two = len({s for s, _ in sides}) > 1
    for side, depth in sides:
        who = f"{side.upper()} ({(labels or {}).get(side, side)})" if two else ""
        if depth is not None:
            who = f"{who} at depth {depth}".strip()
        who = f"{who}: " if who else ""
        mine = [c for c in curves if (c.side, c.depth) == (side, depth)]
        mods = [s for s in slopes if (s.side, s.depth) == (side, depth)]
        for up in (True, False):
            worst_group: dict[str, tuple[float, CoordCurve, str, float]] = {}
            for c in mine:
                low, high = allowed("head" if c.group == "head" else "stream", th)
                for quantity, v in (("abs", c.abs_slope), ("delta", c.delta_slope)):
                    over = _over(v, low, high, up)
                    if v is not None and over > 0 and over > worst_group.get(c.group, (0,))[0]:
                        worst_group[c.group] = (over, c, quantity, v)
            if not worst_group:
                continue
            named: dict[tuple, tuple[float, CoordSlope, str, float]] = {}
            for group in worst_group:
                in_group = [s for s in mods if s.group == group]
                for s in in_group:
                    low, high = allowed(s.kind, th)
                    for quantity, v in (("abs", s.abs_slope), ("delta", s.delta_slope)):
                        over = _over(v, low, high, up)
                        key = _module_key(s)
                        if v is not None and over > 0 and over > named.get(key, (0,))[0]:
                            named[key] = (over, s, quantity, v)
                if not any(n[1].group == group for n in named.values()):
                    for s in in_group:
                        named.setdefault(_module_key(s), (0.0, s, "abs", s.abs_slope or 0.0))
            layers = tuple(
                dict.fromkeys(
                    n[1].name for n in sorted(named.values(), key=lambda n: _exec_key(n[1], first))
                )
            )
            groups = sorted(worst_group.values(), key=lambda g: GROUPS.index(g[1].group))
            glist = ", ".join(f"{g[1].group} {_fmt_slope(g[1], g[2], g[3])}" for g in groups)
            top = sorted(named.values(), key=lambda n: -n[0])[:3]
            mlist = "; ".join(f"{n[1].name} {_fmt_slope(n[1], n[2], n[3])}" for n in top)
            worst = max(worst_group.values(), key=lambda g: g[0])
            head = f"{who}{len(groups)} module group(s)"
            drove = (drive or {}).get((side, depth))
            severity, message, hint = _texts(up, head, span, glist, mlist, th, drove, lr)
            out.append(
                Finding(
                    check=CheckId.COORD_CHECK,
                    severity=severity,
                    layers=layers,
                    value=worst[3],
                    threshold=th.coord_slope if up else -th.coord_shrink,
                    message=message,
                    hint=hint,
                )
            )
    return tuple(out)


def coord_check(
    rows: Sequence[tuple[str, int | None, int, StepsRun]],
    th: Thresholds,
    *,
    labels: Mapping[str, str] | None = None,
) -> CoordCheck | None:
    """The coordinate check of a width sweep, or None when no row took steps or fewer
    than two widths did."""
    min_widths = max(2, int(th.coord_min_widths))
    widths, slopes, curves = coord_slopes(rows, min_widths, th)
    if len(widths) < 2:
        return None
    dyn = next(r.dynamics for _, _, _, r in rows if r.dynamics is not None)
    assert dyn is not None
    return CoordCheck(
        widths=widths,
        steps=max(len(r.dynamics.steps) for *_, r in rows if r.dynamics is not None) - 1,
        lr=dyn.optimizer.lr,
        bound=th.coord_slope,
        shrink=th.coord_shrink,
        slopes=slopes,
        curves=curves,
        findings=coord_findings(
            slopes,
            curves,
            th,
            labels=labels,
            widths=widths,
            drive=narrow_drive(rows),
            lr=dyn.optimizer.lr,
        ),
    )
