"""The compiled loop of `fused_moved` (numba): imported on first use only, so that a run
without numba, or without `--steps`, never pays numba's import.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_GROUP = 1 << 14  # values per group: its fp64 lanes stay in registers

_OPTS: dict[str, Any] = dict(
    cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "nsz"},
    error_model="numpy",
)  # fmt: skip
_INF = np.float32(np.inf)


@numba.njit(**_OPTS)
def kernel(old: Any, now: Any, w0: Any, drift: Any, out: Any) -> None:
    """out += (‖old‖², ‖old − now‖², ‖now − w0‖² (`drift`), non-finite differences)."""
    n = old.shape[0]
    for g in range(0, n, _GROUP):
        x, y = old[g : g + _GROUP], now[g : g + _GROUP]
        w2 = 0.0
        d2 = 0.0
        bad = 0.0
        for i in range(x.shape[0]):
            d = x[i] - y[i]
            w2 += np.float64(x[i]) * x[i]
            d2 += np.float64(d) * d
            bad += 0.0 if abs(d) < _INF else 1.0
        r2 = 0.0
        if drift:
            z = w0[g : g + _GROUP]
            for i in range(x.shape[0]):
                r = y[i] - z[i]
                r2 += np.float64(r) * r
        out[0] += w2
        out[1] += d2
        out[2] += r2
        out[3] += bad
