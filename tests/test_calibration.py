"""The calibration matrix: healthy models stay quiet, planted pathologies fire the right
check at the right place. Thresholds (actscan/thresholds.py) were set on these cases.

Small widths and short runs keep it fast; the numbers quoted in comments were measured at
the shipped sizes (d_model 256, batch 4 × 64) and hold at these too.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from actscan.models.arch import build_config, read_config_file
from actscan.models.gpt import build_model
from actscan.records import CheckId, Finding, Severity
from actscan.report.report import Report
from actscan.run import scan
from actscan.targets.info import infer_info

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAST = dict(batch=2, seq_len=32)


def builtin(config: str | None = None, **overrides: object) -> nn.Module:
    data: dict[str, object] = {}
    if config is not None:
        path = next(CONFIGS.glob(f"{config}.*"))
        data = read_config_file(path)
    data.update(overrides)
    return build_model(build_config(data), seed=0)


def profile(model: nn.Module, **kw: object) -> Report:
    info = dataclasses.replace(infer_info(model), at_init=True)
    return scan(model, info=info, **{**FAST, **kw})  # type: ignore[arg-type]


def loud(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.severity is not Severity.INFO]


def first(report: Report) -> Finding:
    assert report.findings, "no findings"
    return report.findings[0]


def gpt2(n_layer: int, d: int, *, unscaled: bool = False) -> nn.Module:
    """GPT-2 as transformers initializes it (c_proj already scaled by 1/√(2N))."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=d,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    if unscaled:  # remove the 1/√(2N): c_proj back to a flat normal(0, 0.02)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, 0.02)
    return model


# --------------------------------------------------------------------------- must stay quiet


@pytest.mark.parametrize(
    "config",
    [
        pytest.param("gpt-12-preln", marks=pytest.mark.slow),
        pytest.param("gpt-48-scaled", marks=pytest.mark.slow),
        "llama-12",
    ],
)
def test_healthy_builtin_configs_are_quiet(config: str) -> None:
    report = profile(builtin(config))
    assert not loud(report), report.findings
    # growth ×3.2–3.3 with p ≈ 0.35–0.37 at 0.02 init: the embedding is small, the branches
    # scaled — a narrow band, far from sqrt-growth's drift ×4 with p ≥ 0.4
    assert report.summary["growth_exponent"] < 0.4


def test_gpt2_as_transformers_initializes_it_is_quiet() -> None:
    # 12 layers; at the full 768 width the same holds (measured: drift ×3.73, no findings)
    report = profile(gpt2(12, 128))
    assert not loud(report), report.findings


@pytest.mark.slow
def test_deep_post_ln_is_quiet_at_init_and_why() -> None:
    """The deep post-LN row: neither vanishing-grad nor the growth checks fire at init.

    gpt-24-postln (0.02 init) writes branches of 3–11% of the normalized stream, so every
    LayerNorm Jacobian is ≈ the identity and the relative gradient is flat; post-LN's
    fragility appears once training grows the branches. The ×35 "growth" over the
    embedding is the first LayerNorm rescaling a 0.028-RMS embedding to 1, a step, not a
    drift (p = 0): flagging it would be a false alarm.
    """
    report = profile(builtin("gpt-24-postln"))
    assert not loud(report), report.findings
    assert report.summary["growth"] > 20 and abs(report.summary["growth_exponent"]) < 0.05
    r = [p.grad_rms * p.rms for p in report.stream]  # type: ignore[operator]
    assert max(r) / min(r) < 1.5  # relative gradient flat through 24 post-LN blocks


@pytest.mark.slow
def test_rezero_branches_are_info_by_design() -> None:
    report = profile(builtin("gpt-24-rezero", tie_embeddings=False, n_layers=8))
    dead = [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    assert [f.severity for f in dead] == [Severity.INFO]
    assert "ReZero" in dead[0].message and "16 of 16" in dead[0].message
    assert not loud(report), report.findings


# --------------------------------------------------------------------------- must fire


@pytest.mark.slow
def test_naive_48_block_stack_fires_sqrt_growth() -> None:
    report = profile(builtin("gpt-48-naive"))
    f = first(report)  # measured: drift ×8.3, growth ×35 over the embedding, p = 0.55
    # ×8.3 = 1.2·√48: less than Llama's own init drifts at 48 blocks (×15.4 = 2.22·√L),
    # which trains: reported with the number, at info
    assert (f.check, f.severity) == (CheckId.SQRT_GROWTH, Severity.INFO)
    assert f.layers[-1] == "blocks.47" and f.value >= 6  # type: ignore[operator]
    assert "1/√96" in f.hint
    # the static cause is reported too, after the measured effect
    init = [x for x in report.findings if x.check == CheckId.INIT_SCALE]
    assert init and "not down-scaled" in init[0].message
    assert report.summary["growth_exponent"] > 0.45 and report.summary["growth"] > 20


@pytest.mark.slow
def test_gpt2_without_c_proj_scaling_at_48_layers_fires_sqrt_growth() -> None:
    report = profile(gpt2(48, 128, unscaled=True))
    f = first(report)  # measured at d 128: drift ×7.5, p = 0.53; at d 256: ×8.7, p = 0.55
    assert (f.check, f.severity) == (CheckId.SQRT_GROWTH, Severity.INFO)  # ≤ 2.22·√L
    assert f.layers[-1] == "transformer.h.47"
    # the same model with transformers' own 1/√(2N) is quiet
    assert not loud(profile(gpt2(48, 128)))


def test_zeroed_mlp_output_projection_fires_dead_branch_at_that_block() -> None:
    model = builtin(n_layers=6, d_model=64, vocab_size=256, branch_scale="depth")
    with torch.no_grad():
        model.blocks[3].mlp.down.weight.zero_()
        model.blocks[3].mlp.down.bias.zero_()
    f = first(profile(model))
    assert (f.check, f.severity) == (CheckId.DEAD_BRANCH, Severity.WARN)
    assert f.layers == ("blocks.3.mlp",) and "block 3" in f.message


def test_one_embedding_channel_x100_fires_outlier_channels_with_its_index() -> None:
    model = builtin(
        n_layers=2,
        d_model=64,
        vocab_size=256,
        init="fan-in",
        branch_scale="depth",
        tie_embeddings=False,
    )
    with torch.no_grad():
        model.tok_emb.weight[:, 17].mul_(100.0)
    report = profile(model)
    f = first(report)
    assert (f.check, f.severity) == (CheckId.OUTLIER_CHANNELS, Severity.WARN)
    assert "channel 17 " in f.message and f.layers[0] == "tok_emb"
    assert f.value > 50  # type: ignore[operator]
    assert len(report.findings) == 1


def test_relu_with_large_negative_bias_fires_dead_units() -> None:
    model = builtin(n_layers=2, d_model=64, vocab_size=256, activation="relu", mlp_bias_init=-5)
    report = profile(model)
    f = first(report)
    assert (f.check, f.severity) == (CheckId.DEAD_UNITS, Severity.ERROR)
    assert f.layers == ("blocks.0.mlp.act", "blocks.1.mlp.act") and f.value == 1.0
    assert "mean -5" in f.message  # the shifted pre-activation is named
    checks = {x.check for x in report.findings}
    assert CheckId.INIT_SCALE in checks  # the −5 bias itself, at init


def test_fp16_overflow_names_the_first_module() -> None:
    model = builtin(
        n_layers=4,
        d_model=64,
        vocab_size=256,
        init="fan-in",
        branch_scale="depth",
        tie_embeddings=False,
    )
    with torch.no_grad():
        model.blocks[1].mlp.up.weight.mul_(500.0)
        model.blocks[1].mlp.down.weight.mul_(500.0)
    report = profile(model, dtype="fp16")
    f = first(report)
    assert (f.check, f.severity) == (CheckId.OVERFLOW, Severity.ERROR)
    assert f.layers[0] == "blocks.1.mlp.down" and "fp16" in f.message
    # in fp32 the same model runs, and the tool says it would not fit fp16
    fp32 = [x for x in profile(model).findings if x.check == CheckId.OVERFLOW]
    assert [x.severity for x in fp32] == [Severity.INFO] and "65504" in fp32[0].message


@pytest.mark.slow
def test_flat_002_init_at_width_2048_fires_init_scale() -> None:
    model = builtin(n_layers=1, d_model=2048, n_heads=32, vocab_size=64, seq_len=8)
    report = profile(model, batch=1, seq_len=8, backward=False)
    f = first(report)  # 0.02 vs √(1/8192) = 0.011 on the MLP down-projection: 1.81×
    assert (f.check, f.severity) == (CheckId.INIT_SCALE, Severity.WARN)
    assert f.layers == ("blocks.0.mlp.down",) and f.value == pytest.approx(1.81, abs=0.02)
    assert len(loud(report)) == 1  # fan_in 2048 (0.905×) is fine


def test_tied_unit_variance_embedding_fires_logit_scale() -> None:
    model = builtin(n_layers=2, d_model=64, vocab_size=256, init="xavier")  # embed_std 1, tied
    f = first(profile(model))  # logits std ≈ √64 = 8 vs √(2 ln 256) = 3.33
    assert (f.check, f.layers) == (CheckId.LOGIT_SCALE, ("head",))
    assert f.severity is Severity.WARN and "tied" in f.hint


def test_unscaled_attention_fires_logit_scale() -> None:
    report = profile(builtin(n_layers=2, d_model=64, vocab_size=256, attn_scale="none"))
    f = first(report)
    assert (f.check, f.severity) == (CheckId.LOGIT_SCALE, Severity.WARN)
    assert f.layers == ("blocks.0.attn.logits", "blocks.1.attn.logits")


# --------------------------------------------------------------------------- signal propagation


class TanhStack(nn.Module):
    """Mean-field textbook stack (Poole et al. 2016): x ← act(W x + b), no residual, no norm.

    W ~ N(0, σ_w²/d), b ~ N(0, σ_b²). Ordered phase: gradients vanish while the forward
    signal sits at a fixed point; chaotic phase: gradients explode; small σ_w collapses.
    """

    def __init__(self, sw: float, sb: float, act: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        d = 64
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), act()) for _ in range(24))
        with torch.no_grad():
            for b in self.blocks:
                b[0].weight.normal_(0.0, sw / math.sqrt(d))
                b[0].bias.normal_(0.0, sb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def stack_report(sw: float, sb: float, act: type[nn.Module] = nn.Tanh) -> Report:
    torch.manual_seed(0)
    model = TanhStack(sw, sb, act)
    return scan(model, inputs=torch.randn(256, 64))


@pytest.mark.parametrize(
    ("sw", "sb", "act", "check", "severity"),
    [
        (1.0, 1.0, nn.Tanh, CheckId.VANISHING_GRAD, Severity.ERROR),  # ordered phase
        (3.0, 0.0, nn.Tanh, CheckId.EXPLODING_GRAD, Severity.ERROR),  # chaotic phase
        (0.5, 0.0, nn.Tanh, CheckId.COLLAPSE, Severity.ERROR),  # 0.5^24
        (2.0 * math.sqrt(2.0), 0.0, nn.ReLU, CheckId.EXP_GROWTH, Severity.ERROR),  # 2× He
    ],
)
def test_signal_propagation_regimes(sw, sb, act, check, severity) -> None:
    report = stack_report(sw, sb, act)
    f = first(report)
    assert (f.check, f.severity) == (check, severity), report.findings
    assert f.layers[-1] == "blocks.23"


def test_edge_of_chaos_is_quiet() -> None:
    assert not loud(stack_report(1.5, 0.5))


def test_he_init_preserves_variance_but_deep_narrow_relu_stacks_lose_units() -> None:
    """He init keeps the forward scale (no exp-growth/collapse), yet 24 ReLU layers of width
    64 without residuals correlate their inputs until whole units stay off on every input:
    the "born dead" effect of deep narrow ReLU nets (Lu et al. 2019), reported as dead-units."""
    report = stack_report(math.sqrt(2.0), 0.0, nn.ReLU)
    checks = {f.check for f in loud(report)}
    assert checks == {CheckId.DEAD_UNITS}, report.findings
    dead = next(f for f in report.findings if f.check == CheckId.DEAD_UNITS)
    assert "blocks.0.1" not in dead.layers  # the first layer, on independent inputs, is alive


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_reports_with_findings_validate_and_gate(tmp_path: Path) -> None:
    """Findings survive the JSON schema, and the CLI's exit code follows their severity."""
    import json

    from typer.testing import CliRunner

    from actscan.cli import app
    from actscan.report.schema import validate_report

    model = builtin(n_layers=2, d_model=64, vocab_size=256, activation="relu", mlp_bias_init=-5)
    validate_report(json.loads(profile(model).to_json()))

    runner = CliRunner()
    base = ["profile", "gpt-48-naive", "--set", "d_model=128", "--batch", "2", "--seq-len", "32"]
    out = tmp_path / "r.json"
    res = runner.invoke(app, [*base, "-q", "--json", str(out)])
    assert res.exit_code == 0, res.output  # sqrt-growth is info: √k growth real inits ship
    data = json.loads(out.read_text())
    validate_report(data)
    assert data["findings"][0]["check"] == "sqrt-growth"
    assert data["summary"]["growth_exponent"] > 0.45
    assert "sqrt-growth" in res.stdout.split("init-scale")[0]  # shown first in the panel
    assert runner.invoke(app, [*base, "-q", "--fail-on", "info"]).exit_code == 1
    # a threshold override makes it a warning: the drift (×7.7 at d 128) is 1.1·√48
    warn = [*base, "-q", "--fail-on", "warn"]
    assert runner.invoke(app, warn).exit_code == 0
    assert runner.invoke(app, [*warn, "--threshold", "growth-excess=1"]).exit_code == 1
