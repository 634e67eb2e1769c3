"""Attention heads, from the attention probes (CheckContext.attention): score scale for
logit-scale (std against √(2 ln T), max against Gemma 2's soft-cap 50 and QK-Clip's τ = 100)
and attn-entropy (heads collapsed onto one key). Theory: docs/checks.md, logit-scale and
attn-entropy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from actscan.diagnose.common import finding, finite, grade, known, listing, n, skip
from actscan.records import AttentionRecord, CheckId, Finding, HeadRecord, Severity, Skip

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

Hit = tuple[AttentionRecord, HeadRecord]


def freeze(keys: int) -> float:
    """√(2 ln T): score std above which a softmax over T keys is max-dominated."""
    return math.sqrt(2 * math.log(max(keys, 2)))


def heads_text(hits: Sequence[Hit], limit: int = 3) -> str:
    """'model.layers.2.self_attn heads 0, 1, 3; model.layers.5.self_attn head 2 and 4
    more layers', in layer order."""
    by_layer: dict[str, list[int]] = {}
    for rec, head in hits:
        by_layer.setdefault(rec.name, []).append(head.head)
    parts = [
        f"{name} head{'s' if len(hs) > 1 else ''} {listing(map(str, sorted(hs)), 8)}"
        for name, hs in by_layer.items()
    ]
    more = len(parts) - limit
    return "; ".join(parts[:limit]) + (f"; and {more} more layers" if more > 0 else "")


def _hits(ctx: CheckContext, keep: Callable[[AttentionRecord, HeadRecord], bool]) -> list[Hit]:
    return [(r, h) for r in ctx.attention for h in r.heads if keep(r, h)]


def _layers(hits: Sequence[Hit]) -> list[str]:
    return list(dict.fromkeys(r.name for r, _ in hits))


def temperature(r: AttentionRecord) -> float | None:
    """A QK-normed layer's designed score scale: q and k enter with one row norm each, so
    a score is s·‖q‖‖k‖·cos θ, of std s·‖q‖‖k‖/√d over random directions at init (None:
    q or k not normed, or not measured). The scale is the design's (a norm gain learns
    it, a fixed factor sets it), and no activation can push a score past s·‖q‖‖k‖."""
    if r.q_norm is None or r.k_norm is None or r.scaling is None or not r.head_dim:
        return None
    return r.scaling * r.q_norm * r.k_norm / math.sqrt(r.head_dim)


def _normed(hits: Sequence[Hit]) -> tuple[list[Hit], list[Hit]]:
    """Hits split into (QK-normed layers, the rest)."""
    normed = [x for x in hits if temperature(x[0]) is not None]
    return normed, [x for x in hits if temperature(x[0]) is None]


def _designed(hits: Sequence[Hit]) -> str:
    """Why a QK-normed layer's sharp scores at init are its design, with the numbers."""
    recs = list({r.name: r for r, _ in hits}.values())
    taus = [known(temperature(r)) for r in recs]
    r = recs[taus.index(max(taus))]
    span = n(min(taus)) if len(recs) == 1 else f"{n(min(taus))}–{n(max(taus))}"
    return (
        f"q and k enter {'this layer' if len(recs) == 1 else 'these layers'} with one row "
        f"norm each (QK-normed; {r.name}: ‖q‖ = {n(r.q_norm)}, ‖k‖ = {n(r.k_norm)} over "
        f"head_dim {r.head_dim}) and scaling {n(r.scaling)}, so the score std at init is "
        f"s·‖q‖‖k‖/√d = {span}: a temperature the design sets on purpose (the norm gain "
        f"learns it, a fixed factor keeps it), and no score can pass s·‖q‖‖k‖ = "
        f"{n(known(r.scaling) * known(r.q_norm) * known(r.k_norm))} whatever the stream does."
    )


def score_findings(ctx: CheckContext) -> list[Finding]:
    """logit-scale on the probed attention scores: std vs √(2 ln T), and the max score."""
    th = ctx.thresholds
    at_init = ctx.info.at_init
    out: list[Finding] = []

    def factor(r: AttentionRecord, h: HeadRecord) -> float:
        return (h.score_std or 0.0) / freeze(r.keys) if finite(h.score_std) else 0.0

    hot = _hits(ctx, lambda r, h: r.keys >= 2 and factor(r, h) >= th.logit_freeze)
    spread = [(r, h) for r, h in hot if _spread(th.attn_entropy_low, factor(r, h), h)]
    hot = [(r, h) for r, h in hot if not _spread(th.attn_entropy_low, factor(r, h), h)]
    if spread and not hot:
        out.append(_spread_finding(ctx, spread, factor))
    if at_init:
        designed, hot = _normed(hot)
        if designed:
            rec, head = max(designed, key=lambda x: factor(*x))
            out.append(
                finding(
                    CheckId.LOGIT_SCALE,
                    Severity.INFO,
                    _layers(designed),
                    factor(rec, head),
                    th.logit_freeze,
                    f"Attention scores at init have std up to {n(head.score_std)} at "
                    f"{rec.name} head {head.head} over T = {rec.keys} keys, "
                    f"{n(factor(rec, head))}× √(2 ln T) = {n(freeze(rec.keys))} "
                    f"({len(designed)} head{'s' if len(designed) > 1 else ''}: "
                    f"{heads_text(designed)}), but " + _designed(designed),
                    "Nothing to fix at init; --steps follows the score maximum as training "
                    "moves the norm gains.",
                )
            )
    if hot:
        rec, head = max(hot, key=lambda x: factor(*x))
        worst = factor(rec, head)
        sev, threshold = (
            grade(worst, th.logit_freeze, th.logit_freeze_error)
            if at_init
            else (Severity.INFO, th.logit_freeze)
        )
        state = "at init " if at_init else ""
        tail = (
            "each such softmax is near one-hot and passes almost no gradient."
            if at_init
            else "trained heads may be this sharp on purpose (positional, sink and copy heads)."
        )
        out.append(
            finding(
                CheckId.LOGIT_SCALE,
                sev,
                _layers(hot),
                worst,
                threshold,
                f"Attention scores {state}have std up to {n(head.score_std)} at {rec.name} head "
                f"{head.head} over T = {rec.keys} keys, {n(worst)}× √(2 ln T) = "
                f"{n(freeze(rec.keys))} ({len(hot)} head{'s' if len(hot) > 1 else ''}: "
                f"{heads_text(hot)}): {tail}",
                "Check the attention scale (1/√d_k) and the q/k projections' init; QK-norm, "
                "a lower q/k init or a logit soft-cap keeps the scores near unit scale.",
            )
        )
    big = _hits(ctx, lambda r, h: finite(h.score_max) and h.score_max >= th.attn_score_max)
    if big:
        rec, head = max(big, key=lambda x: known(x[1].score_max))
        top = float(known(head.score_max))
        over = top >= th.attn_score_max_error
        # at init: warn, error past τ; a checkpoint: info, warn past τ (one notch lower)
        sev = grade(top, th.attn_score_max, th.attn_score_max_error)[0]
        if not at_init:
            sev = Severity.WARN if sev is Severity.ERROR else Severity.INFO
        out.append(
            finding(
                CheckId.LOGIT_SCALE,
                sev,
                _layers(big),
                top,
                th.attn_score_max_error if over else th.attn_score_max,
                f"Attention scores reach {n(top)} at {rec.name} head {head.head} "
                f"({len(big)} head{'s' if len(big) > 1 else ''} ≥ {n(th.attn_score_max)}: "
                f"{heads_text(big)}); Gemma 2 soft-caps its scores at 50 and Kimi K2's QK-Clip "
                f"rescales W_q, W_k of any head past τ = 100, the attention-logit growth that "
                f"precedes loss spikes.",
                "Bound the scores: QK-norm, a tanh soft-cap (Gemma 2: 50·tanh(s/50)) or "
                "QK-Clip; at init, check the q/k projections' scale.",
            )
        )
    return out


# Normalised entropy of a softmax over T Gaussian scores of std m·√(2 ln T) (20 000 draws
# each, docs/checks.md "logit-scale"): at m = 1 it is 0.73 (T = 2), 0.52 (16), 0.46 (64),
# 0.37 (1024); at m = 2 at most 0.49 at any T ≥ 2. √(2 ln T) is the freezing point of
# T → ∞; over few keys scores past it still spread. Below this multiple the measured
# entropy decides whether the head is near one-hot; at and above it the std alone does.
FINITE_KEYS_BAND = 2.0


def _spread(low: float, factor: float, h: HeadRecord) -> bool:
    """A head past the freezing point whose measured entropy says it is not near one-hot:
    inside the finite-size band, spread over at least √T of its keys."""
    return factor < FINITE_KEYS_BAND and finite(h.entropy) and known(h.entropy) >= low


def _spread_finding(
    ctx: CheckContext, spread: Sequence[Hit], factor: Callable[[AttentionRecord, HeadRecord], float]
) -> Finding:
    """logit-scale at info: score std past √(2 ln T) over few keys, heads still spread."""
    th = ctx.thresholds
    rec, head = max(spread, key=lambda x: factor(*x))
    low = min(known(h.entropy) for _, h in spread)
    return finding(
        CheckId.LOGIT_SCALE,
        Severity.INFO,
        _layers(spread),
        factor(rec, head),
        th.logit_freeze,
        f"Attention scores have std up to {n(head.score_std)} at {rec.name} head {head.head} "
        f"over T = {rec.keys} keys, {n(factor(rec, head))}× √(2 ln T) = {n(freeze(rec.keys))} "
        f"({len(spread)} head{'s' if len(spread) > 1 else ''}: {heads_text(spread)}), but their "
        f"measured normalised entropy is ≥ {n(low)} (at least √T of the keys): √(2 ln T) is "
        f"the freezing point of many keys, and over {rec.keys} keys scores this large still "
        f"spread (below ×{n(FINITE_KEYS_BAND)} of it the entropy, not the std, says one-hot).",
        "Nothing to fix at this sequence length; attn-entropy judges the heads' spread. "
        "Rerun with a longer --seq-len to judge the scale over as many keys as training sees.",
    )


def attn_entropy(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    if not ctx.attention:
        return [
            skip(
                CheckId.ATTN_ENTROPY,
                "no attention probes recorded (--no-attention, no attention layers, or a "
                "family whose attention cannot be probed: see the notes)",
            )
        ]

    def ent(h: HeadRecord) -> float | None:
        return h.entropy if finite(h.entropy) else None

    def keys_of(r: AttentionRecord, e: float) -> str:
        m = r.mean_keys or r.keys
        return f"≈ {n(m**e)} of {n(m)} keys" if m else ""

    if ctx.info.at_init:
        low = _hits(ctx, lambda r, h: (e := ent(h)) is not None and e < th.attn_entropy_low)
        designed, low = _normed(low)
        out: list[Finding | Skip] = []
        if designed:
            rec, head = min(designed, key=lambda x: known(x[1].entropy))
            e = float(known(head.entropy))
            out.append(
                finding(
                    CheckId.ATTN_ENTROPY,
                    Severity.INFO,
                    _layers(designed),
                    e,
                    th.attn_entropy_low,
                    f"{len(designed)} attention head{'s' if len(designed) > 1 else ''} at "
                    f"init {'have' if len(designed) > 1 else 'has'} normalised entropy below "
                    f"{n(th.attn_entropy_low)}: lowest {rec.name} head {head.head} at {n(e)} "
                    f"(spread over {keys_of(rec, e)}); {heads_text(designed)}. But "
                    + _designed(designed),
                    "Nothing to fix at init; a longer --seq-len judges the spread over as "
                    "many keys as training sees.",
                )
            )
        if not low:
            return out
        rec, head = min(low, key=lambda x: known(x[1].entropy))
        e = float(known(head.entropy))
        sev, threshold = grade(e, th.attn_entropy_low, th.attn_entropy_collapse, above=False)
        return [
            *out,
            finding(
                CheckId.ATTN_ENTROPY,
                sev,
                _layers(low),
                e,
                threshold,
                f"{len(low)} attention head{'s' if len(low) > 1 else ''} at init "
                f"{'have' if len(low) > 1 else 'has'} normalised entropy below "
                f"{n(th.attn_entropy_low)} (healthy heads at init sit near 1, uniform over "
                f"their keys): lowest {rec.name} head {head.head} at {n(e)} (spread over "
                f"{keys_of(rec, e)}); {heads_text(low)}. "
                + ("It is collapsed onto one key." if e < th.attn_entropy_collapse else ""),
                "The scores are too large at init: check the q/k projections' init and the "
                "1/√d_k scale (logit-scale says by how much); QK-norm keeps them near unit "
                "scale.",
            ),
        ]
    collapsed = _hits(ctx, lambda r, h: (e := ent(h)) is not None and e < th.attn_entropy_collapse)
    if not collapsed:
        return []
    whole = [
        r.name
        for r in ctx.attention
        if r.heads
        and all((x := ent(h)) is not None and x < th.attn_entropy_collapse for h in r.heads)
    ]
    total = sum(len(r.heads) for r in ctx.attention)
    rec, head = min(collapsed, key=lambda x: known(x[1].entropy))
    e = float(known(head.entropy))
    message = (
        f"{len(collapsed)} of {total} attention heads are collapsed onto about one key "
        f"(normalised entropy < {n(th.attn_entropy_collapse)}): {heads_text(collapsed)}; "
        f"lowest {rec.name} head {head.head} at {n(e)} ({keys_of(rec, e)}). "
    )
    if whole:
        message += (
            f"Every head of {listing(whole, 3)} is collapsed: the layer mixes no information "
            "across tokens."
        )
        sev = Severity.WARN
    else:
        message += (
            "In a trained model this is usually deliberate (previous-token, positional and "
            "sink heads); the run's inputs decide which heads do it."
        )
        sev = Severity.INFO
    return [
        finding(
            CheckId.ATTN_ENTROPY,
            sev,
            whole or _layers(collapsed),
            e,
            th.attn_entropy_collapse,
            message,
            "Compare with a healthy checkpoint of the same family on real text (--input); "
            "during training, falling entropy with growing scores (logit-scale) is the "
            "entropy-collapse instability QK-norm and σReparam prevent.",
        )
    ]
