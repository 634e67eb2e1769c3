"""`fused_moved`'s loops (the update figures; the probe's change sums), written as LLVM
IR and built for this CPU when first used (`measure.jit`, one module, ~0.03 s; numba's
import and first call cost ~0.5 s a process, which a `--steps` run would pay for 3 % of
a step). Imported on first use only (`compiled.lazy`).
"""

from __future__ import annotations

import ctypes

import llvmlite.ir as ir
import torch

from actscan.measure.jit import Lanes, build_all, new_module, sum_kernel

__all__ = ["change", "moved"]


def _moved_terms(b: ir.IRBuilder, lanes: Lanes, v: list[ir.Value]) -> list[ir.Value]:
    x, y, z = v
    d, r = b.fsub(x, y), b.fsub(y, z)  # in fp32: the torch passes' own differences
    xd, dd, rd = (lanes.ext(b, t) for t in (x, d, r))
    finite = b.fcmp_ordered("<", b.call(lanes.fabs_f, [d]), lanes.const_f(float("inf")))
    bad = b.select(finite, lanes.const_d(0.0), lanes.const_d(1.0))
    return [b.fmul(xd, xd), b.fmul(dd, dd), b.fmul(rd, rd), bad]


def _moved_fn(mod: ir.Module) -> None:
    """void moved(float *x, float *y, float *z, i64 n, double *out): with d = x − y and
    r = y − z in fp32 (the torch passes' own differences), out += (Σx², Σd², Σr², the
    count of non-finite d), the squares summed in fp64 lanes."""
    sum_kernel(mod, "moved", 3, 4, _moved_terms)


def _change_terms(b: ir.IRBuilder, lanes: Lanes, v: list[ir.Value]) -> list[ir.Value]:
    x, x0 = v
    xd, dd = lanes.ext(b, x), lanes.ext(b, b.fsub(x, x0))
    return [b.fmul(dd, dd), b.fmul(xd, xd), b.call(lanes.fabs_d, [xd]), b.call(lanes.fabs_d, [dd])]


def _change_fn(mod: ir.Module) -> None:
    """void change(float *x, float *x0, i64 n, double *out): with d = x − x0 in fp32,
    out += (Σd², Σx², Σ|x|, Σ|d|), summed in fp64 lanes: a probe point's sums in one read."""
    sum_kernel(mod, "change", 2, 4, _change_terms)


def _module() -> ir.Module:
    mod = new_module("actscan_steps")
    for add in (_moved_fn, _change_fn):
        add(mod)
    return mod


_P = ctypes.c_void_p
_ENGINE, _FNS = build_all(
    _module(),
    {
        "moved": [_P, _P, _P, ctypes.c_int64, _P],
        "change": [_P, _P, ctypes.c_int64, _P],
    },
)
_MOVED, _CHANGE = _FNS["moved"], _FNS["change"]


def moved(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> None:
    """The loop on three contiguous fp32 CPU tensors of one size; `out` (4,) fp64."""
    assert x.numel() == y.numel() == z.numel() and out.dtype == torch.float64
    _MOVED(x.data_ptr(), y.data_ptr(), z.data_ptr(), x.numel(), out.data_ptr())


def change(x: torch.Tensor, x0: torch.Tensor, out: torch.Tensor) -> None:
    """out[:4] += (Σ(x − x0)², Σx², Σ|x|, Σ|x − x0|): contiguous fp32 CPU, one size."""
    assert x.numel() == x0.numel() and out.dtype == torch.float64
    _CHANGE(x.data_ptr(), x0.data_ptr(), x.numel(), out.data_ptr())
