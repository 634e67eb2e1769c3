"""One number format for tables and finding messages: 3 significant digits."""

from __future__ import annotations

import math


def num(x: float | str | None, digits: int = 3) -> str:
    """1.23, 0.0123, 1.23e+05, nan, inf, — (None); strings (JSON's "nan") pass through."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"
