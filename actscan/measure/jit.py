"""LLVM IR → machine code for this CPU, with llvmlite (the `fast` extra): what the compiled
loops that must load fast are built with (`reduce_kernels`, `steps.moved_kernel`).

A loop built here takes ~0.03 s: parse, the optimisation pipeline at -O3 with the loop and
SLP vectorisers for the host's own features (AVX-512 where it has them), MCJIT. numba
compiles the same loops, but its import and first call cost ~0.5 s a process. Imported
only by the kernel modules, themselves loaded on first use (`compiled.lazy`); any failure
to build is raised as ImportError, so the caller falls back to its torch passes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llvmlite.binding as llvm
import llvmlite.ir as ir

__all__ = [
    "F32",
    "F64",
    "I64",
    "SUMS",
    "Lanes",
    "add_totals",
    "build",
    "build_all",
    "new_module",
    "sum_kernel",
]

F32, F64, I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
SUMS = ("reassoc", "nsz")  # on a sum's adds only: they may be reordered into lanes


def new_module(name: str) -> ir.Module:
    """An empty module for this process's target."""
    mod = ir.Module(name=name)
    mod.triple = llvm.get_process_triple()
    return mod


def add_totals(
    b: ir.IRBuilder, out: ir.Value, totals: Sequence[ir.Value], skipped: ir.Block, ran: ir.Block
) -> None:
    """At a loop's exit block: out[k] += totals[k] (fp64), 0 where the loop never ran (the
    branch from `skipped`) and the loop's last value where it did (from `ran`)."""
    got = [b.phi(F64) for _ in totals]  # the phis first, then the stores
    for phi, total in zip(got, totals, strict=True):
        phi.add_incoming(ir.Constant(F64, 0.0), skipped)
        phi.add_incoming(total, ran)
    _add_into(b, out, got)


def _add_into(b: ir.IRBuilder, out: ir.Value, values: Sequence[ir.Value]) -> None:
    """out[k] += values[k] (fp64)."""
    for k, v in enumerate(values):
        at = b.gep(out, [ir.Constant(I64, k)])
        b.store(b.fadd(b.load(at), v), at)


LANES, UNROLL = 8, 4  # fp64 lanes per vector; independent vectors per sum


@dataclass(frozen=True)
class Lanes:
    """What a `sum_kernel` body is written against: one value (the tail loop) or vectors
    of `width` (the main loop): the same instructions build both."""

    f: ir.Type  # float, or <width x float>
    d: ir.Type  # double, or <width x double>
    width: int | None
    fabs_f: ir.Function
    fabs_d: ir.Function

    def const_f(self, v: float) -> ir.Constant:
        return ir.Constant(self.f, [v] * self.width if self.width else v)

    def const_d(self, v: float) -> ir.Constant:
        return ir.Constant(self.d, [v] * self.width if self.width else v)

    def ext(self, b: ir.IRBuilder, v: ir.Value) -> ir.Value:
        return b.fpext(v, self.d)


def _lanes(mod: ir.Module, width: int | None) -> Lanes:
    f = ir.VectorType(F32, width) if width else F32
    d = ir.VectorType(F64, width) if width else F64

    def fabs(t: ir.Type, tag: str) -> ir.Function:
        name = f"llvm.fabs.{tag}"
        got = mod.globals.get(name)
        return got if got is not None else ir.Function(mod, ir.FunctionType(t, [t]), name)

    w = f"v{width}" if width else ""
    return Lanes(f, d, width, fabs(f, f"{w}f32"), fabs(d, f"{w}f64"))


Terms = Callable[[ir.IRBuilder, Lanes, list[ir.Value]], list[ir.Value]]


def sum_kernel(mod: ir.Module, name: str, inputs: int, outputs: int, terms: Terms) -> None:
    """void name(float *x_1 … float *x_k, i64 n, double *out): out[j] += Σ_i t_j for
    j < `outputs`, the fp64 terms `terms(b, lanes, [x_1[i] … x_k[i]])` returns, i < n.

    Why not a scalar loop for the vectoriser: its single chain of fp64 adds per sum
    waited on the add's latency (Σx, Σx² over GPT-2's 124M weights: 0.064 s, where a
    read of them takes 0.04 s). Here each sum has `UNROLL` independent vectors of
    `LANES`, then a scalar tail; the body is written once for both."""
    fp = F32.as_pointer()
    fn = ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [*([fp] * inputs), I64, F64.as_pointer()]), name
    )
    *xs, n, out = fn.args
    for a in (*xs, out):
        a.add_attribute("noalias")
    vec, one = _lanes(mod, LANES), _lanes(mod, None)
    i0, i1 = ir.Constant(I64, 0), ir.Constant(I64, 1)
    step = ir.Constant(I64, LANES * UNROLL)
    entry, vloop, vdone, tail, done = (
        fn.append_basic_block(b) for b in ("entry", "vloop", "vdone", "tail", "done")
    )
    b = ir.IRBuilder(entry)
    nv = b.mul(b.sdiv(n, step), step)  # the values the vector loop takes
    b.cbranch(b.icmp_signed(">", nv, i0), vloop, vdone)

    b.position_at_end(vloop)
    i = b.phi(I64)
    accs = [[b.phi(vec.d) for _ in range(outputs)] for _ in range(UNROLL)]
    nexts = []
    for u, acc in enumerate(accs):
        at = b.add(i, ir.Constant(I64, u * LANES))
        vals = [b.load(b.bitcast(b.gep(x, [at]), vec.f.as_pointer()), align=4) for x in xs]
        nexts.append([b.fadd(a, t) for a, t in zip(acc, terms(b, vec, vals), strict=True)])
    i2 = b.add(i, step)
    b.cbranch(b.icmp_signed("<", i2, nv), vloop, vdone)
    i.add_incoming(i0, entry)
    i.add_incoming(i2, vloop)
    for acc, nxt in zip(accs, nexts, strict=True):
        for phi, v in zip(acc, nxt, strict=True):
            phi.add_incoming(vec.const_d(0.0), entry)
            phi.add_incoming(v, vloop)

    b.position_at_end(vdone)  # the vectors' lanes into one scalar per sum (the phis first)
    ends = []
    for nxt in nexts:
        row = []
        for v in nxt:
            phi = b.phi(vec.d)
            phi.add_incoming(vec.const_d(0.0), entry)
            phi.add_incoming(v, vloop)
            row.append(phi)
        ends.append(row)
    totals = []
    for j in range(outputs):
        v = ends[0][j]
        for row in ends[1:]:
            v = b.fadd(v, row[j])
        total = b.extract_element(v, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, LANES):
            total = b.fadd(total, b.extract_element(v, ir.Constant(ir.IntType(32), lane)))
        totals.append(total)
    b.cbranch(b.icmp_signed("<", nv, n), tail, done)

    b.position_at_end(tail)  # the last < LANES · UNROLL values, one by one
    j_ = b.phi(I64)
    run = [b.phi(F64) for _ in range(outputs)]
    vals = [b.load(b.gep(x, [j_])) for x in xs]
    ran = [b.fadd(a, t) for a, t in zip(run, terms(b, one, vals), strict=True)]
    j2 = b.add(j_, i1)
    b.cbranch(b.icmp_signed("<", j2, n), tail, done)
    j_.add_incoming(nv, vdone)
    j_.add_incoming(j2, tail)
    for phi, start, nxt in zip(run, totals, ran, strict=True):
        phi.add_incoming(start, vdone)
        phi.add_incoming(nxt, tail)

    b.position_at_end(done)
    finals = []
    for total, last in zip(totals, ran, strict=True):
        phi = b.phi(F64)
        phi.add_incoming(total, vdone)
        phi.add_incoming(last, tail)
        finals.append(phi)
    _add_into(b, out, finals)
    b.ret_void()


def build(mod: ir.Module, name: str, argtypes: list[Any]) -> tuple[Any, Any]:
    """(the engine, which must stay alive while the function is used; `name` as a ctypes
    function of `argtypes` returning void: a ctypes call releases the GIL)."""
    engine, fns = build_all(mod, {name: argtypes})
    return engine, fns[name]


def build_all(mod: ir.Module, fns: dict[str, list[Any]]) -> tuple[Any, dict[str, Any]]:
    """`build` for several functions of one module: one parse, one optimisation, one
    MCJIT for all of them."""
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        tm = llvm.Target.from_default_triple().create_target_machine(
            opt=3, cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten()
        )
        code = llvm.parse_assembly(str(mod))
        code.verify()
        tuning = llvm.create_pipeline_tuning_options(speed_level=3)
        tuning.loop_vectorization = tuning.slp_vectorization = True
        passes = llvm.create_pass_builder(tm, tuning)
        passes.getModulePassManager().run(code, passes)
        engine = llvm.create_mcjit_compiler(code, tm)
        engine.finalize_object()
        got = {
            name: ctypes.CFUNCTYPE(None, *argtypes)(engine.get_function_address(name))
            for name, argtypes in fns.items()
        }
    except Exception as err:  # an llvmlite without this API, a target LLVM lacks
        raise ImportError(f"the compiled loops {list(fns)} could not be built: {err}") from err
    return engine, got
