"""Numerics: non-finite values and dtype headroom (overflow), softmax logit scale
(logit-scale). Theory: docs/checks.md, overflow and
logit-scale (the z-loss, and the 1/√d_k attention scale)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from actscan.diagnose.attention import score_findings
from actscan.diagnose.common import (
    DTYPE_MAX,
    FP16_EXP_LIMIT,
    FP16_MAX,
    finding,
    finite,
    grade,
    is_fill,
    known,
    listing,
    n,
    positive,
    runs_after,
    skip,
)
from actscan.diagnose.steps import divergence_findings
from actscan.records import CheckId, Finding, LayerRecord, Severity, Skip, TraceOp, TraceRecord

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

ATTN_LOGITS = "AttentionLogits"


def _fp16(ctx: CheckContext) -> bool:
    return ctx.run.dtype == "fp16" or ctx.run.amp == "fp16"


def overflow(ctx: CheckContext) -> list[Finding | Skip]:
    """Non-finite weights, outputs or gradients (error), steps that went non-finite
    (error: the first step, module and parameter), values near the dtype's ceiling
    (warn), beyond fp16's (info, in wider runs) and logits that exp() overflows (info).
    With a trace (`ctx.trace`), the error of the pass or step it reran names the first
    operation out of range; one no module output shows is a warning of its own."""
    fp16 = _fp16(ctx)
    dtype = "fp16" if fp16 else ctx.run.dtype
    tr = ctx.trace
    at_step = tr is not None and tr.reason == "diverged"
    outputs = _with_trace(_nonfinite_outputs(ctx, dtype, fp16), None if at_step else tr)
    out: list[Finding | Skip] = [*_nonfinite_params(ctx), *outputs]
    if tr is not None and not at_step and not outputs:
        out += _hidden_op(tr)
    out += _with_trace(divergence_findings(ctx), tr if at_step else None)  # the steps' breaking
    if any(r.nonfinite > 0 for r in ctx.layers):
        return out  # no ceiling to judge once values are inf
    out += _near_ceiling(ctx, dtype, fp16)
    if fp16:
        out += _hot_logits(ctx)
    return out


def trace_words(tr: TraceRecord) -> str:
    """The trace in one sentence: the first operation out of range and where it ran, or
    that none was and the largest output's headroom."""
    ceiling = f"{tr.dtype}'s largest value {n(tr.ceiling)}" if tr.ceiling else None
    rerun = f"batch {tr.batch} rerun op by op at step {tr.step}, {tr.ops} operations"
    if tr.first is None:
        peak = tr.peak
        if peak is None:
            return f"The trace ({rerun}) saw no floating-point operation."
        room = (
            f", headroom ×{n(tr.ceiling / peak.max_abs)} to {ceiling}"
            if tr.ceiling and positive(peak.max_abs)
            else ""
        )
        return (
            f"The trace ({rerun}) found no operation out of range; the largest output is "
            f"{_op_words(peak)}: max|x| {n(peak.max_abs)}{room}."
        )
    op = tr.first
    what = f"{op.nonfinite} inf/nan values" if op.nonfinite else f"max|x| {n(op.max_abs)}"
    beyond = f" (beyond {ceiling})" if ceiling and not op.nonfinite else ""
    ins = ", ".join(
        f"{n(i.max_abs)}" + (f" with {i.nonfinite} inf/nan" if i.nonfinite else "")
        for i in op.inputs
    )
    fed = f" from inputs of max|x| {ins}" if ins else ""
    return (
        f"The first operation out of range ({rerun}) is {_op_words(op)}: its output holds "
        f"{what}{beyond}{fed}."
    )


def _op_words(op: TraceOp) -> str:
    where = f"in {op.module}" if op.module else "outside every module (the loss)"
    line = f" at {op.source}" if op.source else ""
    code = f" `{op.code}`" if op.code else ""
    return f"{op.op} {where} ({op.phase}, operation {op.index}){line}{code}"


def _with_trace(found: list[Finding], tr: TraceRecord | None) -> list[Finding]:
    """The first error of `found` with the trace's sentence appended to its message."""
    if tr is None or not found:
        return found
    first = found[0]
    message = f"{first.message} {trace_words(tr)}"
    return [replace(first, message=message), *found[1:]]


def _hidden_op(tr: TraceRecord) -> list[Finding]:
    """An operation that broke although no module output shows it (a later operation of
    the same module brought it back in range, or it ran in the backward): a warning."""
    op = tr.first
    if op is None:
        return []
    return [
        finding(
            CheckId.OVERFLOW,
            Severity.WARN,
            [op.module] if op.module else [],
            op.max_abs if not op.nonfinite else float(op.nonfinite),
            tr.ceiling,
            "No recorded module output is non-finite, but inside the pass an operation is: "
            + trace_words(tr)
            + " A later operation hides it (a tanh, clamp or mask of inf), or the "
            "recorder's statistics do not reach it.",
            "Rescale the operation's inputs or compute it in fp32 (torch.autocast keeps "
            "listed ops in fp32); values that round-trip through inf lose their gradient.",
        )
    ]


def _nonfinite_params(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    bad_params = [p for p in ctx.params if p.nonfinite]
    if bad_params:
        out.append(
            finding(
                CheckId.OVERFLOW,
                Severity.ERROR,
                [p.module for p in bad_params],
                float(sum(p.nonfinite for p in bad_params)),
                0.0,
                f"{len(bad_params)} parameter tensor{'s' if len(bad_params) > 1 else ''} hold "
                f"non-finite values before the run (first: {bad_params[0].name}, "
                f"{bad_params[0].nonfinite} inf/nan).",
                "The weights themselves are broken: reload the checkpoint, or find the step "
                "where training diverged (lower the learning rate, clip gradients).",
            )
        )
    return out


def _nonfinite_outputs(ctx: CheckContext, dtype: str, fp16: bool) -> list[Finding]:
    """The first module whose output is non-finite; else the gradient that overflows."""
    out: list[Finding] = []
    bad = sorted((r for r in ctx.layers if r.nonfinite > 0), key=lambda r: r.order)
    if bad:
        first = bad[0]
        before = [r.max_abs for r in ctx.layers if r.order < first.order and finite(r.max_abs)]
        prior = f"; the largest finite |x| before it was {n(max(before))}" if before else ""
        where = f"in {dtype}" + (f" (largest finite value {n(FP16_MAX)})" if fp16 else "")
        message = (
            f"{first.name} is the first module (in execution order) whose output is non-finite "
            f"{where}: {first.nonfinite} inf/nan values{prior}; {len(bad) - 1} later "
            f"module{'s' if len(bad) != 2 else ''} inherit them."
        )
        if fp16:
            hint = (
                f"fp16 tops out at 65504: run in bf16 (fp32's range) or fp32, or bring the "
                f"activations feeding {first.name} down (smaller weights, a norm before it)."
            )
        else:
            hint = (
                f"Check the weights and inputs feeding {first.name}: an inf/nan weight, a log "
                f"or division of zero, or a scale that exploded."
            )
        out.append(
            finding(
                CheckId.OVERFLOW,
                Severity.ERROR,
                [r.name for r in bad],
                float(first.nonfinite),
                0.0,
                message,
                hint,
            )
        )
    elif ctx.run.backward:
        bad_grad = sorted(
            (r for r in ctx.layers if r.grad_rms is not None and not math.isfinite(r.grad_rms)),
            key=lambda r: -r.order,
        )
        if bad_grad:
            last = bad_grad[0]
            out.append(
                finding(
                    CheckId.OVERFLOW,
                    Severity.ERROR,
                    [r.name for r in bad_grad],
                    None,
                    0.0,
                    f"The forward pass is finite but the gradient overflows in {dtype}: "
                    f"{len(bad_grad)} modules get a non-finite output gradient, starting "
                    f"(backward order) at {last.name}.",
                    "Use loss scaling that backs off (torch.amp.GradScaler) or bf16, and check "
                    "the loss for log(0).",
                )
            )
    return out


def _near_ceiling(ctx: CheckContext, dtype: str, fp16: bool) -> list[Finding]:
    th = ctx.thresholds
    out: list[Finding] = []
    ceiling = DTYPE_MAX.get(dtype, DTYPE_MAX["fp32"])
    filled = [r for r in ctx.layers if is_fill(r.max_abs)]
    if filled:
        out.append(_fill_constants(filled))
    near = [
        r
        for r in ctx.layers
        if positive(r.max_abs) and r.max_abs >= ceiling / th.headroom and not is_fill(r.max_abs)
    ]
    if near:
        worst = max(near, key=lambda r: known(r.max_abs))
        headroom = ceiling / known(worst.max_abs)
        near.sort(key=lambda r: r.order)
        out.append(
            finding(
                CheckId.OVERFLOW,
                Severity.WARN,
                [r.name for r in near],
                worst.max_abs,
                ceiling / th.headroom,
                f"max|x| = {n(worst.max_abs)} at {worst.name} is within ×{n(th.headroom)} of "
                f"{dtype}'s largest value {n(ceiling)} (headroom ×{n(headroom)}); "
                f"{len(near)} module{'s' if len(near) > 1 else ''} are this close "
                f"(first: {near[0].name}).",
                "A little more growth (depth, training) overflows to Inf: run in bf16, or "
                "rescale what feeds these modules (1/√(2L) output projections, a norm).",
            )
        )
    elif not fp16:
        over16 = sorted(
            (
                r
                for r in ctx.layers
                if positive(r.max_abs) and r.max_abs > FP16_MAX and not is_fill(r.max_abs)
            ),
            key=lambda r: r.order,
        )
        if over16:
            worst = max(over16, key=lambda r: known(r.max_abs))
            out.append(
                finding(
                    CheckId.OVERFLOW,
                    Severity.INFO,
                    [r.name for r in over16],
                    worst.max_abs,
                    FP16_MAX,
                    f"max|x| = {n(worst.max_abs)} at {worst.name} exceeds fp16's 65504 "
                    f"(first: {over16[0].name}): this model overflows if run in fp16.",
                    "Fine in fp32/bf16. For fp16 inference, rescale what feeds these modules "
                    "or keep them in fp32.",
                )
            )
    return out


def _fill_constants(filled: list[LayerRecord]) -> Finding:
    """Outputs whose max|x| is exactly a float format's largest finite value: a fill
    constant the forward wrote (LightGlue's `similarity.masked_fill(mask == 0,
    finfo.min)` on padded keypoints), not a value that grew toward overflow. Info, with
    the number: their std and RMS hold the constant too, so they say nothing there."""
    filled = sorted(filled, key=lambda r: r.order)
    first = filled[0]
    return finding(
        CheckId.OVERFLOW,
        Severity.INFO,
        [r.name for r in filled],
        first.max_abs,
        None,
        f"max|x| = {n(first.max_abs)} at {first.name} is exactly a float format's largest "
        f"finite value ({len(filled)} module{'s' if len(filled) > 1 else ''}: "
        f"{listing([r.name for r in filled], 3)}): a fill constant the forward wrote "
        f"(masked_fill(mask, torch.finfo(dtype).min), the masking idiom), not a value grown "
        f"toward overflow; arithmetic past the ceiling gives inf, not the ceiling.",
        "Nothing to fix if the constant is a mask; its std and RMS there are the "
        "constant's, not the activations'. A -inf (or a large finite fill the softmax "
        "subtracts) behaves the same.",
    )


def _hot_logits(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    hot = [
        r
        for r in ctx.layers
        if (r.role == "head" or r.type == ATTN_LOGITS)
        and positive(r.max_abs)
        and r.max_abs > FP16_EXP_LIMIT
    ]
    if hot:
        worst = max(hot, key=lambda r: known(r.max_abs))
        out.append(
            finding(
                CheckId.OVERFLOW,
                Severity.INFO,
                [r.name for r in hot],
                worst.max_abs,
                FP16_EXP_LIMIT,
                f"Logits reach |z| = {n(worst.max_abs)} at {worst.name}: exp(z) overflows "
                f"fp16 above {n(FP16_EXP_LIMIT)}, so their softmax is finite only because "
                f"it subtracts the max first.",
                "Keep softmax/cross-entropy max-subtracted (PyTorch's are) and never "
                "exponentiate these logits by hand in half precision.",
            )
        )
    return out


def _freeze(size: int) -> float:
    """√(2 ln V): logit std above which a softmax over V outcomes is max-dominated."""
    return math.sqrt(2 * math.log(max(size, 2)))


def _log_z(mean: float, std: float, size: int) -> float:
    """Gaussian-logit estimate of log Σ exp(z): ln V + s²/2 below freezing, s·√(2 ln V) above."""
    f = _freeze(size)
    return mean + (math.log(size) + std * std / 2 if std < f else std * f)


def logit_scale(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    if (
        not any(r.role == "head" or r.type == ATTN_LOGITS for r in ctx.layers)
        and not ctx.attention
        and ctx.info.arch.get("attn_scale") != "none"
    ):
        return [skip(CheckId.LOGIT_SCALE, "no output head or attention scores were recorded")]
    out: list[Finding | Skip] = []
    heads = [r for r in ctx.layers if r.role == "head" and positive(r.std) and not r.nonfinite]
    vocab = ctx.info.vocab_size
    tied = bool(ctx.info.arch.get("tie_embeddings"))
    for head in heads[-1:]:
        size = int(vocab or head.n_channels or 0)
        if size < 2:
            continue
        f = _freeze(size)
        factor = known(head.std) / f
        if factor < th.logit_freeze:
            continue
        why = _no_logits(ctx, head.name)
        if why is not None:
            out.append(
                finding(
                    CheckId.LOGIT_SCALE,
                    Severity.INFO,
                    [head.name],
                    factor,
                    None,
                    f"{head.name} (the last Linear after the blocks) has outputs of std "
                    f"{n(head.std)} over {size} outcomes, {n(factor)}× √(2 ln V) = {n(f)}, "
                    f"but {why}: no softmax reads them as logits over V, so they are not "
                    f"judged as the head's.",
                    "Nothing to fix at the head; a similarity softmax with a learned "
                    "temperature (CLIP's logit_scale) is judged by what it gives.",
                )
            )
            continue
        # A trained model may have chosen sharp logits: information, not a defect.
        sev, threshold = (
            grade(factor, th.logit_freeze, th.logit_freeze_error)
            if ctx.info.at_init
            else (Severity.INFO, th.logit_freeze)
        )
        log_z = _log_z(head.mean or 0.0, known(head.std), size)
        state = "at init " if ctx.info.at_init else ""
        upper = (head.max_abs or 0.0) + math.log(size)
        message = (
            f"The head's logits {state}have std {n(head.std)} (max |z| {n(head.max_abs)}) over "
            f"V = {size} outcomes, {n(factor)}× the softmax freezing point √(2 ln V) = {n(f)}: "
            f"predictions collapse onto the top logit, log Z ≈ {n(log_z)} (Gaussian estimate; "
            f"up to max |z| + ln V = {n(upper)}) vs ln V = {n(math.log(size))} for a uniform "
            f"start, a z-loss term (log Z)² ≳ {n(log_z**2)}."
        )
        hint = (
            "Initialize the head with std ≈ 1/√d_model (fan-in) or multiply the logits by "
            "1/√d (μP), keep a final norm before it, and add z-loss 1e-4·(log Z)² to hold "
            "log Z near 0."
        )
        if tied:
            hint = (
                "The head shares the embedding matrix (tied), so an embedding of std σ gives "
                "logits of std ≈ σ·√d_model: init the embedding with std ≈ 1/√d_model (and "
                "scale its input by √d_model as the original Transformer does) or untie the "
                "head. " + hint
            )
        out.append(finding(CheckId.LOGIT_SCALE, sev, [head.name], factor, threshold, message, hint))
    out.extend(_attention_logits(ctx))
    return out


def _no_logits(ctx: CheckContext, head: str) -> str | None:
    """Why the head layer's output is no softmax's logits, or None when it may be: its
    output goes into a norm (an L2-normalised contrastive embedding: AIMv2's, CLIP's
    projections), which divides its scale out, or other recorded modules run after it
    (the last Linear after the blocks is an inner MLP's: OneFormer's task MLP feeds the
    decoder), so it is not the model's output."""
    if any(p.normed for p in ctx.params if p.module == head and p.kind == "weight"):
        return (
            "its output goes straight into a norm (an L2-normalised embedding), which "
            "divides that scale out"
        )
    later = runs_after(ctx, head)
    if later:
        return f"it is not the model's output: {listing(later, 2)} run after it"
    return None


def _attention_logits(ctx: CheckContext) -> list[Finding]:
    """The declared-scale rule, then the measured scores: per head from the attention
    probes when they ran, else from score modules the recorder saw."""

    unscaled = _unscaled_attention(ctx)
    if ctx.attention:
        return unscaled + score_findings(ctx)
    return unscaled or _recorded_scores(ctx)


def _unscaled_attention(ctx: CheckContext) -> list[Finding]:
    scores = [
        r for r in ctx.layers if r.type == ATTN_LOGITS and positive(r.std) and not r.nonfinite
    ]
    scale = str(ctx.info.arch.get("attn_scale", ""))
    head_dim = ctx.info.arch.get("head_dim")
    if scale == "none":
        worst = max(scores, key=lambda r: known(r.std), default=None)
        measured = f" (std up to {n(worst.std)} now, at {worst.name})" if worst else ""
        grow = f"√d_k = {n(math.sqrt(head_dim))}× " if isinstance(head_dim, int) else ""
        value = float(head_dim) if isinstance(head_dim, int) else None
        return [
            finding(
                CheckId.LOGIT_SCALE,
                Severity.WARN,
                [r.name for r in scores],
                value,
                None,
                f"Attention scores are not scaled by 1/√d_k (d_k = {head_dim}): their std is "
                f"{grow}that of scaled scores{measured}, and softmax saturates once q and k "
                f"reach unit scale.",
                "Multiply QKᵀ by 1/√d_k before the softmax (1/d_k under μP).",
            )
        ]
    return []


def _recorded_scores(ctx: CheckContext) -> list[Finding]:
    th = ctx.thresholds
    scores = [
        r for r in ctx.layers if r.type == ATTN_LOGITS and positive(r.std) and not r.nonfinite
    ]
    keys = int(ctx.run.seq_len or (scores[0].n_channels if scores else 0) or 0)
    if keys < 2 or not scores:
        return []
    f = _freeze(keys)
    hot = [r for r in scores if known(r.std) / f >= th.logit_freeze]
    if not hot:
        return []
    worst = max(hot, key=lambda r: known(r.std))
    return [
        finding(
            CheckId.LOGIT_SCALE,
            Severity.WARN,
            [r.name for r in hot],
            known(worst.std) / f,
            th.logit_freeze,
            f"Attention scores have std up to {n(worst.std)} at {worst.name} over T = {keys} keys "
            f"({n(known(worst.std) / f)}× √(2 ln T) = {n(f)}; {len(hot)} layer"
            f"{'s' if len(hot) > 1 else ''}: {listing([r.name for r in hot], 3)}): each softmax "
            f"is near one-hot and passes almost no gradient.",
            "Check the attention scale (1/√d_k) and the q/k projections' init; QK-norm or a "
            "lower init keeps the scores near unit scale.",
        )
    ]
