"""Derived figures of the first optimizer steps (no torch, no printing): what the tables and
`compare --steps` show, computed once here and carried in the records."""

from __future__ import annotations

import math
from collections.abc import Sequence

from actscan.records import Dynamics


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def ratio_spread(dyn: Dynamics) -> float | None:
    """max ÷ min over the blocks' median update ratios (block matrices only): 1 when every
    block moves alike; large when some layers race ahead of or lag behind the rest."""
    meds = [b.ratio_median for b in dyn.blocks if b.block is not None]
    vals = [v for v in _finite(meds) if v > 0]
    return max(vals) / min(vals) if vals else None


def amplification(dyn: Dynamics, t: int | None = None) -> tuple[tuple[int, float | None], ...]:
    """(k, rel) of the probe's stream points at step t (default: the last): how far the
    stream at each depth moved from step 0, ‖x_t − x_0‖/‖x_0‖."""
    if not dyn.steps:
        return ()
    step = dyn.steps[-1 if t is None else t]
    return tuple((c.k, c.rel) for c in step.change if c.kind == "stream" and c.k is not None)


def final_amplification(dyn: Dynamics) -> float | None:
    """The probe's relative change at the last stream point after the last step."""
    curve = amplification(dyn)
    return curve[-1][1] if curve else None


def attn_growth(dyn: Dynamics) -> float | None:
    """Largest attention score after the last step ÷ at step 0 (None where not recorded)."""
    if len(dyn.steps) < 2:
        return None
    a, b = dyn.steps[0].attn_max, dyn.steps[-1].attn_max
    if a is None or b is None or not a > 0:
        return None
    return b / a
