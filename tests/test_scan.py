"""The measuring engine end to end: statistics vs an fp64 recomputation, Chan merging,
bit-identical outputs, hook hygiene, and the √k property of the residual stream."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from actscan.measure.inputs import random_tokens
from actscan.measure.recorder import Recorder, first_tensor, iter_named
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.run import scan

SMALL = dict(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=16)


def tiny(**kw: object) -> nn.Module:
    return build_model(ArchConfig(**{**SMALL, **kw}))  # type: ignore[arg-type]


def reference(model: nn.Module, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Independent fp64 statistics of every module output and its gradient."""
    outs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []

    def make(name: str):
        def hook(_m: nn.Module, _a: object, out: object) -> None:
            t = first_tensor(out)
            if t is None:
                return
            outs[name] = t.detach().double().clone()
            if t.requires_grad:
                t.register_hook(lambda g: grads.__setitem__(name, g.detach().double().clone()))

        return hook

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_hook(make(name)))
    model.eval()
    try:
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    ref = {}
    for name, x in outs.items():
        flat = x.flatten()
        chan = x.reshape(-1, x.shape[-1]).abs().amax(0)
        ref[name] = {
            "mean": flat.mean().item(),
            "std": flat.std(unbiased=False).item(),
            "rms": flat.square().mean().sqrt().item(),
            "max_abs": flat.abs().max().item(),
            "zero_frac": (flat == 0).double().mean().item(),
            "chan_ratio": (chan.max() / chan[chan > 0].quantile(0.5)).item()
            if x.shape[-1] >= 4
            else None,
        }
        if name in grads:
            g = grads[name].flatten()
            ref[name]["grad_rms"] = g.square().mean().sqrt().item()
            ref[name]["grad_norm"] = g.norm().item()
    return ref


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_statistics_match_fp64_recomputation() -> None:
    model = tiny(activation="relu")
    ids = random_tokens(128, 4, 16, seed=0, index=0)
    ref = reference(model, ids)
    report = scan(
        model,
        inputs=ids,
        loss_fn=lambda out: nn.functional.cross_entropy(
            out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        ),
    )
    checked = 0
    for rec in report.layers:
        r = ref[rec.name]
        assert rel(rec.rms, r["rms"]) <= 1e-5, rec.name
        assert rel(rec.std, r["std"]) <= 1e-5 or abs(rec.std - r["std"]) < 1e-9, rec.name
        assert abs(rec.mean - r["mean"]) <= 1e-5 * max(r["rms"], 1e-12), rec.name
        assert rec.max_abs == pytest.approx(r["max_abs"], rel=0, abs=0), rec.name  # exact
        assert rec.zero_frac == pytest.approx(r["zero_frac"], abs=1e-12), rec.name
        if r["chan_ratio"] is not None and rec.channel_max_ratio is not None:
            assert rel(rec.channel_max_ratio, r["chan_ratio"]) <= 1e-5, rec.name
        if "grad_rms" in r:
            assert rec.grad_rms is not None, rec.name
            assert rel(rec.grad_rms, r["grad_rms"]) <= 1e-5, rec.name
            assert rel(rec.grad_norm, r["grad_norm"]) <= 1e-5, rec.name
        checked += 1
    assert checked >= 40
    # ReLU outputs really have zeros, so the zero fraction is exercised
    act = report.layer("blocks.0.mlp.act")
    assert 0.3 < act.zero_frac < 0.7


def test_param_grad_norm_matches_autograd() -> None:
    model = tiny()
    ids = random_tokens(128, 2, 16, seed=1, index=0)
    report = scan(
        model,
        inputs=ids,
        loss_fn=lambda out: nn.functional.cross_entropy(
            out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        ),
    )
    model.eval()
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    w = model.blocks[2].mlp.up.weight
    b = model.blocks[2].mlp.up.bias
    gw, gb = torch.autograd.grad(loss, [w, b])
    expect = math.sqrt(gw.double().square().sum().item() + gb.double().square().sum().item())
    assert rel(report.layer("blocks.2.mlp.up").param_grad_norm, expect) <= 1e-5
    # modules without their own parameters report None
    assert report.layer("blocks.2.mlp").param_grad_norm is None


def test_chan_merge_two_halves_equal_whole() -> None:
    model = tiny()
    ids = random_tokens(128, 4, 16, seed=2, index=0)
    whole = scan(model, inputs=ids)
    halves = scan(model, inputs=[ids[:2], ids[2:]], batches=2)
    assert halves.run.batches == 2
    for a, b in zip(whole.layers, halves.layers, strict=True):
        assert a.name == b.name
        assert b.calls == a.calls
        assert rel(b.rms, a.rms) <= 1e-5, a.name
        assert rel(b.std, a.std) <= 1e-5 or abs(b.std - a.std) < 1e-9, a.name
        assert abs(b.mean - a.mean) <= 1e-5 * max(a.rms, 1e-12), a.name
        assert b.max_abs == pytest.approx(a.max_abs, rel=1e-6), a.name
        assert b.zero_frac == pytest.approx(a.zero_frac, abs=1e-12), a.name


def test_hooks_leave_outputs_and_gradients_bit_identical() -> None:
    model = tiny(activation="swiglu", norm="rmsnorm", position="rope")
    model.eval()
    ids = random_tokens(128, 2, 16, seed=3, index=0)
    params = list(model.parameters())

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(ids)
        loss = nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return out.detach(), list(torch.autograd.grad(loss, params))

    plain_out, plain_grads = run()
    targets = list(iter_named(model, None))
    stream_in = ("blocks.0:input", model.blocks[0])
    with Recorder(targets, stream_input=stream_in, backward=True) as rec:
        hooked_out, hooked_grads = run()
        rec.end_batch()
    assert torch.equal(plain_out, hooked_out)
    for g0, g1 in zip(plain_grads, hooked_grads, strict=True):
        assert torch.equal(g0, g1)
    assert rec.result(1)["blocks.0:input"].numel == 2 * 16 * 64


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = x + b(x)
            if i == 2:
                raise RuntimeError("boom inside forward")
        return x


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def test_no_hook_left_behind_after_exception_and_state_restored() -> None:
    model = Exploding().train()
    model.blocks[1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"):
        scan(model, inputs=torch.randn(2, 8), dtype="bf16")
    assert _hook_count(model) == 0
    assert model.training and not model.blocks[1].training and model.blocks[0].training
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v, before[k])


def test_model_state_untouched_by_scan() -> None:
    model = tiny()
    model.train()
    model.blocks[0].attn.proj.weight.grad = torch.ones_like(model.blocks[0].attn.proj.weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scan(model, dtype="fp16", batches=2)
    assert model.training
    assert _hook_count(model) == 0
    assert torch.equal(model.blocks[0].attn.proj.weight.grad, torch.ones(64, 64))
    assert model.blocks[1].attn.proj.weight.grad is None
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k])


def test_module_called_twice_counts_calls() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    x = torch.randn(4, 8)
    report = scan(Twice(), inputs=x, batches=3)
    rec = report.layer("lin")
    assert rec.calls == 2
    assert rec.numel == 2 * 4 * 8  # elements per batch over both calls
    assert report.notes  # no blocks → a note says so
    assert report.stream == ()


def test_modules_regex_filters_recording() -> None:
    report = scan(tiny(), modules=r"\.mlp$")
    assert {r.name for r in report.layers} == {f"blocks.{i}.mlp" for i in range(4)}
    with pytest.raises(Exception, match="invalid regex"):
        scan(tiny(), modules="(")


def _stream(report):
    return [(p.k, p.rms) for p in report.stream]


@pytest.mark.slow
def test_stream_grows_like_sqrt_k_without_branch_scaling_and_stays_flat_with_it() -> None:
    cfg = dict(n_layers=48, d_model=64, n_heads=2, vocab_size=128, seq_len=16)
    naive = scan(build_model(ArchConfig(**cfg, branch_scale="none")), batch=2, seq_len=16)
    scaled = scan(build_model(ArchConfig(**cfg, branch_scale="depth")), batch=2, seq_len=16)
    assert [p.k for p in naive.stream] == list(range(0, 97, 2))
    # Var(x_k) ≈ a + b·k: RMS² is close to linear in k (the accumulator model) …
    ks = [k for k, _ in _stream(naive)[1:]]
    v = [r * r for _, r in _stream(naive)[1:]]
    n = len(ks)
    mk, mv = sum(ks) / n, sum(v) / n
    b = sum((k - mk) * (y - mv) for k, y in zip(ks, v, strict=True)) / sum(
        (k - mk) ** 2 for k in ks
    )
    resid = sum((y - (mv + b * (k - mk))) ** 2 for k, y in zip(ks, v, strict=True))
    total = sum((y - mv) ** 2 for y in v)
    assert 1 - resid / total > 0.95
    # … so RMS grows like k^p with p near 1/2
    assert 0.35 < naive.summary["growth_exponent"] < 0.65
    # With 1/√(2L) the whole stream stays in a narrow band; without it, it keeps growing.
    naive_growth = naive.stream[-1].rms / naive.stream[1].rms
    scaled_growth = scaled.stream[-1].rms / scaled.stream[1].rms
    assert naive.summary["growth"] > 5 * scaled.summary["growth"]
    assert scaled.summary["growth"] < 5
    assert naive_growth > 4 and scaled_growth < naive_growth


def test_dtype_and_amp_runs_report_their_precision() -> None:
    bf = scan(tiny(), dtype="bf16")
    assert bf.run.dtype == "bf16"
    amp = scan(tiny(), amp="bf16")
    assert amp.run.dtype == "fp32" and amp.run.amp == "bf16"
    fp = scan(tiny())
    # bf16 statistics are close to fp32 ones but not identical
    a, b = fp.layer("blocks.3").rms, bf.layer("blocks.3").rms
    assert a != b and rel(b, a) < 0.05


def test_no_backward_has_no_gradients() -> None:
    report = scan(tiny(), backward=False)
    assert report.run.backward is False
    assert all(r.grad_rms is None and r.param_grad_norm is None for r in report.layers)
    assert all(p.grad_rms is None for p in report.stream)


def test_nonfinite_values_are_counted() -> None:
    model = tiny()
    with torch.no_grad():
        model.blocks[1].mlp.up.weight[0, 0] = float("inf")
    report = scan(model, backward=False)
    assert report.layer("blocks.0.mlp.up").nonfinite == 0
    assert report.layer("blocks.1.mlp.up").nonfinite > 0
    json_text = report.to_json()  # non-finite floats must not break JSON
    assert "NaN" not in json_text and "Infinity" not in json_text


class _Bag(nn.Module):
    """A residual stack behind an embedding table whose gradient is sparse or not."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16, sparse=sparse)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_sparse_embedding_gradient_measures_as_its_dense_equal(optimizer: str) -> None:
    """nn.Embedding(sparse=True) hands autograd a sparse gradient, which torch's norms
    cannot read (it used to end the scan in a NotImplementedError): the profile and the
    steps now read its dense equal, so the report is the one of the same model with a
    dense gradient (the table's gradient norm included), and the caller's weights and
    `.grad` come back as they were."""
    x = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    sparse, dense = _Bag(True), _Bag(False)
    pairs = zip(sparse.parameters(), dense.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    before = [p.detach().clone() for p in sparse.parameters()]
    got = scan(sparse, [x], steps=2, optimizer=optimizer, lr=1e-2)
    want = scan(dense, [x], steps=2, optimizer=optimizer, lr=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(sparse.parameters(), before, strict=True))
    assert all(p.grad is None for p in sparse.parameters())
    a, b = got.to_dict(), want.to_dict()
    for doc in (a, b):
        doc.pop("run", None)  # timings and the like
    assert a == b
    table = next(rec for rec in got.layers if rec.name == "emb")
    assert table.param_grad_norm is not None and table.param_grad_norm > 0
    assert got.dynamics is not None
    moved = next(u for u in got.dynamics.updates if u.param == "emb.weight")
    assert all(r is not None and r > 0 for r in moved.ratio)  # the table was stepped
