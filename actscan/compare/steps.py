"""`compare … --steps N`: the two sides' first optimizer steps side by side, and which side
keeps its updates sane.

Computed once here (no torch, no printing); actscan.render.compare draws it.

The verdict rests on two measured figures per side, each smaller-is-saner:
- the update-ratio spread: max ÷ min over the blocks' median ‖ΔW‖/‖W‖ (block matrices, all
  steps pooled). One learning rate suits every layer only when the layers move alike; a
  spread of 10 means some layer moves 10× faster (or slower) than another.
- the final amplification: the probe's ‖x_N − x_0‖/‖x_0‖ at the last stream point, how far
  the output's input moved after N steps (Admin's amplification view: a Post-LN stack
  amplifies a small update into a large output change).
A figure counts for a side when it is smaller by more than MARGIN (×1.1). A side is saner
when it wins one figure and does not lose the other; when each side wins one, the verdict
says so and names which side wins which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from actscan.numfmt import num
from actscan.records import Dynamics
from actscan.steps.derived import (
    amplification,
    attn_growth,
    final_amplification,
    ratio_spread,
)

MARGIN = 1.1  # a figure must be this many times smaller to count as a win


@dataclass(frozen=True)
class SideSteps:
    """One side's figures."""

    steps: int
    optimizer: str  # "adamw lr 0.001"
    ratio_spread: float | None
    final_amplification: float | None
    attn_first: float | None
    attn_last: float | None
    attn_growth: float | None
    loss_first: float | None
    loss_last: float | None


@dataclass(frozen=True)
class BlockPair:
    """Median update ratio of one block's matrices (all roles pooled by role) on each side."""

    block: int | None
    role: str
    a: float | None
    b: float | None
    ratio: float | None  # b ÷ a


@dataclass(frozen=True)
class StepsComparison:
    a: SideSteps
    b: SideSteps
    updates: tuple[BlockPair, ...]  # per (block, role) both sides have, in A's order
    amplification: tuple[tuple[int, float | None, float | None], ...]  # (k, rel A, rel B)
    saner: str | None  # "a", "b", or None (tie or mixed)
    verdict: str


def _side(d: Dynamics) -> SideSteps:
    o = d.optimizer
    return SideSteps(
        steps=len(d.steps) - 1,
        optimizer=f"{o.name} lr {num(o.lr)}",
        ratio_spread=ratio_spread(d),
        final_amplification=final_amplification(d),
        attn_first=d.steps[0].attn_max if d.steps else None,
        attn_last=d.steps[-1].attn_max if d.steps else None,
        attn_growth=attn_growth(d),
        loss_first=d.steps[0].loss if d.steps else None,
        loss_last=d.steps[-1].loss if d.steps else None,
    )


def _wins(x: float | None, y: float | None) -> str | None:
    """ "a" when x is smaller than y by more than MARGIN, "b" the other way, else None."""
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return None
    if x * MARGIN < y:
        return "a"
    if y * MARGIN < x:
        return "b"
    return None


def compare_steps(
    a: Dynamics, b: Dynamics, *, label_a: str = "A", label_b: str = "B"
) -> StepsComparison:
    sa, sb = _side(a), _side(b)
    mb = {(x.block, x.role): x.ratio_median for x in b.blocks}
    pairs = tuple(
        BlockPair(
            x.block,
            x.role,
            x.ratio_median,
            y,
            y / x.ratio_median if x.ratio_median and y is not None else None,
        )
        for x in a.blocks
        if (x.block, x.role) in mb
        for y in (mb[(x.block, x.role)],)
    )
    amp_b = dict(amplification(b))
    amp = tuple((k, rel, amp_b.get(k)) for k, rel in amplification(a) if k in amp_b)
    spread = _wins(sa.ratio_spread, sb.ratio_spread)
    final = _wins(sa.final_amplification, sb.final_amplification)
    names = {"a": f"A ({label_a})", "b": f"B ({label_b})"}
    figures = (
        f"update-ratio spread A {num(sa.ratio_spread)} vs B {num(sb.ratio_spread)}, "
        f"final amplification A {num(sa.final_amplification)} vs B "
        f"{num(sb.final_amplification)}"
    )
    saner: str | None = None
    if spread is not None and final is not None and spread != final:
        text = (
            f"mixed after {sa.steps} steps: {names[spread]} has the more even updates, "
            f"{names[final]} the smaller output change ({figures})"
        )
    elif spread is None and final is None:
        text = f"both sides keep their updates alike after {sa.steps} steps ({figures})"
    else:
        saner = spread if spread is not None else final
        assert saner is not None
        text = f"{names[saner]} keeps the updates saner after {sa.steps} steps ({figures})"
    return StepsComparison(a=sa, b=sb, updates=pairs, amplification=amp, saner=saner, verdict=text)
