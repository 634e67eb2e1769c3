"""A step's update figures of one fp32 CPU parameter in one read of W_t, W_{t+1}, W_0.

`loop._moved` takes ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² and the non-finite flag in
torch passes: two subtractions that write a chunk each and three norms, six passes over a
chunk. On CPU a compiled loop (numba, the optional `fast` extra, as for the casts) reads
each value of the three once and keeps the sums in registers. The differences are the
same fp32 subtractions; the squares are summed in fp64 (as torch's CPU norm accumulates),
in lanes, so only the order of the sum differs (`fastmath`'s `reassoc` on the sums alone).
"""

from __future__ import annotations

from typing import Any

import torch

from actscan.measure.fused_casts import borrowed

try:  # optional: `loop._moved`'s torch passes stand in without it
    import numba
    import numpy as np
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]

__all__ = ["moved", "supports"]

_GROUP = 1 << 14  # values per group: its fp64 lanes stay in registers

if numba is not None:
    _OPTS: dict[str, Any] = dict(
        cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "nsz"},
        error_model="numpy",
    )  # fmt: skip
    _INF = np.float32(np.inf)

    @numba.njit(**_OPTS)
    def _kernel(old: Any, now: Any, w0: Any, drift: Any, out: Any) -> None:
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


def supports(old: torch.Tensor, now: torch.Tensor) -> bool:
    """numba is here and both are fp32 on the CPU (a half-precision parameter's norms are
    taken by torch, in fp32 at least)."""
    return (
        numba is not None
        and now.device.type == "cpu"
        and now.dtype == torch.float32
        and old.dtype == torch.float32
    )


def _array(t: torch.Tensor) -> Any:
    return borrowed(t.detach().reshape(-1).contiguous())


def moved(
    old: torch.Tensor, now: torch.Tensor, w0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`loop._moved`'s (fp64) ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² (at t = 0, w0
    None: the second, as W_{t+1} − W_0 = −(W_t − W_{t+1})) and 1 where W_t − W_{t+1}
    holds an inf/nan, from one read of W_t's copy `old`, the parameter `now` and `w0`."""
    x, y = _array(old), _array(now)
    z = _array(w0) if w0 is not None else x
    out = np.zeros(4)
    _kernel(x, y, z, w0 is not None, out)
    w2, d2, r2, bad = (torch.tensor(v, dtype=torch.float64) for v in out)
    return w2, d2, (r2 if w0 is not None else d2), (bad > 0).double()
