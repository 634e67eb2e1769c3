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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["amax", "available", "borrowed", "lazy", "operand_figures", "supports"]


class Recipe(Protocol):
    """What the kernels read of a `casts.Recipe` (typed here, not imported: `casts`
    imports this module)."""

    @property
    def block(self) -> int: ...
    @property
    def scale(self) -> str: ...
    def element(self, operand: str) -> Any: ...


def lazy(load: Callable[[], Any]) -> Callable[[], Any]:
    """`load()` (an import of an optional dependency's module) on the first call, then
    its module, or None if the import failed: nothing is imported until it is used."""
    got: list[Any] = []

    def module() -> Any:
        if not got:
            try:
                got.append(load())
            except ImportError:  # numba (the `fast` extra) is not installed
                got.append(None)
        return got[0]

    return module


def _load() -> Any:
    from actscan.measure import cast_kernels

    return cast_kernels


_kernels = lazy(_load)  # `cast_kernels` (numba's loops), or None without numba


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
    got = _run(lambda part: kern.amax(part.reshape(-1)), _numpy(x))
    return torch.tensor(max((np.float32(t) for t in got), key=_pattern), dtype=torch.float32)


class _Borrowed:
    """A C-contiguous fp32 tensor's memory as numpy sees it, through the array
    interface: `Tensor.numpy()` would mark the storage not resizable for good, and FSDP
    frees an unsharded parameter by resizing its storage to 0. Holds the tensor, so the
    memory lives as long as the array does."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.__array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": "<f4",
            "data": (t.data_ptr(), True),
            "version": 3,
        }


def borrowed(t: torch.Tensor) -> Any:
    """`t`'s memory (fp32, C-contiguous) as a numpy array, not a copy: for the compiled
    kernels here and in `steps.fused_moved`."""
    return np.asarray(_Borrowed(t))


def _numpy(x: torch.Tensor) -> Any:
    return borrowed(x.detach().float().contiguous())  # no copy of what `casts` passes


def _pattern(v: Any) -> int:
    """An fp32's int32 bits: the order `casts` takes |x| in (+NaN above inf)."""
    return int(np.float32(v).view(np.int32))


_POOL: ThreadPoolExecutor | None = None
_MIN_PART = 1 << 18  # values below which a thread costs more than it saves


def _run(fn: Callable[[Any], Any], xa: Any) -> list[Any]:
    """`fn` over pieces of whole rows of `xa`, one per torch thread (the kernels release
    the GIL): a user's threads speed the casts as they speed the pass."""
    rows = xa.shape[0]
    n = max(1, min(torch.get_num_threads(), rows, xa.size // _MIN_PART))
    if n == 1:
        return [fn(xa)]
    global _POOL
    if _POOL is None or _POOL._max_workers < n - 1:
        _POOL = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="actscan-casts")
    cuts = [rows * i // n for i in range(n + 1)]
    pieces = [xa[cuts[i] : cuts[i + 1]] for i in range(n)]
    rest = [_POOL.submit(fn, piece) for piece in pieces[1:]]
    return [fn(pieces[0]), *(f.result() for f in rest)]  # the caller's thread does one


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

    def part(piece: Any) -> tuple[Any, Any]:
        acc = np.zeros((4, 7))
        lo = np.full(1, kern.NONE, np.float32)
        kern.kernel(piece, p, acc, lo)
        return acc, lo[0]

    got = _run(part, xa)
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
