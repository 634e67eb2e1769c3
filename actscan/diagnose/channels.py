"""Per-channel pathologies: dead activation units and outlier channels (quantization)."""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    feeding,
    finding,
    finite,
    grade,
    known,
    listing,
    n,
    pct,
    positive,
    skip,
    warn_or_error,
)
from actscan.diagnose.massive import massive_values
from actscan.records import CheckId, Finding, LayerRecord, Severity, Skip, all_points

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

# Channels of these outputs are not features: vocabulary logits, attention keys.
NOT_FEATURES = {"AttentionLogits"}
# Tensors whose last axis is not a feature axis: attention probabilities (and the dropout
# on them: GPT-Neo's `attn_dropout`, whose "channel 0" is the first key under a causal
# mask), attention masks, position ids.
_NOT_CHANNELS = re.compile(
    r"(^|_)(attn|attention)_?(drop(out)?|probs?|weights|scores)$|mask|position_?ids", re.I
)


def not_channels(r: LayerRecord) -> bool:
    """The tensor is not activation channels: named like attention probabilities, a mask
    or position ids, or its rows are distributions (values in [0, 1], mean 1/width: every
    row sums to one, as softmax outputs do)."""
    if r.type in NOT_FEATURES or _NOT_CHANNELS.search(r.name.rsplit(".", 1)[-1]):
        return True
    width, mean, top = r.n_channels, r.mean, r.max_abs
    if not (width and width > 1 and mean is not None and top is not None):
        return False
    return mean > 0 and top <= 1.0 + 1e-6 and abs(mean * width - 1.0) <= 1e-3


def dead_units(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    if not any(r.role == "act" and r.dead_channels is not None for r in ctx.layers):
        why = (
            "per-channel statistics were not recorded"
            if not _has_channels(ctx)
            else "no activation module (nn.ReLU, nn.GELU, …) was recorded"
        )
        return [skip(CheckId.DEAD_UNITS, why)]
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
    out: list[Finding | Skip] = []
    explained = [(r, f, why) for r, f in hits if (why := _input_cause(r, ctx.layers))]
    if explained:
        out.append(_explained(explained, th.dead_units_warn))
        hits = [(r, f) for r, f in hits if all(r is not e for e, _, _ in explained)]
        if not hits:
            return out
    worst, frac = max(hits, key=lambda h: h[1])
    severity, threshold = grade(frac, th.dead_units_warn, th.dead_units_error)
    rows = worst.numel * max(ctx.run.batches, 1) // worst.n_channels if worst.n_channels else 0
    few = ""
    chance = 2.0 ** -min(rows, 1074)  # a centred unit is zero on all N rows with 2^-N
    if severity is Severity.ERROR and chance >= th.dead_units_warn:
        severity = Severity.INFO  # chance alone: an expert that received a token or two
        few = (
            f" Only {rows} row{'s' if rows != 1 else ''} per channel were seen (an expert "
            f"that received {rows} token{'s' if rows != 1 else ''}): a healthy centred unit "
            f"is zero on all of them with probability 2^-{rows} = {pct(chance)}, so this "
            f"fraction is chance; rerun with more --batch/--seq-len/--batches to judge."
        )
    elif rows < th.dead_units_min_rows and severity is Severity.WARN:
        severity = Severity.INFO  # weak evidence: a rarely-firing unit looks dead
        few = (
            f" Only {rows} rows per channel were seen (a unit that fires on fewer than "
            f"~{pct(min(1.0, 3 / max(rows, 1)))} of them looks dead): rerun with more "
            f"--batch/--seq-len/--batches (≥ {th.dead_units_min_rows:g} rows) to judge."
        )
    pre = feeding(worst, ctx.layers)
    why = ""
    if pre is not None and finite(pre.mean) and finite(pre.std):
        why = f" (its input {pre.name} has mean {n(pre.mean)}, std {n(pre.std)})"
    per_layer = [f"{r.name} {pct(f)}" for r, f in hits]
    message = (
        f"{worst.name}: {worst.dead_channels}/{worst.n_channels} channels ({pct(frac)}) are "
        f"zero on every token{why}; {len(hits)} activation layer"
        f"{'s' if len(hits) > 1 else ''} at ≥ {pct(th.dead_units_warn)} dead: "
        f"{listing(per_layer, 4)}.{few}"
    )
    hint = (
        "Dead ReLUs get no gradient and never recover: center the pre-activations (zero bias "
        "init, He init √(2/fan_in)), lower the learning rate, or use GELU/SiLU/leaky ReLU."
    )
    return [
        *out,
        finding(
            CheckId.DEAD_UNITS, severity, [r.name for r, _ in hits], frac, threshold, message, hint
        ),
    ]


def _input_cause(act: LayerRecord, layers: tuple[LayerRecord, ...]) -> str:
    """Why an activation's zero channels say nothing about its init, from what was
    measured: its input is exactly 0 everywhere (nothing reaches the units), or every
    unit is zero on every row or on none (the rows do not vary: with varying, centred
    pre-activations a live ReLU unit is zero on about half of them). '' otherwise."""
    pre = feeding(act, layers)
    if pre is not None and pre.max_abs == 0:
        return (
            f"its input {pre.name} is exactly 0 on every row: nothing reaches these units (an "
            f"input that is 0 here, such as a one-position table, or zeroed weights upstream)"
        )
    width, dead, zeros = act.n_channels, act.dead_channels, act.zero_frac
    if not (width and dead is not None and zeros is not None and 0 < dead < width):
        return ""
    if abs(zeros - dead / width) > 1e-6:
        return ""
    return (
        "every unit is zero on every row or on none: its input's rows do not vary (the same "
        "invented value on every token, such as default ids), so which units fire is one "
        "pattern, not the init's"
    )


def _explained(hits: list[tuple[LayerRecord, float, str]], warn_at: float) -> Finding:
    """dead-units at info: zero channels that the measured input explains."""
    worst, frac, why = max(hits, key=lambda h: h[1])
    per_layer = [f"{r.name} {pct(f)}" for r, f, _ in hits]
    return finding(
        CheckId.DEAD_UNITS,
        Severity.INFO,
        [r.name for r, _, _ in hits],
        frac,
        warn_at,
        f"{worst.name}: {worst.dead_channels}/{worst.n_channels} channels ({pct(frac)}) are "
        f"zero on every token, but {why} ({listing(per_layer, 4)}). Not dead units: they "
        f"are judged on inputs that vary.",
        "Feed real inputs (--input, or the model's own auxiliary ids) to judge these units.",
    )


def _has_channels(ctx: CheckContext) -> bool:
    return any(r.n_channels for r in ctx.layers)


def _signature(r: LayerRecord) -> tuple[object, ...]:
    """Equal for records of one tensor reported by several modules (dropout in eval, a
    wrapper returning its child's output): the recorder reduces such a tensor once."""
    return (r.n_channels, r.numel, r.max_abs, r.rms, r.mean, r.outlier_channels)


def _distinct(hits: list[LayerRecord]) -> list[LayerRecord]:
    seen: set[tuple[object, ...]] = set()
    out = []
    for r in hits:
        key = _signature(r)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _channel_groups(
    hits: list[LayerRecord],
) -> list[tuple[int | None, list[int], list[LayerRecord]]]:
    """(width, the channels that stand out, distinct tensors) per width, first seen first.

    Channel i of a 384-wide output and channel i of a 1536-wide one are different
    features: they are never counted together. A channel is named when it stands out in at
    least half the tensors of its width; else the first tensor's own outliers are.
    """
    by_width: dict[int | None, list[LayerRecord]] = {}
    for r in _distinct(hits):
        by_width.setdefault(r.n_channels, []).append(r)
    groups = []
    for width, recs in by_width.items():
        counts = Counter(c for r in recs for c in r.outlier_channels)
        common = [c for c, k in counts.most_common() if k >= max(1, len(recs) // 2)]
        first_own = list(recs[0].outlier_channels)
        named = sorted(c for c in common if c in first_own) or first_own
        groups.append((width, named, recs))
    return groups


def token_local(ctx: CheckContext) -> set[tuple[int | None, int]]:
    """(width, channel) of the massive activations the stream shows on a few tokens only:
    the channel carries a massive value at a stream point where it is not an outlier
    channel across tokens (actscan.measure.stats.channel_outliers, outlier-tokens)."""
    th = ctx.thresholds
    recs = {r.name: r for r in ctx.layers}
    out: set[tuple[int | None, int]] = set()
    points = all_points(ctx.stream, ctx.streams)
    for p, tv, _ in massive_values(points, th.massive_ratio, th.massive_abs):
        r = recs.get(p.name)
        if r is not None and tv.channel not in r.outlier_channels:
            out.add((r.n_channels, tv.channel))
    return out


def _scaled_by_own_parameters(ctx: CheckContext) -> dict[str, list[str]]:
    """Module → its per-channel parameters that enter no contraction ("structured": an
    SSM's A_log and dt_bias, which set each channel's time scale, log-uniform over two
    orders of magnitude on purpose). Such a module's channels differ by design."""
    out: dict[str, list[str]] = {}
    for p in ctx.params:
        if p.kind == "structured" and len(p.shape) == 1 and p.shape[0] > 1:
            out.setdefault(p.module, []).append(p.name.rsplit(".", 1)[-1])
    return out


def _designed(hits: list[LayerRecord], scaled: dict[str, list[str]], ratio_at: float) -> Finding:
    """outlier-channels at info: at init, outlier channels of a module whose own
    per-channel parameters scale its channels."""
    worst = max(hits, key=lambda r: known(r.channel_max_ratio))
    return finding(
        CheckId.OUTLIER_CHANNELS,
        Severity.INFO,
        [r.name for r in hits],
        worst.channel_max_ratio,
        ratio_at,
        f"At init, {worst.name}'s channels differ by up to {n(worst.channel_max_ratio)}× "
        f"the median channel's max (channels {listing([str(c) for c in worst.outlier_channels], 6)}"
        f"; {len(hits)} such module{'s' if len(hits) > 1 else ''}), set by its own "
        f"per-channel parameters ({', '.join(scaled[worst.name])}: an SSM's or gated "
        f"recurrence's time scales, spread on purpose), not by an outlier feature.",
        "Keep such tensors (decay rates, gates) out of per-tensor activation quantization; "
        "nothing to fix in the init.",
    )


def outlier_channels(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    if not _has_channels(ctx):
        return [skip(CheckId.OUTLIER_CHANNELS, "per-channel statistics were not recorded")]
    # A layer whose outlier channels are all massive activations of a few tokens (the
    # same channel, the same width) is massive-activations' to report, not this check's.
    local = token_local(ctx)
    hits = [
        r
        for r in ctx.layers
        if r.outlier_channels
        and r.role != "head"
        and not not_channels(r)
        and not r.nonfinite
        and positive(r.channel_max_ratio)
        and positive(r.max_abs)
        and not all((r.n_channels, c) in local for c in r.outlier_channels)
    ]
    out: list[Finding | Skip] = []
    scaled = _scaled_by_own_parameters(ctx)
    designed = [r for r in hits if r.name in scaled] if ctx.info.at_init else []
    if designed:
        out.append(_designed(designed, scaled, th.outlier_ratio))
        hits = [r for r in hits if r.name not in scaled]
    if not hits:
        return out
    hits.sort(key=lambda r: r.order)
    groups = _channel_groups(hits)
    worst = max(hits, key=lambda r: known(r.channel_max_ratio))
    ratio = known(worst.channel_max_ratio)
    scale = known(worst.max_abs) / 127
    median = worst.channel_median_max
    levels = median / scale if positive(median) else None
    # At init no random scheme makes such channels: past the error ratio it is a bug. In a
    # trained model they are an emergent feature and a quantization hazard: warn.
    extreme = ratio >= th.outlier_ratio_error
    severity, threshold = warn_or_error(
        extreme and ctx.info.at_init, th.outlier_ratio, th.outlier_ratio_error
    )
    parts = []
    for width, channels, recs in groups:
        label = "channel" if len(channels) == 1 else "channels"
        shown = listing([str(c) for c in channels], 8)
        layers = f"{len(recs)} layer{'s' if len(recs) > 1 else ''}"
        wide = f" of width {width}" if len(groups) > 1 and width else ""
        parts.append(f"{label} {shown} in {layers}{wide} (first: {recs[0].name})")
    lead = parts[0].split(" in ", 1)
    verb = "stands" if lead[0].startswith("channel ") else "stand"
    message = (
        f"Activation {lead[0]} {verb} out in {lead[1]}"
        + "".join(f"; {p}" for p in parts[1:])
        + f": at {worst.name} max|x| = {n(worst.max_abs)} is {n(ratio)}× the median channel's "
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
    return [
        *out,
        finding(
            CheckId.OUTLIER_CHANNELS,
            severity,
            [r.name for r in hits],
            ratio,
            threshold,
            message,
            hint,
        ),
    ]
