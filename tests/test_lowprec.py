"""Simulated low-precision casts (actscan/measure/casts.py) against an independent oracle:
ml_dtypes' float8_e4m3fn, float8_e5m2, float4_e2m1fn and float8_e8m0fnu, round to nearest
even, with the recipes' scaling rules written out again here in numpy. Every comparison is
exact (max error 0): the scales are the same IEEE fp32 operations in the same order, and
the element roundings must agree bit for bit. Then the planted cases of the issue."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import ctx, flat_stream
from torch import nn

from actscan import scan
from actscan.diagnose import run_checks
from actscan.diagnose.thresholds import DEFAULT
from actscan.measure import compiled, fused_casts
from actscan.measure.casts import (
    E2M1,
    E4M3,
    E5M2,
    FIGURES,
    FORMATS,
    Element,
    cast_figures,
    e8m0_scale,
    operand_figures,
    quantize,
    round_element,
)
from actscan.records import CheckId, Finding, LowPrecRecord, Severity
from actscan.render.formats import to_markdown
from actscan.report.report import Report
from actscan.report.schema import validate_report

ML = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}


def oracle_round(y: np.ndarray, elem: Element) -> np.ndarray:
    y = np.clip(y.astype(np.float32), -elem.max, elem.max)
    return y.astype(ML[elem.name]).astype(np.float32)


def grid(elem: Element) -> np.ndarray:
    """Every finite value of the format, and every midpoint between neighbours (the ties)."""
    dt = ML[elem.name]
    bits = 4 if elem.name == "e2m1" else 8
    vals = np.arange(2**bits, dtype=np.uint8).view(dt).astype(np.float32)  # every encoding
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    mids = (vals[:-1] + vals[1:]) / 2
    out = np.concatenate([vals, mids, [elem.max * 1.5, elem.max * 100, elem.tiny / 4]])
    out = np.concatenate([out, -out, np.nextafter(mids, 0), np.nextafter(mids, 1)])
    return out.astype(np.float32)


@pytest.mark.parametrize("elem", [E4M3, E5M2, E2M1], ids=lambda e: e.name)
def test_element_rounding_matches_ml_dtypes_on_every_value_tie_and_edge(elem: Element) -> None:
    rng = np.random.default_rng(0)
    random = (rng.standard_normal(20000) * np.exp2(rng.uniform(-20, 18, 20000))).astype(np.float32)
    x = np.concatenate([grid(elem), random, [0.0, -0.0]]).astype(np.float32)
    got = round_element(torch.from_numpy(x), elem).numpy()
    want = oracle_round(x, elem)
    assert np.array_equal(got, want), np.abs(got - want).max()  # max error: 0
    if elem.dtype is not None:  # and torch's own float8 conversion, bit for bit
        y = torch.from_numpy(x).clamp(-elem.max, elem.max)
        assert torch.equal(round_element(y, elem), y.to(elem.dtype).float())


def test_e8m0_scale_is_the_mx_rule_and_an_e8m0_value() -> None:
    rng = np.random.default_rng(1)
    amax = np.abs(rng.standard_normal(5000) * np.exp2(rng.uniform(-100, 100, 5000)))
    amax = np.concatenate([amax, np.exp2(np.arange(-120, 120, dtype=np.float64))]).astype(
        np.float32
    )
    got = e8m0_scale(torch.from_numpy(amax), E4M3).numpy()
    want = np.exp2(np.clip(np.floor(np.log2(amax.astype(np.float64))) - 8, -127, 127))
    assert np.array_equal(got.astype(np.float64), want)
    as_e8m0 = got.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(as_e8m0, got)  # representable: exactly a power of two in range


def oracle_quantize(x: np.ndarray, fmt: str, operand: str = "input") -> np.ndarray:
    """The recipe written again: per-tensor amax scaling, MX blocks, NVFP4's two levels."""
    r = FORMATS[fmt]
    elem = r.element(operand)
    x = x.astype(np.float32)
    if r.block == 0:
        amax = np.float32(np.abs(x).max())
        scale = np.float32(elem.max) / amax if amax > 0 else np.float32(1)
        return oracle_round(x * scale, elem) / scale
    rows, k = x.shape
    pad = (-k) % r.block
    xb = np.pad(x, ((0, 0), (0, pad))).reshape(rows, -1, r.block)
    bmax = np.abs(xb).max(-1, keepdims=True)
    if r.scale == "e8m0":
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(bmax.astype(np.float64)))
        e = np.where(bmax > 0, e, -1)
        s = np.exp2(np.clip(e - elem.emax, -127, 127)).astype(np.float32)
        q = oracle_round(xb / s, elem) * s
    else:
        tmax = np.float32(bmax.max())
        enc = np.float32(448.0 * 6.0) / tmax
        dec = oracle_round(bmax / np.float32(6.0) * enc, E4M3)
        with np.errstate(divide="ignore"):
            inv = np.where(dec > 0, enc / dec, 0).astype(np.float32)
        q = oracle_round(xb * inv, elem) * (dec / enc)
    return q.reshape(rows, -1)[:, :k]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("operand", ["input", "grad"])
def test_recipes_match_the_oracle(fmt: str, operand: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((24, 100)).astype(np.float32)  # K = 100: a padded last block
    x[3] *= 1e-6  # a row of tiny values
    x[:, 7] *= 300.0  # an outlier channel
    x[5, :40] = 0.0  # zero blocks
    x[6, 0] = 2.0**-20  # a value deep below every format's smallest subnormal at its scale
    got = quantize(torch.from_numpy(x), FORMATS[fmt], operand)
    want = oracle_quantize(x, fmt, operand)
    assert np.array_equal(got.numpy(), want), np.abs(got.numpy() - want).max()


def test_figures_of_a_large_operand_cast_in_pieces_equal_the_whole_cast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU a large operand is cast in pieces of rows: the per-tensor scale still comes
    from the whole tensor's amax, so every count is the same and the sums agree."""
    import actscan.measure.casts as casts

    monkeypatch.setattr(fused_casts, "_kernels", lambda: None)  # the pieces are the torch path's
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 100, generator=g)
    x[:, 7] *= 1e4  # an outlier channel: per-tensor scales flush
    x[40:50] = 0.0  # zero rows, and a piece whose amax is far below the tensor's
    x[70] *= 1e-8
    whole = operand_figures(x, list(FORMATS.values()), "grad")
    monkeypatch.setattr(casts, "_CHUNK", 512)  # pieces of 5 rows
    assert len(casts._pieces(x)) > 10
    pieces = operand_figures(x, list(FORMATS.values()), "grad")
    exact = ("values", "nonzero", "flushed", "saturated", "range_blocks")
    counts = [FIGURES.index(f) for f in exact]
    assert torch.equal(whole[:, counts], pieces[:, counts])
    assert torch.allclose(whole, pieces, rtol=1e-6, atol=0)


def fig(x: torch.Tensor, fmt: str, operand: str = "input", **kw: bool) -> dict[str, float]:
    return dict(zip(FIGURES, cast_figures(x, FORMATS[fmt], operand, **kw).tolist(), strict=True))


def rates(f: dict[str, float]) -> tuple[float, float, float]:
    return f["flushed"] / f["nonzero"], f["saturated"] / f["nonzero"], f["err"] / f["sq"]


@pytest.fixture(params=["torch", "compiled"])
def cast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The figures two ways: torch's elementwise passes, and the compiled casts
    (actscan/measure/fused_casts.py, with numba: the dev extras install it)."""
    if request.param == "torch":
        monkeypatch.setattr(fused_casts, "_kernels", lambda: None)
    elif not fused_casts.available():
        pytest.skip("numba is not installed")
    return str(request.param)


def test_figures_count_what_the_cast_did(cast_path: str) -> None:
    x = torch.tensor([[0.0, 1.0, -2.0, 1e-30, 3.0, 0.0, 5.0, 8.0]])
    f = fig(x, "fp8")
    q = quantize(x, FORMATS["fp8"])
    assert f["values"] == 8 and f["nonzero"] == 6
    assert f["flushed"] == 1  # 1e-30
    assert f["err"] == pytest.approx(float((q - x).square().sum()))
    assert f["range_max"] == pytest.approx(math.log2(8.0 / 1e-30), rel=1e-6)
    assert f["range_blocks"] == 1  # one per-tensor block


def test_outlier_channel_flushes_per_tensor_e4m3_but_not_mxfp8(cast_path: str) -> None:
    """×1e6 on one channel: per-tensor E4M3's scale follows the outlier, and most other
    values fall below its smallest subnormal; MXFP8's 32-blocks along the contraction
    dimension confine that to the one block per row holding the channel. (×1000 is not
    enough to flush most values, E4M3 spans 2^17.8, but it already flushes ≥ 20× more
    than MXFP8.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g)
    big = x.clone()
    big[:, 11] *= 1e6
    uf_t, _, _ = rates(fig(big, "fp8"))
    uf_b, _, _ = rates(fig(big, "mxfp8"))
    assert uf_t > 0.5 and uf_b < 1 / 16 + 0.01  # at most the poisoned block of 16 per row
    mild = x.clone()
    mild[:, 11] *= 1000
    uf_t, _, _ = rates(fig(mild, "fp8"))
    uf_b, _, _ = rates(fig(mild, "mxfp8"))
    assert uf_t > 0.003 and uf_t > 20 * uf_b


def test_tiny_gradient_flushes_in_e5m2_unscaled_not_with_per_tensor_scaling(cast_path: str) -> None:
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(128, 256, generator=g) * 1e-9
    plain = rates(fig(grad, "fp8", "grad", scaled=False))
    scaled = rates(fig(grad, "fp8", "grad"))
    assert plain[0] == 1.0 and plain[2] == pytest.approx(1.0)  # every value lost
    assert scaled[0] < 1e-3 and scaled[2] < 1e-2


def test_a_non_finite_operand_keeps_its_scale_and_counts_inf_and_nan_as_saturated(
    cast_path: str,
) -> None:
    """An inf or NaN amax keeps the per-tensor scale at 1, as Transformer Engine keeps its
    previous scale (its first: 1) when the amax is not finite: the finite values cast
    unscaled (a 0 scale would turn inf into NaN and flush everything else), and in every
    format the inf and the NaN count as nonzero values the cast saturated."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, generator=g)
    x[0, :8] *= 1e-4  # some values E4M3 flushes unscaled
    x[1, 5], x[2, 9] = math.inf, math.nan
    f = fig(x, "fp8")
    finite = x[torch.isfinite(x)].abs().numpy()
    assert f["nonzero"] == 256 and f["saturated"] == 2
    assert f["flushed"] == int((oracle_round(finite, E4M3) == 0).sum()) > 0
    for fmt in ("mxfp8", "nvfp4"):
        f = fig(x, fmt)
        assert f["nonzero"] == 256 and f["saturated"] >= 2, fmt
        assert all(math.isfinite(f[k]) for k in ("flushed", "saturated", "range_blocks")), fmt


def test_one_huge_value_ruins_its_block_only(cast_path: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 256, generator=g)
    # beyond each element format's spread (E4M3: 2^17.8, E2M1: 2^3.6) above its neighbours
    for fmt, size, huge in (("mxfp8", 32, 1e7), ("nvfp4", 16, 1e3)):
        x[3, 40] = huge  # block 1 of row 3 (32-blocks), block 2 (16-blocks)
        q = quantize(x, FORMATS[fmt])
        block = slice(40 // size * size, 40 // size * size + size)
        lost = (q[3, block] == 0) & (x[3, block] != 0)
        assert lost.float().mean() > 0.5, fmt  # the huge value's neighbours flush
        others = torch.ones_like(x, dtype=torch.bool)
        others[3, block] = False
        if fmt == "mxfp8":  # an E8M0 scale per block: the other blocks are untouched
            assert not ((q == 0) & (x != 0) & others).any()
        f = fig(x, fmt)
        assert f["range_max"] > math.log2(huge / 4)  # the worst block's spread shows it


def oracle_figures(x: np.ndarray, fmt: str, operand: str) -> dict[str, float]:
    """The figures from the oracle's cast, summed in fp64: flushed, ‖Q(x) − x‖², and the
    blocks' ranges log2(amax / smallest nonzero |x|)."""
    r = FORMATS[fmt]
    q = oracle_quantize(x, fmt, operand).astype(np.float64)
    x64 = x.astype(np.float64)
    a = np.abs(x64) if r.block == 0 else np.pad(np.abs(x64), ((0, 0), (0, (-x.shape[1]) % r.block)))
    blocks = a.reshape(1, -1) if r.block == 0 else a.reshape(-1, r.block)
    top = blocks.max(-1)
    low = np.where(blocks > 0, blocks, np.inf).min(-1)
    live = top > 0
    rng = np.log2(top[live] / low[live])
    return {
        "nonzero": float((x != 0).sum()),
        "flushed": float(((q == 0) & (x != 0)).sum()),
        "err": float(((q - x64) ** 2).sum()),
        "range_sum": float(rng.sum()),
        "range_blocks": float(live.sum()),
        "range_max": float(rng.max()) if live.any() else 0.0,
    }


def awkward(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.uniform(-6, 6, (rows, 1)))).astype(np.float32)
    x[:, 3] *= 2000.0  # an outlier channel
    x[1, : min(k, 70)] = 0.0  # zero blocks
    x[2] *= 1e-7  # a row deep in the subnormals of every format's scale
    x[0, 5] = 2.0**-140  # an fp32 subnormal
    return x


@pytest.mark.parametrize("operand", ["input", "grad"])
@pytest.mark.parametrize("shape", [(24, 100), (5, 16384 + 48 + 17), (64, 768)], ids=str)
def test_compiled_casts_match_an_fp64_oracle_and_the_torch_casts(
    operand: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled casts count exactly what the oracle's casts and torch's do, and their
    sums agree with the oracle's fp64 ones to 1e-6 (the ranges to 1e-7): K = 100 pads
    each row's last block, K = 16,449 also runs a row over more than one group, K = 768
    none."""
    if not fused_casts.available():
        pytest.skip("numba is not installed")
    x = awkward(*shape, seed=sum(shape))
    t = torch.from_numpy(x)
    recipes = list(FORMATS.values())
    assert fused_casts.supports(t, recipes)
    got = operand_figures(t, recipes, operand)
    with monkeypatch.context() as m:
        m.setattr(fused_casts, "_kernels", lambda: None)
        torch_path = operand_figures(t, recipes, operand)
    exact = [
        FIGURES.index(f) for f in ("values", "nonzero", "flushed", "saturated", "range_blocks")
    ]
    assert torch.equal(got[:, exact], torch_path[:, exact])
    assert torch.allclose(got, torch_path, rtol=2e-4, atol=0)  # torch sums in fp32
    for i, fmt in enumerate(FORMATS):
        f = dict(zip(FIGURES, got[i].tolist(), strict=True))
        want = oracle_figures(x, fmt, operand)
        assert f["flushed"] > 0, fmt  # the planted tiny values flush in every format
        for k in ("nonzero", "flushed", "range_blocks"):
            assert f[k] == want[k], (fmt, k)
        assert f["err"] == pytest.approx(want["err"], rel=1e-6), fmt
        assert f["range_sum"] == pytest.approx(want["range_sum"], rel=1e-7), fmt
        assert f["range_max"] == pytest.approx(want["range_max"], abs=1e-5), fmt
        assert f["sq"] == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-6)


def test_compiled_casts_on_several_threads_sum_to_the_one_thread_figures() -> None:
    """A user's torch threads split the operand's rows among the kernels: the same
    counts, and sums that differ only by their order."""
    if not fused_casts.available():
        pytest.skip("numba is not installed")
    x = torch.from_numpy(awkward(96, 6000, seed=4))
    recipes = list(FORMATS.values())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = operand_figures(x, recipes, "input")
        torch.set_num_threads(3)
        assert min(3, x.numel() // compiled.MIN_PART) > 1  # split, really
        three = operand_figures(x, recipes, "input")
    finally:
        torch.set_num_threads(threads)
    counts = [FIGURES.index(f) for f in ("values", "nonzero", "flushed", "saturated")]
    assert torch.equal(one[:, counts], three[:, counts])
    assert torch.allclose(one, three, rtol=1e-12, atol=0)


def test_without_numba_the_torch_casts_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """No numba (the `fast` extra not installed): `supports` says no and the figures come
    from torch's passes, the kernel never called."""
    monkeypatch.setattr(fused_casts, "_kernels", lambda: None)
    called: list[int] = []
    monkeypatch.setattr(fused_casts, "operand_figures", lambda *a, **k: called.append(1))
    x = torch.from_numpy(awkward(8, 64, seed=1))
    assert not fused_casts.supports(x, list(FORMATS.values()))
    f = dict(zip(FIGURES, cast_figures(x, FORMATS["mxfp8"]).tolist(), strict=True))
    assert not called and f["flushed"] == oracle_figures(x.numpy(), "mxfp8", "input")["flushed"]


# -- the recorded pass (`--formats`: actscan/measure/lowprec.py) ------------------------


class Mixer(nn.Module):
    """Two Linears and, in the module itself, two activation × activation matmuls."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        scores = torch.softmax(h @ h.transpose(-1, -2) / 8, -1)  # (b, t, t)
        return self.down(torch.matmul(scores, h))


def mixer_batch() -> torch.Tensor:
    return torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))


def test_records_match_an_independent_cast_of_the_captured_operands() -> None:
    """Each record is the oracle's cast of the tensor that GEMM really multiplied: the
    inputs and output gradients captured by plain module hooks, the weights as they are,
    the matmul's right operand blocked along its rows (its contraction dimension)."""
    torch.manual_seed(0)
    model = Mixer()
    x = mixer_batch()
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.up.register_forward_hook(lambda m, a, o: seen.__setitem__("up", a[0].detach())),
        model.down.register_full_backward_hook(
            lambda m, gi, go: seen.__setitem__("down.grad", go[0].detach())
        ),
        model.register_forward_hook(lambda m, a, o: seen.__setitem__("h", m.up(a[0]).detach())),
    ]
    model(x).square().mean().backward()
    for h in hooks:
        h.remove()
    model.zero_grad()
    report = scan(model, x, loss_fn=lambda out: out.square().mean(), formats="fp8,mxfp8,nvfp4")
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    assert {g for g, _, _ in recs} == {"up", "down", ":matmul#0", ":matmul#1"}

    def want(t: torch.Tensor, fmt: str, operand: str = "input") -> float:
        rows = t.reshape(-1, t.shape[-1]).numpy()
        q = oracle_quantize(rows, fmt, operand)
        return float(((q - rows) ** 2).sum() / (rows**2).sum())

    for fmt in FORMATS:
        assert recs[("up", "input", fmt)].error == pytest.approx(want(seen["up"], fmt), rel=1e-5)
        w = model.down.weight.detach()
        assert recs[("down", "weight", fmt)].error == pytest.approx(want(w, fmt), rel=1e-5)
        g = seen["down.grad"]
        assert recs[("down", "grad", fmt)].error == pytest.approx(want(g, fmt, "grad"), rel=1e-5)
        # h @ hᵀ: the right operand hᵀ contracts over its rows, i.e. blocks along h's last dim
        rhs = recs[(":matmul#0", "rhs", fmt)]
        assert rhs.error == pytest.approx(want(seen["h"], fmt), rel=1e-5)
    assert recs[("down", "weight", "fp8")].element == "e4m3"
    assert recs[("down", "grad", "fp8")].element == "e5m2"
    assert all(r.calls == 1 for r in report.low_precision)


class Tied(nn.Module):
    """One weight, two GEMMs: `a` and `b` share it (as a tied embedding and head do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Fanout(nn.Module):
    """q, k, v projections of one input (as Llama's attention reads its normed input), and
    one of another tensor."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        return self.o(self.q(h) + self.k(h) * self.v(h))


def test_an_input_the_next_gemms_read_again_is_cast_once_with_the_figures_of_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actscan.measure import lowprec

    cast = lowprec.operand_figures
    inputs: list[str] = []

    def counted(x: torch.Tensor, recipes: object, operand: str = "input", **kw: object) -> object:
        inputs.append(operand)
        return cast(x, recipes, operand, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lowprec, "operand_figures", counted)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    report = scan(Fanout(), x, loss_fn=lambda o: o.square().mean(), formats="fp8,mxfp8")
    assert inputs.count("input") == 2  # q, k and v share one cast; o reads another tensor
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    rows = x.reshape(-1, 64).numpy()
    for fmt in ("fp8", "mxfp8"):
        want = oracle_quantize(rows, fmt)
        err = float(((want - rows) ** 2).sum() / (rows**2).sum())
        for name in ("q", "k", "v"):
            assert recs[(name, "input", fmt)].error == pytest.approx(err, rel=1e-5), (name, fmt)
        assert recs[("o", "input", fmt)].error != pytest.approx(err, rel=1e-3)


def test_an_input_changed_in_place_between_two_gemms_is_cast_again() -> None:
    """The cached cast is keyed by the tensor's view and version: an in-place change
    between two GEMMs that read the same storage is another input."""
    from actscan.measure.hooks import HookSet
    from actscan.measure.lowprec import lowprec_watch

    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    with HookSet() as hooks, lowprec_watch(nn.Linear(64, 64), ["fp8"], False, hooks) as got:
        watch = got[0]
        watch._fold(("a", 0, "linear"), "input", h, [1])
        watch._fold(("b", 0, "linear"), "input", h, [1])  # the same: the cached cast
        h.mul_(1e-3)
        watch._fold(("c", 0, "linear"), "input", h, [1])
        sums = {k[0][0]: v.acc for k, v in watch.sums.items()}
    assert torch.equal(sums["a"], sums["b"])
    assert not torch.equal(sums["a"], sums["c"])
    rows = h.numpy()
    want = oracle_quantize(rows, "fp8")
    err, sq = float(sums["c"][FIGURES.index("err")]), float(sums["c"][FIGURES.index("sq")])
    assert err / sq == pytest.approx(float(((want - rows) ** 2).sum() / (rows**2).sum()), rel=1e-5)


def test_a_weight_two_gemms_share_is_cast_once_with_the_figures_of_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actscan.measure import lowprec

    torch.manual_seed(0)
    cast = lowprec.operand_figures
    operands: list[str] = []

    def counted(x: torch.Tensor, recipes: object, operand: str = "input", **kw: object) -> object:
        operands.append(operand)
        return cast(x, recipes, operand, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lowprec, "operand_figures", counted)
    model = Tied()
    report = scan(model, torch.randn(4, 8, 64), loss_fn=lambda o: o.square().mean(),
                  formats="fp8,nvfp4")  # fmt: skip
    assert operands.count("weight") == 1
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    for fmt in ("fp8", "nvfp4"):
        a, b = recs[("a", "weight", fmt)], recs[("b", "weight", fmt)]
        assert replace(a, gemm="b", block=b.block) == b
        want = oracle_quantize(model.a.weight.detach().numpy(), fmt, "weight")
        w = model.a.weight.detach().numpy()
        assert a.error == pytest.approx(float(((want - w) ** 2).sum() / (w**2).sum()), rel=1e-5)


def test_formats_off_changes_nothing_and_on_changes_no_measurement() -> None:
    torch.manual_seed(0)
    model = Mixer()
    x = mixer_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    off = scan(model, x)
    on = scan(model, x, formats=["nvfp4", "fp8"])
    assert off.low_precision == ()
    assert {r.format for r in on.low_precision} == {"fp8", "nvfp4"}
    assert on.layers == off.layers and on.stream == off.stream  # the model ran the same
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "low-precision" in {s.check for s in off.skipped}


def test_report_carries_low_precision_through_json_schema_and_markdown() -> None:
    torch.manual_seed(0)
    report = scan(Mixer(), mixer_batch(), formats="mxfp8")
    data = json.loads(report.to_json())
    validate_report(data)
    assert len(data["low_precision"]) == len(report.low_precision) == 4 * 3
    assert Report.from_dict(data).low_precision == report.low_precision
    md = to_markdown(report)
    assert "#### Low precision" in md and "| `:matmul#1` | rhs | mxfp8 (e4m3) |" in md


def test_the_check_names_the_module_operand_and_format_of_a_planted_outlier() -> None:
    """Channel 7 of the first layer's input at 3·10^4 × the rest: per-tensor E4M3 flushes
    12% of that input, MXFP8's blocks ~0.6%: the check names `0`, input, fp8 only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))
    with torch.no_grad():
        model[0].weight[:, 7] *= 1e-4
    x = torch.randn(64, 256)
    x[:, 7] *= 3e4
    report = scan(model, x, formats="fp8,mxfp8")
    (f,) = [f for f in report.findings if f.check == "low-precision"]
    assert f.severity == "info" and f.layers == ("0",)  # not earned: docs/checks.md
    assert "0 input fp8 12%" in f.message and "mxfp8" not in f.message
    assert "SmoothQuant" in f.hint
    clean = scan(model, torch.randn(64, 256), formats="fp8,mxfp8")
    assert "low-precision" not in {f.check for f in clean.findings}


def test_a_tiny_loss_is_no_underflow_under_per_tensor_scaling() -> None:
    """Gradients of RMS ~1e-12 (the loss × 1e-10): E5M2 alone would flush them all, its
    per-tensor scale keeps them."""
    torch.manual_seed(0)
    report = scan(
        Mixer(), mixer_batch(), loss_fn=lambda o: o.square().mean() * 1e-10, formats="fp8"
    )
    grads = [r for r in report.low_precision if r.operand == "grad"]
    assert grads and all(r.underflow is not None and r.underflow < 1e-3 for r in grads)
    assert not [f for f in report.findings if f.check == "low-precision"]


@pytest.mark.slow  # transformers import (~10 s cold)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quiet_on_healthy_transformers_at_init_and_every_gemm_is_there(
    family: str, impl: str
) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl,
        )  # fmt: skip
        model, per_block = transformers.LlamaForCausalLM(cfg), 7 + 2
    else:
        cfg = transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, attn_implementation=impl
        )
        model, per_block = transformers.GPT2LMHeadModel(cfg), 4 + 2
    steps = 2 if impl == "sdpa" else 0  # and fp8 delayed scaling over two steps
    report = scan(model, formats="fp8,mxfp8,nvfp4", seq_len=32, steps=steps)
    gemms = {r.gemm for r in report.low_precision}
    assert len(gemms) == 2 * per_block + 1  # every projection, QKᵀ and PV, and the head
    pv = ":matmul#1" if impl == "eager" else ".sdpa.pv"
    assert sum(g.endswith(pv) for g in gemms) == 2 and "lm_head" in gemms
    assert {r.block for r in report.low_precision} == {0, 1, None}
    assert "low-precision" not in {f.check for f in report.findings}


# -- the check on planted records (pure: actscan/diagnose/lowprec.py) --------------------


def lp(gemm: str, operand: str, fmt: str, *, underflow: float = 0.0, error: float | None = None,
       rng: float = 10.0, block: int | None = 1) -> LowPrecRecord:  # fmt: skip
    r = FORMATS[fmt]
    nominal = {"fp8": 7.0e-4, "mxfp8": 8.6e-4, "nvfp4": 9.1e-3}[fmt]
    elem = r.element(operand).name
    if error is None:
        error = 2.8e-3 if elem == "e5m2" else nominal
    return LowPrecRecord(
        gemm, "linear", operand, fmt, elem, r.block, block, 1000, 1000, underflow, 0.0, error,
        rng, rng, 1,
    )  # fmt: skip


def judge(*records: LowPrecRecord) -> list[Finding]:
    c = replace(ctx(points=flat_stream(4)), low_precision=records)
    return [f for f in run_checks(c) if f.check == CheckId.LOW_PRECISION]


def test_check_thresholds_severity_and_remedy_by_cause() -> None:
    healthy = [lp(f"b.{i}", op, fmt) for i in range(3) for op in ("input", "weight", "grad")
               for fmt in FORMATS]  # fmt: skip
    assert judge(*healthy) == []
    # per-tensor fp8 flushes 6% of an input that MXFP8 keeps: reported (info: the
    # calibration did not earn a warning), smoothing or blocks
    (f,) = judge(*healthy, lp("b.x", "input", "fp8", underflow=0.06), lp("b.x", "input", "mxfp8"))
    assert f.severity is Severity.INFO and f.layers == ("b.x",)
    assert "b.x input fp8 6%" in f.message and "SmoothQuant" in f.hint
    assert "bf16" not in f.hint  # block 1 of 4 blocks: neither the first nor the last
    assert judge(lp("b.x", "input", "fp8", underflow=0.04)) == []  # under TE's 5%
    # NVFP4 flushes ~7% of any block by itself: not judged on underflow …
    assert judge(lp("b.x", "grad", "nvfp4", underflow=0.2)) == []
    # … but 10× its Gaussian error is reported, at info, with the FP4-gradient remedy
    (f,) = judge(lp("b.x", "grad", "nvfp4", error=0.1))
    assert f.severity is Severity.INFO and "Hadamard" in f.hint and "11×" in f.message
    # the head (outside the blocks) flushing its weight: keep it in bf16, check its init
    (f,) = judge(lp("lm_head", "weight", "fp8", underflow=0.5, block=None))
    assert "bf16" in f.hint and "init scale" in f.hint
    # a block spread beyond the element format's range: the outlier remedy
    (f,) = judge(lp("b.x", "input", "mxfp8", underflow=0.1, rng=25.0))
    assert "SmoothQuant" in f.hint
    th = replace(DEFAULT, lowprec_underflow=0.5)
    c = replace(
        ctx(points=flat_stream(4), th=th), low_precision=(lp("b", "input", "fp8", underflow=0.1),)
    )
    assert not [f for f in run_checks(c) if f.check == CheckId.LOW_PRECISION]


def test_odd_contractions_are_cast_or_skipped_without_breaking_the_pass() -> None:
    """A dot product (0-d output and gradient), a 3-operand einsum, an outer product."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = x.mean(0) * self.w[0]  # (needs a gradient)
            dot = torch.matmul(v, v)  # 0-d
            three = torch.einsum("bi,ij,bj->b", x, self.w, x)
            outer = torch.einsum("i,j->ij", v, v)
            return dot + three.sum() + outer.sum()

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    model = Odd()
    want = model(x)
    report = scan(model, x, loss_fn=lambda out: out, formats="fp8,nvfp4")
    got = {(r.gemm, r.operand) for r in report.low_precision}
    assert (":matmul#0", "grad") in got and (":einsum#1", "third") in got
    assert torch.equal(model(x), want)


def test_compare_shows_both_sides_low_precision() -> None:
    """Two inits side by side: the one with a planted outlier input loses more in fp8."""
    from rich.console import Console

    from actscan.compare.pairs import compare_reports
    from actscan.render.compare import lowprec_table

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    loud = x.clone()
    loud[:, 7] *= 3e4
    a, b = scan(model, x, formats="fp8"), scan(model, loud, formats="fp8")
    table = lowprec_table(compare_reports(a, b, label_a="plain", label_b="outlier"))
    assert table is not None
    console = Console(width=200, record=True)
    console.print(table)
    row = next(line for line in console.export_text().splitlines() if " input " in line)
    cells = row.split()
    assert cells[:5] == ["0", "input", "fp8", "e4m3", "0"]  # A flushes nothing …
    assert float(cells[5].rstrip("%")) > 5  # … B, the outlier's side, > 5%
    assert lowprec_table(compare_reports(a, scan(model, x))) is None


def test_sweep_shows_how_the_worst_operand_moves_with_size() -> None:
    from rich.console import Console

    from actscan.compare.sweep import Sweep, SweepPoint, row
    from actscan.render.compare import sweep_lowprec_table

    rows = []
    for width in (64, 128):
        torch.manual_seed(0)
        report = scan(Mixer(width), torch.randn(2, 16, width), formats="fp8,mxfp8")
        rows.append(row(SweepPoint("a", None, width, (("d", str(width)),)), report))
    sw = Sweep("mixer", (("a", "mixer"),), (), (64, 128), None, "d", tuple(rows))
    table = sweep_lowprec_table(sw)
    assert table is not None and table.row_count == 2 * 2  # 2 sizes × 2 formats
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "fp8" in text and "mxfp8" in text
    assert (
        sweep_lowprec_table(
            replace(sw, rows=(row(SweepPoint("a", None, 64, ()), scan(Mixer(), mixer_batch())),))
        )
        is None
    )


def test_plot_gets_a_low_precision_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from actscan.render.plot import plot_profile, profile_figure

    torch.manual_seed(0)
    report = scan(Mixer(), mixer_batch(), formats="fp8,nvfp4")
    fig = profile_figure(report)
    assert fig.formats == ("fp8", "nvfp4") and len(fig.lowprec) == 4
    up = dict(fig.lowprec)["up"]
    want = max(r.error or 0 for r in report.low_precision if r.gemm == "up" and r.format == "nvfp4")
    assert up[1] == want
    assert plot_profile(fig, tmp_path / "p.png").stat().st_size > 0
    assert profile_figure(scan(Mixer(), mixer_batch())).lowprec == ()


# -- attention's fused call: QKᵀ and PV inside scaled_dot_product_attention -------------


class SdpaAttention(nn.Module):
    """Grouped-query causal attention through F.scaled_dot_product_attention (4 query heads
    on 2 key/value heads, `enable_gqa`), keeping its q, k, v and output for the test."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, 4, d // 4).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 4, d // 4).transpose(1, 2).chunk(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=0.3, enable_gqa=True
        )
        if out.requires_grad:
            out.retain_grad()
        self.seen = {"q": q, "k": k, "v": v, "out": out}
        return self.o(out.transpose(1, 2).reshape(b, t, d))


def test_sdpa_qk_and_pv_are_gemms_matching_an_independent_recomputation() -> None:
    """`attn.sdpa.qk` casts q and k, `attn.sdpa.pv` the probabilities and v, their
    gradients the scores' and the output's: each figure against the oracle's cast of the
    same tensor recomputed here by plain autograd (explicit softmax, repeated kv heads)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", SdpaAttention())
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    want_out = model(x).detach()
    # the reference: the same call written out, with S as a leaf so autograd gives dS
    model(x).square().mean().backward()
    seen = model.attn.seen
    d_out = seen["out"].grad
    assert d_out is not None
    q, k, v = (seen[n].detach() for n in ("q", "k", "v"))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2)).requires_grad_()
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    p = torch.softmax((s * 0.3).masked_fill(~causal, -math.inf), -1)
    (ds,) = torch.autograd.grad(p @ vv, s, d_out)
    model.zero_grad()

    report = scan(model, x, loss_fn=lambda out: out.square().mean(), formats="fp8,mxfp8,nvfp4")
    assert torch.equal(model(x), want_out)  # the pass changed nothing
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    assert {(g, o) for g, o, _ in recs if ".sdpa." in g} == {
        ("attn.sdpa.qk", "q"), ("attn.sdpa.qk", "k"), ("attn.sdpa.qk", "grad"),
        ("attn.sdpa.pv", "probs"), ("attn.sdpa.pv", "v"), ("attn.sdpa.pv", "grad"),
    }  # fmt: skip
    assert {r.op for r in report.low_precision if ".sdpa." in r.gemm} == {"sdpa"}

    def want(t: torch.Tensor, fmt: str, operand: str = "input") -> tuple[float, float]:
        rows = t.reshape(-1, t.shape[-1]).numpy()
        qz = oracle_quantize(rows, fmt, operand)
        lost = ((qz == 0) & (rows != 0)).sum() / max((rows != 0).sum(), 1)
        return float(((qz - rows) ** 2).sum() / (rows**2).sum()), float(lost)

    cases = {
        ("attn.sdpa.qk", "q"): (q, "input"),
        ("attn.sdpa.qk", "k"): (k, "input"),  # Kᵀ contracts over k's last dim
        ("attn.sdpa.qk", "grad"): (ds.detach(), "grad"),
        ("attn.sdpa.pv", "probs"): (p.detach(), "input"),
        ("attn.sdpa.pv", "v"): (v.transpose(-1, -2), "input"),  # v contracts over its rows
        ("attn.sdpa.pv", "grad"): (d_out, "grad"),
    }
    for fmt in FORMATS:
        for (gemm, operand), (t, kind) in cases.items():
            r = recs[(gemm, operand, fmt)]
            err, lost = want(t, fmt, kind)
            assert r.values == t.numel()
            assert r.error == pytest.approx(err, rel=1e-4), (gemm, operand, fmt)
            assert r.underflow == pytest.approx(lost, abs=1e-6), (gemm, operand, fmt)
    assert recs[("attn.sdpa.qk", "grad", "fp8")].element == "e5m2"
    assert {r.block for r in report.low_precision} == {None}


# -- `--gemm-error`: the GEMM output's own error ------------------------------------------


def oracle_cast(t: torch.Tensor, fmt: str, contract_rows: bool = False) -> torch.Tensor:
    """Q(t) by the oracle, blocked along t's last dim (its rows when `contract_rows`)."""
    if contract_rows:
        return oracle_cast(t.transpose(-1, -2), fmt).transpose(-1, -2)
    rows = t.detach().reshape(-1, t.shape[-1]).double().float().numpy()
    return torch.from_numpy(oracle_quantize(rows, fmt)).reshape(t.shape)


def test_gemm_error_matches_an_independent_product_of_oracle_casts() -> None:
    """‖Q(X)Q(W)ᵀ − XWᵀ‖/‖XWᵀ‖ of a Linear, of an activation × activation matmul (its right
    operand blocked along its rows) and of SDPA's QKᵀ and PV, against the same products of
    the oracle's casts of the captured operands; the same figure on every operand row; off
    by default, and nothing without --formats."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mix", Mixer())
    model.add_module("attn", SdpaAttention())
    x = mixer_batch()
    seen: dict[str, torch.Tensor] = {}
    model.mix.register_forward_hook(lambda m, a, o: seen.__setitem__("h", m.up(a[0]).detach()))
    model.mix.up.register_forward_hook(lambda m, a, o: seen.__setitem__("up", a[0].detach()))
    model(x)
    model.mix._forward_hooks.clear()
    model.mix.up._forward_hooks.clear()
    att = {k: v.detach() for k, v in model.attn.seen.items()}
    h = seen["h"]
    scores = torch.softmax(h @ h.transpose(-1, -2) / 8, -1)
    q, k, v = att["q"], att["k"].repeat_interleave(2, 1), att["v"].repeat_interleave(2, 1)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal, -math.inf), -1)

    def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
        return float((got - ref).norm() / ref.norm())

    report = scan(model, x, formats="fp8,mxfp8,nvfp4", gemm_error=True)
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    for fmt in FORMATS:
        w = model.mix.up.weight.detach()
        xs = seen["up"]
        want = {
            "mix.up": rel(oracle_cast(xs, fmt) @ oracle_cast(w, fmt).T, xs @ w.T),
            "mix:matmul#1": rel(
                oracle_cast(scores, fmt) @ oracle_cast(h, fmt, contract_rows=True), scores @ h
            ),
            "attn.sdpa.qk": rel(
                oracle_cast(q, fmt) @ oracle_cast(k, fmt).transpose(-1, -2), q @ k.transpose(-1, -2)
            ),
            "attn.sdpa.pv": rel(
                oracle_cast(p, fmt) @ oracle_cast(v, fmt, contract_rows=True), p @ v
            ),
        }
        for gemm, value in want.items():
            rows = [r for (g, _, f), r in recs.items() if g == gemm and f == fmt]
            assert len(rows) == 3  # both operands and the gradient carry the GEMM's figure
            for r in rows:
                assert r.gemm_error == pytest.approx(value, rel=1e-4), (gemm, fmt)
    fp4, fp8 = (recs[("mix.up", "input", f)].gemm_error for f in ("nvfp4", "fp8"))
    assert fp4 is not None and fp8 is not None and fp4 > fp8
    validate_report(json.loads(report.to_json()))
    assert "GEMM error" in to_markdown(report)
    assert all(r.gemm_error is None for r in scan(model, x, formats="fp8").low_precision)
    assert scan(model, x, gemm_error=True).low_precision == ()


# -- fp8 delayed scaling over --steps ---------------------------------------------------


def delayed_oracle(batches: list[np.ndarray]) -> tuple[float, float, float, bool]:
    """Delayed scaling written out: step t ≥ 1 casts with 448 / max(amax of steps < t)."""
    hist = np.float32(np.abs(batches[0]).max())
    flushed = saturated = nonzero = 0
    err = sq = 0.0
    grew = False
    for x in batches[1:]:
        scale = np.float32(448.0) / hist
        y = np.abs(x) * scale
        q = oracle_round(y, E4M3) / scale
        nonzero += int((x != 0).sum())
        flushed += int(((q == 0) & (x != 0)).sum())
        saturated += int((y > 448.0).sum())
        err += float(((q - np.abs(x)).astype(np.float64) ** 2).sum())
        sq += float((x.astype(np.float64) ** 2).sum())
        grew |= bool(np.abs(x).max() > hist)
        hist = max(hist, np.float32(np.abs(x).max()))
    return flushed / nonzero, saturated / nonzero, err / sq, grew


@pytest.mark.parametrize("grow", [1.0, 4.0])
def test_delayed_scaling_over_steps_matches_an_independent_history(grow: float) -> None:
    """The first Linear's input is step t's batch itself (× grow^t): its delayed figures
    against the history written out again; growing 4× a step saturates (an info finding
    naming it), a steady input is quiet. Weights barely move (SGD, lr 1e-9)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(32, 64, generator=g) for _ in range(4)]

    def batch(i: int) -> torch.Tensor:
        return base[i % 4] * grow ** min(i, 8)

    report = scan(
        model, inputs=batch, loss_fn=lambda o: o.square().mean(), formats="fp8,mxfp8",
        steps=3, optimizer="sgd", lr=1e-9,
    )  # fmt: skip
    recs = {(r.gemm, r.operand, r.format): r for r in report.low_precision}
    r = recs[("0", "input", "fp8")]
    uf, sat, err, grew = delayed_oracle([batch(t).numpy() for t in range(4)])
    assert r.steps == 3 and r.amax_grew is grew
    assert r.delayed_underflow == pytest.approx(uf, abs=1e-9)
    assert r.delayed_saturation == pytest.approx(sat, abs=1e-9)
    assert r.delayed_error == pytest.approx(err, rel=1e-4)
    assert recs[("0", "grad", "fp8")].steps == 2  # the last step runs no backward
    assert recs[("0", "input", "mxfp8")].delayed_saturation is None  # fp8 only
    validate_report(json.loads(report.to_json()))
    assert "delayed saturation" in to_markdown(report)
    delayed = [f for f in report.findings if f.check == "low-precision" and "delayed" in f.message]
    if grow == 1.0:
        assert not delayed and sat == 0.0
    else:
        (f,) = delayed
        assert f.severity == "info" and "0 input" in f.message and sat > 0.2
    off = scan(model, inputs=batch, formats="fp8")  # no steps: no delayed figures
    assert all(x.steps == 0 and x.delayed_saturation is None for x in off.low_precision)


# -- distributed: the ranks' records merged (actscan.distributed.merge.merge_state) ------


@pytest.mark.slow  # two processes (gloo on CPU)
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
def test_two_ranks_merge_the_low_precision_records_exactly(tmp_path: Path) -> None:
    """`--nproc 2`: every record merged over the ranks' rows. Against one process: the
    counts of values cast and the calls are exact everywhere; MXFP8 (its scales are per
    32-block within a row) and every weight (the same whole weight on both ranks) agree
    in every figure, counts exactly, sums to 1e-6; fp8 / NVFP4 activations differ only
    through each rank's own per-tensor scale, as data-parallel training casts them."""
    from test_distributed import BATCH, BUILTIN, SEQ, _env, _profile2

    from actscan.api import TargetSpec, scan_target
    from actscan.settings import Settings

    cfg = tmp_path / "deep.yaml"
    cfg.write_text(BUILTIN)
    out = tmp_path / "r2.json"
    fmts = "fp8,mxfp8,nvfp4"
    res = _profile2(cfg, out, _env(), "--formats", fmts, "--gemm-error")
    assert res.returncode == 0, res.stderr
    two = json.loads(out.read_text())
    assert not [n for n in two["notes"] if "not merged" in n]
    settings = Settings(batch=BATCH, seq_len=SEQ, formats=fmts, gemm_error=True)
    one = scan_target(TargetSpec(str(cfg)), settings).report.to_dict()
    a = {(r["gemm"], r["operand"], r["format"]): r for r in one["low_precision"]}
    b = {(r["gemm"], r["operand"], r["format"]): r for r in two["low_precision"]}
    assert set(a) == set(b) and len(a) > 100
    counts = ("values", "nonzero", "calls")
    for key, ra in a.items():
        rb = b[key]
        assert [ra[k] for k in counts] == [rb[k] for k in counts], key
        if key[2] == "mxfp8" or key[1] == "weight":
            for k in ("underflow", "saturation", "error", "range_worst", "range_mean"):
                x, y = ra[k], rb[k]
                assert (x is None) == (y is None), (key, k)
                if x is not None:
                    assert abs(x - y) <= 1e-6 * max(abs(x), abs(y), 1e-30), (key, k, x, y)
    # a weight's GEMM error mixes its rows' inputs: present on both, finite
    assert all(r["gemm_error"] is not None for r in b.values() if r["operand"] == "weight")


@pytest.mark.slow  # two processes (gloo on CPU), FSDP2-sharded steps
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
def test_two_ranks_share_the_delayed_scaling_history(tmp_path: Path) -> None:
    """`--nproc 2 --steps 2 --formats fp8`: the amax history is MAX-reduced over the ranks
    before each step, so each rank casts its rows under the scale one process uses for
    the whole batch, and the figures summed over the ranks equal one process's (to the
    few values the ranks' slightly different weights move across a rounding boundary).
    Each rank's own history would saturate more: its rows' amax is below the batch's."""
    from test_distributed import JOB_TIMEOUT_S, STEPS, TINY, _env

    from actscan.api import TargetSpec, scan_target
    from actscan.settings import Settings

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "r2.json"
    cmd = [sys.executable, "-m", "actscan", "profile", str(cfg), "--nproc", "2", *STEPS,
           "--formats", "fp8", "--json", str(out), "-q"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=_env())
    assert res.returncode in (0, 1), res.stderr
    two = json.loads(out.read_text())
    assert not [n for n in two["notes"] if "not merged" in n]
    settings = Settings(batch=8, seq_len=16, steps=2, lr=0.2, eps=1e-3, formats="fp8")
    one = scan_target(TargetSpec(str(cfg)), settings).report.to_dict()
    a = {(r["gemm"], r["operand"]): r for r in one["low_precision"]}
    b = {(r["gemm"], r["operand"]): r for r in two["low_precision"]}
    assert set(a) == set(b)
    keys = ("delayed_underflow", "delayed_saturation", "delayed_error")
    compared = saturating = 0
    for key, ra in a.items():
        rb = b[key]
        assert ra["steps"] == rb["steps"], key
        if ra["steps"] == 0 or key[1] == "weight":
            continue  # a weight is the whole gathered weight on both: not the merge's test
        for k in keys:
            x, y = ra[k], rb[k]
            assert (x is None) == (y is None), (key, k)
            if x is not None:
                assert abs(x - y) <= 2e-3 * max(abs(x), abs(y)) + 1e-4, (key, k, x, y)
                compared += 1
        saturating += ra["delayed_saturation"] > 0
    assert compared >= 30 and saturating >= 3


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
def test_fsdp_sharded_conv1d_weights_stay_weights(tmp_path: Path) -> None:
    """GPT-2's Conv1D runs addmm(bias, x, W): W is the weight only by being a parameter.
    Under FSDP2 the module holds the gathered, unsharded W while it runs (new storage,
    not the shard the watch saw at its start): the records still name input and weight,
    with the figures of the unsharded model (rank 0 of a 1-rank gloo group)."""
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from actscan.distributed.fsdp import shard_model
    from actscan.distributed.runtime import DistRun, active

    def build() -> nn.Module:
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
        return GPT2LMHeadModel(cfg).eval()

    ids = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    plain = {(r.gemm, r.operand): r for r in scan(build(), inputs=ids, formats="fp8").low_precision}
    model = build()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        shard_model(model, ["transformer.h.0", "transformer.h.1"], torch.device("cpu"))
        run = DistRun(
            rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu")
        )
        with active(run):
            sharded = {
                (r.gemm, r.operand): r for r in scan(model, inputs=ids, formats="fp8").low_precision
            }
    finally:
        dist.destroy_process_group()
    assert set(sharded) == set(plain)
    conv = [k for k in plain if k[0].endswith(("c_attn", "c_fc", "mlp.c_proj", "attn.c_proj"))]
    assert {op for _, op in conv} >= {"input", "weight"} and len(conv) >= 16
    for key in conv:
        a, b = plain[key], sharded[key]
        assert (a.values, a.nonzero) == (b.values, b.nonzero), key
        assert b.error == pytest.approx(a.error, rel=1e-6), key


def test_without_numba_the_report_says_the_casts_ran_as_torch_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slower path is not silent: a note names it and the extra that compiles the
    casts; with numba, no note."""
    model, x = Mixer(), mixer_batch()

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    def slow_note(report: Report) -> list[str]:
        return [n for n in report.notes if "actscan[fast]" in n]

    if fused_casts.available():
        assert not slow_note(scan(model, x, loss_fn=loss, formats="fp8"))
    monkeypatch.setattr(fused_casts, "_kernels", lambda: None)
    assert slow_note(scan(model, x, loss_fn=loss, formats="fp8"))
    assert not slow_note(scan(model, x, loss_fn=loss))  # formats off: nothing to say
