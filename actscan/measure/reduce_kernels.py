"""`fused_reduce`'s loop, written as LLVM IR and built for this CPU when first used
(`jit`: ~0.07 s with the import, where numba's import and first call cost ~0.5 s). The loop
vectoriser turns the row's sums into fp32 lanes (the `reassoc` flag on those adds alone)
and the max/min into vector selects. Imported on first use only (`compiled.lazy`); a
failure to build raises ImportError, and the recorder then takes its torch passes.
"""

from __future__ import annotations

import ctypes
import math

import llvmlite.ir as ir
import torch

from actscan.measure.jit import F32 as _F
from actscan.measure.jit import F64 as _D
from actscan.measure.jit import I64 as _I64
from actscan.measure.jit import SUMS as _SUMS
from actscan.measure.jit import Lanes, add_totals, build_all, new_module, sum_kernel

__all__ = ["rows", "sums"]


def _module() -> ir.Module:
    """void rows(float *x, i64 r, i64 c, float *hi, float *lo, float *norms, double *acc):
    for each row i of x (r × c, row-major): norms[i] = √Σx², hi[j]/lo[j] ← the max/min of
    column j (set to ∓inf first: the caller's buffers need no fill; a NaN, once seen,
    stays), acc += (Σx, finite values, zeros), each row's sums in fp32, rows added in fp64."""
    mod = new_module("actscan_reduce")
    fp, dp = _F.as_pointer(), _D.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [fp, _I64, _I64, fp, fp, fp, dp]), "rows")
    x, r, c, hi, lo, norms, acc = fn.args
    for a in (x, hi, lo, norms, acc):
        a.add_attribute("noalias")
    sqrt = mod.declare_intrinsic("llvm.sqrt", [_F])
    fabs = mod.declare_intrinsic("llvm.fabs", [_F])
    f0, f1, inf = ir.Constant(_F, 0.0), ir.Constant(_F, 1.0), ir.Constant(_F, math.inf)
    d0, i0, i1 = ir.Constant(_D, 0.0), ir.Constant(_I64, 0), ir.Constant(_I64, 1)
    entry, init, begin, outer, inner, row_end, done = (
        fn.append_basic_block(n)
        for n in ("entry", "init", "begin", "outer", "inner", "row_end", "done")
    )
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", c, i0), init, begin)

    b.position_at_end(init)  # hi ← -inf, lo ← +inf: the caller's buffers come uninitialised
    k = b.phi(_I64)
    b.store(b.fneg(inf), b.gep(hi, [k]))
    b.store(inf, b.gep(lo, [k]))
    k2 = b.add(k, i1)
    b.cbranch(b.icmp_signed("<", k2, c), init, begin)
    k.add_incoming(i0, entry)
    k.add_incoming(k2, init)

    b.position_at_end(begin)
    b.cbranch(b.and_(b.icmp_signed(">", r, i0), b.icmp_signed(">", c, i0)), outer, done)

    b.position_at_end(outer)  # over the rows
    i, st, ft, zt = b.phi(_I64), b.phi(_D), b.phi(_D), b.phi(_D)
    row = b.gep(x, [b.mul(i, c)])
    b.branch(inner)

    b.position_at_end(inner)  # over one row's columns
    j, s, q, f, z = b.phi(_I64), b.phi(_F), b.phi(_F), b.phi(_F), b.phi(_F)
    v = b.load(b.gep(row, [j]))
    s2 = b.fadd(s, v, flags=_SUMS)
    q2 = b.fadd(q, b.fmul(v, v), flags=_SUMS)
    f2 = b.fadd(f, b.select(b.fcmp_ordered("<", b.call(fabs, [v]), inf), f1, f0), flags=_SUMS)
    z2 = b.fadd(z, b.select(b.fcmp_ordered("==", v, f0), f1, f0), flags=_SUMS)
    hp, lp = b.gep(hi, [j]), b.gep(lo, [j])
    h, low = b.load(hp), b.load(lp)
    # v replaces the running max where v > h or v is NaN, unless h is NaN: NaN stays (as
    # torch's amax carries it); the min alike
    b.store(b.select(b.and_(b.fcmp_unordered(">", v, h), b.fcmp_ordered("ord", h, h)), v, h), hp)
    keep_low = b.fcmp_ordered("ord", low, low)
    b.store(b.select(b.and_(b.fcmp_unordered("<", v, low), keep_low), v, low), lp)
    j2 = b.add(j, i1)
    b.cbranch(b.icmp_signed("<", j2, c), inner, row_end)
    for phi, nxt, start in ((j, j2, i0), (s, s2, f0), (q, q2, f0), (f, f2, f0), (z, z2, f0)):
        phi.add_incoming(start, outer)
        phi.add_incoming(nxt, inner)

    b.position_at_end(row_end)
    b.store(b.call(sqrt, [q2]), b.gep(norms, [i]))
    st2, ft2, zt2 = (b.fadd(t, b.fpext(u, _D)) for t, u in ((st, s2), (ft, f2), (zt, z2)))
    i2 = b.add(i, i1)
    b.cbranch(b.icmp_signed("<", i2, r), outer, done)
    for phi, nxt, first in ((i, i2, i0), (st, st2, d0), (ft, ft2, d0), (zt, zt2, d0)):
        phi.add_incoming(first, begin)
        phi.add_incoming(nxt, row_end)

    b.position_at_end(done)
    add_totals(b, acc, (st2, ft2, zt2), begin, row_end)
    b.ret_void()
    return mod


def _sums_terms(b: ir.IRBuilder, lanes: Lanes, xs: list[ir.Value]) -> list[ir.Value]:
    v = lanes.ext(b, xs[0])
    return [v, b.fmul(v, v)]


def _sums_fn(mod: ir.Module) -> None:
    """void sums(float *x, i64 n, double *acc): acc += (Σx, Σx²), both in fp64 lanes: a
    parameter's mean and variance in one read (its moments need no per-row or
    per-column figure)."""
    sum_kernel(mod, "sums", 1, 2, _sums_terms)


def _all() -> ir.Module:
    mod = _module()
    _sums_fn(mod)
    return mod


_P = ctypes.c_void_p
_ENGINE, _FNS = build_all(
    _all(),
    {
        "rows": [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, _P],
        "sums": [_P, ctypes.c_int64, _P],
    },
)
_ROWS, _SUMS_FN = _FNS["rows"], _FNS["sums"]


def sums(x: torch.Tensor, acc: torch.Tensor) -> None:
    """acc[:2] += (Σx, Σx²) in fp64 of a contiguous fp32 CPU `x`."""
    assert x.is_contiguous() and x.dtype == torch.float32 and acc.dtype == torch.float64
    _SUMS_FN(x.data_ptr(), x.numel(), acc.data_ptr())


def rows(
    x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, norms: torch.Tensor, acc: torch.Tensor
) -> None:
    """The loop on a C-contiguous (r, c) fp32 CPU `x`: `norms` (r,) and `hi`/`lo` (c,) fp32
    written, `acc` (3,) fp64 added to (see `_module`)."""
    assert x.is_contiguous() and x.dtype == torch.float32 and x.dim() == 2
    _ROWS(
        x.data_ptr(), x.shape[0], x.shape[1], hi.data_ptr(), lo.data_ptr(), norms.data_ptr(),
        acc.data_ptr(),
    )  # fmt: skip
