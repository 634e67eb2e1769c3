"""Glyph helpers every terminal view shares (sparklines): drawing only, no measuring."""

from __future__ import annotations

import math
from collections.abc import Sequence

from actscan.numfmt import as_float

__all__ = ["FLAT", "SPARK", "is_flat", "spark"]

SPARK = "▁▂▃▄▅▆▇█"
# Values whose max/min is within this factor are drawn flat: one step of an 8-level
# sparkline must not turn a 0.4% drift into a full-height trend.
FLAT = 1.05


def is_flat(values: Sequence[float | None]) -> bool:
    """True when the positive finite values differ by less than FLAT (×1.05) end to end."""
    finite = [v for v in map(as_float, values) if v is not None and math.isfinite(v) and v > 0]
    return bool(finite) and max(finite) / min(finite) < FLAT


def spark(values: Sequence[float | None], lo: float | None = None, hi: float | None = None) -> str:
    """One glyph per value on a shared scale (log scale when the range is wide); values
    within ×1.05 of each other are drawn flat. Not measured (None, e.g. left out by
    --modules): blank; zero: ·; non-finite: !."""
    values = [as_float(v) for v in values]  # a report read from JSON spells inf "inf"
    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not finite:
        return "".join(" " if v is None else ("·" if v == 0 else "!") for v in values)
    lo = min(finite) if lo is None else lo
    hi = max(finite) if hi is None else hi
    use_log = hi / max(lo, 1e-30) > 20
    f = (lambda v: math.log(v)) if use_log else (lambda v: v)
    a, b = f(max(lo, 1e-30)), f(max(hi, 1e-30))
    flat = hi / max(lo, 1e-30) < FLAT
    out = []
    for v in values:
        if v is None or not math.isfinite(v) or v <= 0:
            out.append(" " if v is None else ("·" if v == 0 else "!"))
            continue
        if flat:
            out.append(SPARK[len(SPARK) // 2 - 1])
            continue
        t = 0.0 if b == a else (f(v) - a) / (b - a)
        out.append(SPARK[min(len(SPARK) - 1, max(0, round(t * (len(SPARK) - 1))))])
    return "".join(out)
