"""Small helpers shared by the checks: number formatting, finite filters, stream views,
and the one warn/error choice (`grade`, `warn_or_error`)."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeGuard

from actscan.numfmt import num as n  # noqa: F401  (re-exported for the checks)
from actscan.records import (
    CheckId,
    Finding,
    LayerRecord,
    ParamRecord,
    Severity,
    Skip,
    StreamPoint,
)

if TYPE_CHECKING:
    from actscan.diagnose.context import CheckContext

# Largest finite value per run dtype; ln(65504) is where exp() overflows fp16.
DTYPE_MAX = {"fp16": 65504.0, "bf16": 3.3895e38, "fp32": 3.4028e38}
FP16_MAX = DTYPE_MAX["fp16"]
FP16_EXP_LIMIT = math.log(FP16_MAX)  # 11.09
# Each float format's largest finite value, exactly (fp16, bf16, fp32). A value at exactly
# ±this was written, not computed: arithmetic past it rounds to inf, not onto it, and
# `masked_fill(mask, torch.finfo(dtype).min)` (the masking idiom) puts it there; a sum
# with it stays it (its ulp, 2e31 in fp32, swallows any logit).
FILL_VALUES = frozenset({65504.0, (2 - 2**-7) * 2.0**127, (2 - 2**-23) * 2.0**127})


def is_fill(x: float | None) -> bool:
    """|x| is exactly a float format's largest finite value: a fill constant."""
    return x is not None and abs(x) in FILL_VALUES


# A module that multiplies a branch by a learned gain: attn_gain, ls1, gamma_1, alpha, …
GAIN_NAME = re.compile(r"(gain|alpha|gamma|rezero|layer_?scale|^ls\d*$|_ls$|scale)", re.I)


def pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def finite(x: float | None) -> TypeGuard[float]:
    return x is not None and math.isfinite(x)


def positive(x: float | None) -> TypeGuard[float]:
    return finite(x) and x > 0


def known(x: float | None) -> float:
    """A field the caller has already filtered to a number (`finite`, `positive`, `is not
    None`), typed as one: the filter lives in a comprehension mypy cannot see into."""
    assert x is not None
    return x


def block_points(stream: Sequence[StreamPoint]) -> list[StreamPoint]:
    """Block outputs (k ≥ 1) with a usable RMS, in depth order."""
    return [p for p in stream if p.block is not None and positive(p.rms)]


def warn_or_error(
    error: bool, warn_at: float, error_at: float | None = None
) -> tuple[Severity, float]:
    """The warn/error choice every check makes: (severity, the threshold the finding
    reports). Without `error_at` both severities report `warn_at`."""
    if error:
        return Severity.ERROR, warn_at if error_at is None else error_at
    return Severity.WARN, warn_at


def grade(value: float, warn: float, error: float, *, above: bool = True) -> tuple[Severity, float]:
    """(severity, threshold) of a value already past `warn`: ERROR with `error` once it
    reaches `error` (at or above it, or at or below it with above=False), else WARN."""
    return warn_or_error(value >= error if above else value <= error, warn, error)


def listing(items: Iterable[str], limit: int = 4) -> str:
    """'a, b, c and 5 more' for messages."""
    items = list(items)
    if len(items) <= limit:
        return ", ".join(items)
    return f"{', '.join(items[:limit])} and {len(items) - limit} more"


def finding(
    check: CheckId,
    severity: Severity,
    layers: Iterable[str],
    value: float | None,
    threshold: float | None,
    message: str,
    hint: str = "",
) -> Finding:
    return Finding(
        check=str(check),
        severity=severity,
        layers=tuple(dict.fromkeys(layers)),
        value=value,
        threshold=threshold,
        message=message,
        hint=hint,
    )


def skip(check: CheckId, reason: str) -> Skip:
    return Skip(check=str(check), reason=reason)


def too_few_blocks(ctx: CheckContext, found: int, need: float, what: str = "blocks") -> str:
    """The reason a depth check did not run: how many it needs and how many there were."""
    if not ctx.layout.blocks:
        return NO_STREAM
    return f"needs {int(need)} {what}, found {found}"


NO_STREAM = "no residual stream found (no stack of blocks in the model)"
NO_BACKWARD = "no backward pass (forward only)"


def branch_projections(ctx: CheckContext) -> list[tuple[ParamRecord, ParamRecord, str]]:
    """(input projection, output projection, kind) weight pairs per branch, by call order."""
    order = {r.name: r.order for r in ctx.layers}
    index = {p.name: i for i, p in enumerate(ctx.params)}
    pairs = []
    for b in ctx.layout.blocks:
        for br in b.branch_list():
            kind, branch = br.role, br.name
            ws = [
                p
                for p in ctx.params
                if p.kind == "weight" and (p.module == branch or p.module.startswith(branch + "."))
            ]
            if len(ws) < 2:
                continue
            ws.sort(key=lambda p: (order.get(p.module, 10**9), index[p.name]))
            pairs.append((ws[0], ws[-1], kind))
    return pairs


def post_branch_norms(ctx: CheckContext) -> bool:
    """True when a block's write into the stream is a norm's output (Gemma 2/3's and
    OLMo 2/3's post-branch norms): the norm sets the write's scale, so scaling the
    projection before it changes nothing the stream sees."""
    return any(
        br.write is not None and ctx.layout.role(br.write) == "norm"
        for b in ctx.layout.blocks
        for br in b.branches
    )


def residual_budget(
    ctx: CheckContext,
) -> tuple[float, int, float, list[tuple[ParamRecord, ParamRecord]]] | None:
    """(s, 2L, 2L·s², attention (in, out) pairs) for a pre-norm stack at init, else None.

    s = median over blocks of std(attention output projection) / std(its input projection):
    both have fan_in = d_model, so s is the residual down-scaling whatever the init rule
    (1 when not down-scaled, 1/√(2L) for GPT-2). 2L·s² is how many unit branch variances
    the branches add to the stream.
    """
    arch = ctx.info.arch
    if not ctx.info.at_init or arch.get("placement", "pre") != "pre":
        return None
    if arch.get("branch_scale") in ("rezero", "layerscale", "deepnorm"):
        return None
    if any(
        p.block is not None
        and GAIN_NAME.search(p.module.rsplit(".", 1)[-1])
        and p.kind in ("scalar", "other", "structured")
        for p in ctx.params
    ):
        return None  # branch gains carry the depth scaling
    if post_branch_norms(ctx):
        return None  # post-branch norms (sandwich) set the write's scale, not the projection
    pairs = [(i, o) for i, o, kind in branch_projections(ctx) if kind == "attn"]
    scales = [o.std / i.std for i, o in pairs if i.std > 0]
    if len(scales) < ctx.thresholds.min_blocks:
        return None
    s = statistics.median(scales)
    adds = sum(b.adds for b in ctx.layout.blocks)
    return s, adds, adds * s * s, pairs


def feeding(act: LayerRecord, layers: tuple[LayerRecord, ...]) -> LayerRecord | None:
    """The pre-activation: the latest module before `act` in its block with as many channels."""
    before = [
        r
        for r in layers
        if r.block == act.block
        and r.order < act.order
        and r.n_channels == act.n_channels
        and r.role != "act"
        and not act.name.startswith(r.name + ".")
    ]
    return max(before, key=lambda r: r.order) if before else None


def runs_after(ctx: CheckContext, module: str) -> list[str] | None:
    """The recorded modules that run after `module` (its own children and the
    containers holding it aside: they return after it), in execution order; None when
    `module` was not recorded."""
    rec = next((r for r in ctx.layers if r.name == module), None)
    if rec is None:
        return None
    later = [
        o
        for o in ctx.layers
        if o.order > rec.order
        and not o.name.startswith(module + ".")
        and not module.startswith(o.name + ".")
    ]
    return [o.name for o in sorted(later, key=lambda o: o.order)]


def is_last(ctx: CheckContext, module: str) -> bool:
    """No other recorded module runs after `module` (its own children aside): it is the
    model's output, read by the loss only."""
    return runs_after(ctx, module) == []
