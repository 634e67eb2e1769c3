"""init-scale: weight statistics of a model at initialization against the variance rules
(theory: docs/checks.md, "init-scale": the fan-in rule, Xavier, He, the 1/√(2N)
residual scaling)."""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    branch_projections,
    feeding,
    finding,
    grade,
    is_last,
    known,
    listing,
    n,
    post_branch_norms,
    residual_budget,
    skip,
)
from actscan.records import CheckId, Finding, ParamRecord, Severity, Skip

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

NOT_AT_INIT = "not at init (init-scale judges weights a model was initialized with)"
_INDEX = re.compile(r"\.\d+\.")


def pattern(name: str) -> str:
    """'blocks.3.mlp.down.weight' → 'blocks.*.mlp.down.weight' (group across blocks)."""
    return _INDEX.sub(".*.", name)


def _groups(params: list[ParamRecord]) -> dict[str, list[ParamRecord]]:
    out: dict[str, list[ParamRecord]] = defaultdict(list)
    for p in params:
        out[pattern(p.name)].append(p)
    return out


def init_scale(ctx: CheckContext) -> list[Finding | Skip]:
    if not ctx.info.at_init:
        return [skip(CheckId.INIT_SCALE, NOT_AT_INIT)]
    th = ctx.thresholds
    out: list[Finding | Skip] = []
    weights = [p for p in ctx.params if p.kind == "weight" and p.fan_in and p.std > 0]
    out_proj = {o.name for _, o, _ in branch_projections(ctx)}

    def ratio(p: ParamRecord) -> float:
        return p.std * math.sqrt(_fan_in(p))  # std / √(1/fan_in)

    high = [p for p in weights if ratio(p) * _sampling_floor(p) >= th.init_scale_high]
    periodic = [p for p in high if p.periodic and not p.normed]
    high = [p for p in high if not p.periodic or p.normed]
    heads = [p for p in high if not p.normed and p.role == "head" and is_last(ctx, p.module)]
    fan_out = [p for p in high if not p.normed and _he_fan_out(p)]
    apart = {id(p) for p in (*heads, *fan_out)}
    big = [p for p in high if not p.normed and id(p) not in apart]
    normed = [p for p in high if p.normed]
    if normed:
        out.append(_normed(normed, ratio))
    if periodic:
        out.append(_periodic(periodic, ratio))
    if fan_out:
        out.append(_fan_out(fan_out, ratio))
    if big:
        groups = _groups(big)
        worst_key = max(groups, key=lambda k: max(ratio(p) for p in groups[k]))
        w = max(groups[worst_key], key=ratio)
        r = ratio(w)
        fan = _fan_in(w)
        severity, threshold = grade(r, th.init_scale_high, th.init_scale_error)
        others = [k for k in groups if k != worst_key]
        more = f"; also {listing(others, 3)}" if others else ""
        flat = statistics.median(p.std for p in big)
        count = len(groups[worst_key])
        message = (
            f"{worst_key} ({count} matri{'ces' if count > 1 else 'x'}) "
            f"has std {n(w.std)} = {n(r)}× the fan-in rule {_rule(w)} = "
            f"{n(1 / math.sqrt(fan))} (He √(2/fan_in) = {n(math.sqrt(2 / fan))}): "
            f"each such layer multiplies its input variance by {n(r * r)} at init{more}."
        )
        hint = (
            "Initialize with std = √(1/fan_in) (He √(2/fan_in) before ReLU-like activations, "
            "Xavier √(2/(fan_in+fan_out)) for linear projections) rather than a flat value: "
            f"a flat {n(flat)} matches √(1/fan_in) only at fan_in ≈ {round(1 / flat**2)}"
            + (
                "; the post-branch norms set what reaches the stream."
                if post_branch_norms(ctx)
                else "; residual output projections also take 1/√(2L)."
            )
        )
        out.append(
            finding(
                CheckId.INIT_SCALE,
                severity,
                sorted({p.module for p in big}),
                r,
                threshold,
                message,
                hint,
            )
        )

    if heads:
        out.append(_head(ctx, heads, ratio))

    small = [
        p
        for p in weights
        if ratio(p) <= th.init_scale_low and p.name not in out_proj and not p.periodic
    ]
    if small:
        groups = _groups(small)
        w = min(small, key=ratio)
        out.append(
            finding(
                CheckId.INIT_SCALE,
                Severity.INFO,
                sorted({p.module for p in small}),
                ratio(w),
                th.init_scale_low,
                f"{pattern(w.name)} has std {n(w.std)} = {n(ratio(w))}× {_rule(w)}: each "
                f"such layer passes on {n(ratio(w) ** 2)} of its input variance at init "
                f"({len(groups)} weight group{'s' if len(groups) > 1 else ''} this small: "
                f"{listing(list(groups), 3)}).",
                "Deliberately small inits (T-Fixup, small-init) are fine behind norms; "
                "otherwise use std √(1/fan_in).",
            )
        )

    out.extend(_residual_budget(ctx))
    out.extend(_gains_and_biases(ctx))
    return out


def _fan_in(p: ParamRecord) -> int:
    """The fan-in the rule takes: the contracted size, or 1 when the input's vectors have
    unit L2 norm over it (Σ x_i² = 1 rather than fan_in: the output's std is the
    weight's own, SwiftFormer's w_g on F.normalize'd queries)."""
    return 1 if p.unit_input else int(known(p.fan_in))


def _rule(p: ParamRecord) -> str:
    """The fan-in rule the weight is held to, in words."""
    if p.unit_input:
        return f"√(1/1) (its input has unit L2 norm over the {p.fan_in} it contracts)"
    return f"√(1/{p.fan_in})"


def _periodic(params: list[ParamRecord], ratio: Callable[[ParamRecord], float]) -> Finding:
    """Weights above the fan-in rule whose product the forward reads through sin/cos
    (random Fourier features: SAM's positional matrix, NeRF's encodings, Tancik et al.
    2020): the std is the features' frequency scale, chosen for the bandwidth, and
    sin/cos bound the output whatever it is. Info, with the number."""
    return _explained_scale(
        params,
        ratio,
        lambda w, like: (
            f", but its product is read by sin/cos (random Fourier features; {like}): the "
            f"std is the features' frequency scale, and the output is bounded whatever it is."
        ),
        "Nothing to fix: a Fourier-feature matrix is drawn at the bandwidth it should "
        "resolve (Tancik et al. 2020), not by the fan-in rule.",
    )


def _normed(params: list[ParamRecord], ratio: Callable[[ParamRecord], float]) -> Finding:
    """Weights above the fan-in rule whose output goes straight into a norm (conv →
    BatchNorm, torchvision's ResNet init: He with fan-out): the norm divides any scale
    out of its input, so the forward sees none of it. Info, with the number."""
    return _explained_scale(
        params,
        ratio,
        lambda w, like: (
            f", but its output goes straight into a norm, which divides that "
            f"scale out ({like}): the forward pass sees none of it."
        ),
        "Nothing to fix for the forward pass; with plain SGD a large weight learns "
        "slower relative to its size (Adam normalises the step).",
    )


def _explained_scale(
    params: list[ParamRecord],
    ratio: Callable[[ParamRecord], float],
    why: Callable[[ParamRecord, str], str],
    hint: str,
) -> Finding:
    """init-scale at info for weights above the fan-in rule whose scale the layout
    explains: the worst weight's numbers, then `why(worst, "N weight groups like it: …")`."""
    groups = _groups(params)
    w = max(params, key=ratio)
    like = (
        f"{len(groups)} weight group{'s' if len(groups) > 1 else ''} like it: "
        f"{listing(list(groups), 3)}"
    )
    return finding(
        CheckId.INIT_SCALE,
        Severity.INFO,
        sorted({p.module for p in params}),
        ratio(w),
        None,
        f"{pattern(w.name)} has std {n(w.std)} = {n(ratio(w))}× the fan-in rule "
        f"{_rule(w)}" + why(w, like),
        hint,
    )


def _sampling_floor(p: ParamRecord) -> float:
    """1 − 2 standard errors of a std estimated from the tensor's n values (≈ 1/√(2n)):
    a 64-value kernel drawn at He's √2 reads anywhere in ×1.16–1.66 of the fan-in rule
    (VITS's 1-channel convolutions); judged by the lower bound, it is He. No change for
    matrices of thousands of values."""
    count = max(math.prod(p.shape), 1)
    return max(0.0, 1 - 2 / math.sqrt(2 * count))


def _priors(shifted: list[tuple[ParamRecord, float]]) -> Finding:
    """Biases far from 0 on outputs that feed no activation: nothing is pushed off a
    ReLU or into a saturated range; such a bias is a prior the family chose (RetinaNet's
    class prior −log((1 − π)/π) = −4.6 at π = 0.01, Deformable DETR's grid of sampling
    offsets). Info, with the number."""
    b, sigma = max(shifted, key=lambda t: t[1])
    groups = sorted({pattern(p.name) for p, _ in shifted})
    return finding(
        CheckId.INIT_SCALE,
        Severity.INFO,
        [p.module for p, _ in shifted],
        sigma,
        None,
        f"Biases are not 0 at init: {pattern(b.name)} has mean {n(b.mean)}, {n(sigma)}σ of "
        f"its layer's output ({listing(groups, 3)}), but no activation reads that output: "
        f"a prior (a class prior −log((1 − π)/π), a grid of offsets), not a shifted "
        f"pre-activation.",
        "Nothing to fix if the prior is deliberate (RetinaNet's −4.6 at π = 0.01).",
    )


def _he_fan_out(p: ParamRecord) -> bool:
    """std = √(2/fan_out) within sampling error: Kaiming's mode='fan_out' (torchvision's
    ResNet/RegNet convolutions), a classical rule of its own."""
    if not p.fan_out or not p.fan_in or p.fan_out >= p.fan_in:
        return False
    tol = max(0.05, 2 / math.sqrt(2 * max(math.prod(p.shape), 1)))
    return abs(p.std / math.sqrt(2 / p.fan_out) - 1) <= tol


def _fan_out(params: list[ParamRecord], ratio: Callable[[ParamRecord], float]) -> Finding:
    """Weights at He's fan-out rule on a reducing layer: He et al. (2015) show that either
    mode keeps one pass's variance, fan-out the backward's; the forward gain is the
    layer's fan_in/fan_out, which the layer expanding back (a squeeze-excite bottleneck,
    RegNet's) returns. Info, with the number."""
    return _explained_scale(
        params,
        ratio,
        lambda w, like: (
            f", which is He's fan-out rule √(2/{w.fan_out}) (Kaiming "
            f"mode='fan_out', torchvision's ResNet init; {like}): it "
            f"keeps the backward pass's variance; the forward gain {n(ratio(w) ** 2)} is the "
            f"layer's reduction, returned by the layer that expands back."
        ),
        "Nothing to fix for a bottleneck pair; a reducing layer with nothing expanding after "
        "it grows the forward by fan_in/fan_out: use mode='fan_in' there.",
    )


def _head(
    ctx: CheckContext, params: list[ParamRecord], ratio: Callable[[ParamRecord], float]
) -> Finding:
    """Weights of the output head above the fan-in rule: nothing reads their output but
    the loss, so their scale compounds nowhere; what it does is the logits' scale, which
    logit-scale measures (Pop2Piano's std-1 head behind T5's d^-1/2 rescale gives logits
    of std 1). Info, with the measured logit std."""
    w = max(params, key=ratio)
    rec = next((r for r in ctx.layers if r.name == w.module), None)
    logits = (
        f"; its logits measure std {n(rec.std)} over {rec.n_channels} outcomes"
        if rec is not None and rec.std is not None and rec.n_channels
        else ""
    )
    return finding(
        CheckId.INIT_SCALE,
        Severity.INFO,
        sorted({p.module for p in params}),
        ratio(w),
        ctx.thresholds.init_scale_high,
        f"{pattern(w.name)} has std {n(w.std)} = {n(ratio(w))}× the fan-in rule "
        f"{_rule(w)}, but it is the output head: no layer reads its output, so the "
        f"scale compounds nowhere{logits} (logit-scale judges them against √(2 ln V)).",
        "Nothing to fix unless logit-scale reports the logits: a head's init is judged by "
        "what it gives.",
    )


def _residual_budget(ctx: CheckContext) -> list[Finding]:
    """Pre-norm stacks whose residual output projections are not down-scaled."""
    th = ctx.thresholds
    found = residual_budget(ctx)
    if found is None:
        return []
    s, adds, budget, pairs = found
    if budget < th.residual_budget:
        return []
    outs = sorted({pattern(o.name) for _, o, _ in branch_projections(ctx)})
    return [
        finding(
            CheckId.INIT_SCALE,
            Severity.INFO,
            [o.module for _, o in pairs],
            budget,
            th.residual_budget,
            f"Residual output projections are not down-scaled: attention out/in std ratio "
            f"{n(s)} (1/√(2L) = {n(1 / math.sqrt(adds))} would hold the stream), so the {adds} "
            f"branches add ≈ {n(budget)} unit branch variances to the stream "
            f"({listing(outs, 2)}).",
            f"Multiply the output projections' init by 1/√(2L) = 1/√{adds} (GPT-2), or gate "
            f"the branches (ReZero/LayerScale); sqrt-growth shows the measured drift.",
        )
    ]


def _gain(p: ParamRecord) -> tuple[float, float]:
    """(mean, std) of a norm's gain: measured by a probe when known, else its weight's."""
    if p.gain is not None:
        return p.gain, p.gain_std or 0.0
    return p.mean, p.std


def _gains_and_biases(ctx: CheckContext) -> list[Finding]:
    th = ctx.thresholds
    out: list[Finding] = []
    gains = [
        p
        for p in ctx.params
        if p.kind == "norm-gain" and max(abs(_gain(p)[0] - 1), _gain(p)[1]) > th.init_gain_tol
    ]
    if gains:
        g = max(gains, key=lambda p: abs(_gain(p)[0] - 1) + _gain(p)[1])
        mean, std = _gain(g)
        measured = " effective gain" if g.gain is not None else ""
        out.append(
            finding(
                CheckId.INIT_SCALE,
                Severity.WARN,
                [p.module for p in gains],
                mean,
                th.init_gain_tol,
                f"{len(gains)} norm gain{'s' if len(gains) > 1 else ''} are not 1 at init "
                f"(worst {g.name}:{measured} mean {n(mean)}, std {n(std)}): the gain alone sets "
                f"the scale of what the branch reads.",
                "Initialize norm gains to 1 and norm biases to 0 (and keep them out of weight "
                "decay).",
            )
        )
    weight_of = {p.module: p for p in ctx.params if p.kind == "weight" and p.fan_in}
    shifted: list[tuple[ParamRecord, float]] = []
    for p in ctx.params:
        if p.kind != "bias":
            continue
        size = math.sqrt(p.mean * p.mean + p.std * p.std)  # RMS of the bias vector
        w = weight_of.get(p.module)
        # against the pre-activation std it shifts; norm biases: the unit scale of the norm
        has_w = w is not None and w.std > 0
        sigma = size / (w.std * math.sqrt(known(w.fan_in))) if w is not None and has_w else size
        if sigma >= th.init_bias_sigma:
            shifted.append((p, sigma))
    recorded = {r.name: r for r in ctx.layers}
    # only the activations of the shifted biases' blocks: feeding() scans every layer
    blocks = {recorded[p.module].block for p, _ in shifted if p.module in recorded}
    feeds_act = {
        pre.name
        for r in ctx.layers
        if r.role == "act" and r.block in blocks and (pre := feeding(r, ctx.layers))
    }
    priors = [
        (p, s)
        for p, s in shifted
        if p.module in weight_of and p.module in recorded and p.module not in feeds_act
    ]
    if priors:
        out.append(_priors(priors))
        shifted = [(p, s) for p, s in shifted if all(p is not q for q, _ in priors)]
    if shifted:
        b, sigma = max(shifted, key=lambda t: t[1])
        groups = sorted({pattern(p.name) for p, _ in shifted})
        out.append(
            finding(
                CheckId.INIT_SCALE,
                Severity.WARN,
                [p.module for p, _ in shifted],
                sigma,
                th.init_bias_sigma,
                f"Biases are not 0 at init: {pattern(b.name)} has mean {n(b.mean)}, "
                f"{n(sigma)}σ of the pre-activation it shifts ({listing(groups, 3)}).",
                "Initialize biases to 0: a shifted pre-activation leaves ReLU units dead "
                "(or saturates the nonlinearity) from step 0.",
            )
        )
    return out
