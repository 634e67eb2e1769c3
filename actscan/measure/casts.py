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

E4M3 and E5M2 round through torch's float8 dtypes; E2M1 and E8M0 are computed here. No
function syncs the host: every figure stays a device tensor (`cast_figures`).
"""

from __future__ import annotations

import math
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
    "Element",
    "Recipe",
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
    (emax_elem of the MX spec) and, where torch has it, its dtype."""

    name: str
    max: float
    tiny: float  # the smallest subnormal
    emax: int
    dtype: torch.dtype | None = None

    @property
    def range_bits(self) -> float:
        """log2(max / smallest subnormal): the widest spread one scale can hold."""
        return math.log2(self.max / self.tiny)


E4M3 = Element("e4m3", 448.0, 2.0**-9, 8, torch.float8_e4m3fn)
E5M2 = Element("e5m2", 57344.0, 2.0**-16, 15, torch.float8_e5m2)
E2M1 = Element("e2m1", 6.0, 0.5, 2)


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


FORMATS: dict[str, Recipe] = {
    "fp8": Recipe("fp8", E4M3, E5M2, 0, "tensor"),
    "mxfp8": Recipe("mxfp8", E4M3, E4M3, 32, "e8m0"),
    "nvfp4": Recipe("nvfp4", E2M1, E2M1, 16, "e4m3"),
}

# The figures of one cast, in the order of `cast_figures`' vector: sums, then a maximum.
FIGURES = (
    "values", "nonzero", "flushed", "saturated", "err", "sq", "range_sum", "range_blocks",
    "range_max",
)  # fmt: skip
N_SUMS = len(FIGURES) - 1


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest even onto E2M1's grid {0, .5, 1, 1.5, 2, 3, 4, 6} (|y| ≤ 6): the
    spacing is 0.5 below 2, 1 below 4, 2 above, and torch.round rounds half to even (an
    even multiple of the spacing is an even mantissa, across the binade edges too)."""
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, y)


def round_element(y: torch.Tensor, elem: Element) -> torch.Tensor:
    """`y` (fp32) rounded to nearest even in `elem`, saturated at ±max, back in fp32."""
    y = y.clamp(-elem.max, elem.max)
    if elem.dtype is not None:
        return y.to(elem.dtype).to(torch.float32)
    return _round_e2m1(y)


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


class _Prepared:
    """What every recipe reads of one operand, computed once: x (rows, K) in fp32, |x|,
    |x| with zeros as inf (for block minima), its zero count and ‖x‖²."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x.detach().float()
        self.ab = self.x.abs()
        self.abinf = torch.where(self.ab > 0, self.ab, math.inf)
        flat = self.x.reshape(-1)
        self.zeros = flat.numel() - torch.count_nonzero(flat)
        self.sq = torch.dot(flat, flat)

    def blocks(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, |x| and |x|-with-zeros-as-inf in blocks of `size` (one block: the tensor)."""
        if size == 0:
            return self.x.reshape(1, 1, -1), self.ab.reshape(1, 1, -1), self.abinf.reshape(1, 1, -1)
        return _blocks(self.x, size), _blocks(self.ab, size), _blocks(self.abinf, size, math.inf)


def _quantize(
    p: _Prepared, recipe: Recipe, operand: str, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q(x) in blocks, the saturated count, block amax, block min nonzero |x|)."""
    elem = recipe.element(operand)
    xb, ab, abinf = p.blocks(recipe.block)
    bmax = ab.amax(-1, keepdim=True)
    bmin = abinf.amin(-1, keepdim=True)
    if recipe.block == 0:
        fmax = torch.finfo(torch.float32).max
        amax = bmax.reshape(())
        scale = torch.full_like(amax, elem.max) / amax if scaled else torch.ones_like(amax)
        scale = torch.where(amax > 0, scale.clamp(max=fmax), torch.ones_like(scale))
        y = xb * scale
        q = round_element(y, elem) / scale
    elif recipe.scale == "e8m0":
        s = e8m0_scale(bmax, elem)
        y = xb / s
        q = round_element(y, elem) * s
    else:  # two levels: an E4M3 scale per block under an fp32 scale per tensor
        tmax = bmax.amax()
        enc = torch.full_like(tmax, E4M3.max * elem.max) / tmax  # (a / t: t.__rtruediv__
        enc = torch.where(tmax > 0, enc, torch.ones_like(tmax))  # rounds 1/t first)
        dec = round_element(bmax / elem.max * enc, E4M3)  # the stored block scale
        y = xb * torch.where(dec > 0, enc / dec, torch.zeros_like(dec))
        q = round_element(y, elem) * (dec / enc)
    saturated = torch.count_nonzero(y.abs() > elem.max)
    return q, saturated, bmax, bmin


def _unblocked(q: torch.Tensor, x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Q(x) in blocks back to x's (rows, K) shape (the padding dropped)."""
    return q.reshape(x.shape[0], -1)[:, : x.shape[-1]] if recipe.block else q.reshape(x.shape)


def quantize(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """Q(x) for `x` of shape (rows, K), K the contraction dimension, in fp32.
    `scaled=False`: a per-tensor recipe casts unscaled (what a plain cast to the element
    dtype does)."""
    q, _, _, _ = _quantize(_Prepared(x), recipe, operand, scaled)
    return _unblocked(q, x, recipe)


def quantize_all(
    x: torch.Tensor, recipes: Sequence[Recipe], operand: str = "input"
) -> list[torch.Tensor]:
    """Q(x) of `x` (rows, K) in each recipe (what `--gemm-error` multiplies)."""
    p = _Prepared(x)
    return [_unblocked(_quantize(p, r, operand, True)[0], x, r) for r in recipes]


def operand_figures(
    x: torch.Tensor, recipes: tuple[Recipe, ...] | list[Recipe], operand: str = "input",
    *, scaled: bool = True, casts: list[torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The figures (`FIGURES`) of casting `x` (rows, K) with each recipe: a (recipes,
    figures) fp32 tensor on x's device, no host sync. Flushed: nonzero values whose cast
    is 0; saturated: values the cast clamped; err / sq: ‖Q(x) − x‖² and ‖x‖²; the range
    of a block is log2(its amax / its smallest nonzero |x|), summed and counted over the
    blocks with a nonzero value, and its maximum. `casts`: a list that gets each recipe's
    Q(x) as (rows, K)."""
    p = _Prepared(x)
    values = torch.full((), float(p.x.numel()), device=p.x.device)
    nonzero = values - p.zeros
    rows = []
    for r in recipes:
        q, saturated, bmax, bmin = _quantize(p, r, operand, scaled)
        if casts is not None:
            casts.append(_unblocked(q, p.x, r))
        xb = p.blocks(r.block)[0]
        live = bmax > 0
        rng = torch.where(live, torch.log2(bmax / torch.where(live, bmin, 1.0)), 0.0)
        rows.append(
            torch.stack(
                [
                    values,
                    nonzero,
                    (q.numel() - torch.count_nonzero(q)) - (xb.numel() - nonzero),
                    saturated.float(),
                    F.mse_loss(q, xb, reduction="sum"),
                    p.sq,
                    rng.sum(),
                    live.sum().float(),
                    rng.amax(),
                ]
            ).float()
        )
    return torch.stack(rows)


def cast_figures(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """`operand_figures` of one recipe: a vector of `FIGURES`."""
    return operand_figures(x, [recipe], operand, scaled=scaled)[0]
