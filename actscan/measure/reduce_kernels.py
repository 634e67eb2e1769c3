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
from actscan.measure.jit import add_totals, build_all, new_module

__all__ = ["rows", "sums"]


def _module() -> ir.Module:
    """void rows(float *x, i64 r, i64 c, float *hi, float *lo, float *norms, double *acc):
    for each row i of x (r × c, row-major): norms[i] = √Σx², hi[j]/lo[j] ← the running
    max/min of column j (a NaN, once seen, stays), acc += (Σx, finite values, zeros),
    each row's sums in fp32, rows added in fp64."""
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
    entry, outer, inner, row_end, done = (
        fn.append_basic_block(n) for n in ("entry", "outer", "inner", "row_end", "done")
    )
    b = ir.IRBuilder(entry)
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
    for phi, nxt, start in ((i, i2, i0), (st, st2, d0), (ft, ft2, d0), (zt, zt2, d0)):
        phi.add_incoming(start, entry)
        phi.add_incoming(nxt, row_end)

    b.position_at_end(done)
    add_totals(b, acc, (st2, ft2, zt2), entry, row_end)
    b.ret_void()
    return mod


_LANES, _UNROLL = 8, 4  # fp64 lanes per vector, independent vectors per sum


def _sums_fn(mod: ir.Module) -> None:
    """void sums(float *x, i64 n, double *acc): acc += (Σx, Σx²), both in fp64 lanes: a
    parameter's mean and variance in one read (its moments need no per-row or
    per-column figure). Written with explicit vectors, `_UNROLL` independent ones per sum:
    the loop vectoriser's single chain of fp64 adds waited on the add's latency (0.05–0.06 s
    over GPT-2's 124M weights, where a read of them takes 0.04 s)."""
    fn = ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [_F.as_pointer(), _I64, _D.as_pointer()]), "sums"
    )
    x, n, acc = fn.args
    for a in (x, acc):
        a.add_attribute("noalias")
    vf, vd = ir.VectorType(_F, _LANES), ir.VectorType(_D, _LANES)
    zero, i0, i1 = ir.Constant(vd, [0.0] * _LANES), ir.Constant(_I64, 0), ir.Constant(_I64, 1)
    step = ir.Constant(_I64, _LANES * _UNROLL)
    entry, vloop, vdone, tail, done = (
        fn.append_basic_block(b) for b in ("entry", "vloop", "vdone", "tail", "done")
    )
    b = ir.IRBuilder(entry)
    nv = b.mul(b.sdiv(n, step), step)  # the values the vector loop takes
    b.cbranch(b.icmp_signed(">", nv, i0), vloop, vdone)

    b.position_at_end(vloop)
    i = b.phi(_I64)
    s, q = [b.phi(vd) for _ in range(_UNROLL)], [b.phi(vd) for _ in range(_UNROLL)]
    s2, q2 = [], []
    for u in range(_UNROLL):
        at = b.bitcast(b.gep(x, [b.add(i, ir.Constant(_I64, u * _LANES))]), vf.as_pointer())
        v = b.fpext(b.load(at, align=4), vd)
        s2.append(b.fadd(s[u], v))
        q2.append(b.fadd(q[u], b.fmul(v, v)))
    i2 = b.add(i, step)
    b.cbranch(b.icmp_signed("<", i2, nv), vloop, vdone)
    i.add_incoming(i0, entry)
    i.add_incoming(i2, vloop)
    for phi, nxt in zip((*s, *q), (*s2, *q2), strict=True):
        phi.add_incoming(zero, entry)
        phi.add_incoming(nxt, vloop)

    b.position_at_end(vdone)  # the vectors' lanes into two scalars (the phis first)
    ends = []
    for nxt in (*s2, *q2):
        phi = b.phi(vd)
        phi.add_incoming(zero, entry)
        phi.add_incoming(nxt, vloop)
        ends.append(phi)
    totals = []
    for got in (ends[:_UNROLL], ends[_UNROLL:]):
        vec = got[0]
        for phi in got[1:]:
            vec = b.fadd(vec, phi)
        total = b.extract_element(vec, ir.Constant(ir.IntType(32), 0))
        for k in range(1, _LANES):
            total = b.fadd(total, b.extract_element(vec, ir.Constant(ir.IntType(32), k)))
        totals.append(total)
    b.cbranch(b.icmp_signed("<", nv, n), tail, done)

    b.position_at_end(tail)  # the last < _LANES · _UNROLL values, one by one
    j, ts, tq = b.phi(_I64), b.phi(_D), b.phi(_D)
    v = b.fpext(b.load(b.gep(x, [j])), _D)
    ts2, tq2 = b.fadd(ts, v), b.fadd(tq, b.fmul(v, v))
    j2 = b.add(j, i1)
    b.cbranch(b.icmp_signed("<", j2, n), tail, done)
    for phi, start, nxt in ((j, nv, j2), (ts, totals[0], ts2), (tq, totals[1], tq2)):
        phi.add_incoming(start, vdone)
        phi.add_incoming(nxt, tail)

    b.position_at_end(done)
    finals = []
    for total, tail_total in zip(totals, (ts2, tq2), strict=True):
        phi = b.phi(_D)
        phi.add_incoming(total, vdone)
        phi.add_incoming(tail_total, tail)
        finals.append(phi)
    for k, phi in enumerate(finals):
        at = b.gep(acc, [ir.Constant(_I64, k)])
        b.store(b.fadd(b.load(at), phi), at)
    b.ret_void()


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
    """The loop on a C-contiguous (r, c) fp32 CPU `x`: `norms` (r,) fp32 written, `hi`/`lo`
    (c,) fp32 and `acc` (3,) fp64 updated in place (see `_module`)."""
    assert x.is_contiguous() and x.dtype == torch.float32 and x.dim() == 2
    _ROWS(
        x.data_ptr(), x.shape[0], x.shape[1], hi.data_ptr(), lo.data_ptr(), norms.data_ptr(),
        acc.data_ptr(),
    )  # fmt: skip
