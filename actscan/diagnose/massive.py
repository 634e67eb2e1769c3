"""Per-token pathologies: massive activations (Sun et al. 2024).

A massive activation is one value of the residual stream, on one token, in one channel,
that is ≥ 100 in absolute value and ≥ 1000× the stream's median |x|. Trained LLMs grow a
handful of them on the start token and delimiters, in a few fixed channels: a known
mechanism (they act as fixed attention biases) and benign for training, but they set the
per-tensor quantization scale. At init no scheme makes them: there they are a bug.

They are kept apart from outlier-channels, which is per channel across tokens: at stream
points a channel that is large on fewer than outlier-tokens of its tokens is not an outlier
channel (actscan.measure.stats.channel_outliers) and is reported here, per token.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from actscan.diagnose.common import FP16_MAX, finding, is_fill, listing, n, skip
from actscan.records import CheckId, Finding, Severity, Skip, StreamPoint, TopValue, all_points

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext


def massive_values(
    points: tuple[StreamPoint, ...], ratio: float, floor: float
) -> list[tuple[StreamPoint, TopValue, float]]:
    """(point, value, |value| / median |x|) of every recorded value that is massive."""
    out = []
    for p in points:
        med = p.median_abs
        for tv in p.top_values:
            a = abs(tv.value)
            if not math.isfinite(a) or a < floor or med is None or is_fill(a):
                continue
            r = a / med if med > 0 else math.inf
            if r >= ratio:
                out.append((p, tv, r))
    return out


def token_label(tv: TopValue) -> str:
    """'token 0' / "token 0 ('<s>', id 1)"."""
    if tv.text is not None:
        return f"token {tv.token} ({tv.text!r}, id {tv.token_id})"
    if tv.token_id is not None:
        return f"token {tv.token} (id {tv.token_id})"
    return f"token {tv.token}"


def massive_activations(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    points = all_points(ctx.stream, ctx.streams)
    if not any(p.median_abs is not None for p in points):
        why = (
            "no residual stream was found"
            if not points
            else "the per-token view was not recorded at the stream points"
        )
        return [skip(CheckId.MASSIVE_ACTIVATIONS, why)]
    hits = massive_values(points, th.massive_ratio, th.massive_abs)
    if not hits:
        return []
    order = {p.name: i for i, p in enumerate(points)}
    # one group per (token position, channel): the same value carried down the stream
    groups: dict[tuple[int, int], list[tuple[StreamPoint, TopValue, float]]] = {}
    for h in hits:
        groups.setdefault((h[1].token, h[1].channel), []).append(h)
    ranked = sorted(groups.values(), key=lambda g: -max(abs(h[1].value) for h in g))
    lead = ranked[0]
    first = min(lead, key=lambda h: order[h[0].name])
    big = max(lead, key=lambda h: abs(h[1].value))
    where = sorted({h[0].name for h in lead}, key=order.__getitem__)
    worst_ratio = max(h[2] for g in ranked for h in g)
    top = max(abs(h[1].value) for g in ranked for h in g)
    scale = top / 127
    med = big[0].median_abs or 0.0
    others = [f"{token_label(g[0][1])} channel {g[0][1].channel}" for g in ranked[1:]]
    more = f"; also {listing(others, 4)}" if others else ""
    seqs = {(h[1].batch, h[1].sequence) for h in lead}
    many = f" of {len(seqs)} sequences" if len(seqs) > 1 else ""
    typical = (
        "the median value included"
        if med < scale / 2
        else f"a median value keeps {n(med / scale)} levels"
    )
    message = (
        f"Massive activation at {token_label(big[1])}{many}, channel {big[1].channel}: |x| = "
        f"{n(abs(big[1].value))}, {n(big[2])}× the median |x| ({n(med)}); first at "
        f"{first[0].name} (k = {first[0].k}), at {len(where)} of {len(points)} stream "
        f"points{more}. Per-tensor int8 (s = max/127 = {n(scale)}) rounds every |x| below "
        f"{n(scale / 2)} to 0, {typical}; fp16 keeps ×{n(FP16_MAX / top)} headroom to 65504."
    )
    if ctx.info.at_init:
        severity = Severity.WARN
        hint = (
            "At initialization no scheme makes one token ×1000 the rest: look at what feeds "
            f"{token_label(big[1])} at {first[0].name} (an embedding row, a positional "
            "embedding, an input scaled by mistake)."
        )
    else:
        severity = Severity.INFO
        hint = (
            "A known mechanism in trained LLMs (Sun et al. 2024, 'Massive Activations in "
            "Large Language Models'): a few fixed channels of the start token and delimiters "
            "act as attention biases; benign for training. For int8 they waste the "
            "per-tensor scale: quantize per token, or keep those tokens in higher precision."
        )
    layers = [h[0].name for h in sorted(hits, key=lambda h: order[h[0].name])]
    return [
        finding(
            CheckId.MASSIVE_ACTIVATIONS,
            severity,
            list(dict.fromkeys(layers)),
            worst_ratio,
            th.massive_ratio,
            message,
            hint,
        )
    ]
