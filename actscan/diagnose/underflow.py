"""underflow: fp16 gradients (and activations) below fp16's smallest normal, the loss-scaling
problem. Theory: docs/checks.md, underflow (Transformer Engine's "underflows %")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    NO_BACKWARD,
    feeding,
    finding,
    grade,
    known,
    listing,
    n,
    pct,
    skip,
)
from actscan.records import CheckId, Finding, LayerRecord, Skip

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

# fp16's smallest normal value, 2^-14: below it 10 mantissa bits are lost one by one
# (subnormals) down to 2^-24 ≈ 5.96e-8, and below that a value is 0.
FP16_TINY = 2.0**-14
NOT_FP16 = "not an fp16 run (--dtype fp16 or --amp fp16): fp32 and bf16 share fp32's range"


def _structural_zeros(ctx: CheckContext) -> set[str]:
    """Outputs whose gradient is zero or tiny by design, not by underflow: the input of an
    activation (a ReLU passes no gradient where it is off), attention scores (the causal
    mask), and the head's logits (p/N per token and class: with a large vocabulary almost
    every entry is tiny, and they carry a negligible part of the gradient)."""
    out = {r.name for r in ctx.layers if r.type == "AttentionLogits" or r.role == "head"}
    for act in (r for r in ctx.layers if r.role == "act"):
        pre = feeding(act, ctx.layers)
        if pre is not None:
            out.add(pre.name)
    return out


def underflow(ctx: CheckContext) -> list[Finding | Skip]:
    run = ctx.run
    if not (run.dtype == "fp16" or run.amp == "fp16"):
        return [skip(CheckId.UNDERFLOW, NOT_FP16)]
    if not run.backward:
        return [skip(CheckId.UNDERFLOW, NO_BACKWARD)]
    th = ctx.thresholds
    excluded = _structural_zeros(ctx)
    recs: list[LayerRecord] = [
        r
        for r in ctx.layers
        if r.grad_underflow_frac is not None and not r.nonfinite and r.name not in excluded
    ]
    if not recs:
        return [skip(CheckId.UNDERFLOW, "no output gradient was recorded")]
    hits = sorted(
        (r for r in recs if known(r.grad_underflow_frac) >= th.underflow_warn),
        key=lambda r: r.order,
    )
    if not hits:
        return []
    worst = max(hits, key=lambda r: known(r.grad_underflow_frac))
    frac: float = known(worst.grad_underflow_frac)
    severity, threshold = grade(frac, th.underflow_warn, th.underflow_error)
    acts = [r for r in ctx.layers if r.underflow_frac is not None and not r.nonfinite]
    top_act = max(acts, key=lambda r: known(r.underflow_frac), default=None)
    act_part = (
        f"; activations: at most {pct(top_act.underflow_frac)} at {top_act.name}"
        if top_act is not None and top_act.underflow_frac
        else ""
    )
    where = "amp fp16" if run.amp == "fp16" else "fp16"
    many = len(hits) > 1
    message = (
        f"In {where}, {pct(frac)} of the output gradient of {worst.name} is below fp16's "
        f"smallest normal {n(FP16_TINY)} (subnormal or flushed to 0); {len(hits)} "
        f"module{'s' if many else ''} lose{'' if many else 's'} ≥ {pct(th.underflow_warn)} "
        f"of {'their' if many else 'its'} gradient this way "
        f"({listing([f'{r.name} {pct(known(r.grad_underflow_frac))}' for r in hits], 4)})"
        f"{act_part}."
    )
    hint = (
        "Scale the loss before backward and unscale the gradients before the step: "
        "torch.amp.GradScaler (dynamic loss scaling: starts at 2^16, halves on inf/nan, grows "
        "back while finite), or a static loss scale; or train in bf16 (fp32's range)."
    )
    return [
        finding(CheckId.UNDERFLOW, severity, [r.name for r in hits], frac, threshold, message, hint)
    ]
