"""Per-channel pathologies: dead activation units and outlier channels (quantization)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    finding,
    finite,
    grade,
    listing,
    n,
    pct,
    positive,
    warn_or_error,
)
from actscan.types import CheckId, Finding, LayerRecord

if TYPE_CHECKING:
    from actscan.diagnose import CheckContext

# Channels of these outputs are not features: vocabulary logits, attention keys.
NOT_FEATURES = {"AttentionLogits"}


def _feeding(act: LayerRecord, layers: tuple[LayerRecord, ...]) -> LayerRecord | None:
    """The pre-activation: the latest module before `act` in its block with as many channels."""
    before = [
        r for r in layers
        if r.block == act.block and r.order < act.order and r.n_channels == act.n_channels
        and r.role != "act" and not act.name.startswith(r.name + ".")
    ]  # fmt: skip
    return max(before, key=lambda r: r.order) if before else None


def dead_units(ctx: CheckContext) -> list[Finding]:
    th = ctx.thresholds
    hits: list[tuple[LayerRecord, float]] = []
    for r in ctx.layers:
        if r.role != "act" or not r.n_channels or r.dead_channels is None or r.nonfinite:
            continue
        frac = r.dead_channels / r.n_channels
        if frac >= th.dead_units_warn:
            hits.append((r, frac))
    if not hits:
        return []
    hits.sort(key=lambda h: h[0].order)
    worst, frac = max(hits, key=lambda h: h[1])
    severity, threshold = grade(frac, th.dead_units_warn, th.dead_units_error)
    pre = _feeding(worst, ctx.layers)
    why = ""
    if pre is not None and finite(pre.mean) and finite(pre.std):
        why = f" (its input {pre.name} has mean {n(pre.mean)}, std {n(pre.std)})"
    per_layer = [f"{r.name} {pct(f)}" for r, f in hits]
    message = (
        f"{worst.name}: {worst.dead_channels}/{worst.n_channels} channels ({pct(frac)}) are "
        f"zero on every token{why}; {len(hits)} activation layer"
        f"{'s' if len(hits) > 1 else ''} at ≥ {pct(th.dead_units_warn)} dead: "
        f"{listing(per_layer, 4)}."
    )
    hint = (
        "Dead ReLUs get no gradient and never recover: center the pre-activations (zero bias "
        "init, He init √(2/fan_in)), lower the learning rate, or use GELU/SiLU/leaky ReLU."
    )
    return [finding(CheckId.DEAD_UNITS, severity, [r.name for r, _ in hits], frac, threshold,
                    message, hint)]  # fmt: skip


def outlier_channels(ctx: CheckContext) -> list[Finding]:
    th = ctx.thresholds
    hits = [
        r for r in ctx.layers
        if r.outlier_channels and r.role != "head" and r.type not in NOT_FEATURES
        and not r.nonfinite and positive(r.channel_max_ratio) and positive(r.max_abs)
    ]  # fmt: skip
    if not hits:
        return []
    hits.sort(key=lambda r: r.order)
    counts = Counter(c for r in hits for c in r.outlier_channels)
    common = [c for c, k in counts.most_common() if k >= max(1, len(hits) // 2)]
    channels = sorted(common or [c for c, _ in counts.most_common(5)])
    worst = max(hits, key=lambda r: r.channel_max_ratio)  # type: ignore[arg-type, return-value]
    ratio = worst.channel_max_ratio
    scale = worst.max_abs / 127  # type: ignore[operator]
    median = worst.channel_median_max
    levels = median / scale if positive(median) else None  # type: ignore[operator]
    # At init no random scheme makes such channels: past the error ratio it is a bug. In a
    # trained model they are an emergent feature and a quantization hazard: warn.
    extreme = ratio >= th.outlier_ratio_error  # type: ignore[operator]
    severity, threshold = warn_or_error(
        extreme and ctx.info.at_init, th.outlier_ratio, th.outlier_ratio_error
    )
    label = "channel" if len(channels) == 1 else "channels"
    shown = listing([str(c) for c in channels], 8)
    message = (
        f"Activation {label} {shown} stand{'s' if len(channels) == 1 else ''} out in "
        f"{len(hits)} layer{'s' if len(hits) > 1 else ''} (first: {hits[0].name}): at "
        f"{worst.name} max|x| = {n(worst.max_abs)} is {n(ratio)}× the median channel's "
        f"{n(median)}; per-tensor int8 (s = max/127 = {n(scale)}) leaves a typical value "
        f"{n(levels)} quantization levels."
    )
    hint = (
        "Quantize activations per channel (or per token) instead of per tensor, keep the "
        "outlier channels in fp16 (LLM.int8() mixed precision), or move the range into the "
        "weights with SmoothQuant (Y = (X·diag(s)⁻¹)(diag(s)·W))."
    )
    if hits[0].role == "embed" or hits[0].type == "StreamInput":
        hint += " Here the channel starts at the embedding: check that column's values."
    return [finding(CheckId.OUTLIER_CHANNELS, severity, [r.name for r in hits], ratio,
                    threshold, message, hint)]  # fmt: skip
