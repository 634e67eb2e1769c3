"""A step's figures of fp32 CPU tensors in compiled single reads: the update figures of a
parameter (one read of W_t, W_{t+1}, W_0) and a probe point's change sums.

`loop._moved` takes ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² and the non-finite flag in
torch passes: two subtractions that write a chunk each and three norms, six passes over a
chunk. On CPU a compiled loop (`moved_kernel`, built with llvmlite, the optional `fast`
extra) reads each value of the three once and keeps the sums in registers. The
differences are the same fp32 subtractions; the squares are summed in fp64 (as torch's
CPU norm accumulates), in lanes, so only the order of the sum differs (`reassoc` on the
sums' adds alone). The same holds for `change`: a probe point's Σ(x_t − x_0)², Σx², Σ|x|,
Σ|x_t − x_0| in one read, where torch took a difference tensor and three fp64 norms (the
probe's taps 0.045 → ~0.01 s a step at 12 × 768). The gradients' norms stay torch's
`_foreach_norm`: folded into the copy of W_t the same way they measured slower (LLVM
splits the copy off as a memcpy, so the read is not shared).
"""

from __future__ import annotations

from typing import Any

import torch

from actscan.measure.compiled import lazy

__all__ = ["change", "fits", "loader", "moved", "supports"]


def _load() -> Any:
    from actscan.steps import moved_kernel  # builds the loop (~0.03 s)

    return moved_kernel


def loader() -> Any:
    """The kernel's loader, for `compiled.preload` (None: not installed)."""
    return _kernels()


_kernels = lazy(_load)  # `moved_kernel` (the compiled loop), or None without llvmlite


def supports(*ts: torch.Tensor) -> bool:
    """The loops are built (llvmlite is here) and every one of `ts` is fp32 on the CPU
    (a half-precision parameter's norms are taken by torch, in fp32 at least)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts) and (
        _kernels() is not None
    )


def fits(*ts: torch.Tensor) -> bool:
    """`supports`, and every one of `ts` contiguous (read in place, not copied flat)."""
    return all(t.is_contiguous() for t in ts) and supports(*ts)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous()


def moved(
    old: torch.Tensor, now: torch.Tensor, w0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`loop._moved`'s (fp64) ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² (at t = 0, w0
    None: the second, as W_{t+1} − W_0 = −(W_t − W_{t+1})) and 1 where W_t − W_{t+1}
    holds an inf/nan, from one read of W_t's copy `old`, the parameter `now` and `w0`."""
    x, y = _flat(old), _flat(now)
    z = _flat(w0) if w0 is not None else y  # y − y = 0: read from cache, unused
    out = torch.zeros(4, dtype=torch.float64)
    _kernels().moved(x, y, z, out)
    w2, d2, r2, bad = out.unbind()
    return w2, d2, (r2 if w0 is not None else d2), (bad > 0).double()


def change(x: torch.Tensor, x0: torch.Tensor, out: torch.Tensor) -> None:
    """out[:4] += (Σ(x − x0)², Σx², Σ|x|, Σ|x − x0|) in fp64, the difference in fp32, in
    one read of x and x0 (`fits(x, x0)`; `out` fp64 on the CPU)."""
    _kernels().change(x.reshape(-1), x0.reshape(-1), out)
