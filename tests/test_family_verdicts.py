"""Verdicts on what healthy families do on purpose (issue 22), each against a planted
pathology the check must still find. Tiny models built in process (transformers' own
init, no download)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import ctx, stream
from torch import nn

import actscan.measure.recorder as recmod
from actscan import scan
from actscan.diagnose import run_checks
from actscan.measure.recorder import Recorder
from actscan.records import CheckId, Finding, Severity, StreamPoint

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _of(findings: Any, check: CheckId) -> list[Finding]:
    return [f for f in findings if f.check == str(check)]


# -- exploding-grad: compare like with like, token by token -----------------------------


def _with_tokens(points: tuple[StreamPoint, ...], rel: list[float]) -> tuple[StreamPoint, ...]:
    from dataclasses import replace

    return tuple(replace(p, token_grad_rel=r) for p, r in zip(points, rel, strict=True))


def test_a_gradient_on_near_zero_tokens_is_info_and_a_real_explosion_is_not() -> None:
    rms = [1.0] * 5
    grads = [500.0, 40.0, 8.0, 2.0, 1.0]  # ×500 as whole tensors
    flat = _with_tokens(stream(rms, grads), [1.1, 1.05, 1.0, 1.0, 1.0])
    f = _of(run_checks(ctx(points=flat)), CheckId.EXPLODING_GRAD)[0]
    assert f.severity is Severity.INFO and f.value == pytest.approx(1.1)
    assert "token by token" in f.message and "500× stronger" in f.message
    every = _with_tokens(stream(rms, grads), grads)  # every token's gradient explodes
    f = _of(run_checks(ctx(points=every)), CheckId.EXPLODING_GRAD)[0]
    assert f.severity is Severity.ERROR and f.value == pytest.approx(500)
    part = _with_tokens(stream(rms, grads), [30.0, 8.0, 3.0, 1.5, 1.0])  # ×30 token by token
    f = _of(run_checks(ctx(points=part)), CheckId.EXPLODING_GRAD)[0]
    assert f.severity is Severity.WARN and f.value == pytest.approx(30)
    assert "token by token ×30" in f.message
    # no per-token view (an older report, a CNN's feature map): the whole tensors decide
    f = _of(run_checks(ctx(points=stream(rms, grads))), CheckId.EXPLODING_GRAD)[0]
    assert f.severity is Severity.ERROR


def test_the_token_view_matches_an_independent_computation() -> None:
    """Σ_t |x_t|²·|g_t|² of the recorder against fp64 copies of x and ∂L/∂x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    seen: dict[str, list[torch.Tensor]] = {"x": [], "g": []}

    def keep(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        seen["x"].append(out.detach().double().clone())
        out.register_hook(lambda g: seen["g"].append(g.double().clone()))

    handle = model[0].register_forward_hook(keep)
    targets = list(recmod.iter_named(model, None))
    params = list(model.parameters())
    try:
        with Recorder(targets, tokens=["0"]) as rec:
            for _ in range(2):
                x = torch.randn(3, 5, 16)
                x[:, 0] = 0.0  # a zero token, as a class token enters
                loss = model(x).square().mean()
                rec.add_param_grads(
                    dict(zip(params, torch.autograd.grad(loss, params), strict=True))
                )
                rec.end_batch()
            raw = rec.result(2)
    finally:
        handle.remove()
    want = sum(
        (x.square().sum(-1) * g.square().sum(-1)).sum().item()
        for x, g in zip(seen["x"], seen["g"], strict=True)
    )
    r = raw["0"]
    assert r.token_rows == 30 and r.token_grad_sumsq == pytest.approx(want, rel=1e-5)
    assert raw["1"].token_grad_sumsq is None  # not a stream point: no token view
    # the median over tokens of |x_t|·|g_t|, per batch, then the median of the batches'
    meds = [
        (x.norm(dim=-1) * g.norm(dim=-1)).reshape(-1).median()
        for x, g in zip(seen["x"], seen["g"], strict=True)
    ]
    assert r.token_grad_median == pytest.approx(torch.stack(meds).median().item(), rel=1e-5)
    assert raw["1"].token_grad_median is None


def test_the_token_gradient_median_is_unscaled_by_the_loss_scale() -> None:
    """A loss scaled by s (fp16's GradScaler) scales g_t by s: the median over tokens of
    |x_t|·|g_t| comes back divided by s, Σ|x_t|²|g_t|² by s²."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    x = torch.randn(3, 5, 16)
    targets = list(recmod.iter_named(model, None))
    got = []
    for scale in (1.0, 64.0):
        with Recorder(targets, tokens=["0"], loss_scale=scale) as rec:
            (model(x).square().mean() * scale).backward()
            raw = rec.result(1)["0"]
        got.append((raw.token_grad_median, raw.token_grad_sumsq))
    assert got[0][0] and got[0][1]
    assert got[1][0] == pytest.approx(got[0][0], rel=1e-5)
    assert got[1][1] == pytest.approx(got[0][1], rel=1e-5)


def _deit(zero_tokens: bool = True) -> nn.Module:
    cfg = transformers.DeiTConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    torch.manual_seed(0)
    model = transformers.DeiTModel(cfg).eval()
    if not zero_tokens:
        with torch.no_grad():
            for p in (model.embeddings.cls_token, model.embeddings.distillation_token):
                p.normal_(0, 0.02)
            model.embeddings.position_embeddings.normal_(0, 0.02)
    return model


def _blocks(model: nn.Module) -> nn.ModuleList:
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == 4)


class _Amplify(torch.autograd.Function):
    """Identity forward, ×5 backward: a gradient amplified through depth on every token."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 5 * g


def test_deit_zero_class_token_is_not_an_exploding_gradient() -> None:
    """DeiT initialises its class and distillation tokens (and position table) at 0: at the
    first block's input they are exactly 0, and LayerNorm (eps 1e-12) hands them a
    gradient ~1e4× the patches'. As whole tensors that reads ×1e4 (an error before);
    token by token the gradient is flat through depth."""
    report = scan(_deit(), batch=2, seq_len=16)
    first, last = report.stream[0], report.stream[-1]
    assert first.rms and first.grad_rms and last.rms and last.grad_rms
    whole = (first.rms * first.grad_rms) / (last.rms * last.grad_rms)
    assert whole > 100  # what the check judged before
    assert first.token_grad_rel and last.token_grad_rel
    assert first.token_grad_rel / last.token_grad_rel < 3
    found = _of(report.findings, CheckId.EXPLODING_GRAD)
    assert [f.severity for f in found] == [Severity.INFO]
    assert "class or distillation" in found[0].message
    # the same model with small nonzero tokens: nothing to say
    calm = scan(_deit(zero_tokens=False), batch=2, seq_len=16)
    assert not _of(calm.findings, CheckId.EXPLODING_GRAD)


def test_deit_with_a_gradient_amplified_through_depth_is_still_found() -> None:
    model = _deit()
    handles = [
        layer.register_forward_pre_hook(lambda _m, args: (_Amplify.apply(args[0]), *args[1:]))
        for layer in list(_blocks(model))[1:]
    ]
    try:
        report = scan(model, batch=2, seq_len=16)
    finally:
        for h in handles:
            h.remove()
    found = _of(report.findings, CheckId.EXPLODING_GRAD)
    assert found and found[0].severity is Severity.ERROR, found
    assert found[0].value is not None and found[0].value > 100
    assert math.isfinite(found[0].value)


# -- exploding-grad: the gradient on a causal sequence's first positions -----------------


class _Sink(nn.Module):
    """A pre-norm causal attention block whose every query attends to position 0 (an
    attention sink, as trained causal models and long audio/vision prefixes show): at each
    block's input position 0 collects the gradient of all T queries, the other positions
    keep their own. `amplify`: the block's input also gets a ×5 backward (a real
    explosion through depth, on every position)."""

    def __init__(self, i: int, d: int = 32, amplify: bool = False) -> None:
        super().__init__()
        self.width, self.amplify = d, amplify and i > 0
        self.ln, self.v, self.o = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amplify:
            x = _Amplify.apply(x)
        t = x.shape[1]
        scores = torch.zeros(t, t, device=x.device)
        scores[:, 0] = 20.0
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
        return x + 2 * self.o(scores.softmax(-1) @ self.v(self.ln(x)))


def test_a_gradient_on_the_first_positions_is_info_and_a_real_explosion_is_not() -> None:
    ids = torch.randint(0, 64, (2, 512), generator=torch.Generator().manual_seed(0))
    report = scan(_Stack(_Sink), inputs=ids)
    first, last = report.stream[0], report.stream[-1]
    assert first.rms and first.grad_rms and last.rms and last.grad_rms
    assert (first.rms * first.grad_rms) / (last.rms * last.grad_rms) > 10  # whole tensors
    assert first.token_grad_rel and last.token_grad_rel
    assert first.token_grad_rel / last.token_grad_rel > 10  # RMS over tokens: position 0
    assert first.token_grad_median and last.token_grad_median
    assert first.token_grad_median / last.token_grad_median < 2  # the median token: flat
    found = _of(report.findings, CheckId.EXPLODING_GRAD)
    assert [f.severity for f in found] == [Severity.INFO], found
    assert "a few positions" in found[0].message and "median token" in found[0].message
    assert found[0].value == pytest.approx(first.token_grad_median / last.token_grad_median)
    # the same model with a ×5 gradient at each block's input: every position explodes
    boom = scan(_Stack(lambda i: _Sink(i, amplify=True)), inputs=ids)
    found = _of(boom.findings, CheckId.EXPLODING_GRAD)
    assert [f.severity for f in found] == [Severity.ERROR], found
    assert boom.stream[0].token_grad_median / boom.stream[-1].token_grad_median > 10  # type: ignore[operator]


def test_a_median_token_within_range_turns_a_vanishing_gradient_to_info() -> None:
    from dataclasses import replace

    rms = [1.0] * 5
    grads = [0.01, 0.05, 0.2, 0.5, 1.0]  # ×100 weaker as whole tensors
    pts = stream(rms, grads)
    meds = [0.9, 1.0, 1.0, 1.0, 1.0]  # the median token: flat
    flat = tuple(replace(p, token_grad_median=m) for p, m in zip(pts, meds, strict=True))
    f = _of(run_checks(ctx(points=flat)), CheckId.VANISHING_GRAD)[0]
    assert f.severity is Severity.INFO and "weaker" in f.message
    fading = tuple(replace(p, token_grad_median=g) for p, g in zip(pts, grads, strict=True))
    f = _of(run_checks(ctx(points=fading)), CheckId.VANISHING_GRAD)[0]
    assert f.severity is Severity.ERROR


# -- layout: a first block's extra norm, shape changes, convolutions on a transpose -----


class _Stack(nn.Module):
    """Embedding → 4 blocks → head, for scan()."""

    def __init__(self, block: Any, d: int = 32, scale: float = 1.0, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, d)
        with torch.no_grad():
            self.emb.weight.mul_(scale)
        self.blocks = nn.ModuleList(block(i) for i in range(n))
        self.head = nn.Linear(self.blocks[-1].width, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _EntryNorm(nn.Module):
    """RWKV's first block: x ← LN(x) first, then a pre-norm residual from there."""

    def __init__(self, i: int, d: int = 32, square: bool = False) -> None:
        super().__init__()
        self.first, self.square, self.width = i == 0, square, d
        self.pre_ln, self.ln = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.pre_ln(x)
        out = x + self.mlp(self.ln(x))
        return out * out if self.square else out  # planted: the output is no such sum


def _layout(report: Any) -> list[Any]:
    return list(report.layout)


def _scan(model: nn.Module) -> Any:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return scan(model, inputs=ids)


def test_a_first_block_that_normalises_its_input_is_proven() -> None:
    report = _scan(_Stack(_EntryNorm, scale=1e-4))
    proofs = _layout(report)
    assert [p.status for p in proofs] == ["verified"] * 4
    assert proofs[0].norms == ("blocks.0.pre_ln",) and proofs[1].norms == ()
    # the ×1e4 jump of a tiny embedding through that norm: info, not "branches too large"
    jumps = [f for f in _of(report.findings, CheckId.EXP_GROWTH) if "jumps" in f.message]
    assert [f.severity for f in jumps] == [Severity.INFO], jumps
    assert "blocks.0.pre_ln" in jumps[0].message


def test_a_block_whose_output_is_no_sum_stays_unverified() -> None:
    def squared(i: int) -> nn.Module:
        return _EntryNorm(i, square=True)

    proofs = _layout(_scan(_Stack(squared)))
    assert all(p.status == "unverified" for p in proofs), proofs


class _Stage(nn.Module):
    """A downsampling stage (width d → d/2): no residual add across its boundary."""

    def __init__(self, i: int, d: int = 32) -> None:
        super().__init__()
        self.width = d // 2 ** (i + 1)
        self.down = nn.Linear(d // 2**i, self.width)
        self.norm = nn.LayerNorm(self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(x)
        return y + self.norm(y)


def test_a_block_that_changes_the_stream_shape_is_plain() -> None:
    proofs = _layout(_scan(_Stack(_Stage)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "plain")] * 4
    assert "changes the stream's shape (2×16×32 → 2×16×16)" in proofs[0].note


class _PosConv(nn.Module):
    """data2vec-audio's positional conv layer: conv over a transpose, norm, activation."""

    def __init__(self, i: int, d: int = 32, residual: bool = False) -> None:
        super().__init__()
        self.width, self.residual = d, residual
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        h = self.act(self.norm(h))
        return x + h if self.residual else h


def test_a_conv_layer_on_a_transpose_is_a_plain_chain_and_with_an_add_is_residual() -> None:
    proofs = _layout(_scan(_Stack(_PosConv)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "plain")] * 4
    assert "blocks.0.act ← blocks.0.norm ← blocks.0.conv" in proofs[0].note

    def residual(i: int) -> nn.Module:
        return _PosConv(i, residual=True)

    proofs = _layout(_scan(_Stack(residual)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "additive")] * 4


# -- sqrt-growth: post-branch norms whose writes' variances add up -------------------------


class _Sandwich(nn.Module):
    """OLMo 2's block: x + norm(branch(x)), the write a norm's output (gain 1)."""

    def __init__(self, i: int, d: int = 32, aligned: bool = False) -> None:
        super().__init__()
        self.width = d
        self.mlp = nn.Linear(d, d)
        self.post_norm = nn.LayerNorm(d)
        if aligned:  # planted: every block writes the same direction: they add linearly
            with torch.no_grad():
                self.mlp.weight.zero_()
                self.mlp.bias.copy_(torch.linspace(-1, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_norm(self.mlp(x))


def _deep(block: Any, n: int = 25) -> nn.Module:
    return _Stack(block, scale=0.02, n=n)


def test_post_branch_norm_writes_adding_up_are_info_and_aligned_writes_warn() -> None:
    found = _of(_scan(_deep(_Sandwich)).findings, CheckId.SQRT_GROWTH)
    assert found and found[0].severity is Severity.INFO, found
    assert "writes' variances adding up" in found[0].message

    def aligned(i: int) -> nn.Module:
        return _Sandwich(i, aligned=True)

    found = _of(_scan(_deep(aligned)).findings, CheckId.SQRT_GROWTH)
    assert found and found[0].severity in (Severity.WARN, Severity.ERROR), found
    assert "writes' variances adding up" not in found[0].message


class _SharedAct(nn.Module):
    """OpenAI GPT's blocks share one activation module instance: named_modules() lists it
    once (under block 0), every block runs it."""

    act = nn.GELU()

    def __init__(self, i: int, d: int = 32) -> None:
        super().__init__()
        self.width = d
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.shared = _SharedAct.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.shared(self.up(self.ln(x))))


def test_blocks_sharing_one_module_instance_are_proven() -> None:
    proofs = _layout(_scan(_Stack(_SharedAct)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "additive")] * 4, proofs


# -- depth checks within a stage: never across a change of the stream's shape ----------


class _Staged(nn.Module):
    """Block i downsamples (width ÷2, RMS ×10: a stage change) where i is in `downs`,
    else adds gain·W x to the stream (gain 3: planted geometric growth)."""

    def __init__(self, i: int, downs: tuple[int, ...], widths: list[int], gain: float) -> None:
        super().__init__()
        d_in, d_out = widths[i], widths[i + 1]
        self.down = i in downs
        self.width = d_out
        self.proj = nn.Linear(d_in, d_out, bias=False)
        self.gain = gain
        with torch.no_grad():
            self.proj.weight.normal_(0, (10.0 if self.down else 1.0) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if self.down else x + self.gain * self.proj(x)


def _staged(downs: tuple[int, ...], n: int, gain: float) -> nn.Module:
    widths = [64]
    for i in range(n):
        widths.append(widths[-1] // 2 if i in downs else widths[-1])
    return _Stack(lambda i: _Staged(i, downs, widths, gain), d=64, n=n)


DEPTH = (CheckId.SQRT_GROWTH, CheckId.EXP_GROWTH, CheckId.COLLAPSE, CheckId.EXPLODING_GRAD)


def test_growth_across_stage_changes_is_not_judged() -> None:
    """Every other block is a stage change that multiplies the RMS by ×10: ×1e3 'growth'
    over 8 blocks, none of it through a residual stream of one shape."""
    report = _scan(_staged(downs=(0, 2, 4, 6), n=8, gain=0.05))
    proofs = _layout(report)
    assert [p.reshaped for p in proofs] == [True, False] * 4
    loud = [f for c in DEPTH for f in _of(report.findings, c) if f.severity is not Severity.INFO]
    assert not loud, loud
    assert report.stream[-1].rms / report.stream[0].rms > 100  # what was judged before


def test_geometric_growth_inside_a_stage_is_still_found() -> None:
    report = _scan(_staged(downs=(0,), n=7, gain=3.0))
    found = _of(report.findings, CheckId.EXP_GROWTH)
    assert found and found[0].severity is Severity.ERROR, found
    # judged from the stage's start (block 0's output), not from the embedding
    assert "blocks.0" not in found[0].layers


# -- init-scale: a weight whose output goes straight into a norm ------------------------


class _IntoNorm(nn.Module):
    """conv → BatchNorm's shape in a token model: x + LN(W x), W at std 1 (8× √(1/64))."""

    def __init__(self, i: int, d: int = 64, normed: bool = True) -> None:
        super().__init__()
        self.width, self.normed = d, normed
        self.proj = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            self.proj.weight.normal_(0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return x + (self.norm(h) if self.normed else 0.1 * torch.tanh(h))


def test_a_large_weight_straight_into_a_norm_is_info_and_elsewhere_an_error() -> None:
    found = _of(_scan(_Stack(_IntoNorm, d=64)).findings, CheckId.INIT_SCALE)
    mine = [f for f in found if "blocks.0.proj" in f.layers]
    assert [f.severity for f in mine] == [Severity.INFO], found
    assert "straight into a norm" in mine[0].message

    def bare(i: int) -> nn.Module:
        return _IntoNorm(i, normed=False)

    found = _of(_scan(_Stack(bare, d=64)).findings, CheckId.INIT_SCALE)
    mine = [f for f in found if "blocks.0.proj" in f.layers]
    assert [f.severity for f in mine] == [Severity.ERROR], found


class _PaddedConv(nn.Module):
    """MobileNetV1's conv layer: a TF-style pad (functional), conv, norm, activation."""

    def __init__(self, i: int, d: int = 32, add: bool = False) -> None:
        super().__init__()
        self.width, self.add = d, add
        self.conv = nn.Conv1d(d, d, 3)
        self.norm = nn.LayerNorm(d)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.pad(x.transpose(1, 2), (1, 1))
        h = self.norm(self.conv(h).transpose(1, 2))
        return self.act(h + x) if self.add else self.act(h)  # planted: an add inside


def test_a_conv_layer_after_a_functional_pad_is_plain_and_an_add_is_not() -> None:
    proofs = _layout(_scan(_Stack(_PaddedConv)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "plain")] * 4, proofs

    def added(i: int) -> nn.Module:
        return _PaddedConv(i, add=True)

    # relu(x + F(x)) with the add inside is ResNet v1's residual, no plain layer: proven
    # at the activation's input (post-act), the conv branch its write
    proofs = _layout(_scan(_Stack(added)))
    assert [(p.status, p.placement) for p in proofs] == [("verified", "post-act")] * 4, proofs
    assert all(any(w.endswith(".norm") for w in p.writes) for p in proofs), proofs


# -- the loss of a vision-language masked LM reaches its text --------------------------


def test_projection_loss_covers_the_logits_beside_nested_towers() -> None:
    """ModernVBERT's masked-LM output nests the image tower's outputs and has `logits`
    for the text: a loss on the nested towers alone left every text block without a
    gradient (dead-branch error: 'no parameter gradient at all')."""
    from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

    from actscan.measure.inputs import projection_loss

    image = torch.randn(2, 5, 8, requires_grad=True)
    logits = torch.randn(2, 7, 32, requires_grad=True)
    out = MaskedLMOutput(logits=logits)
    out["image_outputs"] = BaseModelOutput(last_hidden_state=image)
    projection_loss(out).backward()
    assert image.grad is not None and logits.grad is not None
    assert bool((logits.grad.abs().sum(-1) > 0).all())
    # a plain encoder output is unchanged: its own last hidden state only
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    projection_loss(BaseModelOutput(last_hidden_state=hidden)).backward()
    assert hidden.grad is not None
