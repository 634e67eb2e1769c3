"""The figures of `casts.operand_figures`, on CPU, in one read of the operand for every format.

Torch's elementwise kernels cost a pass over memory each, and a cast's figures take about
fifteen of them per format (scale, round, saturate, count twice, descale, error, block
extrema): on CPU that made `--formats` cost 1.4–2.3× a plain forward+backward, depending
on how fast the machine's caches are next to its matrix units. A compiled loop
(`cast_kernels`) reads each value once, group by group, and does every format's work in
registers. numba compiles it (LLVM, no C compiler on the user's machine, cached on disk
after the first run; imported only when a cast runs); it is an optional dependency
(`pip install actscan[fast]`): without it, `casts` does the same in torch.

The arithmetic is `casts`' own, in the same IEEE fp32 operations: the scales, and the
rounding to nearest even, here as round-to-even of |y| ÷ the grid's spacing (a power of
two, so exact) times the spacing, where `casts` adds and subtracts a power of two. The
counts agree exactly. The sums (error, ‖x‖²) run in fp32 lanes over a group of 16,384
values and in fp64 across groups (1e-6 relative on a 38M-value weight, where torch's
fp32 dot over a piece drifts by 3e-5); the block ranges in fp64. Only the sums are
reassociated (`fastmath`'s `reassoc`, so that they vectorise): no fp32 operation of a
cast is reordered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from actscan.measure.compiled import borrowed, lazy, split_rows

__all__ = ["amax", "available", "loader", "operand_figures", "supports"]


class Recipe(Protocol):
    """What the kernels read of a `casts.Recipe` (typed here, not imported: `casts`
    imports this module)."""

    @property
    def block(self) -> int: ...
    @property
    def scale(self) -> str: ...
    def element(self, operand: str) -> Any: ...


def _load() -> Any:
    from actscan.measure import cast_kernels

    # the first calls load the compiled code from numba's cache: here, so that
    # `compiled.preload` takes it off the pass; the argument types are the calls' own
    x = borrowed(torch.zeros(1, 32))
    cast_kernels.amax(x.reshape(-1))
    lo = np.full(1, cast_kernels.NONE, np.float32)
    cast_kernels.kernel(x, np.ones((3, 7), np.float32), np.zeros((4, 7)), lo)
    return cast_kernels


_kernels = lazy(_load)  # `cast_kernels` (numba's loops), or None without numba


def loader() -> Any:
    """The kernels' loader, for `compiled.preload` (None: not installed)."""
    return _kernels()


def available() -> bool:
    """Whether the compiled casts can run here (numba importable)."""
    return _kernels() is not None


_KINDS = {(0, "tensor"): 0, (32, "e8m0"): 1, (16, "e4m3"): 2}


def supports(x: torch.Tensor, recipes: Sequence[Recipe]) -> bool:
    """Whether these kernels cast `x` with `recipes`: numba is here, x is a 2-D CPU
    tensor, and the recipes are the three kinds the kernel has, each at most once."""
    kinds = [_KINDS.get((r.block, r.scale)) for r in recipes]
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and available()
        and None not in kinds
        and len(set(kinds)) == len(kinds)
    )


def amax(x: torch.Tensor) -> torch.Tensor:
    """|x|'s amax of a CPU `x` (NaN if it holds one), in one read: the per-tensor
    scales' reference, before the casts."""
    kern = _kernels()
    xa = _numpy(x)
    got = split_rows(lambda b: kern.amax(xa[b[0] : b[1]].reshape(-1)), xa.shape[0], xa.size)
    return torch.tensor(max((np.float32(t) for t in got), key=_pattern), dtype=torch.float32)


def _numpy(x: torch.Tensor) -> Any:
    return borrowed(x.detach().float().contiguous())  # no copy of what `casts` passes


def _pattern(v: Any) -> int:
    """An fp32's int32 bits: the order `casts` takes |x| in (+NaN above inf)."""
    return int(np.float32(v).view(np.int32))


def operand_figures(
    x: torch.Tensor, recipes: Sequence[Recipe], tscales: Sequence[torch.Tensor],
    operand: str, amax: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`casts.operand_figures`' (recipes, figures) fp64 tensor for `x` (rows, K, CPU),
    each recipe under its per-tensor factor `tscales[i]` (`casts._tensor_scale`); `amax`:
    x's own (`amax`: the per-tensor range)."""
    kern = _kernels()
    xa = _numpy(x)
    p = np.zeros((3, 7), np.float32)
    for r, ts in zip(recipes, tscales, strict=True):
        k = _KINDS[(r.block, r.scale)]
        elem = r.element(operand)
        p[k, :6] = (1.0, float(ts), elem.max, elem.tiny / 2, elem.tiny * 2.0**elem.mantissa,
                    2.0**-elem.mantissa)  # fmt: skip
        p[k, 6] = 2.0**-elem.emax

    def part(b: tuple[int, int]) -> tuple[Any, Any]:
        acc = np.zeros((4, 7))
        lo = np.full(1, kern.NONE, np.float32)
        kern.kernel(xa[b[0] : b[1]], p, acc, lo)
        return acc, lo[0]

    got = split_rows(part, xa.shape[0], xa.size)
    acc = np.sum([g[0] for g in got], axis=0)
    acc[:, 5] = np.max([g[0][:, 5] for g in got], axis=0)  # the range's maximum
    lo = min((g[1] for g in got), key=_pattern)
    values, nonzero, sq = float(xa.size), acc[3, 0], acc[3, 1]
    out = []
    for r in recipes:
        k = _KINDS[(r.block, r.scale)]
        nzq, sat, err, rsum, live, rmax = acc[k, :6]
        if k == 0:  # one block, the tensor: its range from the whole amax
            top = float(amax)
            live = float(top > 0)  # 0 for NaN, as `casts` takes it
            low = _after(lo) if _pattern(lo) != _pattern(kern.NONE) else math.inf  # none: inf
            rsum = rmax = math.log2(top) - math.log2(low) if live else 0.0
        out.append([values, nonzero, nonzero - nzq, sat, err, sq, rsum, live, rmax])
    return torch.tensor(out, dtype=torch.float64)


def _after(v: Any) -> float:
    """The float whose pattern follows v's (`_next` on the host)."""
    return float((np.float32(v).view(np.int32) + np.int32(1)).view(np.float32))
