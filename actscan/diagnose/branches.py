"""dead-branch: residual branches that write (or receive) nothing, told apart from branch
gains that are zero by design at init (ReZero α = 0, LayerScale ε)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actscan.diagnose.common import (
    GAIN_NAME,
    NO_STREAM,
    branch_projections,
    finding,
    finite,
    listing,
    n,
    skip,
    warn_or_error,
)
from actscan.records import (
    BranchRecord,
    CheckId,
    Finding,
    LayerRecord,
    ParamRecord,
    Severity,
    Skip,
    all_points,
    stream_branch_records,
)

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

KIND_NAME = {
    "attn": "attention",
    "mlp": "MLP",
    "mixer": "mixer (SSM)",
    "cross_attn": "cross-attention",
}


def kind_name(rec: BranchRecord) -> str:
    """What the branch is, for messages: a router + experts MLP is called MoE."""
    return "MoE" if rec.moe else KIND_NAME.get(rec.kind, rec.kind)


@dataclass(frozen=True)
class _Branch:
    rec: BranchRecord
    gain: LayerRecord | None
    gain_params: tuple[ParamRecord, ...]
    ratio: float | None  # what reaches the stream (after the gain) / stream RMS
    grad_ratio: float | None  # branch-output gradient / stream gradient at the block
    scale: ParamRecord | None = None  # a per-channel gain parameter, not a module

    @property
    def gain_name(self) -> str | None:
        return self.gain.name if self.gain is not None else self.scale.name if self.scale else None

    @property
    def own_ratio(self) -> float:
        """What the branch writes before its gain, ÷ the stream."""
        if self.gain is None and self.scale is not None and self.ratio is not None:
            size = abs(self.scale.mean) + self.scale.std
            return self.ratio / size if size else 0.0
        return self.rec.ratio or 0.0


# A parameter that scales a branch's output: ConvNeXt's layer_scale_parameter, CaiT's
# gamma_1, DINOv2's lambda1, a ReZero alpha.
_SCALE_PARAM = re.compile(r"(gain|alpha|gamma|lambda|rezero|layer_?scale|^ls\d*$|scale)", re.I)


def _scale_param(rec: BranchRecord, block: list[ParamRecord]) -> ParamRecord | None:
    """A learnable gain on this branch held as a parameter (no module of its own): named
    like one, a vector (or a (C, 1, 1) one that broadcasts over a channels-first map:
    FastViT's RepMixer) or scalar owned by the branch, inside it, or by a module of the
    block that encloses it (ConvNeXt's layer multiplies its branch by
    `layer_scale_parameter` before the add), and not a norm's weight."""
    found = [
        p
        for p in block
        if sum(d > 1 for d in p.shape) <= 1  # a vector, also shaped to broadcast: (C, 1, 1)
        and p.kind != "norm-gain"
        and p.role != "norm"
        and _SCALE_PARAM.search(p.name.rsplit(".", 1)[-1])
        and (
            p.module == rec.name
            or p.module.startswith(rec.name + ".")
            or rec.name.startswith(p.module + ".")
        )
    ]
    return min(found, key=lambda p: abs(p.mean) + p.std) if found else None


def _gain_for(
    rec: BranchRecord, branch: LayerRecord, block: list[LayerRecord]
) -> LayerRecord | None:
    """The gain module applied right after this branch (next gain in execution order)."""
    later = [
        r
        for r in block
        if r.order > branch.order
        and GAIN_NAME.search(r.name.rsplit(".", 1)[-1])
        and not r.name.startswith(rec.name + ".")
        and r.role not in (*KIND_NAME, "norm")
    ]
    return min(later, key=lambda r: r.order) if later else None


def _branches(ctx: CheckContext) -> list[_Branch]:
    """The branches to judge: blocks whose layout self-check failed are not judged (the
    report's notes and `layout` list them as unverified)."""
    by_name = {r.name: r for r in ctx.layers}
    in_block: dict[int, list[LayerRecord]] = {}
    for r in ctx.layers:
        if r.block is not None:
            in_block.setdefault(r.block, []).append(r)
    grad_at = {
        p.block: p.grad_rms for p in all_points(ctx.stream, ctx.streams) if p.block is not None
    }
    params_of: dict[str, list[ParamRecord]] = {}
    params_in: dict[int, list[ParamRecord]] = {}
    for p in ctx.params:
        params_of.setdefault(p.module, []).append(p)
        if p.block is not None:
            params_in.setdefault(p.block, []).append(p)
    out = []
    for rec in stream_branch_records(ctx.layout, ctx.layers, ctx.stream, ctx.streams):
        if rec.verified is False:
            continue
        own = by_name[rec.name]
        gain = _gain_for(rec, own, in_block.get(rec.block, []))
        # what the stream receives: the proven write (post-branch norm, gain), else the gain
        if rec.write is not None and rec.write_rms is not None:
            written: float | None = rec.write_rms
        else:
            written = gain.rms if gain is not None else rec.rms
        ratio = None
        if written == 0:
            ratio = 0.0
        elif finite(written) and finite(rec.stream_rms) and rec.stream_rms:
            ratio = written / rec.stream_rms
        g_stream = grad_at.get(rec.block)
        # Behind a post-branch norm (Gemma 2/3, OLMo 2/3) the gradient before the norm is
        # divided by the branch's own RMS (÷1e4 with large weights): what the branch is
        # judged by is what the norm writes and receives.
        g_branch = rec.grad_rms
        if behind_norm(ctx, rec) and rec.write in by_name:
            g_branch = by_name[rec.write].grad_rms
        grad_ratio = None
        if ctx.run.backward and finite(g_branch) and finite(g_stream) and g_stream:
            grad_ratio = g_branch / g_stream
        gp = tuple(params_of.get(gain.name, ())) if gain is not None else ()
        scale = _scale_param(rec, params_in.get(rec.block, [])) if gain is None else None
        out.append(_Branch(rec, gain, gp, ratio, grad_ratio, scale))
    return out


def behind_norm(ctx: CheckContext, rec: BranchRecord) -> bool:
    """The branch's write into the stream is a norm's output (a post-branch norm)."""
    return rec.write is not None and ctx.layout.role(rec.write) == "norm"


def _tiny_scale(b: _Branch, ctx: CheckContext) -> str | None:
    """A gain parameter whose every value is ~0 and explains the silence: the branch
    without it writes a living share of the stream (ratio ÷ |gain| above the threshold)."""
    p, th = b.scale, ctx.thresholds.dead_branch_ratio
    if p is None or not ctx.info.at_init:
        return None
    size = abs(p.mean) + p.std
    if size > th or b.ratio is None:
        return None
    if size == 0:
        return "ReZero: α = 0"
    if b.ratio / size <= th:
        return None  # the branch is silent before its gain too
    return f"LayerScale: {p.name.rsplit('.', 1)[-1]} = {n(p.mean)}"


def _by_design(b: _Branch, ctx: CheckContext) -> str | None:
    """Why a silent branch is silent on purpose, or None."""
    if b.gain is None:
        return _tiny_scale(b, ctx)
    own_alive = b.rec.ratio is not None and b.rec.ratio > ctx.thresholds.dead_branch_ratio
    constant = bool(b.gain_params) and all(p.std == 0 for p in b.gain_params)
    scheme = str(ctx.info.arch.get("branch_scale", ""))
    if not (own_alive and (constant or scheme in ("rezero", "layerscale"))):
        return None
    value = b.gain_params[0].mean if b.gain_params else None
    if scheme == "rezero" or value == 0:
        return "ReZero: α = 0"
    return f"LayerScale: ε = {n(value)}" if value is not None else "a branch gain at init"


def dead_branch(ctx: CheckContext) -> list[Finding | Skip]:
    th = ctx.thresholds
    if not ctx.layout.blocks:
        return [skip(CheckId.DEAD_BRANCH, NO_STREAM)]
    branches = _branches(ctx)
    if not branches:
        return [
            skip(CheckId.DEAD_BRANCH, "no attention/MLP branch output was identified or recorded")
        ]
    dead = [
        b
        for b in branches
        if (b.ratio is not None and b.ratio <= th.dead_branch_ratio)
        or (b.grad_ratio is not None and b.grad_ratio <= th.dead_branch_ratio)
    ]
    if not dead:
        return []
    out: list[Finding | Skip] = []
    designed = [(b, why) for b in dead if (why := _by_design(b, ctx)) is not None]
    if designed:
        whys = sorted({why for _, why in designed})
        gains = [name for b, _ in designed if (name := b.gain_name) is not None]
        worst = max((b.ratio for b, _ in designed if b.ratio is not None), default=None)
        out.append(
            finding(
                CheckId.DEAD_BRANCH,
                Severity.INFO,
                gains,
                worst,
                th.dead_branch_ratio,
                f"{len(designed)} of {len(branches)} residual branches are multiplied by a "
                f"gain that is ~0 at init ({'; '.join(whys)}): every block starts as the "
                f"identity by design, and the branches' own outputs are alive "
                f"(÷stream up to {n(max(b.own_ratio for b, _ in designed))}).",
                "Nothing to fix at init: the gains learn to open. If they are still ~0 after "
                "training, the gain parameters get too small a learning rate.",
            )
        )
    rest = [b for b in dead if all(b is not d for d, _ in designed)]
    if not rest:
        return out
    zeroed, rest = _zero_initialised(ctx, branches, rest)
    out.extend(zeroed)
    if not rest:
        return out
    small, rest = _uniformly_small(ctx, branches, rest)
    out.extend(small)
    if not rest:
        return out
    like, rest = _like_siblings(ctx, branches, rest)
    out.extend(like)
    if not rest:
        return out
    stuck = [
        b
        for b in rest
        if ctx.run.backward and b.rec.param_grad_norm is not None and b.rec.param_grad_norm == 0
    ]
    severity, threshold = warn_or_error(bool(stuck), th.dead_branch_ratio)
    dead_acts = {
        r.name
        for r in ctx.layers
        if r.role == "act" and r.n_channels and r.dead_channels == r.n_channels
    }
    parts = []
    for b in rest:
        what = f"{kind_name(b.rec)} of {ctx.layout.block_label(b.rec.block)} ({b.rec.name}"
        what += f" → {b.rec.write}: " if b.rec.write else ": "
        if b.ratio is not None and b.ratio <= th.dead_branch_ratio:
            written = b.rec.write_rms if b.rec.write else (b.gain.rms if b.gain else b.rec.rms)
            what += f"RMS {n(written)} vs stream {n(b.rec.stream_rms)}"
        else:
            what += f"output gradient {n(b.grad_ratio)} of the stream's"
        if any(a.startswith(b.rec.name + ".") for a in dead_acts):
            what += "; all its activation units are dead, see dead-units"
        parts.append(what + ")")
    values = [v for b in rest for v in (b.ratio, b.grad_ratio) if v is not None]
    value = min(values) if values else None
    noun = "branch writes" if len(rest) == 1 else f"{len(rest)} branches write"
    message = (
        f"The {noun} ~nothing into the residual stream (≤ {n(th.dead_branch_ratio)} of its RMS "
        f"or gradient): {listing(parts, 3)}"
        + (f"; {len(stuck)} of them get no parameter gradient at all." if stuck else ".")
    )
    hint = (
        "Check that branch's output projection and gain (all-zero or tiny weights: a failed "
        "or partial load, a stray zero-init, masking). A zero-initialized projection only "
        "makes sense in every block at once, with weights that can learn (Fixup/SkipInit)."
    )
    out.append(
        finding(
            CheckId.DEAD_BRANCH,
            severity,
            [b.rec.name for b in rest],
            value,
            threshold,
            message,
            hint,
        )
    )
    return out


def _zero_initialised(
    ctx: CheckContext, branches: list[_Branch], rest: list[_Branch]
) -> tuple[list[Finding], list[_Branch]]:
    """Every branch of one kind zeroed at init through an all-zero output projection is a
    deliberate zero-init (Fixup / SkipInit), not an accident: info."""
    th = ctx.thresholds
    out: list[Finding] = []
    zero_out = {o.module for _, o, _ in branch_projections(ctx) if o.std == 0 and o.mean == 0}
    for kind in KIND_NAME:
        of_kind = [b for b in branches if b.rec.kind == kind]
        dead_kind = [b for b in rest if b.rec.kind == kind]
        zeroed = all(any(m.startswith(b.rec.name + ".") for m in zero_out) for b in dead_kind)
        if ctx.info.at_init and len(of_kind) >= 2 and len(dead_kind) == len(of_kind) and zeroed:
            out.append(
                finding(
                    CheckId.DEAD_BRANCH,
                    Severity.INFO,
                    [b.rec.name for b in dead_kind],
                    0.0,
                    th.dead_branch_ratio,
                    f"All {len(of_kind)} {kind_name(of_kind[0].rec)} branches write ~0 into the "
                    f"stream at "
                    f"init: a zero-initialized output projection in every block (Fixup / "
                    f"SkipInit style) starts each block as the identity.",
                    "Fine if deliberate: the zeroed projections still get gradients and grow. "
                    "If not, initialize them (std √(1/fan_in), times 1/√(2L)).",
                )
            )
            rest = [b for b in rest if b.rec.kind != kind]
    return out, rest


def _uniformly_small(
    ctx: CheckContext, branches: list[_Branch], rest: list[_Branch]
) -> tuple[list[Finding], list[_Branch]]:
    """At init, every branch of one kind writing a small, similar, non-zero fraction of
    the stream through weights that get gradients is the init's scale, not an accident.

    A failed load or a stray zero-init silences one block against its siblings; a small
    init (output projections scaled by 1/√(2L), a flat 0.02 at a small width, which a GLU
    MLP squares) silences all of them alike, and they learn from step 0. The evidence for a
    pathology is weak there: info with the numbers. Branches far below their siblings'
    median (`dead-branch-spread`), at exactly 0, without a parameter gradient, or dead by
    their gradient stay findings.
    """
    th = ctx.thresholds
    if not ctx.info.at_init:
        return [], rest
    out: list[Finding] = []
    for kind in KIND_NAME:
        of_kind = [b for b in branches if b.rec.kind == kind]
        dead_kind = [b for b in rest if b.rec.kind == kind]
        if len(of_kind) < 2 or len(dead_kind) != len(of_kind):
            continue
        ratios = sorted(b.ratio for b in dead_kind if b.ratio is not None)
        if len(ratios) != len(dead_kind) or ratios[len(ratios) // 2] <= 0:
            continue
        floor = ratios[len(ratios) // 2] / max(th.dead_branch_spread, 1.0)
        small = [
            b
            for b in dead_kind
            if b.ratio is not None
            and b.ratio > 0
            and b.ratio >= floor
            and (b.grad_ratio is None or b.grad_ratio > th.dead_branch_ratio)
            and not (ctx.run.backward and b.rec.param_grad_norm == 0)
        ]
        if not small:
            continue
        lo = min(b.ratio for b in small if b.ratio is not None)
        hi = max(b.ratio for b in small if b.ratio is not None)
        name = kind_name(small[0].rec)
        hint = (
            "Nothing to fix if the small init is deliberate: these branches learn from "
            "step 0. If they should start alive, initialize the output projections at "
            "std √(1/fan_in) times 1/√(2L)."
        )
        if all(behind_norm(ctx, b.rec) for b in small):
            hint = (
                "Nothing to fix if the small init is deliberate: these branches learn from "
                "step 0. The post-branch norms set what reaches the stream, so it is their "
                "gains (not the output projections) that would start the writes larger."
            )
        what = (
            f"{len(small)} of the {len(of_kind)} {name} branches"
            if len(small) < len(of_kind)
            else f"All {len(of_kind)} {name} branches"
        )
        out.append(
            finding(
                CheckId.DEAD_BRANCH,
                Severity.INFO,
                [b.rec.name for b in small],
                lo,
                th.dead_branch_ratio,
                f"{what} write only {n(lo)}–{n(hi)} of the stream's RMS at init (≤ "
                f"{n(th.dead_branch_ratio)}), alike in every block and through non-zero "
                f"weights that get gradients: the init's scale (small or 1/√(2L)-scaled "
                f"output projections; a flat std at a small width), not a dead branch. Each "
                f"block starts close to the identity.",
                hint,
            )
        )
        rest = [b for b in rest if all(b is not s for s in small)]
    return out, rest


def _pattern(name: str) -> str:
    """'encoder.layers.3.self_attn' → 'encoder.layers.*.self_attn': the same branch in
    every block (one stream, one stage)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _learns(b: _Branch, ctx: CheckContext) -> bool:
    """Alive by its gradient and with a non-zero parameter gradient (when measured)."""
    th = ctx.thresholds
    grad_ok = b.grad_ratio is None or b.grad_ratio > th.dead_branch_ratio
    return grad_ok and not (ctx.run.backward and b.rec.param_grad_norm == 0)


def _like_siblings(
    ctx: CheckContext, branches: list[_Branch], rest: list[_Branch]
) -> tuple[list[Finding], list[_Branch]]:
    """At init, a branch under dead-branch-ratio that writes as much as the same branch
    of the other blocks (its siblings: the same module path but for the block index)
    is the init's scale there, not an accident: the threshold sits inside the spread
    the init gives them (Longformer's encoder attention at width 64: 8.6e-4 of the
    stream in one block, ~1e-3 in its siblings; FocalNet's modulation, whose depthwise
    convolutions at std 0.02 multiply to ~2e-4, in every block). An accident silences
    one block against its siblings: a zeroed projection writes exactly 0, a 1e-3-scaled
    one sits orders of magnitude below their median. Info with the numbers; a branch
    at 0, more than dead-branch-spread below its siblings' median, without siblings,
    or without a gradient stays a finding."""
    th = ctx.thresholds
    if not ctx.info.at_init:
        return [], rest
    groups: dict[str, list[_Branch]] = {}
    for b in branches:
        groups.setdefault(_pattern(b.rec.name), []).append(b)
    like: list[tuple[_Branch, float, float]] = []  # (branch, its ratio, siblings' median)
    for b in rest:
        siblings = groups.get(_pattern(b.rec.name), [])
        ratios = sorted(s.ratio for s in siblings if s.ratio is not None)
        if len(siblings) < 2 or len(ratios) != len(siblings) or b.ratio is None:
            continue
        median = ratios[len(ratios) // 2]
        if b.ratio > 0 and b.ratio >= median / max(th.dead_branch_spread, 1.0) and _learns(b, ctx):
            like.append((b, b.ratio, median))
    if not like:
        return [], rest
    lo = min(r for _, r, _ in like)
    medians = [m for _, _, m in like]
    names = sorted({_pattern(b.rec.name) for b, _, _ in like})
    finding_ = finding(
        CheckId.DEAD_BRANCH,
        Severity.INFO,
        [b.rec.name for b, _, _ in like],
        lo,
        th.dead_branch_ratio,
        f"{len(like)} branch{'es' if len(like) > 1 else ''} write under "
        f"{n(th.dead_branch_ratio)} of the stream's RMS at init (lowest {n(lo)}), as much as "
        f"the same branch of the other blocks does (within ×{n(th.dead_branch_spread)} of "
        f"their median, {n(min(medians))}–{n(max(medians))}), through non-zero weights that "
        f"get gradients: the init's scale ({listing(names, 3)}), not a dead branch.",
        "Nothing to fix if the small init is deliberate: these branches learn from step 0. "
        "If they should start alive, initialize the output projections larger (std "
        "√(1/fan_in) times 1/√(2L)).",
    )
    kept = [b for b in rest if all(b is not x for x, _, _ in like)]
    return [finding_], kept
