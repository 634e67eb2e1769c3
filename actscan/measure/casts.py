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
    "quantize",
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
    spacing is 2^(max(floor(log2|y|), 0) − 1), and torch.round rounds half to even."""
    a = y.abs()
    _, e = torch.frexp(a)  # a = m·2^e, m in [0.5, 1): floor(log2 a) = e − 1
    ulp = torch.ldexp(torch.ones_like(a), (e - 1).clamp_min(0) - 1)
    return torch.copysign(torch.round(a / ulp) * ulp, y)


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


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(rows, K) → (rows, ceil(K / size), size), zero-padded (zeros change no figure)."""
    k = x.shape[-1]
    pad = (-k) % size
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(x.shape[0], -1, size)


def quantize(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q(x), saturated mask, the blocks of |x|) for `x` of shape (rows, K), K the
    contraction dimension, fp32. `scaled=False`: per-tensor recipes cast unscaled (what a
    plain cast to the element dtype does). The block view is (rows, blocks, size), one
    block for a per-tensor recipe."""
    elem = recipe.element(operand)
    x = x.float()
    if recipe.block == 0:
        amax = x.abs().amax()
        fmax = torch.finfo(torch.float32).max
        scale = (
            (torch.full_like(amax, elem.max) / amax).clamp(max=fmax)
            if scaled
            else torch.ones_like(amax)
        )
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        y = x * scale
        return round_element(y, elem) / scale, y.abs() > elem.max, x.abs().reshape(1, 1, -1)
    xb = _blocks(x, recipe.block)
    ab = xb.abs()
    bmax = ab.amax(-1, keepdim=True)
    if recipe.scale == "e8m0":
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
    k = x.shape[-1]
    return q.reshape(x.shape[0], -1)[:, :k], (y.abs() > elem.max).reshape(x.shape[0], -1)[:, :k], ab


def cast_figures(
    x: torch.Tensor, recipe: Recipe, operand: str = "input", *, scaled: bool = True
) -> torch.Tensor:
    """The figures (`FIGURES`) of casting `x` (rows, K) with `recipe`: an fp32 vector on
    x's device. Flushed: nonzero values whose cast is 0; saturated: values the cast
    clamped; err / sq: ‖Q(x) − x‖² and ‖x‖²; the range of a block is log2(its amax / its
    smallest nonzero |x|), summed and counted over blocks with a nonzero value, and its
    maximum."""
    x = x.detach().float()
    q, sat, ab = quantize(x, recipe, operand, scaled=scaled)
    nz = x != 0
    bmax = ab.amax(-1)
    bmin = torch.where(ab > 0, ab, torch.full_like(ab, math.inf)).amin(-1)
    live = bmax > 0
    rng = torch.where(live, torch.log2(bmax / torch.where(live, bmin, bmax.clamp_min(1))), 0.0)
    values = torch.tensor(float(x.numel()), device=x.device)
    return torch.stack(
        [
            values,
            nz.sum().float(),
            (nz & (q == 0)).sum().float(),
            sat.sum().float(),
            (q - x).square().sum(),
            x.square().sum(),
            rng.sum(),
            live.sum().float(),
            rng.amax() if rng.numel() else torch.zeros((), device=x.device),
        ]
    )
