"""Simulated low-precision casts, as the training recipes do them, in torch on the device.

Each recipe scales a tensor, rounds it to nearest even onto its element format's grid,
saturates (clamps to the largest finite value, as the recipes' casts do) and scales back:

* `fp8`: per-tensor current scaling, scale = fmt_max / amax (Transformer Engine's
  Float8CurrentScaling); E4M3 for inputs and weights, E5M2 for gradients (its HYBRID format).
* `mxfp8`: OCP Microscaling: 32-value blocks along the contraction dimension, each with a
  shared E8M0 (power-of-two) scale 2^(floor(log2 block amax) − emax_elem), E4M3 elements.
  The spec's floor rule puts the block amax in [2^8, 2^9) for E4M3, above its 448: the top
  values of some blocks saturate, which the figures show.
* `nvfp4`: E2M1 values in 16-value blocks, each with an E4M3 scale, under a per-tensor fp32
  scale (448·6 / tensor amax) that keeps the block scales in E4M3's range.

Every element format rounds the same way, in fp32 arithmetic (`_round_abs_`: the tests
hold it bit for bit to torch's float8 dtypes and to ml_dtypes), on |x|: the rounding is
symmetric, so |Q(x)| = Q(|x|), and every figure is one of |x|. No function syncs the
host: every figure stays a device tensor (`cast_figures`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "FIGURES",
    "FORMATS",
    "FP8",
    "Element",
    "Recipe",
    "Scratch",
    "cast_figures",
    "e8m0_scale",
    "operand_figures",
    "quantize",
    "quantize_all",
    "round_element",
]


@dataclass(frozen=True)
class Element:
    """An element format: its largest finite value, smallest subnormal, largest exponent
    (emax_elem of the MX spec), its mantissa bits and, where torch has it, its dtype."""

    name: str
    max: float
    tiny: float  # the smallest subnormal
    emax: int
    mantissa: int
    dtype: torch.dtype | None = None

    @property
    def range_bits(self) -> float:
        """log2(max / smallest subnormal): the widest spread one scale can hold."""
        return math.log2(self.max / self.tiny)


E4M3 = Element("e4m3", 448.0, 2.0**-9, 8, 3, torch.float8_e4m3fn)
E5M2 = Element("e5m2", 57344.0, 2.0**-16, 15, 2, torch.float8_e5m2)
E2M1 = Element("e2m1", 6.0, 0.5, 2, 1)


@dataclass(frozen=True)
class Recipe:
    """How one format casts a GEMM operand: its element format for the forward operands
    and for gradients, the values per scale block (0: one per-tensor scale) and how the
    block scales are stored ("tensor": fp32 per tensor, "e8m0", "e4m3": under an fp32
    tensor scale)."""

    name: str
    forward: Element
    backward: Element
    block: int
    scale: str

    def element(self, operand: str) -> Element:
        return self.backward if operand == "grad" else self.forward


FP8 = Recipe("fp8", E4M3, E5M2, 0, "tensor")
FORMATS: dict[str, Recipe] = {
    "fp8": FP8,
    "mxfp8": Recipe("mxfp8", E4M3, E4M3, 32, "e8m0"),
    "nvfp4": Recipe("nvfp4", E2M1, E2M1, 16, "e4m3"),
}

# The figures of one cast, in the order of `cast_figures`' vector: sums, then a maximum.
FIGURES = (
    "values", "nonzero", "flushed", "saturated", "err", "sq", "range_sum", "range_blocks",
    "range_max",
)  # fmt: skip
N_SUMS = len(FIGURES) - 1


_EXPONENT = 0x7F800000  # an fp32's exponent bits
_ONE = 0x3F800000  # 1.0's fp32 bits
_EXACT = 1 << 24  # an fp32 sum of 0s and 1s counts exactly below this many values


class Scratch:
    """Buffers the passes over one operand's pieces write into, reused from piece to piece
    and recipe to recipe: on CPU a fresh tensor the size of a piece per pass costs the page
    faults of memory the allocator gave back to the system (most of a pass's time)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def like(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised buffer shaped as `t` (of `dtype`): the front of the same one
        each time, grown when a larger `t` comes (pieces of rows differ by a few values)."""
        return self.flat(name, t.numel(), dtype or t.dtype, t.device).view(t.shape)

    def flat(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer of `n` values: `like`'s, flat."""
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def _scratch(
    scratch: Scratch | None, name: str, t: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`scratch`'s buffer `name` shaped as `t`, or a fresh tensor without scratch."""
    return (
        torch.empty(t.shape, dtype=dtype, device=t.device)
        if scratch is None
        else scratch.like(name, t, dtype)
    )


def _round_abs_(a: torch.Tensor, elem: Element, scratch: Scratch | None = None) -> torch.Tensor:
    """`a` ≥ 0 (fp32, contiguous; overwritten) rounded to nearest even onto `elem`'s grid,
    saturated at its max. The grid's spacing in a's binade is 2^floor(log2 a) · 2^−m (m
    mantissa bits), never below the smallest subnormal; with c = spacing · 2^23 (a power
    of two above a), (a + c) − c rounds a to that spacing in IEEE fp32, to even (an even
    multiple of the spacing is an even mantissa, across binade edges too). c comes from
    a's exponent bits: five cheap passes, where a float8 round trip is two slow ones."""
    a = a.clamp_(max=elem.max)
    bits = _scratch(scratch, "bits", a, torch.int32)
    binade = torch.bitwise_and(a.view(torch.int32), _EXPONENT, out=bits).view(torch.float32)
    c = binade.mul_(2.0 ** (23 - elem.mantissa)).clamp_(min=elem.tiny * 2.0**23)
    return a.add_(c).sub_(c)


def round_element(y: torch.Tensor, elem: Element) -> torch.Tensor:
    """`y` (fp32) rounded to nearest even in `elem`, saturated at ±max, back in fp32."""
    return torch.copysign(_round_abs_(y.float().abs(), elem), y)


def e8m0_scale(amax: torch.Tensor, elem: Element) -> torch.Tensor:
    """The MX block scale 2^(floor(log2 amax) − emax_elem), its exponent clamped to E8M0's
    [−127, 127] (an all-zero block gets 2^−127·…, harmless: its values stay 0)."""
    _, e = torch.frexp(amax)
    return torch.ldexp(torch.ones_like(amax), (e - 1 - elem.emax).clamp(-127, 127))


def _blocks(x: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """(rows, K) → (rows, ceil(K / size), size), padded with `fill` (zeros change no
    figure; |x| padded with inf changes no block minimum)."""
    k = x.shape[-1]
    pad = (-k) % size
    if pad:
        x = F.pad(x, (0, pad), value=fill)
    return x.reshape(x.shape[0], -1, size)


# values per piece an operand is cast in on CPU: its temporaries stay in cache
_CHUNK = 1 << 18


class _Prepared:
    """What every recipe reads of one operand (or one piece of it), computed once: x
    (rows, K) in fp32, |x| (in blocks per size), the whole tensor's amax (the per-tensor
    scales' reference), and per block size the block amax and smallest nonzero |x|; a
    coarser size's extrema are folded from a finer one's (the 32-blocks from the
    16-blocks, the piece's from any), not read again."""

    def __init__(
        self, x: torch.Tensor, amax: torch.Tensor | None = None, scratch: Scratch | None = None
    ) -> None:
        self.x = x.detach().float()
        self.scratch = scratch
        self.ab = torch.abs(self.x, out=_scratch(scratch, "ab", self.x, torch.float32))
        self.amax = self.ab.amax() if amax is None else amax
        self._blocked: dict[int, torch.Tensor] = {}
        self._extrema: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def blocks(self, size: int) -> torch.Tensor:
        """|x| in blocks of `size` (one block: the tensor)."""
        got = self._blocked.get(size)
        if got is None:
            got = self.ab.reshape(1, 1, -1) if size == 0 else _blocks(self.ab, size)
            self._blocked[size] = got
        return got

    def extrema(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block amax, block smallest nonzero |x| (inf: none)), shaped (rows, blocks, 1)."""
        got = self._extrema.get(size)
        if got is not None:
            return got
        k = self.ab.shape[-1]
        finer = [f for f in self._extrema if f and (size == 0 or (size % f == 0 and k % size == 0))]
        if finer:
            bmax, bmin = self._extrema[max(finer)]
            if size == 0:
                got = bmax.amax().reshape(1, 1, 1), bmin.amin().reshape(1, 1, 1)
            else:
                n = size // max(finer)
                rows = bmax.shape[0]
                got = (
                    bmax.reshape(rows, -1, n).amax(-1, keepdim=True),
                    bmin.reshape(rows, -1, n).amin(-1, keepdim=True),
                )
        else:  # on the bits: |x| ≥ 0 orders as int32 does, and int reductions are faster
            bits = self.blocks(size).view(torch.int32)
            bmax = bits.amax(-1, keepdim=True).view(torch.float32)
            low = torch.sub(bits, 1, out=_scratch(self.scratch, "low", bits, torch.int32))
            low = low.bitwise_and_(0x7FFFFFFF).amin(-1, keepdim=True)  # 0 → int max
            none = low == 0x7FFFFFFF
            bmin = torch.where(none, math.inf, (low + 1).view(torch.float32))
            got = bmax, bmin
        self._extrema[size] = got
        return got


def _quantize(
    p: _Prepared, recipe: Recipe, operand: str, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|Q(x)| in blocks, the saturated count, block amax, block min nonzero |x|); the
    per-tensor scales come from the whole tensor's amax."""
    elem = recipe.element(operand)
    ab = p.blocks(recipe.block)
    bmax, bmin = p.extrema(recipe.block)
    if recipe.block == 0:
        fmax = torch.finfo(torch.float32).max
        amax = p.amax
        scale = torch.full_like(amax, elem.max) / amax if scaled else torch.ones_like(amax)
        scale = torch.where(amax > 0, scale.clamp(max=fmax), torch.ones_like(scale))
        y = torch.mul(ab, scale, out=_scratch(p.scratch, "y", ab, torch.float32))
        saturated = _above(y, elem.max, p.scratch)
        q = _round_abs_(y, elem, p.scratch).div_(scale)
    elif recipe.scale == "e8m0":
        s = e8m0_scale(bmax, elem)
        y = torch.div(ab, s, out=_scratch(p.scratch, "y", ab, torch.float32))
        saturated = _above(y, elem.max, p.scratch)
        q = _round_abs_(y, elem, p.scratch).mul_(s)
    else:  # two levels: an E4M3 scale per block under an fp32 scale per tensor
        tmax = p.amax
        enc = torch.full_like(tmax, E4M3.max * elem.max) / tmax  # (a / t: t.__rtruediv__
        enc = torch.where(tmax > 0, enc, torch.ones_like(tmax))  # rounds 1/t first)
        dec = round_element(bmax / elem.max * enc, E4M3)  # the stored block scale
        factor = torch.where(dec > 0, enc / dec, torch.zeros_like(dec))
        y = torch.mul(ab, factor, out=_scratch(p.scratch, "y", ab, torch.float32))
        saturated = _above(y, elem.max, p.scratch)
        q = _round_abs_(y, elem, p.scratch).mul_(dec / enc)
    return q, saturated, bmax, bmin


def _above(y: torch.Tensor, limit: float, scratch: Scratch | None = None) -> torch.Tensor:
    """How many of `y` (≥ 0) exceed `limit`: on the int32 bits (|y| orders as they do),
    y − (limit + 1) is negative, its sign bit set, exactly where y ≤ limit; cheaper on CPU
    than a comparison's bool tensor."""
    (top,) = struct.unpack("<i", struct.pack("<f", limit))
    diff = _scratch(scratch, "bits", y, torch.int32)
    torch.sub(y.view(torch.int32), top + 1, out=diff).bitwise_right_shift_(31)
    if y.numel() >= _EXACT:
        return y.numel() - torch.count_nonzero(diff)
    # −1 (every bit set) where y ≤ limit: masked to 1.0's bits, an fp32 sum counts them
    return y.numel() - diff.bitwise_and_(_ONE).view(torch.float32).sum()


def _nonzero(q: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """How many of `q` (≥ 0, or NaN) are nonzero, as `count_nonzero` counts them. On CPU,
    where count_nonzero branches on every value (2-10× slower where zeros are frequent and
    scattered, as flushed values are), the sum of sign(q), NaN taken to 1 first (sign
    takes it to 0)."""
    if q.device.type != "cpu" or q.numel() >= _EXACT:
        return torch.count_nonzero(q)
    ind = _scratch(scratch, "bits", q, torch.int32).view(torch.float32)
    return torch.nan_to_num(q, nan=1.0, out=ind).sign_().sum()


def _unblocked(q: torch.Tensor, x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Q(x) in blocks back to x's (rows, K) shape (the padding dropped)."""
    return q.reshape(x.shape[0], -1)[:, : x.shape[-1]] if recipe.block else q.reshape(x.shape)


def _signed(q: torch.Tensor, p: _Prepared, recipe: Recipe) -> torch.Tensor:
    return torch.copysign(_unblocked(q, p.x, recipe), p.x)


def quantize(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """Q(x) for `x` of shape (rows, K), K the contraction dimension, in fp32.
    `scaled=False`: a per-tensor recipe casts unscaled (what a plain cast to the element
    dtype does)."""
    p = _Prepared(x)
    return _signed(_quantize(p, recipe, operand, scaled)[0], p, recipe)


def quantize_all(
    x: torch.Tensor, recipes: Sequence[Recipe], operand: str = "input"
) -> list[torch.Tensor]:
    """Q(x) of `x` (rows, K) in each recipe (what `--gemm-error` multiplies)."""
    p = _Prepared(x)
    _warm(p, recipes)
    return [_signed(_quantize(p, r, operand, True)[0], p, r) for r in recipes]


def _warm(p: _Prepared, recipes: Sequence[Recipe]) -> None:
    """The block extrema finest first, so that the coarser ones fold from them."""
    for size in sorted({r.block for r in recipes if r.block}):
        p.extrema(size)


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    """`x` (rows, K) in pieces of whole rows of about `_CHUNK` values on CPU, where
    elementwise passes over a cached piece beat passes over memory; one piece elsewhere."""
    if x.device.type != "cpu" or x.numel() <= 2 * _CHUNK or x.dim() != 2:
        return [x]
    return list(x.split(max(1, _CHUNK // max(int(x.shape[-1]), 1))))


def _ranges(
    extrema: list[tuple[torch.Tensor, torch.Tensor]], amax: torch.Tensor | None,
    scratch: Scratch,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(each block's log2(amax / smallest nonzero |x|) in fp64, 0 where the block is all
    zero; which blocks are not) over all pieces' blocks, written into `scratch`'s buffers
    (a large operand has millions of blocks: fresh tensors would fault their pages in).
    `amax`: one block, the tensor, its range from the whole's amax."""
    if amax is not None:
        bmax = amax.reshape(1)
        bmin = torch.cat([e[1] for e in extrema]).amin().reshape(1)
    else:
        n, dev = sum(int(e[0].numel()) for e in extrema), extrema[0][0].device
        bmax = torch.cat([e[0] for e in extrema], out=scratch.flat("bmax", n, torch.float32, dev))
        bmin = torch.cat([e[1] for e in extrema], out=scratch.flat("bmin", n, torch.float32, dev))
    live = torch.gt(bmax, 0, out=scratch.like("live", bmax, torch.bool))
    one, zero = bmax.new_ones(()), bmax.new_zeros(())
    ratio = torch.where(live, bmin, one, out=scratch.like("ratio", bmax))
    ratio = torch.log2(torch.div(bmax, ratio, out=ratio), out=ratio)
    ratio = torch.where(live, ratio, zero, out=ratio)
    return scratch.like("rng", ratio, torch.float64).copy_(ratio), live


def operand_figures(
    x: torch.Tensor, recipes: tuple[Recipe, ...] | list[Recipe], operand: str = "input",
    *, scaled: bool = True, casts: list[torch.Tensor] | None = None,
    ref: torch.Tensor | None = None, scratch: Scratch | None = None,
) -> torch.Tensor:  # fmt: skip
    """The figures (`FIGURES`) of casting `x` (rows, K) with each recipe: a (recipes,
    figures) fp64 tensor on x's device, no host sync. Flushed: nonzero values whose cast
    is 0; saturated: values the cast clamped; err / sq: ‖Q(x) − x‖² and ‖x‖²; the range
    of a block is log2(its amax / its smallest nonzero |x|), summed and counted over the
    blocks with a nonzero value, and its maximum. `casts`: a list that gets each recipe's
    Q(x) as (rows, K). On CPU a large `x` is cast in pieces of rows (the scales are the
    same: a block lies within a row, a per-tensor scale comes from the whole amax).
    `ref`: the amax the per-tensor scales come from instead of x's own (delayed scaling:
    the previous steps' history); x's values above it saturate. `scratch`: the buffers
    the passes write into, kept from call to call (a pass's operands on CPU)."""
    x = x.detach().float()
    flat = x.reshape(-1)
    nonzero = torch.count_nonzero(flat).double()
    sq = torch.dot(flat, flat).double()
    lo, hi = torch.aminmax(flat)  # |x|'s max without a pass writing |x| (vector_norm's
    amax = torch.maximum(-lo, hi)  # inf-norm is an order of magnitude slower on CPU)
    # per recipe and piece: Q's nonzero count, the saturated count, ‖Q(|x|) − |x|‖², and
    # the block extrema (the ranges are taken once, over all pieces' blocks, at the end)
    counts: list[list[torch.Tensor]] = [[] for _ in recipes]
    errs: list[list[torch.Tensor]] = [[] for _ in recipes]
    extrema: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in recipes]
    parts: list[list[torch.Tensor]] = [[] for _ in recipes]
    padded = [0] * len(recipes)  # values of Q, padding included
    scale_ref = amax if ref is None else ref.to(amax)
    scratch = Scratch() if scratch is None else scratch
    for piece in _pieces(x):
        p = _Prepared(piece, scale_ref, scratch)
        _warm(p, recipes)
        for i, r in enumerate(recipes):
            q, saturated, bmax, bmin = _quantize(p, r, operand, scaled)
            if casts is not None:
                parts[i].append(_signed(q, p, r))
            counts[i] += [_nonzero(q, scratch), saturated]
            qf = q.reshape(-1).sub_(p.blocks(r.block).reshape(-1))  # Q(|x|) − |x|, in place
            errs[i].append(torch.dot(qf, qf))
            extrema[i].append((bmax.reshape(-1), bmin.reshape(-1)))
            padded[i] += q.numel()
    values = torch.full((), float(flat.numel()), dtype=torch.float64, device=x.device)
    rows = []
    for i, r in enumerate(recipes):
        nz_q, saturated = torch.stack(counts[i]).double().view(-1, 2).sum(0)
        err = torch.stack(errs[i]).sum().double()
        rng, live = _ranges(extrema[i], amax if r.block == 0 else None, scratch)
        flushed = (padded[i] - nz_q) - (padded[i] - nonzero)
        rows.append(
            torch.stack(
                [values, nonzero, flushed, saturated, err, sq, rng.sum(), live.sum().double(),
                 rng.amax()]
            )
        )  # fmt: skip
        if casts is not None:
            casts.append(torch.cat(parts[i]) if len(parts[i]) > 1 else parts[i][0])
    return torch.stack(rows)


def cast_figures(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """`operand_figures` of one recipe: a vector of `FIGURES`."""
    return operand_figures(x, [recipe], operand, scaled=scaled)[0]
