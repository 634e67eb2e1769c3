"""The first optimizer steps (`--steps N`): update sizes, amplification of the output change
through depth, attention-score growth, log-Z drift and Adam's epsilon (theory and the
calibration behind every threshold: docs/checks.md and docs/calibration-dynamics.md).

Each check reads `CheckContext.dynamics` only, and skips with a reason when the run took
no optimizer steps, or when it has nothing finite to judge because the run diverged
(`divergence()`, which the `overflow` check reports as an error: `divergence_findings`).
`statistics()` computes every number the checks judge, once, so the calibration benchmark
records exactly what the checks see.
"""

from __future__ import annotations

import statistics as stats
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actscan.diagnose.common import finding, finite, grade, listing, n, positive, skip
from actscan.diagnose.thresholds import DEFAULT, Thresholds
from actscan.records import MATRIX_KINDS, CheckId, Dynamics, Finding, Severity, Skip, UpdateRecord

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

NO_STEPS = "no optimizer steps (--steps 0)"
ADAM = ("adam", "adamw")
# Parameters whose update ratio is judged for size: MATRIX_KINDS, matrices and embeddings.
# Norm gains and biases start at 1 and 0, so their ratio measures something else.
# A tensor whose first gradient is below this fraction of the median tensor's has none by
# construction (a bias on k: softmax is shift-invariant over keys), not one that shrank;
# adam-epsilon leaves it out.
STRUCTURAL_ZERO = 1e-6
ADAM_EPS_RATIO = DEFAULT.adam_eps_ratio  # numbers() reports the share at the default

DYNAMICS_CHECKS: tuple[str, ...] = (
    CheckId.UPDATE_SIZE.value,
    CheckId.AMPLIFICATION.value,
    CheckId.ATTN_LOGIT_GROWTH.value,
    CheckId.LOGIT_DRIFT.value,
    CheckId.ADAM_EPSILON.value,
)


# The checks that read the first optimizer steps, and overflow (a step that went
# non-finite): what an lr's first steps are judged by (`sweep --lrs`, the ground truth).
STEP_CHECKS: tuple[str, ...] = tuple(
    c.value
    for c in (
        CheckId.UPDATE_SIZE,
        CheckId.AMPLIFICATION,
        CheckId.ATTN_LOGIT_GROWTH,
        CheckId.LOGIT_DRIFT,
        CheckId.ADAM_EPSILON,
        CheckId.OVERFLOW,
    )
)


@dataclass(frozen=True)
class DynStats:
    """The numbers the dynamics checks judge (None: not measured in this run)."""

    steps: int
    lr: float
    adam: bool
    # per matrix parameter: median over the steps (the first update left out when there
    # are 3 or more) of ‖W_t − W_{t−1}‖ / ‖W_{t−1}‖
    update: dict[str, float] = field(default_factory=dict)
    update_block: dict[str, int | None] = field(default_factory=dict)
    update_kind: dict[str, str] = field(default_factory=dict)
    # parameters that did not move at all over the steps (every ratio exactly 0)
    frozen: tuple[str, ...] = ()
    # the probe's change rel per block output after the first update (k, name, rel), its
    # shape statistic (late ÷ early slope through depth), and rel at the last block output
    # after the first and after the last step
    change: tuple[tuple[int, str, float], ...] = ()
    sustain: float | None = None
    change_first: float | None = None
    change_last: float | None = None
    attn: tuple[float, ...] = ()  # attention max per step
    attn_growth: float | None = None  # attn max at the last step / at step 0
    # per attention layer (StepRecord.attn_layers): its max at the first and the last step
    # it was measured
    attn_layers: dict[str, tuple[float, float]] = field(default_factory=dict)
    log_z: tuple[float, ...] = ()  # log Z mean per step
    log_z_drift: float | None = None  # largest |log Z_t − log Z_0|
    # largest |log Z_t − log Z_0| − max(0, loss_0 − loss_t): the drift beyond what the loss
    # learned (a model that learns a peaked distribution raises log Z as its loss falls)
    log_z_excess: float | None = None
    # largest (max logit_t − mean log Z_t) after an update, t ≥ 1, and its step: how far
    # the top logit stands above the average normaliser (a softmax's log Z is never below
    # its own top logit, so past 0 some positions' logits ran away from the rest)
    logit_peak: float | None = None
    logit_peak_step: int | None = None
    logit_peak_start: float | None = None  # the same at step 0 (the init's)
    # per matrix parameter: ‖W_N − W_0‖/‖W_0‖ after the last step (UpdateRecord.drift)
    drift: dict[str, float] = field(default_factory=dict)
    # the same for every norm gain that starts away from 0 (a gain at 1: its relative
    # movement is Adam's Σ lr_t × the update's coherence, whatever the matrices' init)
    gain_drift: dict[str, float] = field(default_factory=dict)
    # per parameter: Adam's update per coordinate at the last step ÷ at the first, each ÷
    # its step's lr (UpdateRecord.step_rms): ≈ 0.2–1 while the gradient is above eps, → 0
    # when the update collapsed (the first Adam step is ≈ lr in every coordinate)
    collapse: dict[str, float] = field(default_factory=dict)
    loss: tuple[float | None, ...] = ()
    # Adam: per parameter, the smallest gradient RMS over the steps ÷ eps
    grad_over_eps: dict[str, float] = field(default_factory=dict)
    eps: float | None = None
    numel: dict[str, int] = field(default_factory=dict)
    # the tensors within adam-eps-ratio × eps (at the thresholds `statistics` was given)
    eps_low_set: frozenset[str] = frozenset()

    def collapsed(self, below: float) -> tuple[list[str], float]:
        """Tensors whose gradient fell to ≤ adam-eps-ratio × eps (`grad_over_eps`) and
        whose update collapsed to ≤ `below` of the first (smallest first), and their share
        of the judged parameters by count of values."""
        low = sorted(
            (
                p
                for p, c in self.collapse.items()
                if c <= below and p in self.grad_over_eps and p in self.eps_low_set
            ),
            key=self.collapse.__getitem__,
        )
        total = sum(self.numel.get(p, 0) for p in self.grad_over_eps)
        share = sum(self.numel.get(p, 0) for p in low) / total if total else 0.0
        return low, share

    @property
    def drift_median(self) -> float | None:
        """The median matrix's cumulative movement after the last step."""
        return stats.median(self.drift.values()) if self.drift else None

    @property
    def gain_drift_median(self) -> float | None:
        """The median norm gain's cumulative movement after the last step."""
        return stats.median(self.gain_drift.values()) if self.gain_drift else None

    def eps_low(self, ratio: float) -> tuple[list[str], float]:
        """Tensors whose gradient RMS fell to ≤ ratio × eps at some step (smallest
        first), and their share of the judged parameters by count of values."""
        low = sorted(
            (p for p, r in self.grad_over_eps.items() if r <= ratio),
            key=self.grad_over_eps.__getitem__,
        )
        total = sum(self.numel.get(p, 0) for p in self.grad_over_eps)
        share = sum(self.numel.get(p, 0) for p in low) / total if total else 0.0
        return low, share

    @property
    def update_max(self) -> float | None:
        return max(self.update.values()) if self.update else None

    @property
    def attn_last(self) -> float | None:
        return self.attn[-1] if self.attn else None


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if finite(x)]
    return stats.median(vals) if vals else None


def _update_stats(updates: Sequence[UpdateRecord]) -> tuple[dict, dict, dict, tuple[str, ...]]:
    ratio: dict[str, float] = {}
    block: dict[str, int | None] = {}
    kind: dict[str, str] = {}
    frozen: list[str] = []
    for u in updates:
        vals = [r for r in u.ratio if finite(r)]
        if vals and all(r == 0 for r in vals) and u.kind in (*MATRIX_KINDS, "norm-gain"):
            frozen.append(u.param)
            continue
        if u.kind not in MATRIX_KINDS:
            continue
        # Adam's first update is lr·sign(g) in every coordinate: its size is set by lr and
        # the init alone, so with 3+ steps the median leaves it out.
        med = _median(u.ratio[1:] if len(u.ratio) >= 3 else u.ratio)
        if med is not None:
            ratio[u.param], block[u.param], kind[u.param] = med, u.block, u.kind
    return ratio, block, kind, tuple(frozen)


def _curve(d: Dynamics, t: int) -> tuple[tuple[int, str, float], ...]:
    """(k, name, rel) of the block outputs (k ≥ 1) on the probe at step t, in depth order."""
    if len(d.steps) <= t:
        return ()
    pts = sorted(
        (c.k, c.name, c.rel)
        for c in d.steps[t].change
        if c.kind == "stream" and c.k is not None and c.k > 0 and finite(c.rel)
    )
    return tuple(pts)


def sustain(curve: Sequence[tuple[int, str, float]]) -> float | None:
    """Late ÷ early slope of rel against k: the second half of the stack's rise per block
    over the first half's. A change that keeps growing linearly (Post-LN) gives ≈ 1, one
    that saturates after the first blocks (Pre-LN) well below 1."""
    if len(curve) < 3:
        return None
    k0, _, r0 = curve[0]
    k1, _, r1 = curve[-1]
    mid = min(curve, key=lambda p: abs(p[0] - (k0 + k1) / 2))
    km, _, rm = mid
    if not (k0 < km < k1):
        return None
    early, late = (rm - r0) / (km - k0), (r1 - rm) / (k1 - km)
    if early <= 0:
        return None
    return late / early


def _drift(
    updates: Sequence[UpdateRecord], kinds: Sequence[str] = MATRIX_KINDS
) -> dict[str, float]:
    """Per parameter of these kinds: ‖W_N − W_0‖/‖W_0‖ after the last finite step (a
    tensor that starts at 0, as Gemma's 1 + w gains, has none)."""
    out: dict[str, float] = {}
    for u in updates:
        last = [x for x in u.drift if finite(x)]
        if u.kind in kinds and last:
            out[u.param] = last[-1]
    return out


def _collapse(d: Dynamics) -> dict[str, float]:
    """Per tensor: (step_rms ÷ lr) at the last step over the same at the first step."""
    lrs = [s.lr for s in d.steps]
    out: dict[str, float] = {}
    for u in d.updates:
        if len(u.step_rms) < 2 or len(lrs) < len(u.step_rms):
            continue
        a, b = u.step_rms[0], u.step_rms[-1]
        la, lb = lrs[0], lrs[len(u.step_rms) - 1]
        if positive(a) and finite(b) and positive(la) and positive(lb):
            out[u.param] = (b / lb) / (a / la)
    return out


def _log_z_excess(d: Dynamics) -> float | None:
    pairs = [
        (s.logits.log_z_mean, s.loss)
        for s in d.steps
        if s.logits and finite(s.logits.log_z_mean) and finite(s.loss)
    ]
    if len(pairs) < 2:
        return None
    z0, l0 = pairs[0]
    return max(abs(z - z0) - max(0.0, l0 - loss) for z, loss in pairs)


def _logit_peak(d: Dynamics) -> tuple[float | None, int | None, float | None]:
    """(the largest max logit − mean log Z after an update, its step, the step-0 value)."""
    peaks = [
        (st.logits.max - st.logits.log_z_mean, t)
        for t, st in enumerate(d.steps)
        if st.logits and finite(st.logits.max) and finite(st.logits.log_z_mean)
    ]
    start = next((p for p, t in peaks if t == 0), None)
    after = [pt for pt in peaks if pt[1] >= 1]
    if not after:
        return None, None, start
    peak, t = max(after)
    return peak, t, start


def statistics(d: Dynamics, eps_ratio: float = ADAM_EPS_RATIO) -> DynStats:
    """Every number the dynamics checks judge, from the Dynamics record."""
    opt = d.optimizer
    adam = opt.name in ADAM
    ratio, block, kind, frozen = _update_stats(d.updates)
    change = _curve(d, 1)
    last = _curve(d, len(d.steps) - 1)
    attn = tuple(s.attn_max for s in d.steps if finite(s.attn_max))
    attn_growth = attn[-1] / attn[0] if len(attn) >= 2 and attn[0] > 0 else None
    per_layer: dict[str, list[float]] = {}
    for st in d.steps:
        for name, v in st.attn_layers:
            if finite(v):
                per_layer.setdefault(name, []).append(v)
    attn_layers = {name: (vs[0], vs[-1]) for name, vs in per_layer.items() if len(vs) >= 2}
    log_z = tuple(s.logits.log_z_mean for s in d.steps if s.logits and finite(s.logits.log_z_mean))
    drift = max(abs(z - log_z[0]) for z in log_z) if len(log_z) >= 2 else None
    peak, peak_step, peak_start = _logit_peak(d)
    g_eps: dict[str, float] = {}
    if adam and positive(opt.eps):
        first = [u.grad_rms[0] for u in d.updates if u.grad_rms and positive(u.grad_rms[0])]
        floor = STRUCTURAL_ZERO * stats.median(first) if first else 0.0
        for u in d.updates:
            gs = [g for g in u.grad_rms if finite(g)]
            if gs and finite(u.grad_rms[0]) and u.grad_rms[0] > floor:
                g_eps[u.param] = min(gs) / opt.eps
    return DynStats(
        steps=len(d.steps) - 1,
        lr=opt.lr,
        adam=adam,
        update=ratio,
        update_block=block,
        update_kind=kind,
        frozen=frozen,
        change=change,
        sustain=sustain(change),
        change_first=change[-1][2] if change else None,
        change_last=last[-1][2] if last else None,
        attn=attn,
        attn_growth=attn_growth,
        attn_layers=attn_layers,
        log_z=log_z,
        log_z_drift=drift,
        loss=tuple(s.loss for s in d.steps),
        grad_over_eps=g_eps,
        eps=opt.eps,
        numel={u.param: u.numel for u in d.updates},
        log_z_excess=_log_z_excess(d),
        logit_peak=peak,
        logit_peak_step=peak_step,
        logit_peak_start=peak_start,
        drift=_drift(d.updates),
        gain_drift=_drift(d.updates, ("norm-gain",)),
        collapse=_collapse(d),
        eps_low_set=frozenset(p for p, r in g_eps.items() if r <= eps_ratio),
    )


def numbers(d: Dynamics) -> dict[str, float | None]:
    """The headline number of each check (for the calibration table)."""
    s = statistics(d)
    return {
        "update_max": s.update_max,
        "update_over_lr": s.update_max / s.lr if s.update_max is not None else None,
        "amplification_sustain": s.sustain,
        "change_first": s.change_first,
        "change_last": s.change_last,
        "attn_max": s.attn_last,
        "attn_growth": s.attn_growth,
        "log_z_drift": s.log_z_drift,
        "grad_over_eps_min": min(s.grad_over_eps.values()) if s.grad_over_eps else None,
        "eps_low_share": s.eps_low(ADAM_EPS_RATIO)[1] if s.grad_over_eps else None,
    }


# ---- divergence: the first non-finite value of the steps (reported by `overflow`) ----------

PARAM_STAGES = ("gradient", "update")


@dataclass(frozen=True)
class Divergence:
    """Where the steps first met an inf/nan (`StepRecord.nonfinite`)."""

    t: int  # the first step that met one
    stage: str  # what held it first at t: activation, attention, loss, gradient, update
    name: str  # the first module or parameter of that stage
    sites: int  # the non-finite (stage, name) entries at t
    # (step, name) of the first non-finite activation; (step, stage, name, count) of the
    # first parameter whose gradient or update was non-finite; the first non-finite loss
    module: tuple[int, str] | None
    param: tuple[int, str, str, int] | None
    loss: int | None


def divergence(d: Dynamics | None) -> Divergence | None:
    """The first step, module and parameter where the steps went non-finite (None: every
    figure they measured was finite)."""
    steps = [s for s in (d.steps if d else ()) if s.nonfinite]
    if not steps:
        return None
    first = steps[0]
    stage, name = first.nonfinite[0]
    module = next(
        ((s.t, nm) for s in steps for st, nm in s.nonfinite if st in ("activation", "attention")),
        None,
    )
    param = None
    for s in steps:
        for want in PARAM_STAGES:
            hit = [nm for st, nm in s.nonfinite if st == want]
            if hit:
                param = (s.t, want, hit[0], len(hit))
                break
        if param:
            break
    loss = next((s.t for s in steps for st, _ in s.nonfinite if st == "loss"), None)
    return Divergence(first.t, stage, name, len(first.nonfinite), module, param, loss)


def diverged_reason(d: Dynamics | None, what: str) -> str | None:
    """'the run diverged at step t: <what>' when it did (the true reason a check has
    nothing finite to judge), else None."""
    div = divergence(d)
    return f"the run diverged at step {div.t}: {what}" if div else None


_STAGE_WORDS = {
    "activation": "output",
    "attention": "attention scores",
    "loss": "loss",
    "gradient": "gradient",
    "update": "update (the weights it wrote)",
}


def divergence_findings(ctx: CheckContext) -> list[Finding]:
    """An error when the steps went non-finite: the first step, module and parameter, and
    the remedy that fits where it started and the run's precision."""
    d = ctx.dynamics
    div = divergence(d)
    if d is None or div is None:
        return []
    fp16 = ctx.run.dtype == "fp16" or ctx.run.amp == "fp16"
    first = (
        "the loss"
        if div.stage == "loss"
        else f"the {_STAGE_WORDS[div.stage]} of {div.name}"
        if div.stage != "update"
        else f"the update after step {div.t}, in {div.name}"
    )
    when = "before any update" if div.t == 0 and div.stage not in PARAM_STAGES else ""
    parts = [
        f"Training diverged at step {div.t}{f' ({when})' if when else ''}: the first "
        f"non-finite value is {first}"
        + (f" ({div.sites} non-finite tensors at that step)" if div.sites > 1 else "")
        + "."
    ]
    if div.param is not None:
        t, stage, name, count = div.param
        of = f"{count} parameter tensor{'s' if count > 1 else ''}"
        if stage == "update":
            parts.append(
                f"The update after step {t} wrote inf/nan into {of} (first: {name}) from "
                "finite gradients."
            )
        else:
            parts.append(f"The gradient after step {t} is inf/nan in {of} (first: {name}).")
    if div.module is not None:
        t, name = div.module
        parts.append(f"The first module with a non-finite output is {name}, at step {t}.")
    if div.loss is not None:
        parts.append(f"The loss is non-finite from step {div.loss}.")
    parts.append(
        "Every figure after that is inf/nan, so the step checks judge only the steps before it."
    )
    layers = [x for x in (div.module and div.module[1], div.param and div.param[2]) if x]
    return [
        finding(
            CheckId.OVERFLOW,
            Severity.ERROR,
            layers or [div.name],
            float(div.sites),
            0.0,
            " ".join(parts),
            _divergence_hint(ctx, div, fp16),
        )
    ]


def _divergence_hint(ctx: CheckContext, div: Divergence, fp16: bool) -> str:
    """The remedy that fits where the run went non-finite, and its precision."""
    d = ctx.dynamics
    assert d is not None
    opt = d.optimizer
    lower = f"lower --lr (≈ {n(opt.lr / 10)}) or add --warmup"
    clip = "clip gradients (torch.nn.utils.clip_grad_norm_, max norm 1)"
    from_finite = div.param is not None and div.param[1] == "update" and div.param[0] == div.t
    if from_finite and ctx.run.dtype == "fp16" and opt.name in ADAM:
        return (
            f"The weights and Adam's state are fp16: eps = {n(opt.eps)} is below fp16's "
            "smallest value (6e-8) and g² underflows to 0, so g/(√v + eps) divides by zero. "
            "Keep fp32 weights and run fp16 under autocast (--dtype fp32 --amp fp16, with "
            "GradScaler's back-off), or train in bf16 (--amp bf16 or --dtype bf16)."
        )
    if fp16:
        return (
            "fp16 tops out at 65504: scale the loss with back-off (torch.amp.GradScaler "
            "halves the scale and skips a step whose gradients are inf/nan) or run bf16 "
            f"(--amp bf16, fp32's range); {lower}, and {clip}."
        )
    if div.t == 0 and div.stage not in PARAM_STAGES:
        return (
            "The model is non-finite before any update: see the profile's overflow finding "
            "(the weights or inputs feeding that module)."
        )
    return f"The steps are too large for this model: {lower}, and {clip}."


def _no_steps(ctx: CheckContext, check: CheckId) -> list[Finding | Skip] | None:
    d = ctx.dynamics
    if d is None or len(d.steps) < 2:
        return [skip(check, NO_STEPS)]
    return None


def _stats(ctx: CheckContext) -> DynStats:
    """statistics() of a run that `_no_steps` let through, so one that took steps."""
    assert ctx.dynamics is not None
    return statistics(ctx.dynamics, ctx.thresholds.adam_eps_ratio)


def _where(params: Sequence[str], block: Mapping[str, int | None]) -> str:
    blocks = sorted({b for p in params if (b := block.get(p)) is not None})
    if not blocks:
        return listing(params)
    if len(blocks) == 1:
        return f"block {blocks[0]} ({listing(params)})"
    return f"blocks {blocks[0]}–{blocks[-1]} ({listing(params)})"


# ---- update-size ---------------------------------------------------------------------------


def update_size(ctx: CheckContext) -> list[Finding | Skip]:
    if (out := _no_steps(ctx, CheckId.UPDATE_SIZE)) is not None:
        return out
    th = ctx.thresholds
    s = _stats(ctx)
    if not s.update and not s.frozen:
        return [
            skip(
                CheckId.UPDATE_SIZE,
                diverged_reason(ctx.dynamics, "no update ratio of a matrix is finite")
                or "no parameter update ratios were recorded",
            )
        ]
    res: list[Finding | Skip] = []
    if s.frozen:
        res.append(
            finding(
                CheckId.UPDATE_SIZE,
                Severity.WARN,
                s.frozen,
                0.0,
                0.0,
                f"{len(s.frozen)} parameter tensor{'s' if len(s.frozen) > 1 else ''} did not "
                f"move in {s.steps} optimizer step{'s' if s.steps > 1 else ''} at lr "
                f"{n(s.lr)}: {listing(s.frozen)}. They get no gradient (detached, unused, "
                f"requires_grad off in the optimizer) or a zero learning rate.",
                "Check that these parameters are in the optimizer's groups with a non-zero "
                "learning rate and reach the loss (a detach, an unused branch).",
            )
        )
    if not s.update:
        return res
    big = sorted(
        (p for p, r in s.update.items() if r >= th.update_ratio_warn), key=lambda p: -s.update[p]
    )
    top = max(s.update, key=s.update.__getitem__)
    med = stats.median(s.update.values())
    moved = s.drift_median
    if not big and moved is not None and moved >= th.update_drift_warn:
        far = sorted((p for p, x in s.drift.items() if x >= moved), key=lambda p: -s.drift[p])
        res.append(
            finding(
                CheckId.UPDATE_SIZE,
                Severity.WARN,
                far,
                moved,
                th.update_drift_warn,
                f"In {s.steps} step{'s' if s.steps > 1 else ''} at lr {n(s.lr)} the median "
                f"matrix moved {pct_(moved)} of its initial norm (‖W_N − W_0‖/‖W_0‖; the "
                f"largest: {pct_(s.drift[far[0]])}, {far[0]}), while each step's ratio stays "
                f"≤ {pct_(s.update[top])}: the weights grow with their updates, so the "
                "per-step ratio hides how far they went. Runs of the ground truth that moved "
                "this far this soon failed to train (docs/calibration-dynamics.md).",
                f"Lower the learning rate (≈ {n(s.lr * th.update_drift_warn / moved / 2)} "
                "halves the movement) or add warmup.",
            )
        )
    if not big and not res_has_warn(res):
        res.extend(_gains_moved(s, th))
    if big:
        worst = s.update[big[0]]
        sev, threshold = grade(worst, th.update_ratio_warn, th.update_ratio_error)
        adam = " Adam's step is ≈ lr per coordinate whatever the gradient, so" if s.adam else ""
        res.append(
            finding(
                CheckId.UPDATE_SIZE,
                sev,
                big,
                worst,
                threshold,
                f"Each step rewrites {pct_(worst)} of {big[0]}'s norm (median of ‖ΔW‖/‖W‖ "
                f"over {_steps_judged(s.steps)}; {n(worst / s.lr)}× the lr {n(s.lr)}); "
                f"{len(big)} of {len(s.update)} matrices {'is' if len(big) == 1 else 'are'} at ≥ "
                f"{pct_(th.update_ratio_warn)}"
                f" per step: {_where(big, s.update_block)}. The median matrix moves "
                f"{pct_(med)} per step.{adam} at this lr the weights are rewritten within "
                f"~{max(1, round(1 / worst))} step{'s' if round(1 / worst) > 1 else ''} and "
                "tiny runs at this update size fail to train (docs/calibration-dynamics.md).",
                f"Lower the learning rate (≈ {n(s.lr * th.update_ratio_warn / worst / 2)} "
                "puts the largest at half the threshold) or add warmup; in a deep stack "
                "scale the residual projections' learning rate with depth rather than "
                "their init alone.",
            )
        )
    outliers = [
        p for p, r in s.update.items() if med > 0 and r >= th.update_outlier * med and p not in big
    ]
    if outliers:
        res.append(
            finding(
                CheckId.UPDATE_SIZE,
                Severity.INFO,
                outliers,
                s.update[top] / med,
                th.update_outlier,
                f"{len(outliers)} matri{'ces' if len(outliers) > 1 else 'x'} move ≥ "
                f"{n(th.update_outlier)}× the median matrix's update ratio ({pct_(med)} per "
                f"step): {_where(outliers, s.update_block)}. Under Adam a tensor initialised "
                "smaller (a 1/√(2L)-scaled projection, a zero-init readout) gets a "
                "relatively larger update at the same lr.",
                "If these are down-scaled on purpose, give them a smaller learning rate in "
                "proportion (μP / depth-μP parameter groups).",
            )
        )
    return res


def _gains_moved(s: DynStats, th: Thresholds) -> list[Finding]:
    """update-size's third rule (Adam): the median norm gain moved ≥ update-gain-drift-warn
    of its initial value, where no init scale hides the lr (docs/calibration-dynamics.md)."""
    gains = s.gain_drift_median
    if not s.adam or gains is None or gains < th.update_gain_drift_warn:
        return []
    far = sorted((p for p, x in s.gain_drift.items() if x >= gains), key=lambda p: -s.gain_drift[p])
    return [
        finding(
            CheckId.UPDATE_SIZE,
            Severity.WARN,
            far,
            gains,
            th.update_gain_drift_warn,
            f"In {s.steps} step{'s' if s.steps > 1 else ''} at lr {n(s.lr)} the median "
            f"norm gain moved {pct_(gains)} of its initial value (‖g_N − g_0‖/‖g_0‖; the "
            f"largest: {pct_(s.gain_drift[far[0]])}, {far[0]}). Gains start at 1 whatever "
            "the matrices' init, and Adam moves each coordinate by ≈ lr per step, so this "
            "is the lr × steps the run took, seen where no init scale hides it: every "
            "run of the ground truth whose gains moved this far this soon failed to "
            "train (docs/calibration-dynamics.md). A wider model can fail at a smaller "
            "movement than this.",
            f"Lower the learning rate (≈ {n(s.lr * th.update_gain_drift_warn / gains / 2)} "
            "puts the movement at half the threshold) or add warmup.",
        )
    ]


def res_has_warn(res: Sequence[Finding | Skip]) -> bool:
    """Has an update-size warning been given (the frozen-tensor one aside)?"""
    return any(isinstance(f, Finding) and f.severity is Severity.WARN and f.value for f in res)


def _steps_judged(steps: int) -> str:
    """Which updates the median covers (the first is left out with 3 or more)."""
    if steps >= 3:
        return f"steps 2–{steps}"
    return "the first step" if steps == 1 else "both steps"


def pct_(x: float) -> str:
    return f"{100 * x:.3g}%"


# ---- amplification -------------------------------------------------------------------------


def amplification(ctx: CheckContext) -> list[Finding | Skip]:
    if (out := _no_steps(ctx, CheckId.AMPLIFICATION)) is not None:
        return out
    th = ctx.thresholds
    s = _stats(ctx)
    if len(s.change) < th.amplification_min_blocks or s.sustain is None:
        need = (
            f"needs the probe's change at {int(th.amplification_min_blocks)} block outputs, "
            f"found {len(s.change)}"
        )
        what = (
            f"after the first update the probe's change is finite at {len(s.change)} block "
            f"outputs, and the check needs {int(th.amplification_min_blocks)}"
        )
        div = diverged_reason(ctx.dynamics, what)
        return [skip(CheckId.AMPLIFICATION, div or need)]
    if s.sustain < th.amplification_sustain or (s.change_first or 0) > th.amplification_linear:
        return []
    first, last = s.change[0], s.change[-1]
    mid = min(s.change, key=lambda p: abs(p[0] - (first[0] + last[0]) / 2))
    placement = ctx.info.arch.get("placement")
    post = " (this is a Post-LN stack)" if placement == "post" else ""
    return [
        finding(
            CheckId.AMPLIFICATION,
            Severity.INFO,
            [first[1], mid[1], last[1]],
            s.sustain,
            th.amplification_sustain,
            f"After the first update the probe's relative change grows linearly through "
            f"depth{post}: ‖x_1 − x_0‖/‖x_0‖ = {n(first[2])} at {first[1]}, {n(mid[2])} at "
            f"{mid[1]}, {n(last[2])} at {last[1]}; the second half of the stack adds "
            f"{n(s.sustain)}× as much change per block as the first. Each block's update is "
            "amplified by every block above it (Admin, Liu et al. 2020), the Post-LN "
            "signature; a Pre-LN stack's change saturates after the first blocks "
            f"(ratio < {n(th.amplification_sustain)}).",
            "Deep Post-LN trains only at smaller learning rates than its shallow version: "
            "use Pre-LN (or a sandwich norm), DeepNorm or Admin initialisation, or lower "
            "the learning rate and add warmup as the stack gets deeper.",
        )
    ]


# ---- attn-logit-growth -----------------------------------------------------------------------


def attn_logit_growth(ctx: CheckContext) -> list[Finding | Skip]:
    if (out := _no_steps(ctx, CheckId.ATTN_LOGIT_GROWTH)) is not None:
        return out
    th = ctx.thresholds
    s = _stats(ctx)
    if len(s.attn) < 2:
        what = f"the attention scores are finite at {len(s.attn)} step{'s' * (len(s.attn) != 1)}"
        div = diverged_reason(ctx.dynamics, what) if s.attn or _any_attn(ctx.dynamics) else None
        return [skip(CheckId.ATTN_LOGIT_GROWTH, div or "no attention scores were recorded")]
    last = s.attn[-1]
    growth = s.attn_growth
    # judged against the scores' own start: a std-0.2 init starts at ~25 and may double
    # in a run that trains; only growth since step 0 is the instability
    grown = growth is None or growth >= th.attn_logit_growth
    if last >= th.attn_logit_cap and grown:
        sev, threshold = Severity.ERROR, th.attn_logit_cap
    elif last >= th.attn_logit_warn and grown:
        sev, threshold = Severity.WARN, th.attn_logit_warn
    elif last >= th.attn_logit_cap:
        sev, threshold = Severity.INFO, th.attn_logit_cap
    else:
        return []
    qk = bool(ctx.info.arch.get("qk_norm"))
    grew = f" (×{n(growth)} since step 0: {n(s.attn[0])})" if growth is not None else ""
    where = ""
    names = _grown_layers(s, sev, th.attn_logit_cap, th.attn_logit_warn, th.attn_logit_growth)
    if names:
        blocks = _attn_blocks(ctx)
        first, _ = s.attn_layers[names[0]]
        block = blocks.get(names[0])
        rule = (
            f"past the cap of {n(th.attn_logit_cap)}"
            if sev is not Severity.WARN
            else f"≥ {n(th.attn_logit_warn)} and grown ≥ ×{n(th.attn_logit_growth)}"
        )
        where = (
            f", in {names[0]}{f' (block {block})' if block is not None else ''} ({n(first)} "
            f"at step 0); "
            + (
                f"the only one of {len(s.attn_layers)} attention layers {rule}"
                if len(names) == 1
                else f"{len(names)} of {len(s.attn_layers)} attention layers are {rule}: "
                f"{_where(names, blocks)}"
            )
        )
    else:  # a record without per-layer maxima: every score marker
        names = sorted({r.name for r in ctx.layers if r.type == "AttentionLogits"})
    return [
        finding(
            CheckId.ATTN_LOGIT_GROWTH,
            sev,
            names or ["attention scores"],
            last,
            threshold,
            f"The largest pre-softmax attention score reached {n(last)} after {s.steps} "
            f"step{'s' if s.steps > 1 else ''} at lr {n(s.lr)}{grew}{where}. "
            + (
                f"They were large from the start and grew less than ×{n(th.attn_logit_growth)}"
                " (a large init, not growth: runs like this trained in the ground truth); "
                "reported, not a warning. "
                if sev is Severity.INFO
                else ""
            )
            + "Scores this large make "
            "attention one-hot and its gradient vanish: Wortsman et al. 2023 trace the "
            "loss divergence of high-lr small-scale runs to this growth; Gemma 2 soft-caps "
            "scores at 50 and Kimi K2's QK-Clip rescales q, k past τ = 100."
            + (
                " The model already normalises q and k, so the growth is in their gains."
                if qk
                else ""
            ),
            "Add QK-norm (qk_norm: true in the built-in family; a LayerNorm/RMSNorm on q "
            "and k per head), a soft cap (tanh, 50) or QK-Clip, or lower the learning rate.",
        )
    ]


def _grown_layers(s: DynStats, sev: Severity, cap: float, warn: float, growth: float) -> list[str]:
    """The attention layers that pass the rule the finding's severity came from, largest
    last maximum first: ≥ cap (error); ≥ warn and grown ≥ `growth`× since their first
    measurement (warn). The overall maximum's layer always qualifies (its first value is
    at most the overall first one, so its growth is at least the overall growth)."""
    if sev is not Severity.WARN:  # error, or info: large by construction
        hit = [name for name, (_, b) in s.attn_layers.items() if b >= cap]
    else:
        hit = [
            name
            for name, (a, b) in s.attn_layers.items()
            if b >= warn and (a <= 0 or b / a >= growth)
        ]
    return sorted(hit, key=lambda name: -s.attn_layers[name][1])


def _attn_blocks(ctx: CheckContext) -> dict[str, int | None]:
    """Attention layer → block: the probes' records, the layout's map, else the block whose
    module contains the layer."""
    layout = ctx.layout
    blocks: dict[str, int | None] = dict(layout.block_of) if layout else {}
    for r in ctx.attention:
        if r.block is not None:
            blocks[r.name] = r.block
    d = ctx.dynamics
    for name in {a for st in (d.steps if d else ()) for a, _ in st.attn_layers} - set(blocks):
        inside = [b for b in (layout.blocks if layout else ()) if name.startswith(b.name + ".")]
        if inside:
            blocks[name] = max(inside, key=lambda b: len(b.name)).index
    return blocks


def _any_attn(d: Dynamics | None) -> bool:
    """Were attention scores recorded at all (finite or not)?"""
    return (
        any(s.attn_layers or any(st == "attention" for st, _ in s.nonfinite) for s in d.steps)
        if d
        else False
    )


# ---- logit-drift ----------------------------------------------------------------------------


def logit_drift(ctx: CheckContext) -> list[Finding | Skip]:
    if (out := _no_steps(ctx, CheckId.LOGIT_DRIFT)) is not None:
        return out
    th = ctx.thresholds
    s = _stats(ctx)
    if len(s.log_z) < 2 or s.log_z_drift is None:
        what = f"log Z of the output logits is finite at {len(s.log_z)} step"
        what += "s" * (len(s.log_z) != 1)
        div = diverged_reason(ctx.dynamics, what) if s.log_z or _any_logits(ctx) else None
        return [skip(CheckId.LOGIT_DRIFT, div or "no output logits were recorded")]
    return _log_z_moved(ctx, s, th) + _logit_peak_warns(ctx, s, th)


def _log_z_moved(ctx: CheckContext, s: DynStats, th: Thresholds) -> list[Finding | Skip]:
    """log Z's drift: info within what the loss learned, a warning beyond it."""
    excess = s.log_z_excess
    if s.log_z_drift is None:
        return []
    if s.log_z_drift < th.log_z_drift and (excess is None or excess < th.log_z_excess):
        return []
    worst = max(range(len(s.log_z)), key=lambda t: abs(s.log_z[t] - s.log_z[0]))
    head = _head_name(ctx)
    learned = s.log_z_drift - excess if excess is not None else None
    if excess is None or excess < th.log_z_excess:
        return [
            finding(
                CheckId.LOGIT_DRIFT,
                Severity.INFO,
                [head],
                s.log_z_drift,
                th.log_z_drift,
                f"log Z of the output softmax moved by {n(s.log_z_drift)} nats in {s.steps} "
                f"step{'s' if s.steps > 1 else ''} ({n(s.log_z[0])} at step 0, "
                f"{n(s.log_z[worst])} at step {worst}); beyond what the loss fell "
                f"({n(max(0.0, learned)) if learned is not None else '–'} nats) that is "
                f"{n(excess) if excess is not None else '–'} nats, under the "
                f"{n(th.log_z_excess)} that warns (`log-z-excess`). A model that learns a "
                "peaked distribution raises log Z as its loss falls (real text), and in the "
                "ground truth runs that trained moved up to 8.4 nats beyond it; reported, "
                "not a warning.",
                "Nothing to do unless log Z keeps drifting once the loss stops falling; a "
                "z-loss (1e-4 · (log Z)², PaLM) pins it at no cost to the loss.",
            )
        ]
    return [
        finding(
            CheckId.LOGIT_DRIFT,
            Severity.WARN,
            [head],
            excess,
            th.log_z_excess,
            f"log Z of the output softmax moved by {n(s.log_z_drift)} nats in {s.steps} "
            f"step{'s' if s.steps > 1 else ''} ({n(s.log_z[0])} at step 0, {n(s.log_z[worst])}"
            f" at step {worst}), {n(excess)} nats more than the loss fell"
            f"{f' ({n(learned)})' if learned is not None and learned > 0 else ''}. The loss "
            "is invariant to a shift of all logits, so nothing holds log Z: it can drift "
            "until the softmax saturates or bf16 loses the logits' differences (PaLM's "
            "output-logit divergence).",
            "Add a z-loss, 1e-4 · (log Z)² as in PaLM, which pins log Z near 0 at no cost "
            "to the loss; a drift this fast in the first steps also means the lr is too high "
            "for the head: lower it or warm it up.",
        )
    ]


def _logit_peak_warns(ctx: CheckContext, s: DynStats, th: Thresholds) -> list[Finding | Skip]:
    """The top logit far above the mean log Z after an update. Its evidence is the ground
    truth's, whose runs all start at init: for a checkpoint (a trained model's logits may
    be that peaked by design) the same number is info."""
    peak, t = s.logit_peak, s.logit_peak_step
    if peak is None or t is None or peak < th.logit_peak_warn:
        return []
    head = _head_name(ctx)
    start = s.logit_peak_start
    kept = start is not None and start >= th.logit_peak_warn
    how = (
        f"it was {n(start)} at init and the updates have not brought it down (an "
        "init whose logits are this far apart is what `logit-scale` judges at step 0)"
        if kept and start is not None
        else f"{'from ' + n(start) + ' at step 0, ' if start is not None else ''}"
        "the logits of a few positions ran away from the rest"
    )
    at_init = ctx.info.at_init
    return [
        finding(
            CheckId.LOGIT_DRIFT,
            Severity.WARN if at_init else Severity.INFO,
            [head],
            peak,
            th.logit_peak_warn,
            f"After step {t} at lr {n(s.lr)} the largest output logit stands {n(peak)} nats "
            f"above the mean log Z of the probe batch: {how}. A position's top logit is "
            "never above its own log Z (≈ log V below it at a uniform init), so past 0 "
            "some positions' softmax is one-hot while the rest is not. In the ground "
            "truth's calibration half every run from init that stood this far after an "
            "update failed to train or spiked: diverging runs whose logits ran away, and "
            "μP runs at small lrs whose large initial peak had not decayed "
            "(docs/calibration-dynamics.md)."
            + (
                ""
                if at_init
                else " That evidence is of models at init; for a checkpoint it is reported, "
                "not a warning."
            ),
            (
                "The init puts the logits this far apart: start the readout smaller "
                "(zero-init, or μP's readout multiplier at the base width); a z-loss "
                "(1e-4 · (log Z)², PaLM) also pulls the positions' log Z together."
                if kept
                else "Lower the learning rate (the head's first), warm it up, or add a z-loss "
                "(1e-4 · (log Z)², PaLM) or a logit soft cap (Gemma 2: tanh at 30)."
            ),
        )
    ]


def _head_name(ctx: CheckContext) -> str:
    return next((r.name for r in ctx.layers if r.role == "head"), "head")


def _any_logits(ctx: CheckContext) -> bool:
    """Were output logits recorded at some step, or is the head's output non-finite?"""
    d = ctx.dynamics
    head = ctx.layout.head if ctx.layout else None
    return bool(d) and any(
        s.logits is not None or (head is not None and ("activation", head) in s.nonfinite)
        for s in (d.steps if d else ())
    )


# ---- adam-epsilon ---------------------------------------------------------------------------


def _collapsed(d: Dynamics | None, param: str) -> bool:
    """Did the tensor's gradient start ≥ 1000× above its smallest value over the steps?
    (The earlier grid's collapsing Post-LN gradients fell by 10⁴–10⁶: the wording's
    threshold, not a severity's; docs/calibration-dynamics.md.)"""
    u = next((u for u in (d.updates if d else ()) if u.param == param), None)
    gs = [g for g in (u.grad_rms if u else ()) if finite(g)]
    return bool(gs) and positive(gs[0]) and gs[0] >= 1000 * min(gs)


def adam_epsilon(ctx: CheckContext) -> list[Finding | Skip]:
    if (out := _no_steps(ctx, CheckId.ADAM_EPSILON)) is not None:
        return out
    th = ctx.thresholds
    d = ctx.dynamics
    assert d is not None
    if d.optimizer.name not in ADAM:
        return [skip(CheckId.ADAM_EPSILON, f"not an Adam-family optimizer ({d.optimizer.name})")]
    s = statistics(d)
    if not s.grad_over_eps:
        div = diverged_reason(d, "no parameter's gradient RMS is finite")
        return [skip(CheckId.ADAM_EPSILON, div or "no gradient RMS per parameter was recorded")]
    low, share = s.eps_low(th.adam_eps_ratio)
    if not low:
        return []
    worst = s.grad_over_eps[low[0]]
    block = {u.param: u.block for u in d.updates}
    shrink = worst / (worst + 1)
    # warn on the update's collapse, not the gradient's size: Adam's step at 3–7 × eps is
    # still ~80 % of lr, and healthy runs' top-layer q/k gradients get there (without a
    # recorded update, step_rms, the gradient alone decides as it used to)
    dead, dead_share = s.collapsed(th.adam_collapse) if s.collapse else (low, share)
    sev = Severity.WARN if dead and dead_share >= th.adam_eps_share else Severity.INFO
    if sev is Severity.WARN and s.collapse:
        low, share = dead, dead_share
        worst = s.grad_over_eps[low[0]]
        shrink = s.collapse[low[0]]
    head = (
        f"{len(low)} parameter tensor{'s' if len(low) > 1 else ''} ({pct_(share)} of the "
        f"parameters) had a gradient RMS within {n(th.adam_eps_ratio)}× of Adam's eps = "
        f"{n(s.eps)} at some step: {_where(low, block)}; the smallest is {n(worst)}× eps. "
        f"Adam's step is g/(√v + eps), so there it shrinks to ~{pct_(shrink)} of lr"
    )
    if _collapsed(d, low[0]) and s.collapse and not dead:  # the update held
        message = (
            f"{head}. These gradients shrank ≥ 1000× over the steps, but Adam's recorded "
            f"step per coordinate stayed above {n(th.adam_collapse)}× its first "
            "(`adam-collapse`): on the "
            "ground truth a small gradient without a collapsed update did not predict "
            "failure (docs/calibration-dynamics.md); reported, not a warning."
        )
        hint = (
            "Nothing to do while the update holds; if the loss stalls, lower the learning "
            "rate or warm it up."
        )
    elif _collapsed(d, low[0]):
        message = (
            f"{head}. These gradients were normal at step 0 and collapsed over the steps "
            "(by ≥ 1000×): the weights below stop moving. In the calibration every run "
            "whose gradients collapsed like this failed to train."
        )
        hint = (
            "The collapse is the problem, not eps (a smaller eps only lets Adam amplify a "
            "vanishing gradient): lower the learning rate or warm it up; in a deep Post-LN "
            "stack prefer Pre-LN or DeepNorm / Admin initialisation."
        )
    else:
        message = (
            f"{head} (and stops being scale-free): those weights learn slower than the rest, "
            "as in large runs whose gradients fall below eps."
        )
        hint = (
            "Lower eps (1e-15 or below, as large-scale runs use) or scale the loss up; check "
            "that the gradients are not vanishing upstream."
        )
    return [finding(CheckId.ADAM_EPSILON, sev, low, share, th.adam_eps_share, message, hint)]
