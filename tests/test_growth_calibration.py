"""The step-0 growth checks against the inits real families ship.

transformers' own Llama/Mistral/Qwen2 inits (no 1/√(2L)) drift ×4.7–15.4 through 12–48
blocks and train: `--fail-on warn`, as the README's CI recipe runs it, must pass on them.
A jump inside block 0 (every weight at std 1) is seen from the embedding, at block 0.
The thresholds stand on benchmarks/results/growth-calibration.json (calibrate_growth.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from actscan.diagnose.depth import POST_LN_JUMP, REAL_INIT_DRIFT, REAL_INIT_JUMP
from actscan.diagnose.thresholds import DEFAULT
from actscan.records import CheckId, Severity
from actscan.run import scan

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/growth-calibration.json"
DEEP = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
)


def stock(model_type: str, **extra: object) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**DEEP, **extra})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("mistral", {}),
        ("qwen2", {}),
        ("llama", dict(num_hidden_layers=12, hidden_size=128, intermediate_size=256)),
    ],
)
def test_stock_deep_decoders_get_no_warning_at_step_0(model_type: str, extra: dict) -> None:
    report = scan(stock(model_type, **extra), batch=2, seq_len=32)
    loud = [(f.check, f.severity.value) for f in report.findings if f.severity.rank > 0]
    assert not loud, [f.message for f in report.findings if f.severity.rank > 0]
    # the growth is there, and reported: √k accumulation, with its number, at info
    (f,) = [f for f in report.findings if f.check == CheckId.SQRT_GROWTH]
    assert f.severity is Severity.INFO and f.value is not None and f.value > DEFAULT.growth_warn
    blocks = len([p for p in report.stream if p.block is not None])
    assert f.value / math.sqrt(blocks) < DEFAULT.growth_excess  # type: ignore[operator]


def test_the_ci_recipe_passes_on_a_stock_config(tmp_path: Path) -> None:
    """`actscan profile config.json --fail-on warn` (the README's CI/pre-commit recipe) on an
    untouched 24-block Llama config: exit 0."""
    from typer.testing import CliRunner

    from actscan.cli import app

    path = tmp_path / "config.json"
    cfg = transformers.AutoConfig.for_model("llama", **DEEP)
    path.write_text(json.dumps(cfg.to_dict()))
    args = ["profile", str(path), "--batch", "2", "--seq-len", "32", "-q", "--fail-on", "warn"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "sqrt-growth" in res.output  # shown, as info


def test_a_jump_inside_block_0_is_seen_from_the_embedding() -> None:
    """Every weight at std 1: block 0's branches write ×10²–10⁴ what they read, and the
    drift measured after block 0 is only √L. The jump fires exp-growth at block 0, with
    the ratio an independent hook measures."""
    model = stock("llama", num_hidden_layers=4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: object, o: object) -> None:
            t = o[0] if isinstance(o, tuple) else o
            seen.setdefault(name, t.detach().clone())  # type: ignore[union-attr]

        return hook

    hooks = [
        model.model.embed_tokens.register_forward_hook(keep("emb")),
        model.model.layers[0].register_forward_hook(keep("b0")),
    ]
    try:
        report = scan(model, batch=2, seq_len=16)
    finally:
        for h in hooks:
            h.remove()
    rms = {k: float(v.double().pow(2).mean().sqrt()) for k, v in seen.items()}
    (f,) = [f for f in report.findings if f.check == CheckId.EXP_GROWTH]
    assert f.layers == ("model.layers.0",) and "inside block 0" in f.message
    assert f.value == pytest.approx(rms["b0"] / rms["emb"], rel=1e-3)
    assert f.value > DEFAULT.growth_jump and f.severity is not Severity.INFO  # type: ignore[operator]
    # the drift after block 0 is plain √k: sqrt-growth alone would stay at most info
    assert all(
        g.severity is Severity.INFO for g in report.findings if g.check == CheckId.SQRT_GROWTH
    )


def test_the_thresholds_stand_on_the_recorded_calibration() -> None:
    """growth-excess and growth-jump sit above every real family's own init measured, and
    the planted std-1 jump above growth-jump-error: rerunning calibrate_growth.py after a
    transformers change shows whether they still do."""
    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    healthy = data["healthy"]
    families = {r["family"] for r in healthy if "family" in r}
    assert {"llama", "mistral", "qwen2", "gpt2", "gemma"} <= families
    assert {r["depth"] for r in healthy} >= {12, 24, 32, 48}
    worst = max(r["drift_per_sqrt_L"] for r in healthy if "family" in r)
    assert 2.0 < worst < DEFAULT.growth_excess
    assert max(r["jump"] for r in healthy) < DEFAULT.growth_jump
    # the numbers the messages quote are these measurements
    assert worst == pytest.approx(REAL_INIT_DRIFT, abs=0.01)
    assert max(r["jump"] for r in healthy if "family" in r) == pytest.approx(
        REAL_INIT_JUMP, abs=0.1
    )
    post_ln = next(r for r in healthy if "postln" in r.get("case", ""))
    assert post_ln["jump"] == pytest.approx(POST_LN_JUMP, abs=0.1)
    planted = {r["case"]: r for r in data["planted"]}
    assert planted["llama, every weight std 1"]["jump"] > DEFAULT.growth_jump_error
    assert planted["llama, block i's writes ×1.2^i"]["findings"] == {"exp-growth": "error"}
