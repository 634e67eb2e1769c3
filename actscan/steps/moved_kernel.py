"""`fused_moved`'s loops (the update figures; the probe's change sums), written as LLVM
IR and built for this CPU when first used (`measure.jit`, one module, ~0.03 s; numba's
import and first call cost ~0.5 s a process, which a `--steps` run would pay for 3 % of
a step). Imported on first use only (`compiled.lazy`).
"""

from __future__ import annotations

import ctypes

import llvmlite.ir as ir
import torch

from actscan.measure.jit import F32, F64, I64, SUMS, add_totals, build_all, new_module

__all__ = ["change", "moved"]


def _moved_fn(mod: ir.Module) -> None:
    """void moved(float *x, float *y, float *z, i64 n, double *out): with d = x − y and
    r = y − z in fp32 (the torch passes' own differences), out += (Σx², Σd², Σr², the
    count of non-finite d), the squares summed in fp64 lanes."""
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


def _change_fn(mod: ir.Module) -> None:
    """void change(float *x, float *x0, i64 n, double *out): with d = x − x0 in fp32,
    out += (Σd², Σx², Σ|x|, Σ|d|), summed in fp64 lanes: a probe point's sums in one read."""
    fp = F32.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [fp, fp, I64, F64.as_pointer()]), "change")
    x, x0, n, out = fn.args
    for a in (x, x0, out):
        a.add_attribute("noalias")
    fabs = mod.declare_intrinsic("llvm.fabs", [F64])
    d0 = ir.Constant(F64, 0.0)
    i0, i1 = ir.Constant(I64, 0), ir.Constant(I64, 1)
    entry, loop, done = (fn.append_basic_block(b) for b in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", n, i0), loop, done)

    b.position_at_end(loop)
    i, d2, x2, xa, da = b.phi(I64), b.phi(F64), b.phi(F64), b.phi(F64), b.phi(F64)
    xv, x0v = (b.load(b.gep(p, [i])) for p in (x, x0))
    xd, dd = b.fpext(xv, F64), b.fpext(b.fsub(xv, x0v), F64)
    d2n = b.fadd(d2, b.fmul(dd, dd), flags=SUMS)
    x2n = b.fadd(x2, b.fmul(xd, xd), flags=SUMS)
    xan = b.fadd(xa, b.call(fabs, [xd]), flags=SUMS)
    dan = b.fadd(da, b.call(fabs, [dd]), flags=SUMS)
    nxt = b.add(i, i1)
    b.cbranch(b.icmp_signed("<", nxt, n), loop, done)
    for phi, new, start in (
        (i, nxt, i0),
        (d2, d2n, d0),
        (x2, x2n, d0),
        (xa, xan, d0),
        (da, dan, d0),
    ):
        phi.add_incoming(start, entry)
        phi.add_incoming(new, loop)

    b.position_at_end(done)
    add_totals(b, out, (d2n, x2n, xan, dan), entry, loop)
    b.ret_void()


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
