"""`fused_reduce`'s loop, written as LLVM IR and compiled for this CPU when first used.

numba would compile the same loop, but its import and first call cost ~0.5 s per
process, more than the loop saves on a one-shot scan of a 124M model. llvmlite (the LLVM
binding numba itself is built on, part of the `fast` extra) builds and optimises this
one function in ~0.07 s: the loop vectoriser turns the row's sums into fp32 lanes (the
`reassoc` flag on those adds alone) and the max/min into vector selects. Imported on first
use only (`compiled.lazy`); any failure to build raises ImportError, and the recorder then
takes its torch passes.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llvmlite.binding as llvm
import llvmlite.ir as ir
import torch

__all__ = ["rows"]

_F, _D, _I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
_SUMS = ("reassoc", "nsz")  # only the sums are reordered (into lanes)


def _module() -> ir.Module:
    """void rows(float *x, i64 r, i64 c, float *hi, float *lo, float *norms, double *acc):
    for each row i of x (r × c, row-major): norms[i] = √Σx², hi[j]/lo[j] ← the running
    max/min of column j (a NaN, once seen, stays), acc += (Σx, finite values, zeros),
    each row's sums in fp32, rows added in fp64."""
    mod = ir.Module(name="actscan_reduce")
    mod.triple = llvm.get_process_triple()
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
    totals = [b.phi(_D) for _ in range(3)]  # the phis first, then the stores
    for got, total in zip(totals, (st2, ft2, zt2), strict=True):
        got.add_incoming(d0, entry)
        got.add_incoming(total, row_end)
    for k, got in enumerate(totals):
        at = b.gep(acc, [ir.Constant(_I64, k)])
        b.store(b.fadd(b.load(at), got), at)
    b.ret_void()
    return mod


def _compile() -> tuple[Any, Any]:
    """The JIT engine (kept alive with the module) and the function, for this CPU."""
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        target = llvm.Target.from_default_triple()
        tm = target.create_target_machine(
            opt=3, cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten()
        )
        code = llvm.parse_assembly(str(_module()))
        code.verify()
        tuning = llvm.create_pipeline_tuning_options(speed_level=3)
        tuning.loop_vectorization = tuning.slp_vectorization = True
        passes = llvm.create_pass_builder(tm, tuning)
        passes.getModulePassManager().run(code, passes)
        engine = llvm.create_mcjit_compiler(code, tm)
        engine.finalize_object()
        ptr = ctypes.c_void_p
        fn = ctypes.CFUNCTYPE(None, ptr, ctypes.c_int64, ctypes.c_int64, ptr, ptr, ptr, ptr)(
            engine.get_function_address("rows")
        )  # a ctypes call releases the GIL: threads run pieces side by side
    except Exception as err:  # an llvmlite without this API, a target LLVM lacks
        raise ImportError(f"the compiled reduction could not be built: {err}") from err
    return engine, fn


_ENGINE, _ROWS = _compile()


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
