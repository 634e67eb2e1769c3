"""Every check on synthetic measurements: records built by hand, so each rule is tested
against numbers whose verdict follows from the theory, independent of any model."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import replace

import pytest
from helpers import (
    accumulator,
    act,
    branch_layers,
    ctx,
    flat_stream,
    geometric,
    head,
    only,
    outlier_rec,
    param,
    projections,
    rec,
    stream,
    with_gains,
)

import actscan.diagnose.thresholds as thresholds_module
from actscan.diagnose import CHECKS, CheckContext, run_checks
from actscan.diagnose.common import grade, warn_or_error
from actscan.diagnose.thresholds import DEFAULT, Thresholds, parse_threshold_options
from actscan.errors import UsageError
from actscan.records import CHECK_ORDER, SWEEP_CHECKS, CheckId, Finding, Severity


def run(c: CheckContext) -> tuple[Finding, ...]:
    return run_checks(c)


# --------------------------------------------------------------------------- sqrt-growth


def test_sqrt_growth_is_info_on_unscaled_accumulation() -> None:
    """√k accumulation of unscaled branches is what Llama/Mistral/Qwen2 ship (≤ ×2.22·√L
    at 12–48 blocks, benchmarks/calibrate_growth.py): reported with its number, at info."""
    c = ctx(points=stream(accumulator(48, a=1e-3, v=0.01)))
    found = only(run(c), CheckId.SQRT_GROWTH)
    assert len(found) == 1
    f = found[0]
    drift = c.stream[-1].rms / c.stream[1].rms  # type: ignore[operator]
    assert f.severity is Severity.INFO and f.value == pytest.approx(drift)
    assert drift / math.sqrt(48) < DEFAULT.growth_excess  # ≤ √L: accumulation
    assert f.threshold == pytest.approx(DEFAULT.growth_excess * math.sqrt(48))
    assert f.layers[-1] == "blocks.47"
    # the crossing block: first block whose RMS is ≥ 4× block 0's output
    first_cross = next(i for i, r in enumerate(c.stream[1:]) if r.rms / c.stream[1].rms >= 4)  # type: ignore[operator]
    assert f.layers[0] == f"blocks.{first_cross}"
    assert "1/√96" in f.hint and re.search(r"k\^0\.[45]\d", f.message)
    assert "Nothing needs fixing" in f.hint and "·√L" in f.message


def test_sqrt_growth_warns_past_what_real_inits_give() -> None:
    """RMS ∝ k over 48 blocks: ×48 = 6.9·√L, more than branches adding up (≤ √L) and
    than any real family's own init (≤ 2.22·√L), yet not sustained geometric growth."""
    rms = [0.1] + [0.1 * i for i in range(1, 49)]
    found = run(ctx(points=stream(rms)))
    assert [f.check for f in found] == [CheckId.SQRT_GROWTH]  # not exp-growth
    f = found[0]
    assert f.severity is Severity.WARN and f.value == pytest.approx(48)
    assert f.threshold == pytest.approx(DEFAULT.growth_excess * math.sqrt(48))
    assert "past ×4·√L" in f.message and "Nothing needs fixing" not in f.hint


def test_growth_remedy_behind_post_branch_norms_acts_on_the_norms() -> None:
    """OLMo 2/3 and Gemma 2/3 write through post-branch norms, which re-normalise the
    write: 1/√(2L) on the output projections cannot act there; the norms' gains can."""
    from actscan.records import BranchInfo

    rms = [0.1] + [0.1 * i for i in range(1, 49)]
    c = ctx(points=stream(rms))
    blocks = tuple(
        replace(
            b,
            branches=tuple(
                BranchInfo(role=r, name=f"{b.name}.{r}", write=f"{b.name}.post_{r}_norm")
                for r in ("attn", "mlp")
            ),
        )
        for b in c.layout.blocks
    )
    roles = {br.write: "norm" for b in blocks for br in b.branches if br.write}
    post = replace(c, layout=replace(c.layout, blocks=blocks, roles=roles))
    plain = only(run(c), CheckId.SQRT_GROWTH)[0].hint
    normed = only(run(post), CheckId.SQRT_GROWTH)[0].hint
    assert "output projections (attention out, MLP down) by 1/√(2L)" in plain
    assert "output projections (attention out" not in normed
    assert "post-branch norms" in normed and "gains by 1/√(2L) = 1/√96" in normed


def test_sqrt_growth_quiet_when_branches_are_scaled() -> None:
    # 1/√(2L): each branch adds v/(2L), the whole stack adds v: bounded at any depth
    c = ctx(points=stream(accumulator(48, a=1e-3, v=0.01, scale=1 / 96)))
    assert not only(run(c), CheckId.SQRT_GROWTH)


def test_sqrt_growth_quiet_on_post_ln_step() -> None:
    # post-LN: the first block normalizes a tiny embedding (×35), then the stream is flat
    c = ctx(points=stream([0.028] + [1.0] * 24))
    assert c.fit.growth == pytest.approx(1 / 0.028)
    assert not run(c)


def test_sqrt_growth_error_and_threshold_override() -> None:
    rms = accumulator(48, a=1e-3, v=0.01)
    assert only(run(ctx(points=stream(rms))), CheckId.SQRT_GROWTH)[0].severity is Severity.INFO
    th = DEFAULT.with_overrides({"growth-excess": "0.5"})  # warn at max(×4, 0.5·√48)
    f = only(run(ctx(points=stream(rms), th=th)), CheckId.SQRT_GROWTH)[0]
    assert f.severity is Severity.WARN and f.threshold == 4
    th = DEFAULT.with_overrides({"growth-excess": "0.5", "growth-error": "5"})
    f = only(run(ctx(points=stream(rms), th=th)), CheckId.SQRT_GROWTH)[0]
    assert f.severity is Severity.ERROR and f.threshold == 5
    th = DEFAULT.with_overrides({"sqrt_exponent": 0.9})
    assert not only(run(ctx(points=stream(rms), th=th)), CheckId.SQRT_GROWTH)


def test_sqrt_growth_mentions_fp16_headroom_in_fp16() -> None:
    rms = accumulator(48, a=1e-3, v=0.01)
    f = only(run(ctx(points=stream(rms), dtype="fp16")), CheckId.SQRT_GROWTH)[0]
    assert "65504" in f.hint
    f = only(run(ctx(points=stream(rms))), CheckId.SQRT_GROWTH)[0]
    assert "65504" not in f.hint


def test_depth_checks_need_min_blocks() -> None:
    c = ctx(points=stream(accumulator(3, a=1e-6, v=1.0)))
    assert not run(c)


# --------------------------------------------------------------------------- exp-growth / collapse


def test_exp_growth_names_the_crossing_block() -> None:
    c = ctx(points=stream(geometric(24, 1.2)))
    found = run(c)
    assert [f.check for f in found] == [CheckId.EXP_GROWTH]  # not also sqrt-growth
    f = found[0]
    assert f.severity is Severity.WARN
    assert f.value == pytest.approx(1.2**24, rel=1e-6)
    assert f.layers == ("blocks.13", "blocks.23")  # 1.2^13 = 10.7 is the first ≥ 10
    assert "γ = 1.2" in f.message


def test_a_jump_inside_block_0_fires_exp_growth_there() -> None:
    """The drift and γ start at block 0's output; growth from the embedding does not:
    ×5.8e3 inside block 0 (every weight at std 1), then plain √k, fires at block 0."""
    rms = [1.0] + [5.8e3 * math.sqrt(i) for i in range(1, 13)]
    found = only(run(ctx(points=stream(rms))), CheckId.EXP_GROWTH)
    assert len(found) == 1
    f = found[0]
    assert f.layers == ("blocks.0",) and f.value == pytest.approx(5.8e3)
    assert f.severity is Severity.ERROR and f.threshold == DEFAULT.growth_jump_error
    assert "inside block 0" in f.message
    # ×150: a warning; the largest healthy jumps (real inits ×15.7, post-LN ×35.7): quiet
    f = only(run(ctx(points=stream([1.0] + [150.0] * 12))), CheckId.EXP_GROWTH)[0]
    assert f.severity is Severity.WARN and f.threshold == DEFAULT.growth_jump
    for jump in (15.7, 35.7):
        assert not run(ctx(points=stream([1.0] + [jump * math.sqrt(i) for i in range(1, 13)])))


def test_growth_one_block_makes_is_a_jump_there_not_a_per_block_gain() -> None:
    """OLMo-Hybrid's tiny init: three blocks ×1.02 each on a stream of RMS 0.02, then one
    full-attention block ×14.9. A geometric fit says γ = 2.28 (γ^L = 27, past ×10), but
    nothing compounds: judged as a jump inside that block, info under growth-jump."""
    rms = [0.0202, 0.0207, 0.0212, 0.0216, 0.321]
    found = run(ctx(points=stream(rms)))
    assert [f.check for f in found] == [CheckId.EXP_GROWTH]  # not also sqrt-growth
    f = found[0]
    assert f.severity is Severity.INFO and f.threshold == DEFAULT.growth_jump
    assert f.layers == ("blocks.3",) and f.value == pytest.approx(0.321 / 0.0216)
    assert "inside block 3 alone" in f.message
    # the same step past ×100 warns at that block; spread evenly it is a gain (warn)
    f = only(run(ctx(points=stream([0.02, 0.02, 0.0202, 0.0204, 3.0]))), CheckId.EXP_GROWTH)[0]
    assert f.severity is Severity.WARN and f.layers == ("blocks.3",)
    f = only(run(ctx(points=stream(geometric(4, 2.3)))), CheckId.EXP_GROWTH)[0]
    assert "γ = 2.3" in f.message and f.severity is not Severity.INFO
    # branches scaled ×40 block by block (writes 7e-4 of the stream at block 0): the last
    # step holds most of the growth, but the steps before it grow too: a gain, not a jump
    f = only(run(ctx(points=stream([1.0, 1.0, 1.0004, 1.5, 45.0]))), CheckId.EXP_GROWTH)[0]
    assert f.severity is not Severity.INFO and "inside" not in f.message


def test_exp_growth_error_at_exp_gain_error() -> None:
    f = only(run(ctx(points=stream(geometric(32, 1.2)))), CheckId.EXP_GROWTH)[0]
    assert f.severity is Severity.ERROR and f.threshold == DEFAULT.exp_gain_error


def test_collapse_names_the_crossing_block() -> None:
    f = only(run(ctx(points=stream(geometric(24, 0.8)))), CheckId.COLLAPSE)[0]
    assert f.severity is Severity.ERROR  # 0.8^24 = 0.0047 ≤ 1/100
    assert f.layers[0] == "blocks.11"  # 0.8^11 = 0.086 is the first ≤ 0.1
    f = only(run(ctx(points=stream(geometric(24, 0.88)))), CheckId.COLLAPSE)[0]
    assert f.severity is Severity.WARN  # 0.88^24 = 0.047


def test_gentle_gain_is_quiet() -> None:
    assert not run(ctx(points=stream(geometric(24, 1.05))))  # ×3.2 over the stack
    assert not run(ctx(points=stream(geometric(24, 0.95))))


# --------------------------------------------------------------------------- gradients


def test_relative_gradient_ignores_stream_scale() -> None:
    """Pre-LN with a tiny embedding: raw gradient RMS is 35× larger at k = 0 (∝ 1/RMS), but
    the relative gradient RMS(∂L/∂x)·RMS(x) is flat: no alarm (the brief's false alarm)."""
    rms = accumulator(48, a=1e-3, v=0.01, scale=1 / 96)
    rms[0] = rms[-1] / 35
    grads = [1e-4 / r for r in rms]
    assert grads[0] / grads[-1] == pytest.approx(35)
    assert not only(run(ctx(points=stream(rms, grads))), CheckId.EXPLODING_GRAD)


def test_vanishing_grad_fires_and_names_the_block() -> None:
    rms = [1.0] * 25
    grads = [0.5**i for i in range(24, -1, -1)]  # halves per block going down
    f = only(run(ctx(points=stream(rms, grads))), CheckId.VANISHING_GRAD)[0]
    assert f.severity is Severity.ERROR and f.value == pytest.approx(0.5**24)
    # from the top down, 0.5^4 = 1/16 is the first ≤ 1/10: 4 points below the top
    assert f.layers == ("blocks.19", "blocks.23")
    grads = [0.9**i for i in range(24, -1, -1)]  # 0.9^24 = 0.08
    f = only(run(ctx(points=stream(rms, grads))), CheckId.VANISHING_GRAD)[0]
    assert f.severity is Severity.WARN


def test_exploding_grad_fires() -> None:
    rms = [1.0] * 25
    grads = [1.3**i for i in range(25)][::-1]  # the bottom is 1.3^24 = 542× the top
    f = only(run(ctx(points=stream(rms, grads))), CheckId.EXPLODING_GRAD)[0]
    assert f.severity is Severity.ERROR and f.value == pytest.approx(1.3**24)
    assert "stronger" in f.message


def test_gradient_checks_skip_without_backward() -> None:
    rms = [1.0] * 25
    grads = [0.5**i for i in range(24, -1, -1)]
    assert not run(ctx(points=stream(rms, grads), backward=False))


# --------------------------------------------------------------------------- dead-branch


def test_dead_branch_names_the_block() -> None:
    layers = branch_layers(6, **{"blocks.3.mlp": dict(rms=0.0, max_abs=0.0)})
    found = only(run(ctx(points=flat_stream(6), layers=layers)), CheckId.DEAD_BRANCH)
    assert len(found) == 1
    f = found[0]
    assert f.severity is Severity.WARN and f.layers == ("blocks.3.mlp",) and f.value == 0
    assert "block 3" in f.message


def test_dead_branch_without_parameter_gradient_is_an_error() -> None:
    layers = branch_layers(6, **{"blocks.3.mlp": dict(rms=0.0, param_grad_norm=0.0)})
    f = only(run(ctx(points=flat_stream(6), layers=layers)), CheckId.DEAD_BRANCH)[0]
    assert f.severity is Severity.ERROR


def test_dead_branch_by_gradient() -> None:
    layers = branch_layers(4, **{"blocks.2.attn": dict(grad_rms=0.0)})
    f = only(run(ctx(points=flat_stream(4), layers=layers)), CheckId.DEAD_BRANCH)[0]
    assert f.layers == ("blocks.2.attn",) and "gradient" in f.message


def test_tiny_but_alive_branch_is_not_dead() -> None:
    layers = branch_layers(4, **{"blocks.2.attn": dict(rms=0.007)})  # post-LN attention at init
    assert not only(run(ctx(points=flat_stream(4), layers=layers)), CheckId.DEAD_BRANCH)


def test_rezero_gains_are_info_by_design() -> None:
    layers, params = with_gains(4, 0.0, 0.0)
    c = ctx(points=flat_stream(4), layers=layers, params=params, at_init=True)
    found = run(c)
    assert [(f.check, f.severity) for f in found] == [(CheckId.DEAD_BRANCH, Severity.INFO)]
    f = found[0]
    assert "ReZero" in f.message and "8 of 8" in f.message
    assert f.layers[0] == "blocks.0.attn_gain"


def test_layerscale_gains_are_info_by_design() -> None:
    layers, params = with_gains(4, 1e-4, 3e-5)
    f = only(run(ctx(points=flat_stream(4), layers=layers, params=params)), CheckId.DEAD_BRANCH)
    assert [x.severity for x in f] == [Severity.INFO] and "LayerScale" in f[0].message


def test_zero_init_output_projection_everywhere_is_fixup() -> None:
    dead = {f"blocks.{i}.mlp": dict(rms=0.0) for i in range(4)}
    layers = branch_layers(4, **dead)
    layers += [
        rec(f"blocks.{i}.mlp.{p}", role="mlp", order=100 + 2 * i + j)
        for i in range(4)
        for j, p in enumerate(("up", "down"))
    ]
    params = []
    for i in range(4):
        params.append(param(f"blocks.{i}.mlp.up.weight", 0.02, fan_in=64))
        params.append(param(f"blocks.{i}.mlp.down.weight", 0.0, fan_in=256))
    c = ctx(points=flat_stream(4), layers=layers, params=params, at_init=True)
    f = only(run(c), CheckId.DEAD_BRANCH)
    assert [x.severity for x in f] == [Severity.INFO] and "Fixup" in f[0].message
    # the same zero outputs with live projection weights: not by design
    params = [param(p.name, 0.02, fan_in=64) for p in params]
    c = ctx(points=flat_stream(4), layers=layers, params=params, at_init=True)
    assert only(run(c), CheckId.DEAD_BRANCH)[0].severity is Severity.WARN


# --------------------------------------------------------------------------- dead-units


def test_dead_units_severity_by_fraction() -> None:
    def check(dead: int) -> list[Finding]:
        return only(run(ctx(layers=[act("blocks.0.mlp.act", dead)])), CheckId.DEAD_UNITS)

    assert not check(10)  # 1%
    assert check(100)[0].severity is Severity.WARN  # 9.8%
    f = check(600)[0]
    assert f.severity is Severity.ERROR and f.value == pytest.approx(600 / 1024)
    assert "600/1024" in f.message


def test_dead_units_with_few_rows_is_info_unless_half_the_layer_is_dead() -> None:
    """Over 32 rows a unit firing on < ~9% of them looks dead: the warn becomes info with
    the number and how to get more rows; half the layer dead stays an error."""
    few = only(run(ctx(layers=[act("blocks.0.mlp.act", 100, rows=32)])), CheckId.DEAD_UNITS)
    assert few[0].severity is Severity.INFO and "Only 32 rows" in few[0].message
    half = only(run(ctx(layers=[act("blocks.0.mlp.act", 600, rows=32)])), CheckId.DEAD_UNITS)
    assert half[0].severity is Severity.ERROR


def test_dead_units_explains_with_the_pre_activation() -> None:
    layers = [
        rec("blocks.0.mlp.up", role="mlp", n_channels=1024, mean=-5.0, std=0.3, order=1),
        act("blocks.0.mlp.act", 1024, order=2),
        act("blocks.1.mlp.act", 200, order=5),
    ]
    f = only(run(ctx(layers=layers)), CheckId.DEAD_UNITS)[0]
    assert f.layers == ("blocks.0.mlp.act", "blocks.1.mlp.act")
    assert "mean -5" in f.message and "100%" in f.message


def test_dead_units_ignores_non_activation_layers_and_threshold_override() -> None:
    gain = rec("blocks.0.attn_gain", n_channels=64, dead_channels=64)  # ReZero output
    assert not only(run(ctx(layers=[gain])), CheckId.DEAD_UNITS)
    th = DEFAULT.with_overrides({"dead-units-warn": 0.005})
    assert only(run(ctx(layers=[act("a.act", 10)], th=th)), CheckId.DEAD_UNITS)


# --------------------------------------------------------------------------- outlier-channels


def test_outlier_channels_reports_index_and_int8_levels() -> None:
    layers = [
        outlier_rec("tok_emb", 100.0, role="embed", type="Embedding", order=0),
        outlier_rec("blocks.0", 80.0, role="stream", order=5),
    ]
    f = only(run(ctx(layers=layers)), CheckId.OUTLIER_CHANNELS)[0]
    assert f.severity is Severity.WARN and f.value == 100.0
    assert f.layers == ("tok_emb", "blocks.0")
    assert "channel 17 " in f.message
    # s = 300/127, typical value 3 → 127/100 = 1.27 levels
    assert "1.27 quantization levels" in f.message
    assert "embedding" in f.hint


def test_outlier_channels_error_and_exclusions() -> None:
    f = only(run(ctx(layers=[outlier_rec("x", 300.0)], at_init=True)), CheckId.OUTLIER_CHANNELS)
    assert f[0].severity is Severity.ERROR  # no init makes a 300× channel
    f = only(run(ctx(layers=[outlier_rec("x", 300.0)])), CheckId.OUTLIER_CHANNELS)
    assert f[0].severity is Severity.WARN  # trained: massive activations are a known feature
    excluded = [
        outlier_rec("head", 300.0, role="head"),
        outlier_rec("blocks.0.attn.logits", 300.0, type="AttentionLogits"),
        outlier_rec("y", 300.0, nonfinite=3),
    ]
    assert not only(run(ctx(layers=excluded)), CheckId.OUTLIER_CHANNELS)


# --------------------------------------------------------------------------- overflow


def test_overflow_names_the_first_module_in_execution_order() -> None:
    layers = [
        rec("blocks.1.mlp", nonfinite=40, order=9),
        rec("blocks.1.mlp.down", nonfinite=40, order=8, max_abs=math.inf),
        rec("blocks.1.mlp.up", order=6, max_abs=2000.0),
        rec("blocks.2", nonfinite=99, order=12),
    ]
    f = only(run(ctx(layers=layers, dtype="fp16")), CheckId.OVERFLOW)
    assert len(f) == 1 and f[0].severity is Severity.ERROR
    assert f[0].layers == ("blocks.1.mlp.down", "blocks.1.mlp", "blocks.2")
    assert f[0].message.startswith("blocks.1.mlp.down is the first module")
    assert "2e+03" in f[0].message and "bf16" in f[0].hint


def test_overflow_headroom_by_dtype() -> None:
    hot = [rec("blocks.0.mlp", max_abs=5000.0)]  # within 16× of 65504
    f = only(run(ctx(layers=hot, dtype="fp16")), CheckId.OVERFLOW)[0]
    assert f.severity is Severity.WARN and f.threshold == pytest.approx(65504 / 16)
    assert only(run(ctx(layers=hot, amp="fp16")), CheckId.OVERFLOW)
    assert not only(run(ctx(layers=hot)), CheckId.OVERFLOW)  # fp32: far from 3.4e38
    f = only(run(ctx(layers=[rec("x", max_abs=2e5)])), CheckId.OVERFLOW)[0]
    assert f.severity is Severity.INFO and "fp16" in f.message


def test_overflow_logits_against_exp_limit_in_fp16() -> None:
    layers = [rec("head", role="head", max_abs=20.0, std=1.0)]
    f = only(run(ctx(layers=layers, dtype="fp16")), CheckId.OVERFLOW)[0]
    assert f.severity is Severity.INFO and f.threshold == pytest.approx(math.log(65504))
    assert not only(run(ctx(layers=layers)), CheckId.OVERFLOW)


def test_overflow_in_parameters_and_gradients() -> None:
    params = [param("blocks.0.mlp.up.weight", 0.02, fan_in=64, nonfinite=3)]
    f = only(run(ctx(params=params)), CheckId.OVERFLOW)[0]
    assert f.severity is Severity.ERROR and "blocks.0.mlp.up.weight" in f.message
    layers = [rec("a", grad_rms=math.inf, order=1), rec("b", grad_rms=math.nan, order=2)]
    f = only(run(ctx(layers=layers)), CheckId.OVERFLOW)[0]
    assert "gradient" in f.message and f.layers[0] == "b"  # backward starts at the top


# --------------------------------------------------------------------------- logit-scale


def test_logit_scale_against_the_freezing_point() -> None:
    freeze = math.sqrt(2 * math.log(512))  # 3.53
    assert not only(run(ctx(layers=[head(1.0)], at_init=True)), CheckId.LOGIT_SCALE)
    f = only(run(ctx(layers=[head(5.0)], at_init=True)), CheckId.LOGIT_SCALE)[0]
    assert f.severity is Severity.WARN and f.value == pytest.approx(5.0 / freeze)
    f = only(run(ctx(layers=[head(17.8, 219)], at_init=True)), CheckId.LOGIT_SCALE)[0]
    assert f.severity is Severity.ERROR and "log Z" in f.message and "z-loss" in f.hint
    # trained models may be confident: information only
    f = only(run(ctx(layers=[head(17.8)])), CheckId.LOGIT_SCALE)[0]
    assert f.severity is Severity.INFO


def test_logit_scale_tied_hint() -> None:
    c = ctx(layers=[head(17.8)], at_init=True, arch={"tie_embeddings": True})
    assert "tied" in only(run(c), CheckId.LOGIT_SCALE)[0].hint


def test_attention_logits() -> None:
    scores = [
        rec(f"blocks.{i}.attn.logits", type="AttentionLogits", std=s, n_channels=64, order=i)
        for i, s in enumerate((0.5, 5.0))
    ]
    f = only(run(ctx(layers=scores)), CheckId.LOGIT_SCALE)[0]
    assert f.layers == ("blocks.1.attn.logits",) and f.severity is Severity.WARN
    f = only(
        run(ctx(layers=scores[:1], arch={"attn_scale": "none", "head_dim": 64})),
        CheckId.LOGIT_SCALE,
    )[0]
    assert "1/√d_k" in f.message and "8×" in f.message


# --------------------------------------------------------------------------- init-scale


def test_init_scale_flat_std_at_large_fan_in() -> None:
    params = [
        param("blocks.0.mlp.up.weight", 0.02, fan_in=2048),  # 0.905× √(1/fan_in)
        param("blocks.0.mlp.down.weight", 0.02, fan_in=8192),  # 1.81×
        param("blocks.1.mlp.down.weight", 0.02, fan_in=8192),
    ]
    f = only(run(ctx(params=params, at_init=True)), CheckId.INIT_SCALE)
    assert len(f) == 1 and f[0].severity is Severity.WARN
    assert f[0].value == pytest.approx(0.02 * math.sqrt(8192))
    assert f[0].layers == ("blocks.0.mlp.down", "blocks.1.mlp.down")
    assert "blocks.*.mlp.down.weight (2 matrices)" in f[0].message
    assert "fan_in ≈ 2500" in f[0].hint
    assert not only(run(ctx(params=params)), CheckId.INIT_SCALE)  # trained: no init rules


def test_init_scale_accepts_classical_rules_and_errors_far_above() -> None:
    fine = [
        param("a.weight", math.sqrt(2 / 512), fan_in=512),  # He
        param("b.weight", math.sqrt(1 / 512), fan_in=512),  # fan-in
        param("c.weight", math.sqrt(2 / (512 + 2048)), fan_in=512, fan_out=2048),  # Xavier
    ]
    assert not run(ctx(params=fine, at_init=True))
    f = only(
        run(ctx(params=[param("d.weight", 0.2, fan_in=512)], at_init=True)), CheckId.INIT_SCALE
    )[0]
    assert f.severity is Severity.ERROR  # 4.5×


def test_init_scale_tiny_weights_are_info() -> None:
    f = only(
        run(ctx(params=[param("a.weight", 1e-4, fan_in=256)], at_init=True)), CheckId.INIT_SCALE
    )[0]
    assert f.severity is Severity.INFO


def test_init_scale_norm_gains_and_biases() -> None:
    params = [
        param("blocks.0.norm1.weight", 0.0, kind="norm-gain", mean=0.5, fan_out=64),
        param("blocks.0.mlp.up.weight", 0.02, fan_in=256),
        param("blocks.0.mlp.up.bias", 0.0, kind="bias", mean=-5.0, fan_out=1024),
        param("blocks.0.attn.qkv.bias", 0.0, kind="bias", mean=0.0, fan_out=192),
    ]
    f = only(run(ctx(params=params, at_init=True)), CheckId.INIT_SCALE)
    assert {x.severity for x in f} == {Severity.WARN}
    by_topic = {("gain" if "gain" in x.message else "bias"): x for x in f}
    assert by_topic["gain"].layers == ("blocks.0.norm1",)
    assert by_topic["bias"].layers == ("blocks.0.mlp.up",)
    # −5 against a pre-activation std of 0.02·√256 = 0.32: 15.6σ
    assert by_topic["bias"].value == pytest.approx(5 / 0.32)


def test_init_scale_residual_projections_not_down_scaled() -> None:
    layers, params = projections(24, 1.0)
    f = only(run(ctx(layers=layers, params=params, n_blocks=24, at_init=True)), CheckId.INIT_SCALE)
    assert len(f) == 1 and f[0].severity is Severity.INFO
    assert f[0].value == pytest.approx(48) and "1/√48" in f[0].hint
    layers, params = projections(24, 1 / math.sqrt(48))
    assert not run(ctx(layers=layers, params=params, n_blocks=24, at_init=True))
    layers, params = projections(24, 1.0)
    c = ctx(layers=layers, params=params, n_blocks=24, at_init=True, arch={"placement": "post"})
    assert not run(c)


# --------------------------------------------------------------------------- registry, order


def test_registry_keys_cover_every_check_id_once() -> None:
    ids = [c for key in CHECKS for c in key]
    assert all(isinstance(c, CheckId) for c in ids)
    per_report = [c for c in CheckId if c not in SWEEP_CHECKS]  # sweep checks: coord.py
    assert sorted(ids) == sorted(per_report) and len(ids) == len(set(ids))
    assert tuple(CheckId) == CHECK_ORDER and set(CHECK_ORDER) == set(CheckId)


def test_each_check_emits_exactly_its_registered_ids() -> None:
    """Contexts that make every check fire; a check may emit only the ids it is keyed by."""
    rms = [1.0] * 25
    layers = [
        act("blocks.0.mlp.act", 600),
        outlier_rec("x", 100.0),
        head(17.8),
        rec("blocks.0.mlp", max_abs=2e5),
    ]
    gains_layers, gains_params = with_gains(4, 0.0, 0.0)
    contexts = [
        ctx(
            points=stream(geometric(24, 1.2)),
            layers=layers,
            at_init=True,
            params=[param("blocks.0.mlp.up.weight", 0.2, fan_in=512)],
        ),
        ctx(points=stream(geometric(24, 0.8))),
        ctx(points=stream(accumulator(48, a=1e-3, v=0.01))),
        ctx(points=stream(rms, [0.5**i for i in range(24, -1, -1)])),
        ctx(points=stream(rms, [1.3**i for i in range(25)][::-1])),
        ctx(points=flat_stream(4), layers=branch_layers(4, **{"blocks.2.mlp": dict(rms=0.0)})),
        ctx(points=flat_stream(4), layers=gains_layers, params=gains_params, at_init=True),
    ]
    seen: set[str] = set()
    for key, check in CHECKS.items():
        for c in contexts:
            for f in check(c):
                assert f.check in key, (check.__name__, f.check)
                seen.add(f.check)
    assert seen == set(CheckId) - SWEEP_CHECKS


def test_one_warn_error_helper() -> None:
    th = DEFAULT
    assert grade(th.growth_warn, th.growth_warn, th.growth_error) == (
        Severity.WARN,
        th.growth_warn,
    )
    assert grade(th.growth_error, th.growth_warn, th.growth_error) == (
        Severity.ERROR,
        th.growth_error,
    )
    assert grade(0.05, 0.1, 0.01, above=False) == (Severity.WARN, 0.1)
    assert grade(0.01, 0.1, 0.01, above=False) == (Severity.ERROR, 0.01)
    assert warn_or_error(True, 0.5) == (Severity.ERROR, 0.5)
    assert [grade(v, 4, 10)[0] for v in (4, 10)] == [Severity.WARN, Severity.ERROR]
    # no check spells the warn/error choice out again
    for module in {inspect.getmodule(fn) for fn in CHECKS.values()}:
        assert "Severity.ERROR if" not in inspect.getsource(module), module


def test_findings_sorted_by_severity_then_check_order() -> None:
    layers = [
        act("blocks.0.mlp.act", 100),  # dead-units warn
        rec("head", role="head", std=17.8, max_abs=100.0, n_channels=512),  # logit error at init
        rec("blocks.0.mlp", max_abs=2e5),  # overflow info
    ]
    params = [param("blocks.0.mlp.up.weight", 0.2, fan_in=512)]  # init-scale error
    found = run(ctx(layers=layers, params=params, at_init=True))
    assert [(f.severity, f.check) for f in found] == [
        (Severity.ERROR, CheckId.LOGIT_SCALE),
        (Severity.ERROR, CheckId.INIT_SCALE),
        (Severity.WARN, CheckId.DEAD_UNITS),
        (Severity.INFO, CheckId.OVERFLOW),
    ]


def test_every_finding_is_one_sentence_with_numbers() -> None:
    layers = [act("blocks.0.mlp.act", 600), outlier_rec("x", 100.0), head(17.8)]
    found = run(ctx(points=stream(geometric(24, 1.2)), layers=layers, at_init=True))
    assert len(found) == 4
    for f in found:
        assert f.message.endswith(".") and re.search(r"\d", f.message), f
        assert f.hint and f.layers


def test_checks_survive_empty_and_non_finite_measurements() -> None:
    assert run(ctx()) == ()
    nan = float("nan")
    pts = stream([1.0, nan, 2.0, math.inf, 3.0, 4.0], [nan] * 6)
    layers = [rec("a", rms=nan, std=nan, max_abs=nan, channel_max_ratio=nan)]
    run(ctx(points=pts, layers=layers, at_init=True))  # no exception


# --------------------------------------------------------------------------- thresholds


def test_every_threshold_has_a_justifying_comment() -> None:
    lines = inspect.getsource(Thresholds).splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s+(\w+): (float|int) = ", line)
        if m:
            above = lines[i - 1].strip()
            assert above.startswith("#") or lines[i - 2].strip().startswith("#"), m.group(1)


def test_threshold_overrides_validate() -> None:
    th = DEFAULT.with_overrides({"growth_warn": "3", "dead-units-error": 0.25})
    assert th.growth_warn == 3 and th.dead_units_error == 0.25
    assert th.as_dict()["growth-warn"] == 3
    with pytest.raises(UsageError, match="unknown threshold 'nope'"):
        DEFAULT.with_overrides({"nope": 1})
    with pytest.raises(UsageError, match="must be a number"):
        DEFAULT.with_overrides({"headroom": "lots"})
    with pytest.raises(UsageError, match="non-negative"):
        DEFAULT.with_overrides({"headroom": "-1"})
    assert parse_threshold_options(["headroom=8", " growth-warn = 5 "]) == {
        "headroom": "8",
        "growth-warn": "5",
    }
    with pytest.raises(UsageError):
        parse_threshold_options(["headroom"])
    assert replace(DEFAULT) == thresholds_module.DEFAULT


def test_sqrt_growth_is_info_when_projections_are_already_down_scaled() -> None:
    """At init with 1/√(2L) projections, √k growth only means a small embedding: a global
    branch scale cancels behind the norms, so there is nothing to fix in the branches."""
    points = stream(accumulator(24, a=1e-6, v=0.01))
    th = DEFAULT.with_overrides({"growth-excess": "0.5"})  # a warning without the budget
    for out_scale, severity in ((1.0, Severity.WARN), (1 / math.sqrt(48), Severity.INFO)):
        layers, params = projections(24, out_scale)
        c = ctx(points=points, layers=layers, params=params, n_blocks=24, at_init=True, th=th)
        f = only(run(c), CheckId.SQRT_GROWTH)[0]
        assert f.severity is severity
    assert "already down-scaled" in f.message and "embedding" in f.hint
