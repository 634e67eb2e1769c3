"""The compiled loops of `fused_casts` (numba): imported on first use only, so that a scan
without `--formats`, or a machine without numba, never pays numba's import (0.25 s).

See `fused_casts` for what they compute and why they agree with `casts`.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# values per group: its block scales are computed, then its casts run, while it is in
# the second-level cache (a multiple of 32: groups are whole blocks)
_GROUP = 1 << 14

_FM = {"reassoc", "nsz"}  # the sums only: nothing else reassociates
_E4M3_MAX = np.float32(448.0)
_E4M3_FLOOR = np.float32(2.0**-9 * 2.0**3)
_E4M3_STEP = np.float32(2.0**-3)
_S_LO, _S_HI = np.float32(2.0**-127), np.float32(2.0**127)
_ZERO, _ONE = np.float32(0.0), np.float32(1.0)
_BIG = np.float32(math.inf)
NONE = np.int32(0x7FFFFFFF).view(np.float32)  # `_prev` of 0: NaN's pattern, compared as bits


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
def amax(xf: Any) -> Any:
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
        s = NONE
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
    low = NONE
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
def kernel(x: Any, p: Any, acc: Any, lo: Any) -> None:
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
