"""Depth pathologies of the residual stream: √k accumulation, geometric growth or decay,
and the gradient's trend through depth (theory: docs/checks.md,
sqrt-growth, exp-growth, collapse, vanishing-grad and exploding-grad)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    FP16_MAX,
    NO_BACKWARD,
    block_points,
    finding,
    finite,
    grade,
    known,
    n,
    positive,
    post_branch_norms,
    residual_budget,
    skip,
    too_few_blocks,
)
from actscan.records import (
    BlockInfo,
    CheckId,
    Finding,
    Severity,
    Skip,
    StreamPoint,
    growth_fit,
)

if TYPE_CHECKING:
    from actscan.diagnose.context import Check, CheckContext


# What the inits real families ship reach at step 0 (benchmarks/calibrate_growth.py,
# results in benchmarks/results/growth-calibration.json; the table in docs/checks.md):
# the largest drift/√L (Llama's own init, 48 × 256) and jumps inside block 0 (Llama/Qwen2
# at width 1024; the built-in post-LN stack's first norm). Quoted in the messages.
REAL_INIT_DRIFT = 2.22
REAL_INIT_JUMP = 15.7
POST_LN_JUMP = 35.7
# exploding-grad judges the ratio token by token (RMS over tokens of RMS(x_t)·RMS(g_t))
# where it is below the whole tensors' ratio by more than this factor: the gradient then
# sits on a few tokens (a zero class token behind a norm); alike tokens agree within 1 %.
CONCENTRATED = 2.0


def _place(ctx: CheckContext, p: StreamPoint) -> str:
    if p.block is None:
        name = _name(ctx)
        return f"the {name} stream's first block input" if name else "the first block's input"
    return _b(ctx, p)


def _b(ctx: CheckContext, p: StreamPoint) -> str:
    """'block 3', or 'decoder block 1' when the model has several streams."""
    return ctx.layout.block_label(p.block)


def _name(ctx: CheckContext) -> str | None:
    """The name of the stream `ctx.stream` is, when the model has several."""
    if not ctx.layout.streams:
        return None
    block = next((p.block for p in ctx.stream if p.block is not None), None)
    return next((b.stream for b in ctx.layout.blocks if b.index == block), None)


def _stream(ctx: CheckContext) -> str:
    name = _name(ctx)
    return f"{name} stream" if name else "residual stream"


def per_stream(*ids: CheckId) -> Callable[[Check], Check]:
    """Run a depth check (emitting `ids`) on each residual stream of a model that has
    several (encoder, decoder), each with its own points and growth fit. Findings add up;
    a check skipped on some stream is listed as skipped there (silence is not a pass),
    with the stream named."""
    return functools.partial(_per_stream, ids=ids)


def _per_stream(check: Check, ids: tuple[CheckId, ...]) -> Check:
    @functools.wraps(check)
    def run(ctx: CheckContext) -> list[Finding | Skip]:
        if len(ctx.streams) < 2:
            return _chained_only(ctx, check(_stage(ctx)), ids)
        out: list[Finding | Skip] = []
        skips: dict[str, list[str]] = {}
        for s in ctx.streams:
            blocks = tuple(b for b in ctx.layout.blocks if b.stream == s.name)
            sub = replace(
                ctx,
                stream=s.points,
                fit=growth_fit(s.points),
                layout=replace(ctx.layout, blocks=blocks),
            )
            for item in _chained_only(sub, check(_stage(sub)), ids):
                if isinstance(item, Skip):
                    skips.setdefault(item.check, []).append(f"{s.name} stream: {item.reason}")
                else:
                    out.append(item)
        out += [skip(CheckId(c), "; ".join(why)) for c, why in skips.items()]
        return out

    return run


def _chained_only(
    ctx: CheckContext, items: list[Finding | Skip], ids: tuple[CheckId, ...]
) -> list[Finding | Skip]:
    """The check's items, or one skip per check id when the stream's blocks are no chain:
    every block is plain (no residual add inside) and none reads its predecessor's output
    (`BlockProof.chained`): a list of branches the model's forward adds itself (XLM's
    `attentions`), a residual quantizer's stages, each reading x − q(x). Its "depth" is
    no depth. Residual blocks carry the stream from input to output even when the model
    adds more between them (BLT's decoder layers and cross-attentions): judged."""
    proofs = [b.proof for b in ctx.layout.blocks if b.proof is not None and b.proof.ran]
    links = proofs[1:]
    if not links or any(p.chained for p in links) or any(p.placement != "plain" for p in proofs):
        return items
    name = ctx.layout.blocks[0].name.rsplit(".", 1)[0] if ctx.layout.blocks else "the"
    reason = (
        f"the {name} blocks are no stream: none of their {len(links)} later blocks reads "
        "the previous block's output (its layout proof), so nothing passes through depth"
    )
    return [skip(c, reason) for c in ids]


def _stage(ctx: CheckContext) -> CheckContext:
    """The stream within one stage: where blocks change the stream's shape (a downsampling
    stage, a strided convolution, an FPN level: `BlockProof.reshaped`), growth and
    gradients are not comparable across the change. The longest run of blocks after such
    a change (the changing block's output is its start), the last of equal runs; the run
    before the first change keeps the stream's input. Unchanged without reshaping blocks.
    A block without a residual add (`placement == "plain"`) in a stream that has residual
    blocks starts a stage too (EfficientNet's first block of a stage, its shape unchanged
    at a tiny width): it rewrites the stream, the growth across it is no block's gain. An
    all-plain chain stays whole: its growth is the chain's own (a planted collapse)."""
    blocks = ctx.layout.blocks
    residual = any(
        b.proof is not None and b.proof.placement in ("additive", "post-norm", "post-act")
        for b in blocks
    )

    def starts(b: BlockInfo) -> bool:
        return b.proof is not None and (
            b.proof.reshaped or (residual and b.proof.placement == "plain")
        )

    if not any(starts(b) for b in blocks):
        return ctx
    runs: list[list[int]] = [[]]
    for b in blocks:
        if starts(b):
            runs.append([b.index])
        else:
            runs[-1].append(b.index)
    # a run counts the blocks inside it (its start is a reshaping block's output)
    size = [len(r) if i == 0 else len(r) - 1 for i, r in enumerate(runs)]
    best = max(range(len(runs)), key=lambda i: (size[i], i))
    keep = set(runs[best])
    start = runs[best][0] if best > 0 else None
    pts = [p for p in ctx.stream if (p.block is None and best == 0) or p.block in keep]
    if start is not None and pts:  # the reshaping block's output is the stage's k = 0
        k0 = pts[0].k
        pts = [replace(p, k=p.k - k0, block=None if p.block == start else p.block) for p in pts]
    inside = tuple(b for b in blocks if b.index in keep and b.index != start)
    return replace(
        ctx,
        stream=tuple(pts),
        fit=growth_fit(pts),
        layout=replace(ctx.layout, blocks=inside),
    )


def total_gain(ctx: CheckContext, pts: Sequence[StreamPoint]) -> float | None:
    """γ^L: the fitted per-block gain compounded over the L blocks measured."""
    g = ctx.fit.gain
    if not positive(g) or not pts:
        return None
    try:
        return g ** len(pts)
    except OverflowError:
        return math.inf


def sustained(pts: Sequence[StreamPoint], fraction: float) -> bool:
    """True when the second half of the stack grows (in log, per block) ≥ `fraction` of the
    first half.

    Geometric growth keeps its pace (ratio ≈ 1); √k accumulation slows (≈ 0.2 at 48 blocks).
    Per block: with an even count the halves span different numbers of steps (2 and 1 at
    4 blocks), which would put pure geometric growth at a ratio of 0.5.
    """
    if len(pts) < 3:
        return False
    mid = len(pts) // 2
    first = math.log(known(pts[mid].rms) / known(pts[0].rms)) / mid
    second = math.log(known(pts[-1].rms) / known(pts[mid].rms)) / (len(pts) - 1 - mid)
    return first > 0 and second >= fraction * first


def _is_exponential(ctx: CheckContext, pts: Sequence[StreamPoint]) -> bool:
    total = total_gain(ctx, pts)
    th = ctx.thresholds
    return total is not None and total >= th.exp_gain_warn and sustained(pts, th.exp_sustain)


def _writes_add_up(ctx: CheckContext, pts: Sequence[StreamPoint]) -> float | None:
    """Var(x_last) / (Var(x_0) + Σ Var(write)) when every write into the stream is a
    norm's output (OLMo 2's post-branch norms) and that ratio is ≤ 2: the growth is the
    writes' variances adding up (uncorrelated), each bounded by its norm's gain. None
    otherwise (writes that align add linearly and stay a warning)."""
    if not post_branch_norms(ctx):
        return None
    blocks = [b for b in ctx.layout.blocks if b.branches]
    if not blocks or any(br.write is None for b in blocks for br in b.branches):
        return None
    if any(ctx.layout.role(br.write or "") != "norm" for b in blocks for br in b.branches):
        return None
    start = next((p for p in ctx.stream if p.block is None and positive(p.rms)), None)
    last = pts[-1]
    rms = {r.name: r.rms for r in ctx.layers}
    total = known(start.rms) ** 2 if start is not None else 0.0
    for b in blocks:
        if last.block is not None and b.index > last.block:
            break
        for br in b.branches:
            w = rms.get(br.write or "")
            if not finite(w):
                return None
            total += known(w) ** 2
    if total <= 0:
        return None
    ratio = known(last.rms) ** 2 / total
    return ratio if ratio <= 2.0 else None


def _first_crossing(pts: Sequence[StreamPoint], ref: float, factor: float) -> StreamPoint | None:
    """First block whose RMS is ≥ factor·ref (factor > 1) or ≤ factor·ref (factor < 1)."""
    for p in pts:
        r = known(p.rms) / ref
        if (factor >= 1 and r >= factor) or (factor < 1 and r <= factor):
            return p
    return None


def _growth_remedy(ctx: CheckContext, k: int) -> str:
    """What can hold the stream's growth on the layout found."""
    if post_branch_norms(ctx):
        return (
            "the writes come out of post-branch norms, which re-normalise them, so scaling "
            "the output projections cannot act: scale those norms' gains by 1/√(2L) = "
            f"1/√{k} ≈ {n(1 / math.sqrt(k))} (their init), or gate each branch with a "
            "learned gain after the norm (ReZero α = 0, LayerScale)."
        )
    return (
        f"scale the residual output projections (attention out, MLP down) by 1/√(2L) = "
        f"1/√{k} ≈ {n(1 / math.sqrt(k))} as GPT-2 does, or gate each branch with a learned "
        f"gain (ReZero α = 0, LayerScale) or use DeepNorm: the 2L branches then add O(1) "
        f"variance in total, not O(L)."
    )


@per_stream(CheckId.SQRT_GROWTH)
def sqrt_growth(ctx: CheckContext) -> list[Finding | Skip]:
    """Stream RMS ∝ k^p with p near ½ and a large drift: unscaled branches accumulating."""
    th = ctx.thresholds
    pts = block_points(ctx.stream)
    p = ctx.fit.exponent
    if len(pts) < th.min_blocks:
        return [skip(CheckId.SQRT_GROWTH, too_few_blocks(ctx, len(pts), th.min_blocks))]
    if not finite(p):
        return [skip(CheckId.SQRT_GROWTH, "no growth exponent could be fitted to the stream")]
    if _is_exponential(ctx, pts):
        return []
    first, last = pts[0], pts[-1]
    drift = known(last.rms) / known(first.rms)
    if p < th.sqrt_exponent or drift < th.growth_warn:
        return []
    L = len(pts)
    # √k growth is what real families ship (drift ≤ REAL_INIT_DRIFT·√L): info;
    # a warning needs growth beyond that, growth-excess·√L
    warn_at = max(th.growth_warn, th.growth_excess * math.sqrt(L))
    error_at = max(th.growth_error, warn_at * th.growth_error / th.growth_warn)
    if drift >= warn_at:
        severity, threshold = grade(drift, warn_at, error_at)
    else:
        severity, threshold = Severity.INFO, warn_at
    cross = _first_crossing(pts, known(first.rms), th.growth_warn) or last
    k = last.k
    over_embedding = (
        f"; ×{n(ctx.fit.growth)} over the embedding" if positive(ctx.fit.growth) else ""
    )
    var_fit = (
        f", Var(x_k) ≈ {n(ctx.fit.var_a)} + {n(ctx.fit.var_b)}·k"
        if finite(ctx.fit.var_a) and finite(ctx.fit.var_b)
        else ""
    )
    per_root = drift / math.sqrt(L)
    added = _writes_add_up(ctx, pts)
    if added is not None:
        severity, threshold = Severity.INFO, warn_at
        verdict = (
            f"×{n(per_root)}·√L over L = {L} blocks, from a small start; every write into "
            f"this stream is a norm's output (post-branch norms) and its variance at "
            f"{_b(ctx, last)} is {n(added)}× the embedding's plus all the writes' so far: "
            f"the writes' variances adding up, each bounded by its norm's gain, not growth "
            f"beyond them"
        )
    elif severity is Severity.INFO:
        verdict = (
            f"×{n(per_root)}·√L over L = {L} blocks, under the ×{n(th.growth_excess)}·√L that "
            f"warns: transformers' own Llama/Mistral/Qwen2 inits drift up to "
            f"×{n(REAL_INIT_DRIFT)}·√L at 12–48 "
            f"blocks and train, so this is the residual branches accumulating, not a fault"
        )
    else:
        verdict = (
            f"×{n(per_root)}·√L over L = {L} blocks, past ×{n(th.growth_excess)}·√L: more than "
            f"the branches' variances adding up (≤ √L) and than real families' own inits "
            f"give (≤ ×{n(REAL_INIT_DRIFT)}·√L)"
        )
    message = (
        f"The {_stream(ctx)}'s RMS grows ×{n(drift)} from {_b(ctx, first)}'s output to "
        f"{_b(ctx, last)}'s ({n(first.rms)} → {n(last.rms)}{over_embedding}), "
        f"RMS ∝ k^{n(p)}{var_fit}: {verdict} (×{n(th.growth_warn)} is crossed at "
        f"{_b(ctx, cross)})."
    )
    hint = _growth_remedy(ctx, k)
    if severity is Severity.INFO:
        hint = "Nothing needs fixing to train; to hold the stream's scale anyway, " + hint
    else:
        hint = hint[0].upper() + hint[1:]
    budget = residual_budget(ctx)
    if added is not None:
        hint = (
            "Nothing to fix: post-branch norms bound each write by their gain; the stream "
            "reaches √(writes) of it whatever the projections. A larger embedding would "
            "start the stream nearer that scale."
        )
    elif budget is not None and budget[2] < th.residual_budget:
        # At init with measurably down-scaled projections, √k growth is the embedding being
        # small next to the branches (a global branch scale cancels behind the norms).
        s, adds = budget[0], budget[1]
        severity, threshold = Severity.INFO, warn_at
        message = message[:-1] + (
            f"; the output projections are already down-scaled (out/in std {n(s)}, 1/√{adds} = "
            f"{n(1 / math.sqrt(adds))}), so this is a small embedding next to the branches."
        )
        hint = (
            "Nothing to fix in the branches: the embedding's share of the stream's variance "
            "is small; a larger embedding init (or a norm on the embedding) would raise it."
        )
    top = last.max_abs
    fp16_run = ctx.run.dtype == "fp16" or ctx.run.amp == "fp16"
    if positive(top) and (fp16_run or top * drift >= FP16_MAX):
        hint += (
            f" In fp16 the top of the stream (max|x| {n(top)}) keeps ×{n(FP16_MAX / top)} "
            f"headroom below 65504."
        )
    return [
        finding(
            CheckId.SQRT_GROWTH,
            severity,
            (cross.name, last.name),
            drift,
            threshold,
            message,
            hint,
        )
    ]


@per_stream(CheckId.EXP_GROWTH, CheckId.COLLAPSE)
def exp_growth_collapse(ctx: CheckContext) -> list[Finding | Skip]:
    """γ^L far above 1 with sustained growth (exp-growth) or far below 1 (collapse)."""
    th = ctx.thresholds
    pts = block_points(ctx.stream)
    total = total_gain(ctx, pts)
    if len(pts) < th.min_blocks or total is None:
        why = (
            too_few_blocks(ctx, len(pts), th.min_blocks)
            if len(pts) < th.min_blocks
            else "no per-block gain could be fitted to the stream"
        )
        return [skip(CheckId.EXP_GROWTH, why), skip(CheckId.COLLAPSE, why)]
    first, last = pts[0], pts[-1]
    actual = known(last.rms) / known(first.rms)
    gamma = ctx.fit.gain
    L = len(pts)
    if total >= th.exp_gain_warn and sustained(pts, th.exp_sustain):
        single = _one_block(pts)
        if single is not None:
            return [_one_block_finding(ctx, pts, single)]
        severity, threshold = grade(total, th.exp_gain_warn, th.exp_gain_error)
        cross = _first_crossing(pts, known(first.rms), th.exp_gain_warn) or last
        message = (
            f"Each block multiplies the stream's RMS by γ = {n(gamma)} (geometric fit over "
            f"{L} blocks), γ^L = {n(total)}: RMS {n(first.rms)} at {_b(ctx, first)} → "
            f"{n(last.rms)} at {_b(ctx, last)}, past ×{n(th.exp_gain_warn)} at "
            f"{_b(ctx, cross)}."
        )
        hint = (
            "Growth compounds through depth: make each block variance-preserving — fan-in "
            "init (std √(1/fan_in); He √(2/fan_in) before ReLU), a residual path x + F(LN(x)) "
            "with the norm on the branch (pre-norm), or a normalization on the stream."
        )
        return [
            finding(
                CheckId.EXP_GROWTH,
                severity,
                (cross.name, last.name),
                total,
                threshold,
                message,
                hint,
            )
        ]
    jumped = _jump(ctx, pts)
    if jumped is not None:
        return [jumped]
    shrink = min(total, actual)
    if shrink <= 1 / th.exp_gain_warn:
        severity, threshold = grade(
            shrink, 1 / th.exp_gain_warn, 1 / th.exp_gain_error, above=False
        )
        cross = _first_crossing(pts, known(first.rms), 1 / th.exp_gain_warn) or last
        message = (
            f"The stream's RMS shrinks by γ = {n(gamma)} per block (γ^L = {n(total)} over {L} "
            f"blocks): {n(first.rms)} at {_b(ctx, first)} → {n(last.rms)} at "
            f"{_b(ctx, last)}, below 1/{n(th.exp_gain_warn)} of its start from {_b(ctx, cross)}."
        )
        hint = (
            "The signal decays toward zero through depth: initialize so each layer preserves "
            "variance (std √(1/fan_in), He √(2/fan_in) before ReLU), keep a residual path "
            "x + F(x) around each block, and check norm gains and placement."
        )
        return [
            finding(
                CheckId.COLLAPSE,
                severity,
                (cross.name, last.name),
                shrink,
                threshold,
                message,
                hint,
            )
        ]
    return []


# one block carrying this share of the stream's whole log-growth is a jump, not a gain
# compounding (geometric growth spreads evenly: 1/(L − 1) of it per block)
ONE_BLOCK_SHARE = 2 / 3
# …with the other blocks flat together (OLMo-Hybrid ×1.04): branches scaled up block by
# block (×40 each, at 4 blocks: ×1.0004, ×1.5, ×30) also end in one large step, but the
# steps before it grow too: that is a gain compounding, judged by the fit
ONE_BLOCK_REST = 1.25


def _one_block(pts: Sequence[StreamPoint]) -> tuple[int, float] | None:
    """(i, ×jump) when the growth from pts[0] to pts[-1] is mostly one block's: the ratio
    RMS(x_i)/RMS(x_{i−1}) holds ≥ ONE_BLOCK_SHARE of the log-growth (OLMo-Hybrid's one
    full-attention layer after three linear-attention ones, on a stream of RMS 0.02). A
    per-block gain multiplies every block alike; one block writing more than the stream it
    reads is a step, whatever the fit says, when the other steps stay flat together
    (≤ ONE_BLOCK_REST). None with fewer than 3 blocks."""
    if len(pts) < 3:
        return None
    logs = [math.log(known(b.rms) / known(a.rms)) for a, b in itertools.pairwise(pts)]
    total = sum(logs)
    if total <= 0:
        return None
    i = max(range(len(logs)), key=lambda j: logs[j])
    if logs[i] < ONE_BLOCK_SHARE * total or math.exp(total - logs[i]) > ONE_BLOCK_REST:
        return None
    return i + 1, math.exp(logs[i])


def _one_block_finding(
    ctx: CheckContext, pts: Sequence[StreamPoint], single: tuple[int, float]
) -> Finding:
    """The growth of a stream that one block makes: judged as a jump inside that block
    (growth-jump's thresholds, as block 0's jump over the embedding), info below them."""
    th = ctx.thresholds
    i, jump = single
    at, before = pts[i], pts[i - 1]
    rest = known(pts[-1].rms) / known(pts[0].rms) / jump
    severity, threshold = grade(jump, th.growth_jump, th.growth_jump_error)
    if jump < th.growth_jump:
        severity, threshold = Severity.INFO, th.growth_jump
    message = (
        f"The {_stream(ctx)}'s RMS grows ×{n(jump)} inside {_b(ctx, at)} alone "
        f"({n(before.rms)} → {n(at.rms)}), the other {len(pts) - 2} block steps ×{n(rest)} "
        f"together: one block writing more than the stream it reads, not a per-block gain "
        f"compounding (a geometric fit would say γ = {n(ctx.fit.gain)})"
        + (
            f"; under the ×{n(th.growth_jump)} that warns (a small stream meeting a "
            "branch of ordinary scale)."
            if severity is Severity.INFO
            else f", past ×{n(th.growth_jump)}: that block's branches write far more than "
            "the stream they read."
        )
    )
    hint = (
        ""
        if severity is Severity.INFO
        else "Check that block's branch init (fan-in std √(1/fan_in)) and its norms' gains."
    )
    return finding(CheckId.EXP_GROWTH, severity, (at.name,), jump, threshold, message, hint)


def _jump(ctx: CheckContext, pts: Sequence[StreamPoint]) -> Finding | None:
    """The stream's growth from the embedding to block 0's output: a jump inside block 0
    (every weight at std 1: ×5.8e3) that the drift and the per-block gain, both measured
    from block 0's output on, cannot see. Real families' own inits jump ≤ ×15.7, a
    post-LN stack's first norm ×35.7 (a step up to RMS 1): growth-jump is above both."""
    th = ctx.thresholds
    start = next((p for p in ctx.stream if p.block is None and positive(p.rms)), None)
    if start is None or not pts:
        return None
    first = pts[0]
    jump = known(first.rms) / known(start.rms)
    if jump < th.growth_jump:
        return None
    renorm = _renormalised(ctx, first)
    if renorm:
        message = (
            f"The {_stream(ctx)}'s RMS jumps ×{n(jump)} inside {_b(ctx, first)}: "
            f"{n(start.rms)} at {_place(ctx, start)} → {n(first.rms)} at its output; the "
            f"stream passes {renorm} inside the block (its layout proof), which sets the "
            f"output's scale whatever the input's: a small embedding, not branches that "
            f"write far more than the stream."
        )
        return finding(
            CheckId.EXP_GROWTH, Severity.INFO, (first.name,), jump, th.growth_jump, message
        )
    severity, threshold = grade(jump, th.growth_jump, th.growth_jump_error)
    message = (
        f"The {_stream(ctx)}'s RMS jumps ×{n(jump)} inside {_b(ctx, first)}: "
        f"{n(start.rms)} at {_place(ctx, start)} → {n(first.rms)} at its output, past "
        f"×{n(th.growth_jump)} (real families' own inits jump ≤ ×{n(REAL_INIT_JUMP)}, a "
        f"post-LN first norm ×{n(POST_LN_JUMP)}): block 0's branches write far more than the "
        f"stream they read."
    )
    hint = (
        "A branch amplifies its (normalised) input: check the init of block 0's weights "
        "(fan-in std √(1/fan_in), or 0.02 at d ≈ 1000) and the norms' gains; if the "
        "embedding is deliberately tiny, scale it up (Gemma multiplies it by √d)."
    )
    return finding(CheckId.EXP_GROWTH, severity, (first.name,), jump, threshold, message, hint)


def _renormalised(ctx: CheckContext, p: StreamPoint) -> str:
    """The norms the stream itself passes through inside p's block (a post-norm block,
    a first block's extra input norm), as its proof found them; '' when none."""
    block = next((b for b in ctx.layout.blocks if b.index == p.block), None)
    proof = block.proof if block is not None else None
    if proof is None or proof.status != "verified" or not proof.norms:
        return ""
    return ", ".join(proof.norms[:2])


@per_stream(CheckId.VANISHING_GRAD, CheckId.EXPLODING_GRAD)
def gradients(ctx: CheckContext) -> list[Finding | Skip]:
    """Relative activation gradient r = RMS(∂L/∂x)·RMS(x), first block's input vs last output.

    r is what survives a change of the stream's scale (behind a norm, ∂L/∂x ∝ 1/|x|), so a
    small embedding in a pre-LN model — large raw gradient at k = 0 — reads as healthy.
    """
    th = ctx.thresholds
    if not ctx.run.backward:
        return [
            skip(CheckId.VANISHING_GRAD, NO_BACKWARD),
            skip(CheckId.EXPLODING_GRAD, NO_BACKWARD),
        ]
    pts = [p for p in ctx.stream if positive(p.rms) and positive(p.grad_rms)]
    if len(pts) < th.grad_min_blocks + 1:
        blocks = [p for p in pts if p.block is not None]
        why = too_few_blocks(
            ctx, len(blocks), th.grad_min_blocks, "blocks with a measured stream gradient"
        )
        return [skip(CheckId.VANISHING_GRAD, why), skip(CheckId.EXPLODING_GRAD, why)]
    r = [known(p.grad_rms) * known(p.rms) for p in pts]
    top = r[-1]
    ratio = r[0] / top
    first, last = pts[0], pts[-1]
    where = _place(ctx, first) + ("'s output" if first.block is not None else "")
    # past the threshold as whole tensors, within it for the median token: a few positions
    # (a zero token behind a norm has its own reading below, by the RMS over tokens)
    med, tok = _median_ratio(first, last), _token_ratio(first, last)
    within = lambda v: 1 / th.grad_ratio_warn < v < th.grad_ratio_warn  # noqa: E731
    zero_token = ratio > 1 and tok is not None and tok < th.grad_ratio_warn
    if not within(ratio) and med is not None and within(med) and not zero_token:
        return [_few_positions(ctx, first, last, (r[0], top), med, where)]
    if ratio <= 1 / th.grad_ratio_warn:
        severity, threshold = grade(
            ratio, 1 / th.grad_ratio_warn, 1 / th.grad_ratio_error, above=False
        )
        # the highest block below which the gradient stays under the threshold
        cross = next(
            (
                p
                for p, v in zip(reversed(pts), reversed(r), strict=True)
                if v / top <= 1 / th.grad_ratio_warn
            ),
            first,
        )
        message = (
            f"The gradient reaching {where} is {n(1 / ratio)}× weaker than at "
            f"{_b(ctx, last)}'s output, relative to the activations (RMS(∂L/∂x)·RMS(x): "
            f"{n(r[0])} vs {n(top)}); it falls below 1/{n(th.grad_ratio_warn)} at "
            f"{_place(ctx, cross)}."
        )
        hint = (
            "Early blocks barely learn: pre-norm (x + F(LN(x))) keeps an identity path for the "
            "gradient; a post-norm stack needs DeepNorm (α = (2N)^¼ on the identity, "
            "β = (2N)^−¼ on the branch init) or Admin, and learning-rate warmup."
        )
        return [
            finding(
                CheckId.VANISHING_GRAD,
                severity,
                (cross.name, last.name),
                ratio,
                threshold,
                message,
                hint,
            )
        ]
    if ratio >= th.grad_ratio_warn:
        if tok is not None and tok < th.grad_ratio_warn:
            return [_concentrated(ctx, first, last, ratio, tok, where)]
        if tok is not None and tok > ratio / CONCENTRATED:
            tok = None  # tokens alike: the whole tensors' ratio, as measured
        judged = ratio if tok is None else tok
        severity, threshold = grade(judged, th.grad_ratio_warn, th.grad_ratio_error)
        cross = next(
            (
                p
                for p, v in zip(reversed(pts), reversed(r), strict=True)
                if v / top >= th.grad_ratio_warn
            ),
            first,
        )
        message = (
            f"The gradient reaching {where} is {n(ratio)}× stronger than at "
            f"{_b(ctx, last)}'s output, relative to the activations (RMS(∂L/∂x)·RMS(x): "
            f"{n(r[0])} vs {n(top)}); it passes ×{n(th.grad_ratio_warn)} at {_place(ctx, cross)}"
            + (f"; token by token ×{n(tok)}." if tok is not None else ".")
        )
        scaling = (
            "the post-branch norms' gains"
            if post_branch_norms(ctx)
            else "1/√(2L) output projections"
        )
        hint = (
            f"The backward pass amplifies through depth: lower the per-block gain (fan-in "
            f"init, {scaling}), prefer pre-norm, clip gradients, and check the logit scale "
            f"(a saturated softmax concentrates the gradient)."
        )
        return [
            finding(
                CheckId.EXPLODING_GRAD,
                severity,
                (cross.name, last.name),
                judged,
                threshold,
                message,
                hint,
            )
        ]
    return []


def _token_ratio(first: StreamPoint, last: StreamPoint) -> float | None:
    """The relative gradient's ratio token by token (RMS over tokens of RMS(x_t)·RMS(g_t)),
    first point vs last; None where either was not measured."""
    a, b = first.token_grad_rel, last.token_grad_rel
    return a / b if positive(a) and positive(b) else None


def _median_ratio(first: StreamPoint, last: StreamPoint) -> float | None:
    """The median token's relative gradient (median over tokens of RMS(x_t)·RMS(g_t)),
    first point vs last; None where either was not measured or is 0 (most tokens without
    a gradient there: padding, a loss on one position)."""
    a, b = first.token_grad_median, last.token_grad_median
    return a / b if positive(a) and positive(b) else None


def _few_positions(
    ctx: CheckContext,
    first: StreamPoint,
    last: StreamPoint,
    whole: tuple[float, float],
    med: float,
    where: str,
) -> Finding:
    """exploding-/vanishing-grad at info: the whole tensors' ratio is past the threshold,
    the median token's is not. The mean square over tokens follows the few positions that
    hold most of the gradient: in a long causal sequence every later query attends to the
    first positions, so their gradient sums over the whole sequence's, at any depth's
    input more than at the last block's output; a uniform amplification through depth
    moves the median token as much as the whole tensors."""
    ratio = whole[0] / whole[1]
    check = CheckId.EXPLODING_GRAD if ratio > 1 else CheckId.VANISHING_GRAD
    causal = (
        " (in a causal LM every later query attends to the first positions, which collect "
        "the gradient of all of them)"
        if ctx.info.task == "causal-lm"
        else " (as a long causal sequence's first positions do: every later query attends to them)"
    )
    x, y = (ratio, med) if ratio > 1 else (1 / ratio, 1 / med)
    word = "stronger" if ratio > 1 else "weaker"
    message = (
        f"The gradient reaching {where} is {n(x)}× {word} than at {_b(ctx, last)}'s output "
        f"as whole tensors (RMS(∂L/∂x)·RMS(x): {n(whole[0])} vs {n(whole[1])}), but the "
        f"median token's only ×{n(y)} (median over "
        f"tokens of RMS(x_t)·RMS(∂L/∂x_t): {n(first.token_grad_median)} vs "
        f"{n(last.token_grad_median)}): the gradient sits on a few positions{causal}, "
        f"not a {'growth' if ratio > 1 else 'decay'} through depth."
    )
    hint = (
        "Nothing to fix through depth: the typical token's gradient keeps its scale. A "
        "per-position view (the gradient at the first positions vs the rest) shows where it "
        "sits; a sequence packed from many documents spreads it."
    )
    return finding(
        check,
        Severity.INFO,
        (first.name, last.name),
        med,
        ctx.thresholds.grad_ratio_warn if ratio > 1 else 1 / ctx.thresholds.grad_ratio_warn,
        message,
        hint,
    )


def _concentrated(
    ctx: CheckContext, first: StreamPoint, last: StreamPoint, ratio: float, tok: float, where: str
) -> Finding:
    """exploding-grad at info: the whole tensors' ratio is past the threshold, token by
    token it is not. Behind a per-token norm ∂L/∂x_t ∝ 1/|x_t|: a token that enters at
    x ≈ 0 (a zero-initialised class or distillation token, a register) gets a huge
    gradient that its tiny |x_t| cancels; RMS(∂L/∂x)·RMS(x) pairs that gradient with the
    other tokens' activations."""
    message = (
        f"The gradient reaching {where} is {n(ratio)}× stronger than at "
        f"{_b(ctx, last)}'s output as whole tensors (RMS(∂L/∂x)·RMS(x)), but only ×{n(tok)} "
        f"token by token (RMS over tokens of RMS(x_t)·RMS(∂L/∂x_t): {n(first.token_grad_rel)} "
        f"vs {n(last.token_grad_rel)}): the gradient sits on tokens whose activation there is "
        f"~0 (behind a norm ∂L/∂x_t ∝ 1/|x_t|: a zero-initialised class or distillation "
        f"token), not an amplification through depth."
    )
    hint = (
        "Nothing to fix through depth. A token initialised at exactly 0 meets its first norm "
        "at |x| ≈ √eps: its parameter's gradient is ~1/√eps (with eps 1e-12, 10⁶× the rest); "
        "Adam normalises it, SGD does not: initialise such tokens small but nonzero "
        "(trunc-normal std 0.02)."
    )
    return finding(
        CheckId.EXPLODING_GRAD,
        Severity.INFO,
        (first.name, last.name),
        tok,
        ctx.thresholds.grad_ratio_warn,
        message,
        hint,
    )
