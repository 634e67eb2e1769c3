"""Verdicts on healthy library inits (issue 22, "judge what a family does on purpose"):
each mechanism quiets a healthy case and still finds the planted pathology at its old
severity."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import act, branch_layers, ctx, flat_stream, only
from torch import nn

from actscan import scan
from actscan.diagnose import run_checks
from actscan.records import AttentionRecord, HeadRecord, Severity

# -- dead-branch: a branch that writes as much as its siblings ---------------------------


def _dead(layers: list[Any], at_init: bool = True) -> list[Any]:
    found = run_checks(ctx(points=flat_stream(4), layers=layers, at_init=at_init))
    return only(found, "dead-branch")


def test_a_branch_under_the_threshold_like_its_siblings_is_the_init_scale() -> None:
    """Longformer's encoder attention at width 64: 8.6e-4 of the stream in one block,
    ~1.1e-3 in the others. The threshold cuts through the init's own spread."""
    small = {f"blocks.{i}.attn": dict(rms=1.1e-3) for i in range(4)}
    small["blocks.3.attn"] = dict(rms=8.6e-4)
    (f,) = _dead(branch_layers(4, **small))
    assert f.severity is Severity.INFO and f.layers == ("blocks.3.attn",)
    assert "blocks.*.attn" in f.message and "8.60e-04" in f.message
    # the same numbers in a checkpoint are what training produced: a warning
    (f,) = _dead(branch_layers(4, **small), at_init=False)
    assert f.severity is Severity.WARN


def test_a_branch_far_below_its_siblings_or_at_zero_is_still_dead() -> None:
    scaled = {f"blocks.{i}.attn": dict(rms=1.1e-3) for i in range(4)}
    scaled["blocks.3.attn"] = dict(rms=1.1e-6)  # planted: one block scaled by 1e-3
    (f,) = _dead(branch_layers(4, **scaled))
    assert f.severity is Severity.WARN and f.layers == ("blocks.3.attn",)
    zeroed = {**scaled, "blocks.3.attn": dict(rms=0.0)}
    (f,) = _dead(branch_layers(4, **zeroed))
    assert f.severity is Severity.WARN and f.value == 0
    stuck = {**scaled, "blocks.3.attn": dict(rms=8.6e-4, param_grad_norm=0.0)}
    (f,) = _dead(branch_layers(4, **stuck))
    assert f.severity is Severity.ERROR


# -- dead-units: zero channels that the input explains ------------------------------------


def _units(layers: list[Any]) -> list[Any]:
    return only(run_checks(ctx(layers=layers)), "dead-units")


def test_units_on_an_input_that_does_not_vary_are_info() -> None:
    """MarkupLM's xpath embedding on the default (constant) xpath ids: each unit fires on
    every token or on none, 50% of them none."""
    pattern = act("emb.xpath.act", 512, zero_frac=0.5)
    (f,) = _units([pattern])
    assert f.severity is Severity.INFO and "do not vary" in f.message
    # planted: the same fraction with live units zero on some rows (a shifted bias)
    shifted = act("emb.xpath.act", 512, zero_frac=0.7)
    (f,) = _units([shifted])
    assert f.severity is Severity.ERROR


def test_units_whose_input_is_exactly_zero_are_info_and_a_negative_bias_is_an_error() -> None:
    """SwinV2's position-bias MLP over a 1×1 window: its relative-coordinate table is 0."""
    from helpers import rec

    def layers(mean: float, top: float) -> list[Any]:
        pre = rec("blocks.0.cpb.0", n_channels=1024, mean=mean, std=0.0, max_abs=top, order=1)
        return [pre, act("blocks.0.cpb.1", 1024, zero_frac=1.0, order=2)]

    (f,) = _units(layers(0.0, 0.0))
    assert f.severity is Severity.INFO and "exactly 0" in f.message
    (f,) = _units(layers(-5.0, 5.5))  # planted: an up-projection bias of −5
    assert f.severity is Severity.ERROR


class _XPath(nn.Module):
    """An embedding of an auxiliary id (MarkupLM's xpath) through Linear → ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(64, 32)
        self.aux = nn.Embedding(8, 32)
        self.inner = nn.Linear(32, 128)
        self.act = nn.ReLU()
        self.out = nn.Linear(128, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(ids) + self.out(self.act(self.inner(self.aux(aux)))))


def _scan_xpath(aux: torch.Tensor) -> Any:
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    return scan(_XPath(), inputs={"ids": ids, "aux": aux})


def test_a_constant_auxiliary_id_is_named_and_varying_ids_are_quiet() -> None:
    found = only(_scan_xpath(torch.zeros(4, 64, dtype=torch.long)).findings, "dead-units")
    assert [f.severity for f in found] == [Severity.INFO] and "do not vary" in found[0].message
    varied = torch.randint(0, 8, (4, 64), generator=torch.Generator().manual_seed(1))
    assert not only(_scan_xpath(varied).findings, "dead-units")


# -- logit-scale: past √(2 ln T) over few keys, the measured entropy decides ---------------


def _heads(std: float, entropy: float, keys: int) -> AttentionRecord:
    heads = tuple(
        HeadRecord(head=i, score_max=3.0, score_std=std, entropy=entropy, sink=0.1)
        for i in range(2)
    )
    return AttentionRecord(
        name="l.0", block=0, heads=heads, queries=keys, keys=keys, mean_keys=keys, kv_heads=2
    )


def _logit(rec: AttentionRecord) -> list[Any]:
    return only(run_checks(replace(ctx(at_init=True), attention=(rec,))), "logit-scale")


def _softmax_entropy(std: float, keys: int) -> float:
    torch.manual_seed(0)
    p = (torch.randn(20000, keys) * std).softmax(-1)
    return float((-(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(keys)).mean())


def test_scores_past_the_freezing_point_over_two_keys_still_spread_and_are_info() -> None:
    """An audio encoder's 2 subsampled frames: std 1.09 × √(2 ln 2), entropy 0.84."""
    f0 = math.sqrt(2 * math.log(2))
    e = _softmax_entropy(1.09 * f0, 2)  # what such scores give, measured independently
    assert e > 0.5
    (f,) = _logit(_heads(1.09 * f0, e, 2))
    assert f.severity is Severity.INFO and "entropy" in f.message


def test_sharp_heads_past_the_freezing_point_still_warn() -> None:
    f0 = math.sqrt(2 * math.log(16))
    e = _softmax_entropy(1.6 * f0, 16)  # MuseGlimmer's QK-norm temperature at 16 keys
    assert e < 0.5
    (f,) = _logit(_heads(1.6 * f0, e, 16))
    assert f.severity is Severity.WARN
    # past the finite-size band the std alone decides, whatever entropy is recorded
    (f,) = _logit(_heads(2.0 * math.sqrt(2 * math.log(64)), 1.0, 64))
    assert f.severity is Severity.WARN


# -- init-scale: a table read by interpolation is no matmul weight --------------------------


def test_an_interpolated_position_table_is_a_table_and_a_matmul_weight_is_not() -> None:
    """SigLIP 2 resizes its position table with bilinear weights (≥ 0, rows summing to 1)
    @ table: a mixture of the table's rows, whose std is the table's own."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Siglip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_patches=256,
        patch_size=8,
    )
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(cfg)
    report = scan(model, batch=2, seq_len=16)
    table = next(p for p in report.params if p.name == "embeddings.position_embedding.weight")
    assert table.kind == "embedding" and table.std == pytest.approx(64**-0.5, rel=0.05)
    assert not [f for f in only(report.findings, "init-scale") if f.severity is not Severity.INFO]

    class Mixed(nn.Module):  # planted: the same table multiplied by signed activations
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 256)
            self.table = nn.Parameter(torch.randn(256, 64))  # std 1 over fan-in 256: ×16
            self.head = nn.Linear(64, 64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids) @ self.table)

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    found = only(scan(Mixed(), inputs=ids).findings, "init-scale")
    assert any(f.severity is Severity.ERROR and "table" in f.message for f in found), found


# -- init-scale: the output head's scale is its logits' --------------------------------


class _Headed(nn.Module):
    """Pop2Piano's (T5's tied) head: a std-1 head behind a d^-1/2 rescale of its input."""

    def __init__(self, rescale: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.body = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 256, bias=False)
        nn.init.normal_(self.head.weight, 0.0, 1.0)  # 8× √(1/64)
        self.rescale = rescale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.body(self.emb(ids)))
        return self.head(x * 64**-0.5 if self.rescale else x)


def test_a_large_head_whose_logits_are_unit_scale_is_info_and_frozen_logits_still_warn() -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    calm = scan(_Headed(rescale=True), inputs=ids).findings
    (f,) = only(calm, "init-scale")
    assert f.severity is Severity.INFO and "output head" in f.message
    assert not only(calm, "logit-scale")
    hot = scan(_Headed(rescale=False), inputs=ids).findings  # planted: logits of std 8
    (f,) = only(hot, "logit-scale")
    assert f.severity is Severity.WARN and f.layers == ("head",)


# -- init-scale: He's fan-out rule on a squeeze-excite bottleneck -------------------------


class _SqueezeExcite(nn.Module):
    """RegNet's SE gate: pool → 1×1 reduce → ReLU → 1×1 expand → sigmoid, × the input."""

    def __init__(self, reduce_std: float | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 128)
        self.reduce = nn.Conv1d(128, 16, 1)
        self.expand = nn.Conv1d(16, 128, 1)
        for conv in (self.reduce, self.expand):
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        if reduce_std is not None:  # planted: a reduce conv at std 1 (11× √(1/128))
            nn.init.normal_(self.reduce.weight, 0.0, reduce_std)
        self.head = nn.Linear(128, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(1, 2)
        gate = torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean(-1, keepdim=True)))))
        return self.head((x * gate).transpose(1, 2))


def test_he_fan_out_on_a_bottleneck_is_info_and_a_unit_std_reduce_is_an_error() -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    found = only(scan(_SqueezeExcite(None), inputs=ids).findings, "init-scale")
    mine = [f for f in found if "reduce" in f.layers]
    assert [f.severity for f in mine] == [Severity.INFO] and "fan-out" in mine[0].message
    assert mine[0].value == pytest.approx(math.sqrt(2 * 128 / 16), rel=0.1)
    found = only(scan(_SqueezeExcite(1.0), inputs=ids).findings, "init-scale")
    mine = [f for f in found if "reduce" in f.layers]
    assert [f.severity for f in mine] == [Severity.ERROR], found


# -- outlier-channels: channels scaled by a module's own time-scale parameters -------------


class _Decay(nn.Module):
    """A gated recurrence's decay rate (Bailing's forget gate): per channel
    −5·σ(exp(A_log)·(W x + dt_bias)), dt log-uniform over [1e-3, 1e-1] and A uniform over
    [1, 16] by design: channel scales spread over orders of magnitude."""

    def __init__(self, d: int = 256, designed: bool = True) -> None:
        super().__init__()
        self.f_proj = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.f_proj.weight, 0.0, 0.02)
        gen = torch.Generator().manual_seed(0)
        dt = torch.exp(torch.empty(d).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        bias = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt)
        a_log = torch.empty(d).uniform_(1.0, 16.0, generator=gen).log()
        if designed:
            self.A_log, self.dt_bias = nn.Parameter(a_log), nn.Parameter(bias)
        else:  # planted: the same channel scales as constants no parameter owns
            self.register_buffer("A_log", a_log)
            self.register_buffer("dt_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Bailing's "safe gate" form
        return -5 * torch.sigmoid(self.A_log.exp() * (self.f_proj(x) + self.dt_bias))


class _Recurrent(nn.Module):
    def __init__(self, designed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 256)
        self.gate = _Decay(designed=designed)
        self.head = nn.Linear(256, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) * torch.exp(self.gate(self.emb(ids))))


def test_channels_scaled_by_their_own_time_scales_are_info_and_otherwise_not() -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    found = only(scan(_Recurrent(designed=True), inputs=ids).findings, "outlier-channels")
    assert [f.severity for f in found] == [Severity.INFO], found
    assert "dt_bias" in found[0].message and found[0].layers == ("gate",)
    found = only(scan(_Recurrent(designed=False), inputs=ids).findings, "outlier-channels")
    assert found and found[0].severity in (Severity.WARN, Severity.ERROR), found


def test_half_dead_over_one_row_is_chance_and_over_32_rows_an_error() -> None:
    """Switch Transformers' expert that received one token: 68 of 128 ReLU units zero on
    it, what one row of centred pre-activations gives (½)."""
    (f,) = _units([act("blocks.0.mlp.experts.expert_2.act", 68, width=128, rows=1)])
    assert f.severity is Severity.INFO and "2^-1 = 50%" in f.message
    (f,) = _units([act("blocks.0.mlp.experts.expert_2.act", 68, width=128, rows=32)])
    assert f.severity is Severity.ERROR


def test_a_small_kernel_at_he_is_he_within_sampling_error_and_std_2_is_not() -> None:
    """VITS's 1-channel convolutions: 64 values drawn at He's √(2/1) read std 1.61."""
    from helpers import param

    def init(std: float) -> list[Any]:
        params = [param("flows.2.conv_pre.weight", std, fan_in=1, fan_out=64)]
        return only(run_checks(ctx(params=params, at_init=True)), "init-scale")

    assert not init(1.61)  # He's 1.41 within 2 standard errors of a 64-value estimate
    (f,) = init(2.9)  # planted: twice He
    assert f.severity is Severity.WARN and f.value == pytest.approx(2.9)


# -- init-scale: a bias on an output no activation reads is a prior ------------------------


class _Classifier(nn.Module):
    """RetinaNet/RF-DETR's class head: bias −log((1 − π)/π) = −4.6 at π = 0.01 on logits
    no activation reads; planted: the same bias on an MLP's up-projection before a ReLU."""

    def __init__(self, before_relu: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.up = nn.Linear(64, 128)
        self.act = nn.ReLU()
        self.down = nn.Linear(128, 64)
        self.cls = nn.Linear(64, 8)
        target = self.up if before_relu else self.cls
        nn.init.constant_(target.bias, -math.log(99.0))
        self.before_relu = before_relu

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.cls(x + self.down(self.act(self.up(x))))


def test_a_class_prior_is_info_and_the_same_bias_before_a_relu_warns() -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    found = only(scan(_Classifier(False), inputs=ids).findings, "init-scale")
    bias = [f for f in found if "Biases" in f.message]
    assert [f.severity for f in bias] == [Severity.INFO] and "prior" in bias[0].message
    found = only(scan(_Classifier(True), inputs=ids).findings, "init-scale")
    bias = [f for f in found if "Biases" in f.message]
    assert [f.severity for f in bias] == [Severity.WARN] and bias[0].layers == ("up",)
