"""The recorder's fast path against an independent fp64 reference.

The reference keeps a float64 copy of every recorded output and gradient (hooks of its
own) and computes each statistic directly; the Recorder must agree to 1e-5 relative
(mean, std, RMS, gradient RMS) and exactly (max-abs, per-channel max-abs, zero and
non-finite counts). Planted tensors cover what the fast path special-cases: -0.0, NaN,
±inf, fp16/bf16, non-contiguous outputs, 0-d and 1-d outputs, outputs split into chunks,
outputs shared by nested modules and in-place changes between two hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actscan.measure.recorder as recmod
from actscan.measure import fused_reduce
from actscan.measure.recorder import RawStats, Recorder, iter_named
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model

REL = 1e-5


@pytest.fixture(autouse=True, params=["torch", "compiled"])
def reduce_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test two ways: the recorder's torch passes, and the compiled read of an
    output (actscan/measure/fused_reduce.py, with llvmlite: the dev extras install it)."""
    if request.param == "torch":
        monkeypatch.setattr(fused_reduce, "_kernels", lambda: None)
    else:
        pytest.importorskip("llvmlite", reason="llvmlite (the `fast` extra) is not installed")
        assert fused_reduce.available()  # installed, so the loop must build
    return str(request.param)


# -- an independent fp64 reference ------------------------------------------------------
class Reference:
    """Keeps float64 copies of outputs and output-gradients; statistics computed directly."""

    def __init__(self, targets: Sequence[tuple[str, nn.Module]]) -> None:
        self.outs: dict[str, list[torch.Tensor]] = {n: [] for n, _ in targets}
        self.grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in targets}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in targets]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: Any, out: Any) -> None:
            t = recmod.first_tensor(out)
            if t is None:
                return
            self.outs[name].append(t.detach().to(torch.float64).clone())
            if t.requires_grad:
                t.register_hook(lambda g: self.grads[name].append(g.to(torch.float64).clone()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def stats(self, name: str) -> dict[str, Any]:
        xs = self.outs[name]
        flat = torch.cat([x.reshape(-1) for x in xs])
        fin = flat[torch.isfinite(flat)]
        out: dict[str, Any] = {
            "numel": flat.numel(),
            "mean": flat.mean().item(),
            "std": flat.var(correction=0).sqrt().item(),
            "rms": flat.square().mean().sqrt().item(),
            "zeros": int((flat == 0).sum()),
            "nonfinite": flat.numel() - fin.numel(),
            "max_abs": flat.abs().max().item(),
        }
        widths = {x.shape[-1] if x.dim() else 1 for x in xs}
        if len(widths) == 1:
            c = widths.pop()
            rows = torch.cat([x.reshape(-1, c) for x in xs])
            out["channel_max"] = tuple(rows.abs().amax(0).tolist())
        gs = self.grads[name]
        if gs:
            g = torch.cat([x.reshape(-1) for x in gs])
            out["grad_rms"] = g.square().mean().sqrt().item()
        return out


def close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0) or (math.isnan(a) and math.isnan(b))


def check_against(
    raw: RawStats, ref: dict[str, Any], *, batches: int = 1, channels: bool = True
) -> None:
    """The whole contract of one RawStats vs the fp64 reference."""
    where = raw.name
    assert raw.numel == ref["numel"], where
    assert raw.zeros == ref["zeros"], where
    assert raw.nonfinite == ref["nonfinite"], where
    std = math.sqrt(raw.var) if raw.var >= 0 else float("nan")
    rms = math.sqrt(raw.var + raw.mean * raw.mean)
    if ref["nonfinite"]:
        assert not math.isfinite(raw.mean) and not math.isfinite(raw.max_abs), where
        return
    assert raw.max_abs == ref["max_abs"], where  # exact: a max is a value of the tensor
    # mean: relative to its magnitude, or to the RMS when it is ~0 by construction
    assert abs(raw.mean - ref["mean"]) <= REL * max(abs(ref["mean"]), 1e-3 * ref["rms"]), where
    assert close(std, ref["std"]), (where, std, ref["std"])
    assert close(rms, ref["rms"]), (where, rms, ref["rms"])
    if channels and "channel_max" in ref:
        assert raw.channel_max == ref["channel_max"], where
    elif not channels:
        assert raw.channel_max is None, where
    if "grad_rms" in ref:
        assert raw.grad_sumsq is not None, where  # per batch: Σ over batches / batches
        grad_rms = math.sqrt(raw.grad_sumsq * batches / raw.grad_numel)
        assert close(grad_rms, ref["grad_rms"]), (where, grad_rms, ref["grad_rms"])


def run_recorder(
    model: nn.Module,
    batches: Sequence[Any],
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    channels: bool = True,
    reference: bool = True,
) -> tuple[dict[str, RawStats], Reference | None]:
    """Drive the Recorder exactly as scan() does (one batch = fwd, grads, end_batch)."""
    targets = list(iter_named(model, None))
    params = [p for p in model.parameters() if p.requires_grad]
    ref = Reference(targets) if reference else None
    try:
        with Recorder(targets, channels=channels) as rec:
            for b in batches:
                out = model(b)
                if params:
                    value = loss(out) if loss else recmod.first_tensor(out).float().square().mean()
                    grads = torch.autograd.grad(value, params, allow_unused=True)
                    rec.add_param_grads(dict(zip(params, grads, strict=True)))
                rec.end_batch()
            raw = rec.result(len(batches))
    finally:
        if ref:
            ref.remove()
    return raw, ref


# -- the built-in transformer, end to end --------------------------------------------------
def tiny_gpt(**kw: Any) -> nn.Module:
    cfg = ArchConfig(n_layers=3, d_model=64, n_heads=4, vocab_size=128, seq_len=32, **kw)
    return build_model(cfg, seed=0).eval()


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long),
    )


@pytest.mark.parametrize("kw", [{}, {"activation": "relu", "mlp_bias_init": -0.05}])
def test_gpt_matches_fp64_reference_over_batches(kw: dict[str, Any]) -> None:
    model = tiny_gpt(**kw)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(3)]
    raw, ref = run_recorder(model, batches, loss=lm_loss)
    assert ref is not None
    for name, outs in ref.outs.items():
        if not outs:  # containers (ModuleList) are never called
            assert raw[name].calls == 0 and raw[name].numel == 0
            continue
        assert raw[name].calls == len(outs) == 3
        check_against(raw[name], ref.stats(name), batches=3)
    assert raw["blocks.0.mlp.up"].param_grad_sumsq > 0
    if kw:  # relu with a negative bias: many exact zeros, counted exactly
        assert raw["blocks.0.mlp.act"].zeros > 0.3 * raw["blocks.0.mlp.act"].numel


def test_hooks_do_not_change_outputs_or_gradients() -> None:
    model = tiny_gpt()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    params = list(model.parameters())

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = model(ids)
        return out.detach(), torch.autograd.grad(lm_loss(out), params)

    plain_out, plain_g = step()
    with Recorder(list(iter_named(model, None))):
        hooked_out, hooked_g = step()
    assert torch.equal(plain_out, hooked_out)
    assert all(torch.equal(a, b) for a, b in zip(plain_g, hooked_g, strict=True))


# -- planted tensors ---------------------------------------------------------------------
class Emit(nn.Module):
    """Returns a planted tensor (times a weight, so there is a gradient)."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.make = make
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.make(x * self.w)


def planted(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0, 0, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 1e-42])  # ±0 and a subnormal
    y[1, 3, 7] = 3e4  # its square overflows fp16, not the fp32 the recorder squares in
    return y


OFFSET = 3.0


@pytest.mark.parametrize(
    ("label", "make"),
    [
        ("zeros-and-big", planted),
        ("offset-mean", lambda x: x + OFFSET),  # mean = 3·std: Σx² must be accurate
        ("non-contiguous", lambda x: x.transpose(0, 2)),
        ("one-d", lambda x: x.reshape(-1)),
        ("scalar", lambda x: x.sum()),
        ("relu", torch.relu),
        ("fp16", lambda x: x.half()),
        ("bf16", lambda x: x.bfloat16()),
        ("fp64", lambda x: x.double()),
    ],
)
@pytest.mark.parametrize("chunk", [0, 96, 7])  # default, row chunks, rows wider than a chunk
def test_planted_tensor_matches_fp64(
    label: str, make: Callable[[torch.Tensor], torch.Tensor], chunk: int, monkeypatch: Any
) -> None:
    if chunk:
        for name in ("_CHUNK", "_WHOLE", "_MAX_CHANNELS"):
            monkeypatch.setattr(recmod, name, chunk)
        monkeypatch.setattr(recmod, "_WIDE_CHANNELS", 8)  # channel results via the scratch
    else:
        chunk = recmod._MAX_CHANNELS
    model = nn.Sequential(Emit(make))
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 6, 16, generator=gen) for _ in range(2)]
    raw, ref = run_recorder(model, batches)
    assert ref is not None
    out = make(batches[0])
    width = out.shape[-1] if out.dim() else 1
    # rows wider than a chunk are reduced flat: no per-channel statistics
    check_against(raw["0"], ref.stats("0"), batches=2, channels=width <= chunk)


def test_nonfinite_counts_are_exact(monkeypatch: Any) -> None:
    for name in ("_CHUNK", "_WHOLE"):  # the counts are summed over chunks
        monkeypatch.setattr(recmod, name, 40)

    def poison(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[0, 0, 0] = float("nan")
        y[0, 2, 1] = float("inf")
        y[3, 5, 15] = float("-inf")
        y[2, 1, :3] = 0.0
        return y

    model = nn.Sequential(Emit(poison))
    batches = [torch.randn(4, 6, 16) for _ in range(3)]
    raw, ref = run_recorder(model, batches)
    assert ref is not None
    r = raw["0"]
    assert r.nonfinite == 9 == ref.stats("0")["nonfinite"]
    assert r.zeros == 9 == ref.stats("0")["zeros"]
    assert math.isnan(r.mean) and r.channel_max is not None
    assert math.isnan(r.channel_max[0]) and r.channel_max[1] == math.inf
    assert r.channel_max[15] == math.inf and math.isfinite(r.channel_max[2])


@pytest.mark.parametrize("wide", [False, True])
def test_shared_output_is_reduced_once_but_counted_for_every_module(
    wide: bool, monkeypatch: Any
) -> None:
    if wide:  # per-channel results in the scratch, read by the module that shares them
        monkeypatch.setattr(recmod, "_WIDE_CHANNELS", 8)

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(16, 16)
            self.ident = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ident(self.inner(x))

    model = nn.Sequential(Wrap(), nn.Linear(16, 16))  # "1" reuses the scratch after "0"
    raw, ref = run_recorder(model, [torch.randn(4, 16) for _ in range(2)])
    assert ref is not None
    for name in ("0", "0.inner", "0.ident", "1"):
        check_against(raw[name], ref.stats(name), batches=2)
        assert raw[name].calls == 2 and raw[name].channel_max is not None
    assert raw["0"].grad_sumsq == raw["0.inner"].grad_sumsq == raw["0.ident"].grad_sumsq
    assert raw["0.inner"].param_grad_sumsq and raw["0"].param_grad_sumsq is None


def test_in_place_change_between_hooks_is_not_mistaken_for_a_shared_output() -> None:
    class Doubler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).mul_(2.0)  # same object, new version

    model = nn.Sequential(Doubler())
    x = torch.randn(5, 8)
    raw, ref = run_recorder(model, [x])
    assert ref is not None
    # the reference copied the inner output before mul_ (it hooks after the Recorder)
    assert raw["0"].max_abs == pytest.approx(2 * raw["0.inner"].max_abs, rel=1e-6)
    check_against(raw["0"], ref.stats("0"))


def test_channels_off_and_width_change() -> None:
    model = nn.Sequential(Emit(lambda x: x))
    batches = [torch.randn(3, 16), torch.randn(3, 24)]
    raw, ref = run_recorder(model, batches, channels=True)
    assert ref is not None
    assert raw["0"].channel_max is None  # two widths: per-channel stats are void
    assert raw["0"].max_abs == ref.stats("0")["max_abs"]
    raw_off, _ = run_recorder(model, batches[:1], channels=False, reference=False)
    assert raw_off["0"].channel_max is None
    assert raw_off["0"].max_abs == batches[0].abs().max().item()


# -- batches: Chan merge and flat memory ----------------------------------------------------
def test_chan_merge_over_batches_equals_the_whole() -> None:
    """Element-wise model: 4 batches of 2 rows give the stats of 1 batch of 8 rows.

    Element-wise, so the activations are bit-identical however the rows are batched
    (a matmul over 2 rows and over 8 may differ in the last bit); the sums are not
    grouped the same way (fp32 partial sums), hence 1e-6 for mean and variance.
    """
    model = nn.Sequential(Emit(lambda x: 1.5 * x + 1), nn.GELU(), nn.Tanh())
    whole = torch.randn(8, 5, 16) * 3 + 1
    loss = lambda out: out.square().sum()  # noqa: E731  (gradients independent of batching)
    split, _ = run_recorder(model, list(whole.split(2)), loss=loss, reference=False)
    one, _ = run_recorder(model, [whole], loss=loss, reference=False)
    for name in one:
        a, b = split[name], one[name]
        assert a.numel == b.numel and a.calls == 4 and b.calls == 1
        assert a.mean == pytest.approx(b.mean, rel=1e-6)
        assert a.var == pytest.approx(b.var, rel=1e-6)
        assert a.max_abs == b.max_abs and a.channel_max == b.channel_max
        assert a.zeros == b.zeros and a.nonfinite == b.nonfinite
        assert a.grad_sumsq * 4 == pytest.approx(b.grad_sumsq, rel=1e-6)  # per-batch mean


def _held_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable through lists, tuples and dicts (and the Recorder)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Recorder):
        return _held_bytes(list(vars(obj).values()))
    if isinstance(obj, dict):
        return _held_bytes(list(obj.values()))
    if isinstance(obj, list | tuple):
        return sum(_held_bytes(o) for o in obj)
    return 0


@pytest.mark.slow
def test_memory_is_flat_in_the_number_of_batches() -> None:
    model = tiny_gpt()
    params = list(model.parameters())
    held = []
    with Recorder(list(iter_named(model, None))) as rec:
        for i in range(16):
            ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i))
            grads = torch.autograd.grad(lm_loss(model(ids)), params)
            rec.add_param_grads(dict(zip(params, grads, strict=True)))
            assert len(rec._grad_hooks) > 0  # this batch's gradient hooks, one per output
            rec.end_batch()
            assert not rec._pend and not rec._g_rows and not rec._c_idx
            assert len(rec._grad_hooks) == 0  # removed with their batch: none pile up
            held.append(_held_bytes(rec))
        raw = rec.result(16)
    assert held[0] == held[-1] == max(held)
    assert raw["head"].calls == 16


# -- scan's other fast paths: parameter moments, the model build -------------------------
def test_moments_match_fp64_and_count_nonfinite_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    bad = torch.randn(40, 24, generator=gen)
    bad[3, 4], bad[7, 0], bad[9, 9] = float("nan"), float("inf"), float("-inf")
    tensors = [
        torch.randn(300, 64, generator=gen) * 0.02 + 0.5,  # far from 0: the Welford path
        torch.randn(1200, 1000, generator=gen) * 0.02 + 0.01,  # large: the fast path
        torch.randn(7, generator=gen),  # 1-d
        torch.tensor(2.5),  # 0-d
        torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        torch.randn(64, 32, 3, 3, generator=gen) * 0.1 - 0.02,  # a conv weight: 4-d, large
        bad,
        torch.zeros(0),
        torch.arange(6),  # integer: skipped
    ]
    got = recmod.moments(tensors)
    for t, (mean, std, nonfinite) in zip(tensors[:6], got[:6], strict=True):
        ref = t.detach().to(torch.float64)
        assert mean == pytest.approx(ref.mean().item(), rel=REL)
        assert std == pytest.approx(ref.var(correction=0).sqrt().item(), rel=REL, abs=1e-12)
        assert nonfinite == 0
    assert got[6][2] == 3 and not math.isfinite(got[6][0])
    assert got[7] == got[8] == (0.0, 0.0, 0)


def test_channel_summary_matches_the_python_statistics(monkeypatch: Any) -> None:
    """Dead/live counts, median and max of the live channels come from the device in one
    sort; layer_record uses them instead of Python lists: they must agree exactly."""
    import statistics

    from actscan.diagnose.thresholds import DEFAULT
    from actscan.measure.stats import channel_outliers

    def plant(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[..., 0], y[..., 1] = 0.0, float("nan")  # a dead channel, a NaN channel
        y[0, 0, 2] = float("inf")
        y[1, 2, 3] = 40.0  # an outlier channel
        return y

    for make in (plant, lambda x: x[..., :3], lambda x: torch.relu(x - 9.0)):
        model = nn.Sequential(Emit(make))
        raw, _ = run_recorder(model, [torch.randn(4, 6, 16) for _ in range(2)], reference=False)
        r = raw["0"]
        assert r.channel_max is not None
        live = [v for v in r.channel_max if v > 0 and math.isfinite(v)]
        assert r.channel_dead == sum(v == 0.0 for v in r.channel_max)
        assert r.channel_live == len(live)
        assert r.channel_median == (statistics.median(live) if live else 0.0)
        assert r.channel_top == (max(live) if live else None)
        summary = (r.channel_dead, r.channel_live, r.channel_median, r.channel_top)
        assert channel_outliers(r.channel_max, DEFAULT, summary) == channel_outliers(
            r.channel_max, DEFAULT
        )
    assert channel_outliers(raw["0"].channel_max, DEFAULT)[3] == 16  # relu(x − 9): all dead


@pytest.mark.slow
def test_small_outputs_on_one_thread_leave_the_thread_count_alone() -> None:
    """Outputs up to _SERIAL values are reduced with torch's thread count set to 1 and put
    back after each hook, also when the hook raises."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = tiny_gpt()
        seen: list[int] = []
        handle = model.blocks[1].register_forward_pre_hook(  # after blocks.0's hooks
            lambda *_: seen.append(torch.get_num_threads())
        )
        gen = torch.Generator().manual_seed(4)
        batches = [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(2)]
        raw, ref = run_recorder(model, batches, loss=lm_loss)
        handle.remove()
        assert seen == [2, 2] and torch.get_num_threads() == 2
        assert ref is not None
        check_against(raw["blocks.0"], ref.stats("blocks.0"), batches=2)
        boom = nn.Sequential(Emit(lambda x: x))
        with Recorder(list(iter_named(boom, None))) as rec:
            rec._reduce = lambda *_: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="boom"):
                boom(torch.randn(3, 4))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_compiled_read_matches_fp64_and_the_torch_passes(reduce_path: str) -> None:
    """One compiled read of an fp32 output gives the torch passes' figures: Σx and row
    norms to fp64 within fp32 rounding, counts and per-channel extrema exactly, on any
    thread count; a NaN stays in its column's max and min (first row or later), as in
    torch's amax and amin."""
    if reduce_path == "torch":
        pytest.skip("the compiled read itself")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(700, 1024, generator=gen) * 3 + 0.5
    x[3, 7] = 0.0
    x[10, :5] = -0.0
    x64 = x.double()
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            s, norms, counts, hi, lo = fused_reduce.reduce(x)
            assert s.dtype == torch.float64
            assert s.item() == pytest.approx(x64.sum().item(), rel=1e-6)
            assert torch.allclose(norms.double(), x64.norm(dim=1), rtol=1e-6, atol=0)
            assert counts.tolist() == [x.numel(), 6]
            assert torch.equal(hi, x.amax(0)) and torch.equal(lo, x.amin(0))
        y = x.clone()
        y[5, 2], y[6, 3], y[7, 3] = float("nan"), float("inf"), float("-inf")
        y[0, 4] = float("nan")
        s, norms, counts, hi, lo = fused_reduce.reduce(y)
        assert counts.tolist() == [x.numel() - 4, 6] and math.isnan(s.item())
        assert math.isnan(norms[5]) and norms[6] == math.inf and norms[7] == math.inf
        assert math.isnan(hi[2]) and math.isnan(lo[2]) and math.isnan(hi[4])
        assert math.isnan(lo[4]) and hi[3] == math.inf and lo[3] == -math.inf
        assert torch.allclose(hi, y.amax(0), rtol=0, atol=0, equal_nan=True)
        assert torch.allclose(lo, y.amin(0), rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)


def test_parameter_moments_of_a_large_tensor_match_an_fp64_recomputation(reduce_path: str) -> None:
    """A large parameter's mean and std (compiled: the one-read fp64 sums of
    `fused_reduce.sums`; torch: fp32 row sums and norms) against an fp64 recomputation;
    an offset tensor (mean² ≫ var) is measured again exactly either way."""
    from actscan.measure.recorder import moments

    g = torch.Generator().manual_seed(11)
    plain = 0.02 * torch.randn(1 << 20, generator=g).reshape(1024, 1024)
    offset = 3.0 + 0.01 * torch.randn(70_001, generator=g)
    tol = 1e-9 if reduce_path == "compiled" else 1e-5  # fp64 sums vs fp32 rows
    for (mean, std, bad), t in zip(moments([plain, offset]), (plain, offset), strict=True):
        wm, ws = float(t.double().mean()), float(t.double().std(correction=0))
        assert bad == 0
        assert mean == pytest.approx(wm, abs=tol * ws)  # near 0: judged against the spread
        assert std == pytest.approx(ws, rel=tol)
