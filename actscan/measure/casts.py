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

from actscan.measure import fused_casts

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
    # c = binade · 2^(23−m) as add's and sub's alpha (exact: powers of two), its floor the
    # smallest subnormal's 2^23 · tiny as binade's floor tiny · 2^m: one pass fewer
    binade = binade.clamp_(min=elem.tiny * 2.0**elem.mantissa)
    k = 2.0 ** (23 - elem.mantissa)
    return a.add_(binade, alpha=k).sub_(binade, alpha=k)


def round_element(y: torch.Tensor, elem: Element) -> torch.Tensor:
    """`y` (fp32) rounded to nearest even in `elem`, saturated at ±max, back in fp32."""
    return torch.copysign(_round_abs_(y.float().abs(), elem), y)


def e8m0_scale(amax: torch.Tensor, elem: Element) -> torch.Tensor:
    """The MX block scale 2^(floor(log2 amax) − emax_elem), its exponent clamped to E8M0's
    [−127, 127]: amax's exponent bits (2^floor(log2 amax) for a normal amax, 0 below)
    times 2^−emax_elem, exact (powers of two). An all-zero or subnormal block gets 2^−127
    (harmless: its values stay 0 or flush), a non-finite one 2^127."""
    binade = torch.bitwise_and(amax.float().view(torch.int32), _EXPONENT).view(torch.float32)
    return binade.mul_(2.0**-elem.emax).clamp_(2.0**-127, 2.0**127)


# values per piece an operand is cast in on CPU: a piece's few buffers (4 MB each) stay
# in the last-level cache; smaller pieces pay more per-op dispatch than they gain in cache
_CHUNK = 1 << 20


class _Prepared:
    """What every recipe reads of one operand (or one piece of it), computed once: x
    (rows, K) in fp32, |x| (in blocks per size), the whole tensor's amax (the per-tensor
    scales' reference), and per block size the block amax and smallest nonzero |x|; a
    coarser size's extrema are folded from a finer one's (the 32-blocks from the
    16-blocks, the piece's from any), not read again."""

    def __init__(
        self, x: torch.Tensor, amax: torch.Tensor | None = None,
        scratch: Scratch | None = None, recipes: Sequence[Recipe] = (),
    ) -> None:  # fmt: skip
        self.x = x.detach().float()
        self.scratch = scratch
        # |x| (rows, K) padded with zeros to a whole number of every recipe's blocks
        # (zeros change no figure), written where the padded buffer has it: no copy
        rows, k = self.x.shape
        unit = math.lcm(*[r.block for r in recipes if r.block], 1)
        width = k + (-k) % unit
        if scratch is None:
            ab = torch.empty((rows, width), dtype=torch.float32, device=self.x.device)
        else:
            ab = scratch.flat("ab", rows * width, torch.float32, self.x.device).view(rows, width)
        torch.abs(self.x, out=ab[:, :k] if width > k else ab)
        if width > k:
            ab[:, k:].zero_()
        self.ab = ab
        self.amax = self.ab.amax() if amax is None else amax
        self._blocked: dict[int, torch.Tensor] = {}
        self._extrema: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def blocks(self, size: int) -> torch.Tensor:
        """|x| in blocks of `size` (one block: the tensor)."""
        got = self._blocked.get(size)
        if got is None:
            rows = 1 if size == 0 else self.ab.shape[0]
            got = self.ab.reshape(rows, -1, self.ab.numel() // rows if size == 0 else size)
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


def _tensor_scale(amax: torch.Tensor, recipe: Recipe, elem: Element, scaled: bool) -> torch.Tensor:
    """The per-tensor factor a recipe takes from the whole tensor's amax, computed once
    per operand: FP8's scale fmt_max / amax (1 unscaled), NVFP4's encoding scale
    448·6 / amax; MXFP8 has none (1). An amax of 0, inf or NaN keeps the scale at 1, as
    Transformer Engine keeps its previous scale (its first is 1) when the amax is not a
    positive finite number: a 0 scale would turn inf into NaN."""
    one = torch.ones_like(amax)
    if (recipe.block == 0 and not scaled) or recipe.scale == "e8m0":
        return one
    top = elem.max if recipe.block == 0 else E4M3.max * elem.max
    scale = torch.full_like(amax, top) / amax  # (a / t: t.__rtruediv__ rounds 1/t first)
    if recipe.block == 0:
        scale = scale.clamp(max=torch.finfo(torch.float32).max)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, one)


def _quantize(
    p: _Prepared, recipe: Recipe, operand: str, tscale: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """(Q of the scaled |x| in blocks, the factor that takes it back to |Q(x)|
    (`_descaled`), the saturated count, the nonzero count of Q, block amax, block min
    nonzero |x|); `tscale`: the recipe's per-tensor factor (`_tensor_scale`). Both
    counts are read off the scaled |x| before it is rounded in place: Q(y) is 0 exactly
    where y ≤ half the smallest subnormal (that tie rounds to even, 0), and saturates
    where y > max."""
    elem = recipe.element(operand)
    ab = p.blocks(recipe.block)
    bmax, bmin = p.extrema(recipe.block)
    y = _scratch(p.scratch, "y", ab, torch.float32)
    if recipe.block == 0:
        torch.mul(ab, tscale, out=y)
        back = tscale
    elif recipe.scale == "e8m0":
        back = e8m0_scale(bmax, elem)
        torch.div(ab, back, out=y)
    else:  # two levels: an E4M3 scale per block under an fp32 scale per tensor
        dec = _round_abs_(bmax / elem.max * tscale, E4M3)  # the stored block scale (≥ 0)
        factor = torch.where(dec > 0, tscale / dec, 0.0)
        torch.mul(ab, factor, out=y)
        back = dec / tscale
    saturated = _count_above(y, elem.max, p.scratch)
    nonzero = _count_above(y, elem.tiny / 2, p.scratch)
    q = _round_abs_(y, elem, p.scratch)
    return q, back, saturated, nonzero, bmax, bmin


def _descaled(q: torch.Tensor, back: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """|Q(x)| from Q of the scaled |x| (in place): ÷ the per-tensor scale, × a block's."""
    return q.div_(back) if recipe.block == 0 else q.mul_(back)


def _count_above(y: torch.Tensor, limit: float, scratch: Scratch | None = None) -> torch.Tensor:
    """How many of `y` (≥ 0, or +NaN: counted) exceed `limit`, on the int32 bits (|y|
    orders as they do). On CPU, where comparisons' bool tensors and int sums are slow, in
    three cheap passes: the bits clamped to [b, b + 1] (b: limit's bits) are, as floats,
    limit or the next float up; less limit, 0 or one ulp, whose fp32 sum counts exactly
    below 2^24 values."""
    (top,) = struct.unpack("<i", struct.pack("<f", limit))
    bits = y.view(torch.int32)
    if y.device.type != "cpu" or y.numel() >= _EXACT:
        return torch.count_nonzero(bits > top)
    ulp = struct.unpack("<f", struct.pack("<i", top + 1))[0] - limit
    ind = torch.clamp(bits, top, top + 1, out=_scratch(scratch, "bits", y, torch.int32))
    return ind.view(torch.float32).sub_(limit).sum() / ulp


def _count_nonzero(ab: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """How many of `ab` (≥ 0, or +NaN: counted) are nonzero, as `count_nonzero` counts
    them. On CPU, where count_nonzero branches on every value, the int32 bits clamped to
    [0, 1] and shifted into the exponent: 0 or 2^−126 (the smallest normal float, so a
    flush-to-zero mode cannot drop it), whose fp32 sum counts exactly below 2^24 values."""
    if ab.device.type != "cpu" or ab.numel() >= _EXACT:
        return torch.count_nonzero(ab)
    ind = torch.clamp(ab.view(torch.int32), max=1, out=_scratch(scratch, "bits", ab, torch.int32))
    return ind.bitwise_left_shift_(23).view(torch.float32).sum().double() * 2.0**126


def _unblocked(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Q(x) in blocks back to x's (rows, K) shape (the padding dropped)."""
    return q.reshape(x.shape[0], -1)[:, : x.shape[-1]]


def _signed(q: torch.Tensor, p: _Prepared) -> torch.Tensor:
    return torch.copysign(_unblocked(q, p.x), p.x)


def quantize(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """Q(x) for `x` of shape (rows, K), K the contraction dimension, in fp32.
    `scaled=False`: a per-tensor recipe casts unscaled (what a plain cast to the element
    dtype does)."""
    p = _Prepared(x, recipes=[recipe])
    tscale = _tensor_scale(p.amax, recipe, recipe.element(operand), scaled)
    q, back = _quantize(p, recipe, operand, tscale)[:2]
    return _signed(_descaled(q, back, recipe), p)


def quantize_all(
    x: torch.Tensor, recipes: Sequence[Recipe], operand: str = "input"
) -> list[torch.Tensor]:
    """Q(x) of `x` (rows, K) in each recipe (what `--gemm-error` multiplies)."""
    p = _Prepared(x, recipes=recipes)
    _warm(p, recipes)
    out = []
    for r in recipes:
        q, back = _quantize(p, r, operand, _tensor_scale(p.amax, r, r.element(operand), True))[:2]
        out.append(_signed(_descaled(q, back, r), p))
    return out


def _warm(p: _Prepared, recipes: Sequence[Recipe]) -> None:
    """The block extrema finest first, so that the coarser ones fold from them."""
    for size in sorted({r.block for r in recipes if r.block}):
        p.extrema(size)


def _pieces(x: torch.Tensor, recipes: Sequence[Recipe] = ()) -> list[torch.Tensor]:
    """`x` (rows, K) in pieces of whole rows of about `_CHUNK` values on CPU, where
    elementwise passes over a cached piece beat passes over memory; one piece elsewhere.
    Per-tensor recipes alone have no blocks: their pieces are flat runs of values (a
    tensor as one row is not one piece)."""
    if x.device.type != "cpu" or x.numel() <= 2 * _CHUNK or x.dim() != 2:
        return [x]
    if recipes and all(r.block == 0 for r in recipes) and x.is_contiguous():
        return list(x.reshape(1, -1).split(_CHUNK, dim=1))
    return list(x.split(max(1, _CHUNK // max(int(x.shape[-1]), 1))))


def _ranges(
    extrema: list[tuple[torch.Tensor, torch.Tensor]], amax: torch.Tensor | None,
    scratch: Scratch,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(each block's log2(amax / smallest nonzero |x|), in fp64, 0 where the block is all
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
    # in fp64: a block's spread can pass fp32's 2^128 (a subnormal beside a large value)
    rng = scratch.like("rng", bmax, torch.float64).copy_(bmax)
    rng = rng.div_(scratch.like("den", bmax, torch.float64).copy_(bmin)).log2_()
    return torch.where(live, rng, rng.new_zeros(()), out=rng), live


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
    fused = casts is None and fused_casts.supports(x, recipes)
    if fused:  # one read of x for every format, compiled
        x = x.contiguous()  # once: both kernels read its memory as it is
        amax = fused_casts.amax(x)
    else:
        flat = x.reshape(-1)
        sq = torch.dot(flat, flat).double()
        lo, hi = torch.aminmax(flat)  # |x|'s max without a pass writing |x| (vector_norm's
        amax = torch.maximum(-lo, hi)  # inf-norm is an order of magnitude slower on CPU)
    scale_ref = amax if ref is None else ref.to(amax)
    tscales = [_tensor_scale(scale_ref, r, r.element(operand), scaled) for r in recipes]
    if fused:
        return fused_casts.operand_figures(x, recipes, tscales, operand, amax)
    # per recipe and piece: Q's nonzero count, the saturated count, ‖Q(|x|) − |x|‖², and
    # the block extrema (the ranges are taken once, over all pieces' blocks, at the end)
    counts: list[list[torch.Tensor]] = [[] for _ in recipes]
    nonzeros: list[torch.Tensor] = []  # x's nonzero values, per piece
    errs: list[list[torch.Tensor]] = [[] for _ in recipes]
    extrema: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in recipes]
    parts: list[list[torch.Tensor]] = [[] for _ in recipes]
    padded = [0] * len(recipes)  # values of Q, padding included
    scratch = Scratch() if scratch is None else scratch
    for piece in _pieces(x, recipes):
        p = _Prepared(piece, scale_ref, scratch, recipes)
        nonzeros.append(_count_nonzero(p.ab, scratch))
        _warm(p, recipes)
        for i, r in enumerate(recipes):
            q, back, saturated, nz_q, bmax, bmin = _quantize(p, r, operand, tscales[i])
            ab = p.blocks(r.block)
            counts[i] += [nz_q, saturated]
            if casts is not None or not r.block:
                q = _descaled(q, back, r)
                if casts is not None:
                    parts[i].append(_signed(q, p))
                diff = q.sub_(ab)
            else:  # a block's factor: |x| − Q(|x|) in one pass, ab − q · back, in place
                diff = torch.addcmul(ab, q, back, value=-1, out=q)
            qf = diff.reshape(-1)
            errs[i].append(torch.dot(qf, qf))
            extrema[i].append((bmax.reshape(-1), bmin.reshape(-1)))
            padded[i] += q.numel()
    nonzero = torch.stack(nonzeros).double().sum()
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
            got = parts[i]  # pieces of rows, or flat runs: contiguous either way
            casts.append(torch.cat([g.reshape(-1) for g in got]).view(x.shape) if len(got) > 1
                         else got[0].reshape(x.shape))  # fmt: skip
    return torch.stack(rows)


def cast_figures(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """`operand_figures` of one recipe: a vector of `FIGURES`."""
    return operand_figures(x, [recipe], operand, scaled=scaled)[0]
