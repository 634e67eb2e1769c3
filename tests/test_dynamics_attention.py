"""The attention-score maximum per layer and step (`StepRecord.attn_layers`) for every
probed family: a transformers Llama through the attention interface, the built-in model
through its score markers; `attn-logit-growth` names the layer whose scores grew."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from actscan import scan
from actscan.diagnose.thresholds import DEFAULT
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.records import CheckId, Severity
from actscan.report.report import Report
from actscan.report.schema import validate_report

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

SMALL: dict[str, Any] = {"batch": 4, "seq_len": 16}


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def llama(impl: str = "eager", gain: float = 1.0) -> torch.nn.Module:
    """A 2-layer Llama (d 32, GQA 4/2 heads); `gain` multiplies layer 1's input RMSNorm gain.

    Why the gain and not q_proj/k_proj: Adam moves every weight by ≈ lr per coordinate, so
    a layer whose q and k start larger starts with larger scores but does not grow faster
    (measured: q, k ×8 at lr 0.3, the unscaled layer reached 34, the scaled one 28). A gain
    on the layer's input scales its scores and the effect of every q/k update alike."""
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight.mul_(gain)
    return model


LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_llama_records_the_score_max_per_layer_and_step(impl: str) -> None:
    model = llama(impl)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = scan(model, steps=2, lr=1e-3, **SMALL)
    dyn = report.dynamics
    assert dyn is not None and len(dyn.steps) == 3
    for s in dyn.steps:
        assert [name for name, _ in s.attn_layers] == LAYERS
        values = [v for _, v in s.attn_layers]
        assert all(v is not None and v > 0 for v in values)
        assert s.attn_max is not None and s.attn_max == max(values)  # type: ignore[type-var]
    assert {r.name for r in report.attention} == set(LAYERS)  # the step-0 probes checked them
    # the steps moved the scores, and the model came back bit for bit
    assert dyn.steps[2].attn_layers != dyn.steps[0].attn_layers
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_no_attention_leaves_transformers_scores_unrecorded() -> None:
    report = scan(llama(), steps=1, lr=1e-3, attention=False, **SMALL)
    assert report.dynamics is not None
    assert all(s.attn_max is None and s.attn_layers == () for s in report.dynamics.steps)


def test_the_layer_whose_scores_grow_is_the_one_named() -> None:
    """Layer 1's input gain ×4: at lr 0.2 its scores pass the warn level in 2 steps (~160,
    short of the error level of 1000) while layer 0's stay ≈ 10; at lr 1e-3 neither moves
    and nothing is found."""
    report = scan(llama(gain=4.0), steps=2, lr=0.2, **SMALL)
    found = [f for f in report.findings if f.check == CheckId.ATTN_LOGIT_GROWTH.value]
    assert len(found) == 1 and found[0].severity is Severity.WARN
    assert found[0].layers == ("model.layers.1.self_attn",)
    assert "in model.layers.1.self_attn (block 1)" in found[0].message
    warn = f"≥ {DEFAULT.attn_logit_warn:g} and grown ≥ ×{DEFAULT.attn_logit_growth:g}"
    assert f"the only one of 2 attention layers {warn}" in found[0].message
    last = dict(report.dynamics.steps[-1].attn_layers)  # type: ignore[union-attr]
    assert last["model.layers.0.self_attn"] < 50 <= DEFAULT.attn_logit_warn
    assert last["model.layers.1.self_attn"] >= DEFAULT.attn_logit_warn
    quiet = scan(llama(gain=4.0), steps=2, lr=1e-3, **SMALL)
    assert not [f for f in quiet.findings if f.check == CheckId.ATTN_LOGIT_GROWTH.value]


def test_builtin_model_records_its_layers_and_round_trips_json() -> None:
    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    report = scan(build_model(cfg), steps=2, lr=1e-3, batch=4)
    dyn = report.dynamics
    assert dyn is not None
    for s in dyn.steps:
        assert [n for n, _ in s.attn_layers] == ["blocks.0.attn", "blocks.1.attn"]
        assert s.attn_max == max(v for _, v in s.attn_layers)  # type: ignore[type-var]
    # --no-attention keeps the built-in model's free read of its score markers
    off = scan(build_model(cfg), steps=1, lr=1e-3, batch=4, attention=False)
    assert off.dynamics is not None and off.dynamics.steps[0].attn_max == dyn.steps[0].attn_max
    data = report.to_dict()
    validate_report(data)
    assert data["dynamics"]["steps"][1]["attn_layers"][1]["name"] == "blocks.1.attn"
    back = Report.from_dict(data)
    assert back.dynamics is not None and back.dynamics.steps == dyn.steps
    # a report written before attn_layers existed still loads
    for s in data["dynamics"]["steps"]:
        del s["attn_layers"]
    validate_report(data)
    old = Report.from_dict(data)
    assert old.dynamics is not None and old.dynamics.steps[1].attn_layers == ()
