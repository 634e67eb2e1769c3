"""The figures of `casts.operand_figures`, on CPU, in one read of the operand per format.

Torch's elementwise kernels cost a pass over memory each, and a cast's figures take about
fifteen of them per format (scale, round, saturate, count twice, descale, error, block
extrema): on CPU that made `--formats` cost 1.4–2.3× a plain forward+backward, depending
on how fast the machine's caches are next to its matrix units. A compiled loop reads each
value once per format and does all of it in registers. numba compiles it (LLVM, no C
compiler on the user's machine, cached on disk after the first run); it is an optional
dependency (`pip install actscan[fast]`): without it, `casts` does the same in torch.

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

import torch

try:  # optional: the torch path in `casts` stands in without it
    import numba
    import numpy as np
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]

__all__ = ["amax", "available", "borrowed", "operand_figures", "supports"]


class Recipe(Protocol):
    """What the kernels read of a `casts.Recipe` (typed here, not imported: `casts`
    imports this module)."""

    @property
    def block(self) -> int: ...
    @property
    def scale(self) -> str: ...
    def element(self, operand: str) -> Any: ...


# values per group: its block scales are computed, then its casts run, while it is in
# the second-level cache (a multiple of 32: groups are whole blocks)
_GROUP = 1 << 14


def available() -> bool:
    """Whether the compiled casts can run here (numba importable)."""
    return numba is not None


if numba is not None:
    _FM = {"reassoc", "nsz"}  # the sums only: nothing else reassociates
    _E4M3_MAX = np.float32(448.0)
    _E4M3_FLOOR = np.float32(2.0**-9 * 2.0**3)
    _E4M3_STEP = np.float32(2.0**-3)
    _S_LO, _S_HI = np.float32(2.0**-127), np.float32(2.0**127)
    _ZERO, _ONE = np.float32(0.0), np.float32(1.0)
    _BIG = np.float32(math.inf)
    _NONE = np.int32(0x7FFFFFFF).view(np.float32)  # `_prev` of 0: NaN's pattern, compared as bits

    def _codegen(op: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, vals: Any) -> Any:
            i32 = ir.IntType(32)
            bits = [builder.bitcast(v, i32) for v in vals]
            return builder.bitcast(op(builder, i32, *bits), ir.FloatType())

        return codegen

    def _on_bits(op: Any) -> Any:
        """An intrinsic f32 → f32 that does `op` on the int32 bits: numba's own integer
        arithmetic widens to int64, which halves every vector."""

        def make(typingctx: Any, a: Any) -> Any:
            return types.float32(types.float32), _codegen(op)

        return intrinsic(make)

    def _on_bits2(op: Any) -> Any:
        """`_on_bits` of two operands."""

        def make(typingctx: Any, a: Any, m: Any) -> Any:
            return types.float32(types.float32, types.float32), _codegen(op)

        return intrinsic(make)

    # 2^floor(log2 a) (a ≥ 0; 0 below the normals, inf at inf and NaN)
    _binade = _on_bits(lambda b, i32, a: b.and_(a, ir.Constant(i32, 0x7F800000)))
    # 1 / p for a normal power of two p, exact: its exponent mirrored about 127
    _inverse = _on_bits(lambda b, i32, a: b.sub(ir.Constant(i32, 0x7F000000), a))
    # max in |x|'s int32 order (as `casts` takes it: +NaN above inf)
    _top = _on_bits2(lambda b, i32, a, m: b.select(b.icmp_signed(">", a, m), a, m))
    _bottom = _on_bits2(lambda b, i32, a, m: b.select(b.icmp_signed("<", a, m), a, m))
    # |x|'s bits less one, its sign bit cleared: 0 → the largest pattern, so that the
    # smallest of these (`_bottom`) plus one (`_next`) is the smallest nonzero |x|
    _prev = _on_bits(
        lambda b, i32, a: b.and_(b.sub(a, ir.Constant(i32, 1)), ir.Constant(i32, 0x7FFFFFFF))
    )
    _next = _on_bits(lambda b, i32, a: b.add(a, ir.Constant(i32, 1)))
    _SQRT2 = math.sqrt(2.0)

    def _roundeven_of(typingctx: Any, x: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            fn = builder.module.declare_intrinsic("llvm.roundeven", [ir.FloatType()])
            return builder.call(fn, [args[0]])

        return types.float32(types.float32), codegen

    _roundeven: Any = intrinsic(_roundeven_of)

    @numba.njit(inline="always")
    def _round(a: Any, mx: Any, floor: Any, step: Any) -> Any:
        """a ≥ 0 (fp32) to nearest even on the grid whose spacing in a's binade is
        binade · step (2^−m), never below floor · step, saturated at mx (NaN stays)."""
        if a > mx:
            a = mx
        sp = max(_binade(a), floor) * step
        return _roundeven(a * _inverse(sp)) * sp

    _OPTS: dict[str, Any] = dict(
        cache=True, nogil=True, boundscheck=False, fastmath=_FM, error_model="numpy"
    )

    @numba.njit(**_OPTS)
    def _amax(xf: Any) -> Any:
        """The amax of flat |x| in `casts`' int32 order (+NaN above inf)."""
        top = _ZERO
        for i in range(xf.shape[0]):
            top = _top(abs(xf[i]), top)
        return top

    def _top64_of(typingctx: Any, a: Any, m: Any) -> Any:
        """max of two fp64 ≥ 0 on their int64 bits: an integer max vectorises, a float
        one (NaN-aware) does not."""

        def codegen(context: Any, builder: Any, sig: Any, vals: Any) -> Any:
            i64 = ir.IntType(64)
            x, y = (builder.bitcast(v, i64) for v in vals)
            return builder.bitcast(
                builder.select(builder.icmp_signed(">", x, y), x, y), ir.DoubleType()
            )

        return types.float64(types.float64, types.float64), codegen

    _top64: Any = intrinsic(_top64_of)

    def _split64_of(typingctx: Any, r: Any) -> Any:
        """A normal fp64 r as (its mantissa in [1, 2), its unbiased exponent as fp64)."""

        def codegen(context: Any, builder: Any, sig: Any, vals: Any) -> Any:
            i64, f64 = ir.IntType(64), ir.DoubleType()
            bits = builder.bitcast(vals[0], i64)
            m = builder.or_(
                builder.and_(bits, ir.Constant(i64, (1 << 52) - 1)), ir.Constant(i64, 1023 << 52)
            )
            e = builder.sub(builder.lshr(bits, ir.Constant(i64, 52)), ir.Constant(i64, 1023))
            out = cgutils.make_anonymous_struct(
                builder, [builder.bitcast(m, f64), builder.sitofp(e, f64)]
            )
            return out

        return types.UniTuple(types.float64, 2)(types.float64), codegen

    _split64: Any = intrinsic(_split64_of)

    @numba.njit(**_OPTS)
    def _ranges(top: Any, low: Any, n: Any, acc: Any) -> None:
        """Add n (≤ 1024) blocks' ranges log2(amax / smallest nonzero) to acc[3:6] (sum,
        live blocks, max). The ratio in fp64 (it can pass fp32's 2^128); the sum of logs
        as the log of the product, its exponents added and its mantissas, in [√½, √2),
        multiplied (below 2^512 over 1024 blocks): one log per group, not per block.
        `low`: the smallest nonzero's `_prev` pattern. A NaN amax is a dead block, an inf
        one an infinite range, as in casts."""
        live = _ZERO
        infs = _ZERO
        expo = 0.0
        prod = 1.0
        widest = 1.0
        for b in range(n):
            t = top[b]
            ok = t > 0 and t < _BIG
            r = np.float64(t) / np.float64(_next(low[b])) if ok else 1.0
            live += _ONE if t > 0 else _ZERO
            infs += _ONE if t > 0 and not ok else _ZERO
            widest = _top64(r, widest)
            m, e = _split64(r)
            big = m > _SQRT2
            prod *= m * 0.5 if big else m
            expo += e + 1.0 if big else e
        acc[3] += math.inf if infs > 0 else expo + math.log2(prod)
        acc[4] += live
        acc[5] = max(acc[5], math.inf if infs > 0 else math.log2(widest))

    def _blocks_of(size: int) -> Any:
        """The casts of n blocks of `size` values (a constant of the code: the inner
        loop's trip count), as (saturated, nonzero of Q, err) under their factors and
        scales back, summed in lanes across the blocks (ls, lq, le: no reduction per
        block)."""

        @numba.njit(inline="always")
        def blocks(seg: Any, factor: Any, back: Any, n: Any, p: Any, ls: Any, lq: Any,
                   le: Any) -> Any:  # fmt: skip
            mx, half, floor, step = p[2], p[3], p[4], p[5]
            ls[:] = 0
            lq[:] = 0
            le[:] = 0
            for b in range(n):
                f, k = factor[b], back[b]
                for j in range(size):
                    a = abs(seg[b * size + j])
                    y = a * f
                    ls[j] += _ZERO if y <= mx else _ONE
                    lq[j] += _ZERO if y <= half else _ONE
                    d = a - _round(y, mx, floor, step) * k
                    le[j] += d * d
            return ls.sum(), lq.sum(), le.sum()

        return blocks

    _blocks16, _blocks32 = _blocks_of(16), _blocks_of(32)

    @numba.njit(**_OPTS)
    def _group(seg: Any, p: Any, acc: Any, lo: Any, w: Any) -> None:
        """One run of whole 32-blocks (`seg`, flat) cast in every kind p[k, 0] > 0
        enables (0: per-tensor, 1: MX 32-blocks with E8M0 scales, 2: 16-blocks with E4M3
        scales under the tensor scale); p[k, 1:6]: the tensor scale, the max, half the
        smallest subnormal, the spacing's floor binade, 2^−m; p[1, 6]: 2^−emax.
        acc[k] += (nonzero of Q, saturated, err, range sum, live blocks, range max);
        acc[3, 0:2] += the nonzero values, ‖x‖²; lo[0]: the smallest nonzero's `_prev` pattern
        (kind 0's range; kept in fp32, as fp64 would not keep the pattern). w: scratch
        rows (top16, low16, top32, low32, f16, b16, f32, b32, and two rows of lanes)."""
        n16 = seg.shape[0] // 16
        n32 = n16 // 2
        top16, low16, top32, low32 = w[0], w[1], w[2], w[3]
        f16, b16, f32, b32 = w[4], w[5], w[6], w[7]
        lanes = np.zeros(32, np.float32)  # lanes of the error sums
        on_t, on_m, on_n = p[0, 0] > 0, p[1, 0] > 0, p[2, 0] > 0
        for b in range(n16 if on_m or on_n else 0):  # the 16-block extrema, on the bits
            m = _ZERO
            s = _NONE
            for j in range(16):
                a = abs(seg[b * 16 + j])
                m = _top(a, m)
                s = _bottom(_prev(a), s)
            top16[b] = m
            low16[b] = s
        if on_n:
            ts, mx = p[2, 1], p[2, 2]
            for b in range(n16):  # E4M3 block scales under the tensor scale
                dec = _round(top16[b] / mx * ts, _E4M3_MAX, _E4M3_FLOOR, _E4M3_STEP)
                f16[b] = ts / dec if dec > 0 else _ZERO
                b16[b] = dec / ts
            _ranges(top16, low16, n16, acc[2])
        if on_m:
            for c in range(n32):  # folded from the 16-blocks
                top32[c] = _top(top16[2 * c], top16[2 * c + 1])
                low32[c] = _bottom(low16[2 * c], low16[2 * c + 1])
            emax_scale = p[1, 6]
            for c in range(n32):  # 2^(floor(log2 amax) − emax), clamped to E8M0's range
                sc = min(max(_binade(top32[c]) * emax_scale, _S_LO), _S_HI)
                b32[c] = sc
                f32[c] = _ONE / sc  # exact: a power of two
            _ranges(top32, low32, n32, acc[1])
        # each kind's casts in a loop of its own (a flag tested inside one loop keeps it
        # from vectorising); the group is in cache for the second and third
        nz = _ZERO
        sq = _ZERO
        for i in range(seg.shape[0]):
            nz += _ONE if seg[i] != 0 else _ZERO
            sq += seg[i] * seg[i]
        q0, s0, q1, s1, q2, s2 = _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO
        e0, e1, e2 = _ZERO, _ZERO, _ZERO
        low = _NONE
        if on_t:
            ts, mx, half, floor, step = p[0, 1], p[0, 2], p[0, 3], p[0, 4], p[0, 5]
            for i in range(seg.shape[0]):
                a = abs(seg[i])
                low = _bottom(_prev(a), low)
                y = a * ts
                s0 += _ZERO if y <= mx else _ONE
                q0 += _ZERO if y <= half else _ONE
                d = _round(y, mx, floor, step) / ts - a
                e0 += d * d
        if on_m:
            s1, q1, e1 = _blocks32(seg, f32, b32, n32, p[1], w[8, :32], w[9, :32], lanes)
        if on_n:
            s2, q2, e2 = _blocks16(seg, f16, b16, n16, p[2], w[8, :16], w[9, :16], lanes[:16])
        acc[3, 0] += nz
        acc[3, 1] += sq
        acc[0, 0] += q0
        acc[0, 1] += s0
        acc[0, 2] += e0
        lo[0] = _bottom(low, lo[0])
        acc[1, 0] += q1
        acc[1, 1] += s1
        acc[1, 2] += e1
        acc[2, 0] += q2
        acc[2, 1] += s2
        acc[2, 2] += e2

    @numba.njit(**_OPTS)
    def _kernel(x: Any, p: Any, acc: Any, lo: Any) -> None:
        """Every group of x (rows, K); where K is not a whole number of 32-blocks, each
        row's last block is cast from a zero-padded copy (zeros change no figure)."""
        rows, k = x.shape
        w = np.empty((10, max(_GROUP // 16, 32)), np.float32)
        full = k // 32 * 32
        if full == k:
            flat = x.reshape(-1)
            for g in range(0, flat.shape[0], _GROUP):
                _group(flat[g : g + _GROUP], p, acc, lo, w)
        else:
            tail = np.zeros(32, np.float32)
            for r in range(rows):
                row = x[r]
                for g in range(0, full, _GROUP):
                    _group(row[g : min(g + _GROUP, full)], p, acc, lo, w)
                tail[: k - full] = row[full:]
                _group(tail, p, acc, lo, w)


_KINDS = {(0, "tensor"): 0, (32, "e8m0"): 1, (16, "e4m3"): 2}


def supports(x: torch.Tensor, recipes: Sequence[Recipe]) -> bool:
    """Whether these kernels cast `x` with `recipes`: numba is here, x is a 2-D CPU
    tensor, and the recipes are the three kinds the kernel has, each at most once."""
    kinds = [_KINDS.get((r.block, r.scale)) for r in recipes]
    return (
        numba is not None
        and x.device.type == "cpu"
        and x.dim() == 2
        and None not in kinds
        and len(set(kinds)) == len(kinds)
    )


def amax(x: torch.Tensor) -> torch.Tensor:
    """|x|'s amax of a CPU `x` (NaN if it holds one), in one read: the per-tensor
    scales' reference, before the casts."""
    got = _run(lambda part: _amax(part.reshape(-1)), _numpy(x))
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
    return borrowed(x.detach().float().contiguous())


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
        lo = np.full(1, _NONE, np.float32)
        _kernel(piece, p, acc, lo)
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
            low = _after(lo) if _pattern(lo) != 0x7FFFFFFF else math.inf
            rsum = rmax = math.log2(top) - math.log2(low) if live else 0.0
        out.append([values, nonzero, nonzero - nzq, sat, err, sq, rsum, live, rmax])
    return torch.tensor(out, dtype=torch.float64)


def _after(v: Any) -> float:
    """The float whose pattern follows v's (`_next` on the host)."""
    return float((np.float32(v).view(np.int32) + np.int32(1)).view(np.float32))
