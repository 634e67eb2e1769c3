"""The one number format of every table, finding message, Markdown and JUnit output.

Three significant digits, an exponent outside [1e-3, 1e5), and "—" for a missing value,
so the same measurement reads the same wherever it is shown.
"""

from __future__ import annotations

import math

NONE = "—"  # a missing value (None), in every output


def num(x: object, digits: int = 3) -> str:
    """1.23, 0.0123, 1.20e+05, 5.00e-04, nan, inf, -inf, — (None).

    Strings pass through: a Report rebuilt from JSON carries non-finite values as "nan",
    "inf" and "-inf". Booleans print as true/false; other objects as str().
    """
    if x is None:
        return NONE
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x).lower()
    if not isinstance(x, int | float):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def as_float(x: object) -> float | None:
    """A value as a float for drawing (bars, sparklines): the JSON spellings "nan", "inf"
    and "-inf" become floats again; None and anything else non-numeric are None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return None
