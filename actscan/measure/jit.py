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
from collections.abc import Sequence
from typing import Any

import llvmlite.binding as llvm
import llvmlite.ir as ir

__all__ = ["F32", "F64", "I64", "SUMS", "add_totals", "build", "build_all", "new_module"]

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
    for k, phi in enumerate(got):
        at = b.gep(out, [ir.Constant(I64, k)])
        b.store(b.fadd(b.load(at), phi), at)


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
