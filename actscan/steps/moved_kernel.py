"""`fused_moved`'s loop, written as LLVM IR and built for this CPU when first used
(`measure.jit`, ~0.03 s; numba's import and first call cost ~0.5 s a process, which a
`--steps` run would pay for 3 % of a step). Imported on first use only (`compiled.lazy`).
"""

from __future__ import annotations

import ctypes

import llvmlite.ir as ir
import torch

from actscan.measure.jit import F32, F64, I64, SUMS, add_totals, build, new_module

__all__ = ["moved"]


def _module() -> ir.Module:
    """void moved(float *x, float *y, float *z, i64 n, double *out): with d = x − y and
    r = y − z in fp32 (the torch passes' own differences), out += (Σx², Σd², Σr², the
    count of non-finite d), the squares summed in fp64 lanes."""
    mod = new_module("actscan_moved")
    fp = F32.as_pointer()
    fn = ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [fp, fp, fp, I64, F64.as_pointer()]), "moved"
    )
    x, y, z, n, out = fn.args
    for a in (x, y, z, out):
        a.add_attribute("noalias")
    fabs = mod.declare_intrinsic("llvm.fabs", [F32])
    inf = ir.Constant(F32, float("inf"))
    d0, d1 = ir.Constant(F64, 0.0), ir.Constant(F64, 1.0)
    i0, i1 = ir.Constant(I64, 0), ir.Constant(I64, 1)
    entry, loop, done = (fn.append_basic_block(b) for b in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", n, i0), loop, done)

    b.position_at_end(loop)
    i, w2, d2, r2, bad = b.phi(I64), b.phi(F64), b.phi(F64), b.phi(F64), b.phi(F64)
    xv, yv, zv = (b.load(b.gep(p, [i])) for p in (x, y, z))
    d, r = b.fsub(xv, yv), b.fsub(yv, zv)
    xd, dd, rd = (b.fpext(v, F64) for v in (xv, d, r))
    w2n = b.fadd(w2, b.fmul(xd, xd), flags=SUMS)
    d2n = b.fadd(d2, b.fmul(dd, dd), flags=SUMS)
    r2n = b.fadd(r2, b.fmul(rd, rd), flags=SUMS)
    finite = b.fcmp_ordered("<", b.call(fabs, [d]), inf)
    badn = b.fadd(bad, b.select(finite, d0, d1), flags=SUMS)
    nxt = b.add(i, i1)
    b.cbranch(b.icmp_signed("<", nxt, n), loop, done)
    for phi, new, start in (
        (i, nxt, i0),
        (w2, w2n, d0),
        (d2, d2n, d0),
        (r2, r2n, d0),
        (bad, badn, d0),
    ):
        phi.add_incoming(start, entry)
        phi.add_incoming(new, loop)

    b.position_at_end(done)
    add_totals(b, out, (w2n, d2n, r2n, badn), entry, loop)
    b.ret_void()
    return mod


_P = ctypes.c_void_p
_ENGINE, _MOVED = build(_module(), "moved", [_P, _P, _P, ctypes.c_int64, _P])


def moved(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> None:
    """The loop on three contiguous fp32 CPU tensors of one size; `out` (4,) fp64."""
    assert x.numel() == y.numel() == z.numel() and out.dtype == torch.float64
    _MOVED(x.data_ptr(), y.data_ptr(), z.data_ptr(), x.numel(), out.data_ptr())
