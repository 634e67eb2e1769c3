"""The layout proves itself: for every block, stream in + Σ branch writes = stream out.

A calibration matrix of tiny transformers families (built from configs, no download) and
built-in configs: the self-check holds for every block (or reports post-norm placement),
branches get their roles (a Mamba mixer is no attention), sandwich norms are taken as the
writes (no false dead-branch on Gemma), and a planted dead branch is still found.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

from actscan.layout.detect import detect_layout, find_streams
from actscan.layout.proof import prove_layout
from actscan.models.arch import build_config, read_config_file
from actscan.models.gpt import build_model
from actscan.records import BlockProof, CheckId, Layout
from actscan.report.report import Report
from actscan.run import scan
from actscan.targets.info import infer_info

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


DEC = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ENC = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
MATRIX: dict[str, tuple[dict[str, object], str, list[tuple[str, str, str | None]], str]] = {
    # family: (config, model class, [(role, branch, write or None)] per block, placement)
    "gpt2": (
        {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64},
        "causal",
        [("attn", "attn", None), ("mlp", "mlp", None)],
        "additive",
    ),
    "llama": (DEC, "causal", [("attn", "self_attn", None), ("mlp", "mlp", None)], "additive"),
    "qwen2": (DEC, "causal", [("attn", "self_attn", None), ("mlp", "mlp", None)], "additive"),
    "qwen3": (DEC, "causal", [("attn", "self_attn", None), ("mlp", "mlp", None)], "additive"),
    "mistral": (DEC, "causal", [("attn", "self_attn", None), ("mlp", "mlp", None)], "additive"),
    "phi3": (DEC, "causal", [("attn", "self_attn", None), ("mlp", "mlp", None)], "additive"),
    "gemma2": (
        DEC,
        "causal",
        [
            ("attn", "self_attn", "post_attention_layernorm"),
            ("mlp", "mlp", "post_feedforward_layernorm"),
        ],
        "additive",
    ),
    "gemma3_text": (
        DEC,
        "causal",
        [
            ("attn", "self_attn", "post_attention_layernorm"),
            ("mlp", "mlp", "post_feedforward_layernorm"),
        ],
        "additive",
    ),
    "mixtral": (
        {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2},
        "causal",
        [("attn", "self_attn", None), ("mlp", "mlp", None)],
        "additive",
    ),
    "qwen2_moe": (
        {
            **DEC,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
        "causal",
        [("attn", "self_attn", None), ("mlp", "mlp", None)],
        "additive",
    ),
    "falcon": (  # parallel attention + MLP from one norm
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128},
        "causal",
        [("attn", "self_attention", None), ("mlp", "mlp", None)],
        "additive",
    ),
    "opt": (  # fc1/fc2 directly in the layer, adds in (B·T, C)
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "ffn_dim": 96,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 64,
        },
        "causal",
        [("attn", "self_attn", None), ("mlp", "fc2", None)],
        "additive",
    ),
    "mamba": (
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 128,
            "state_size": 8,
            "expand": 2,
        },
        "causal",
        [("mixer", "mixer", None)],
        "additive",
    ),
    "bert": (  # post-LN: the residual add and the norm live inside the branch wrappers
        ENC,
        "masked",
        [("attn", "attention.output.dense", None), ("mlp", "output.dense", None)],
        "post-norm",
    ),
    "modernbert": (
        {**ENC, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2},
        "masked",
        [("attn", "attn", None), ("mlp", "mlp", None)],
        "additive",
    ),
}
MOE = {"mixtral", "qwen2_moe"}


def hf_model(model_type: str, **extra: object) -> nn.Module:
    kw, kind, _, _ = MATRIX[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **{**kw, **extra})
    auto = (
        transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModelForMaskedLM
    )
    torch.manual_seed(0)
    return auto.from_config(cfg).eval()


def builtin(config: str, **overrides: object) -> nn.Module:
    path = next(p for p in _configs() if p.stem == config)
    data = {**read_config_file(path), "n_layers": 3, "d_model": 64, "vocab_size": 128}
    data.update(overrides)
    return build_model(build_config(data), seed=0).eval()


def _configs() -> list:
    from pathlib import Path

    return sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.*"))


def ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(0))


def proven(model: nn.Module, call: Callable[[], object]) -> Layout:
    return prove_layout(model, detect_layout(model), call).layout


def proofs(layout: Layout) -> list[BlockProof]:
    out = [b.proof for b in layout.blocks]
    assert all(p is not None for p in out)
    return out  # type: ignore[return-value]


def only_block_1_fails(model: nn.Module, x: torch.Tensor, wrong: nn.Module) -> None:
    """With block 1 replaced by `wrong` (a write the equation must reject), only its
    proof fails: the others still hold."""
    model.blocks[1] = wrong
    got = [p.status for p in proofs(proven(model, lambda: model(x[:1])))]
    assert got == ["verified", "unverified"] + ["verified"] * (len(model.blocks) - 2), got


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_every_block_of_every_family_proves_its_layout(model_type: str) -> None:
    _, _, expected, placement = MATRIX[model_type]
    model = hf_model(model_type)
    x = ids()
    layout = proven(model, lambda: model(input_ids=x))
    assert len(layout.blocks) == 2
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified", (model_type, p)
        assert p.residual is not None and p.tolerance is not None
        assert p.residual <= p.tolerance <= 1e-4  # fp32: the equation holds to rounding
        assert p.placement == placement
        got = [
            (
                br.role,
                br.name.removeprefix(b.name + "."),
                br.write.removeprefix(b.name + ".") if br.write else None,
            )
            for br in b.branches
        ]
        assert got == expected, model_type
        assert [br.moe for br in b.branches] == [
            model_type in MOE and role == "mlp" for role, _, _ in expected
        ]
        assert p.writes == tuple(br.write or br.name for br in b.branches)
        assert b.adds == len(expected)
        if placement == "post-norm":
            assert len(p.norms) == 2 and all("LayerNorm" in n for n in p.norms)


@pytest.mark.parametrize(
    ("config", "overrides", "writes", "placement"),
    [
        ("gpt-12-preln", {}, ("attn", "mlp"), "additive"),
        ("gpt-24-postln", {}, ("attn", "mlp"), "post-norm"),
        ("gpt-24-deepnorm", {}, ("attn", "mlp"), "post-norm"),
        ("gpt-24-rezero", {}, ("attn_gain", "mlp_gain"), "additive"),
        ("gpt-12-preln", {"branch_scale": "layerscale"}, ("attn_gain", "mlp_gain"), "additive"),
    ],
)
def test_builtin_configs_prove_their_layout(
    config: str, overrides: dict[str, object], writes: tuple[str, ...], placement: str
) -> None:
    model = builtin(config, **overrides)
    x = ids()
    layout = proven(model, lambda: model(x))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert (p.status, p.placement) == ("verified", placement)
        assert p.writes == tuple(f"{b.name}.{w}" for w in writes)
        assert [br.name for br in b.branches] == [f"{b.name}.attn", f"{b.name}.mlp"]
        assert p.residual is not None and p.residual <= 1e-4
    p0 = proofs(layout)[0]
    if config == "gpt-24-deepnorm":  # x_out = LN(α·x + F(x)): α fitted, α = (2N)^¼
        assert p0.stream_scale == pytest.approx((2 * 3) ** 0.25, rel=1e-4)
    else:
        assert p0.stream_scale is None
    if placement == "post-norm":
        assert p0.norms == ("blocks.0.norm1", "blocks.0.norm2")


# --------------------------------------------------------------------------- mechanisms


class _ThreeWays(nn.Module):
    """Self-attention, cross-attention (to a fixed memory) and an MLP: three writes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.register_buffer("memory", torch.randn(1, 5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        mem = self.memory.expand(x.shape[0], -1, -1)
        x = x + self.cross_attn(x, mem, mem, need_weights=False)[0]
        return x + self.mlp(x)


class _Warped(nn.Module):
    """The stream gets exp(branch) through `addcmul`, an op the add watch does not see:
    no module returns what the block adds, and no `+` operand is it either."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Linear(d, d)
        with torch.no_grad():
            self.mlp.weight.mul_(1e-5)
            self.mlp.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.addcmul(torch.exp(self.mlp(x)), torch.ones_like(x))


class _Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def features() -> torch.Tensor:
    return torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))


def test_three_writes_and_cross_attention_role() -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: _ThreeWays(32)).eval()
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b in layout.blocks:
        assert [(br.role, br.name.rsplit(".", 1)[-1]) for br in b.branches] == [
            ("attn", "self_attn"),
            ("cross_attn", "cross_attn"),
            ("mlp", "mlp"),
        ]
        assert b.adds == 3 and b.proof is not None and b.proof.status == "verified"
    report = scan(model, x, lambda out: out.square().mean())
    assert [p.k for p in report.stream] == [0, 3, 6, 9, 12]
    assert {br.kind for br in report.branches} == {"attn", "cross_attn", "mlp"}
    assert report.layer("blocks.0.cross_attn").role == "cross_attn"


def test_unverified_blocks_are_said_and_not_judged() -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: _Warped(32))
    report = scan(model, features(), lambda out: out.square().mean())
    assert [p.status for p in report.layout] == ["unverified"] * 4
    assert all(p.residual is not None and p.residual > 0.1 for p in report.layout)
    # the branch module writes 1e-5 of the stream, but what the stream gets is exp(·) ≈ 1:
    # not judged, and said so
    assert all(br.ratio is not None and br.ratio < 1e-3 for br in report.branches)
    assert all(br.verified is False for br in report.branches)
    assert not [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    note = next(n for n in report.notes if "layout self-check" in n)
    assert "4 of 4 blocks unverified" in note and "dead-branch" in note


def test_probe_leaves_no_hooks_and_the_same_outputs() -> None:
    model = hf_model("gemma2")
    x = ids()
    with torch.no_grad():
        before = model(input_ids=x).logits
    proven(model, lambda: model(input_ids=x))
    assert all(
        not (m._forward_hooks or m._forward_pre_hooks or m._forward_hooks_with_kwargs)
        for m in model.modules()
    )
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, before)


def test_a_probe_that_fails_skips_the_checks_with_a_note() -> None:
    model = builtin("gpt-12-preln")

    def boom() -> None:
        raise RuntimeError("no forward today")

    result = prove_layout(model, detect_layout(model), boom)
    assert [p.status for p in result.proofs] == ["skipped"] * 3
    assert "could not run (RuntimeError: no forward today)" in result.notes[0]
    assert all(
        not (m._forward_hooks or m._forward_pre_hooks or m._forward_hooks_with_kwargs)
        for m in model.modules()
    )


def test_bf16_tolerance_follows_the_dtype() -> None:
    model = builtin("gpt-12-preln").to(torch.bfloat16)
    x = ids()
    layout = proven(model, lambda: model(x))
    for p in proofs(layout):
        assert p.status == "verified" and p.tolerance == pytest.approx(3e-2)
        assert p.residual is not None and 0 < p.residual <= 3e-2


def test_a_stream_1e5_times_its_branches_cannot_prove_a_wrong_layout() -> None:
    """A Llama whose embedding is 1e5× its branches (std 2e4; all heads stream-shaped q/k/v):
    against the output's norm, q/k/v counted as writes balance the sum to 4e-6 and passed
    a 1e-4 tolerance. Measured against the writes they are a hundred times over it; the
    proof keeps attention + MLP, and dead-branch does not name q_proj as a branch."""
    model = hf_model("llama", num_key_value_heads=4)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 2e4)
    x = ids()
    layout = proven(model, lambda: model(input_ids=x))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified", p
        assert p.writes == (f"{b.name}.self_attn", f"{b.name}.mlp")
    report = _profile(model)
    assert {b.name.rsplit(".", 1)[-1] for b in report.branches} == {"self_attn", "mlp"}
    named = [n for f in report.findings for n in f.layers if f.check == CheckId.DEAD_BRANCH]
    assert named and not [n for n in named if "_proj" in n]
    # the equation the old tolerance accepted: q/k/v as writes, ≤ 1e-4 of ‖x_out‖
    h: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: object, o: object) -> None:
            h.setdefault(name, o[0] if isinstance(o, tuple) else o)  # type: ignore[arg-type]

        return hook

    wanted = ("", "self_attn", "mlp", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    hooks = [
        m.register_forward_hook(keep(n))
        for n, m in model.model.layers[0].named_modules()
        if n in wanted
    ]
    with torch.no_grad():
        model(input_ids=x)
    for hook in hooks:
        hook.remove()
    x_out = h[""].double()
    x_in = x_out - h["self_attn"].double() - h["mlp"].double()
    wrong = sum(h[f"self_attn.{q}_proj"].double() for q in "qkv")
    assert float(wrong.norm() / x_out.norm()) < 1e-4 < float(wrong.norm() / (x_out - x_in).norm())


# --------------------------------------------------------------------------- the checks


def _profile(model: nn.Module) -> Report:
    info = dataclasses.replace(infer_info(model), at_init=True)
    return scan(model, info=info, batch=2, seq_len=16)


@pytest.mark.slow
def test_gemma2_at_8_layers_has_no_false_dead_branch_and_a_planted_one_is_found() -> None:
    model = hf_model("gemma2", num_hidden_layers=8)
    report = _profile(model)
    assert not [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    # the post-branch norms set what reaches the stream, not the output projections' init
    assert not any("not down-scaled" in f.message for f in report.findings)
    mlp = [b for b in report.branches if b.kind == "mlp"]
    assert len(mlp) == 8 and all(
        b.write and b.write.endswith("post_feedforward_layernorm") for b in mlp
    )
    # the MLP's own output is tiny, what the stream receives is not (the 0.0029 vs 0.94)
    assert min(b.ratio for b in mlp) < 0.01 < 0.1 < min(b.write_ratio for b in mlp)  # type: ignore[operator, type-var]
    with torch.no_grad():
        model.model.layers[5].mlp.down_proj.weight.zero_()
    dead = [f for f in _profile(model).findings if f.check == CheckId.DEAD_BRANCH]
    assert len(dead) == 1 and dead[0].layers == ("model.layers.5.mlp",)
    assert "MLP of block 5" in dead[0].message and "post_feedforward_layernorm" in dead[0].message


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2"])
def test_a_branch_behind_a_post_norm_is_judged_by_what_the_norm_writes(model_type: str) -> None:
    """Large weights (std 3) behind post-branch norms: the MLP's own output is ~1e4–1e5×
    the stream and the gradient before the norm ÷ that much, a false dead-branch on every
    MLP when read there. The norm's write is what the stream gets and what learns: no
    dead-branch, the Branches table shows the write (as JSON's write_ratio), and no hint
    offers output-projection scaling the norm would undo."""
    from rich.console import Console

    from actscan.render.terminal import branch_table

    cfg = transformers.AutoConfig.for_model(model_type, **{**DEC, "num_hidden_layers": 4})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, 3.0)
    report = _profile(model)
    assert not [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    mlp = [b for b in report.branches if b.kind == "mlp"]
    assert len(mlp) == 4 and all(
        b.write and b.write.endswith("post_feedforward_layernorm") for b in mlp
    )
    assert min(b.ratio for b in mlp) > 1e3 and min(b.write_ratio for b in mlp) > 0.1  # type: ignore[operator, type-var]
    console = Console(width=200, record=True)
    table = branch_table(report)
    assert table is not None
    console.print(table)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "layers.0.mlp" in line)
    assert "→ post_feedforward_layernorm" in row
    from actscan.numfmt import num

    assert num(mlp[0].write_ratio) in row and num(mlp[0].ratio) not in row
    offers = ("output projections (attention out", "projections also take", "1/√(2L) output")
    assert report.findings
    assert not [f.hint for f in report.findings for o in offers if o in f.hint]


def test_planted_dead_mlp_in_llama_is_found_at_its_block() -> None:
    model = hf_model("llama", num_hidden_layers=4)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.zero_()
    dead = [f for f in _profile(model).findings if f.check == CheckId.DEAD_BRANCH]
    assert len(dead) == 1 and dead[0].layers == ("model.layers.2.mlp",)


def test_mamba_mixer_is_a_mixer_not_attention() -> None:
    model = hf_model("mamba", num_hidden_layers=4)
    report = _profile(model)
    assert {b.kind for b in report.branches} == {"mixer"}
    roles = {r.name: r.role for r in report.layers}
    assert roles["backbone.layers.0.mixer"] == roles["backbone.layers.0.mixer.out_proj"] == "mixer"
    assert roles["backbone.layers.0.norm"] == "norm"
    assert not any("attention" in f.message for f in report.findings)
    with torch.no_grad():
        model.backbone.layers[1].mixer.out_proj.weight.zero_()
    dead = [f for f in _profile(model).findings if f.check == CheckId.DEAD_BRANCH]
    assert len(dead) == 1 and "mixer (SSM) of block 1" in dead[0].message


def test_moe_branch_is_an_mlp_called_moe() -> None:
    model = hf_model("qwen2_moe", num_hidden_layers=4)
    report = _profile(model)
    moe = [b for b in report.branches if b.moe]
    assert len(moe) == 4 and {b.kind for b in moe} == {"mlp"}
    mlp = model.model.layers[3].mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
    dead = [f for f in _profile(model).findings if f.check == CheckId.DEAD_BRANCH]
    assert len(dead) == 1 and "MoE of block 3" in dead[0].message


def test_report_records_the_proof_in_json() -> None:
    from actscan.report.schema import validate_report

    pytest.importorskip("jsonschema")
    report = _profile(hf_model("gemma2"))
    data = json.loads(report.to_json())
    validate_report(data)
    assert [d["status"] for d in data["layout"]] == ["verified", "verified"]
    first = data["layout"][0]
    assert first["writes"] == [
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.post_feedforward_layernorm",
    ]
    assert first["roles"] == ["attn", "mlp"] and first["stream"] == "main"
    assert data["branches"][0]["write"] == "model.layers.0.post_attention_layernorm"
    again = Report.from_dict(data)
    assert again.layout == report.layout and again.branches == report.branches


def test_compare_shows_what_the_stream_receives_behind_post_branch_norms() -> None:
    """Gemma 2's stream receives each branch through its post-branch norm: compare pairs
    those writes (×2 here, where the branch's own output is unchanged), not only the branch."""
    from rich.console import Console

    from actscan.compare.pairs import compare_reports
    from actscan.render.compare import branch_table

    model = hf_model("gemma2")
    a = _profile(model)
    with torch.no_grad():  # Gemma's norms apply (1 + w): doubling the gain doubles the write
        w = model.model.layers[0].post_attention_layernorm.weight
        w.copy_(2 * (1 + w) - 1)
    cmp = compare_reports(a, _profile(model))
    first = cmp.branches[0]
    assert (first.block, first.kind) == (0, "attn")
    assert first.rms_ratio == pytest.approx(1.0, rel=1e-5)
    assert first.write_rms_ratio == pytest.approx(2.0, rel=1e-4)
    assert first.write_ratio_a == pytest.approx(a.branches[0].write_ratio)
    console = Console(width=200, record=True)
    table = branch_table(cmp)
    assert table is not None
    console.print(table)
    text = console.export_text()
    assert "write÷stream A" in text and "×2" in text


def test_the_probe_runs_in_eval_mode_and_restores_train_mode() -> None:
    model = hf_model("gpt2").train()  # dropout 0.1 would make every write a fresh tensor
    x = ids()
    layout = proven(model, lambda: model(input_ids=x))
    assert all(p.status == "verified" for p in proofs(layout))
    assert all(m.training for m in model.modules())


def test_blocks_that_change_the_stream_shape_are_plain_and_silent() -> None:
    """x_in + anything of x_in's shape cannot be x_out: no residual add across the
    block's boundary (verified plain, with no branches to judge; issue 22)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 4), nn.ReLU()),
    )
    x = torch.randn(2, 8)
    result = prove_layout(model, detect_layout(model), lambda: model(x[:1]))
    assert [(p.status, p.placement) for p in result.proofs] == [("verified", "plain")] * 2
    assert "shape (1×8 → 1×16)" in result.proofs[0].note and not result.notes
    assert not result.layout.blocks[0].branches


class _MlpBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _MixerBlock(nn.Module):
    """Another layer class: a gated mixer whose output projection is the write, and a
    same-class list inside it (two experts) that must not become a stream."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.SiLU()) for _ in range(2))
        self.mixer = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.mixer(self.experts[0](h) * self.experts[1](h))


def test_a_hybrid_list_of_two_layer_classes_is_the_block_list() -> None:
    """Jamba, Mllama, OLMo-hybrid: one ModuleList of two layer classes (issue 22). The
    list is the stream, the experts list inside a layer is not; each layer proves its own
    write, and a planted wrong one (exp of the branch) is still rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _MlpBlock(), n=4)
    model.blocks = nn.ModuleList([_MlpBlock(), _MixerBlock(), _MlpBlock(), _MixerBlock()])
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    assert [b.name for b in layout.blocks] == [f"blocks.{i}" for i in range(4)]
    assert all(p.status == "verified" for p in proofs(layout))
    assert [[br.name for br in b.branches] for b in layout.blocks] == [
        ["blocks.0.mlp"],
        ["blocks.1.mixer"],
        ["blocks.2.mlp"],
        ["blocks.3.mixer"],
    ]
    model.blocks[2] = _Warped(32)
    layout = proven(model, lambda: model(x[:1]))
    assert [p.status for p in proofs(layout)] == ["verified", "verified", "unverified", "verified"]


def test_a_mixed_list_with_a_bare_activation_is_no_block_list() -> None:
    """A codec's conv stack (Conv, ELU, Conv, …) is a mixed list too, but a leaf module
    in it says its items are layers of one computation, not residual blocks."""
    stack = nn.ModuleList([nn.Sequential(nn.Conv1d(4, 4, 3)), nn.ELU(), _MlpBlock(4)])
    model = nn.Module()
    model.layers = stack
    assert find_streams(model) == []
    assert "no repeated blocks" in (detect_layout(model).note or "")


class _Gated(nn.Module):
    """A write no module returns: a gate times a value, both modules, multiplied by a
    functional op (UnivNet's gated unit); then an MLP whose output is added as is."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.gate = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.sigmoid(self.gate(x)) * torch.tanh(self.value(x))
        return x + self.mlp(x)


class _ChannelsFirst(nn.Module):
    """A ConvNeXt-style block on a (B, C, T) stream: the branch runs channels-last and
    its write is a per-channel gain times the output, transposed back (WavTokenizer)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(d, d, 3, padding=1, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pw(self.norm(self.dwconv(x).transpose(1, 2)))
        return x + (self.gamma * h).transpose(1, 2)


class _ChannelsLastInside(nn.Module):
    """VitDet's layer: a (B, C, L) stream permuted channels-last, two adds of module
    outputs there, permuted back."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(0, 2, 1)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return h.permute(0, 2, 1)


def test_a_write_computed_by_functional_ops_proves_the_stream_not_a_branch() -> None:
    """UnivNet, SAM3, Pegasus-X: the stream gets a tensor computed after the last module
    (a gate, an un-padding). The add's operands are recorded, so the equation is proven;
    the module writes are branches, the functional one is named in the note and never
    judged as one. A block whose add the watch cannot see (`_Warped`) is still rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _Gated(), n=4)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified" and p.placement == "additive", p
        assert p.residual is not None and p.residual < 1e-5
        assert p.writes == (f"{b.name}.mlp",) and b.adds == 2
        assert [br.name for br in b.branches] == [f"{b.name}.mlp"]
        assert "1 of the 2 writes is a tensor computed by functional ops" in p.note
        assert f"after {b.name}.value" in p.note
    with torch.no_grad():
        out = model(x)
    proven(model, lambda: model(x[:1]))
    with torch.no_grad():
        assert torch.equal(model(x), out)  # the add watch reads only
    only_block_1_fails(model, x, _Warped(32))

    # another tool's hook adding the block's delta onto its input is no write of the model
    def delta(_m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        args[0] + (out - args[0])

    handles = [m.register_forward_hook(delta) for m in (model.blocks[1], model.blocks[1].mlp)]
    try:
        assert proofs(proven(model, lambda: model(x[:1])))[1].status == "unverified"
    finally:
        for h in handles:
            h.remove()


class _ScaledInPlace(nn.Module):
    """The tensor an inner module returned is changed in place before its parent returns
    it (Llama 4's MoE adds its routed experts into the shared expert's output, `add_`):
    here halved, so what the inner module returned is not what the block adds."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x).mul_(0.5)


class _InPlaceMoeBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = _ScaledInPlace(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def test_a_write_changed_in_place_after_its_module_returned_is_read_as_added() -> None:
    """The inner module's output, recorded when it returned, is not what the block adds
    once `mul_` changed it: tensors are told apart by their version counter too, so the
    outer module is the write, with unit coefficient (not the inner one fitted at 0.5)."""
    torch.manual_seed(0)
    model = _Stack(lambda: _InPlaceMoeBlock(), n=3)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified" and p.writes == (f"{b.name}.moe",), p
        assert not p.note and p.residual is not None and p.residual < 1e-5
        assert [br.scale for br in b.branches] == [None]


class _AddThenNorm(nn.Module):
    """A post-LN output wrapper that takes the branch output and the residual and holds
    the add itself (FNet's FNetBasicOutput), or leaves it to an inner module whose output
    the norm takes (I-BERT's quantizer `ln_input_act`); "wrong" adds f², which is no
    module's output."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.adder = _Adder() if how == "inner" else None
        self.LayerNorm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.adder is not None:
            return self.LayerNorm(self.adder(h, residual))
        return self.LayerNorm(residual + (h * h if self.how == "wrong" else h))


class _Adder(nn.Module):
    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + h


class _PostLnWrapped(nn.Module):
    def __init__(self, how: str, d: int = 32) -> None:
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.mix_out = _AddThenNorm(d, how)
        self.fc = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.fc_out = _AddThenNorm(d, how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix_out(self.mix(x), x)
        return self.fc_out(self.fc(x), x)


@pytest.mark.parametrize("how", ["wrapper", "inner"])
def test_post_ln_whose_add_lives_in_the_wrapper_that_takes_the_branch(how: str) -> None:
    """The branch output is consumed by a module (the wrapper holding the add), so it is
    no data-flow terminal; as an operand of the `+` it is a write all the same, and the
    norm after the add (taking an inner module's sum, I-BERT) is where the stream passes.
    f² added instead of f is rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _PostLnWrapped(how), n=3)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified" and p.placement == "post-norm", p
        assert p.writes == (f"{b.name}.mix", f"{b.name}.fc")
        assert p.norms == (f"{b.name}.mix_out.LayerNorm", f"{b.name}.fc_out.LayerNorm")
    only_block_1_fails(model, x, _PostLnWrapped("wrong"))


class _PrefixThenResidual(nn.Module):
    """PP-LCNet's block: a depthwise conv and a gate transform the input (no add), then
    a residual channel MLP adds onto that; with `boundary`, Inkling2's block boundary: the
    stream restarts at the attention's output and the MLP adds onto it."""

    def __init__(self, d: int = 32, boundary: bool = False) -> None:
        super().__init__()
        self.boundary = boundary
        self.token = nn.Linear(d, d)
        self.gate = nn.Sigmoid()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop_path = nn.Identity()  # reads the write, computes nothing: not the stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.token(x) if self.boundary else self.gate(self.token(x)) * x
        return h + self.drop_path(self.mlp(h))


@pytest.mark.parametrize("boundary", [False, True])
def test_a_stream_that_restarts_inside_the_block_is_proven_from_there(boundary: bool) -> None:
    """x_out = r + mlp(r), r a module output (or a gate of the input) and not the block's
    input: the stream restarts at r, said in the note; the MLP is the block's branch. A
    block whose output is no sum of its tensors (r·(1 + mlp(r))) is still rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _PrefixThenResidual(boundary=boundary), n=3)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified" and p.placement == "additive", p
        assert p.writes == (f"{b.name}.mlp",) and p.stream_scale is None
        assert "the stream restarts at" in p.note and "not a module's output" not in p.note
        assert [br.name for br in b.branches] == [f"{b.name}.mlp"]

    class Product(_PrefixThenResidual):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.token(x)
            return h * (1 + self.mlp(h))

    model.blocks[1] = Product()
    assert [p.status for p in proofs(proven(model, lambda: model(x[:1])))][1] == "unverified"


@pytest.mark.parametrize("block", [_ChannelsFirst, _ChannelsLastInside])
def test_a_channels_first_stream_proves_writes_made_channels_last(
    block: Callable[[], nn.Module],
) -> None:
    """The stream is (B, C, T); the writes are made as (B, T, C) and transposed back, or
    added while the stream itself is channels-last: both are read in the stream's own
    layout. A wrong write planted the same way (the gain applied twice, so the recorded
    operand is not what was added) is rejected."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    model = Net()
    x = torch.randn(1, 32, 10)
    layout = proven(model, lambda: model(x))
    assert [p.status for p in proofs(layout)] == ["verified"] * 3
    assert all(p.residual is not None and p.residual < 1e-5 for p in proofs(layout))

    class Doubled(_ChannelsFirst):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.pw(self.norm(self.dwconv(x).transpose(1, 2)))
            w = (self.gamma * h).transpose(1, 2)
            return (x + w) + w * 0.5  # one operand is w, the other only half of it

    model.blocks[1] = Doubled()
    statuses = [p.status for p in proofs(proven(model, lambda: model(x)))]
    assert statuses[1] == "verified"  # x + w + 0.5w: the two recorded operands sum right
    model.blocks[1] = _Warped(32)
    model.blocks[1].mlp = nn.Linear(10, 10)  # a (B, C, T) stream: the branch on T
    assert [p.status for p in proofs(proven(model, lambda: model(x)))][1] == "unverified"


def test_blocks_the_forward_never_calls_are_said_and_not_unverified() -> None:
    """A second block list the forward does not reach (a vision tower without pixels, a
    quantizer called through `encode`): nothing measured, so nothing to prove. It is
    skipped with `ran` False and its own note, never "unverified"; the blocks that ran
    are proven as before."""
    torch.manual_seed(0)
    model = _Stack(lambda: _MlpBlock(), n=4)
    model.spare = nn.ModuleList(_MlpBlock() for _ in range(2))
    x = features()
    result = prove_layout(model, detect_layout(model), lambda: model(x[:1]))
    assert [(p.name, p.status, p.ran) for p in result.proofs] == [
        *((f"blocks.{i}", "verified", True) for i in range(4)),
        ("spare.0", "skipped", False),
        ("spare.1", "skipped", False),
    ]
    assert result.notes == (
        "2 of 6 blocks did not run in the forward (blocks 4, 5: spare): nothing was "
        "measured there (inputs that do not reach them, or a list the model calls through "
        "another method than forward)",
    )
    report = scan(model, x, lambda out: out.square().mean())
    assert [d["ran"] for d in report.to_dict()["layout"]] == [True] * 4 + [False] * 2


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_probe_pass_proves_and_measures_usage_as_the_two_passes_did(family: str) -> None:
    """The proof and the at-init usage share one forward: same proofs, same fan-ins and
    norm gains as each measured on its own pass, modes and hooks as they were."""
    from actscan.layout.probe import probe_pass
    from actscan.layout.usage import measure_usage, norm_gains
    from actscan.measure.inputs import Batch

    model = hf_model(family).train()
    batch = Batch((), {"input_ids": torch.cat([ids(), ids()])})  # batch 2: cut to 1
    layout = detect_layout(model)
    alone = prove_layout(model, layout, lambda: model(input_ids=batch.kwargs["input_ids"][:1]))
    usage = measure_usage(model, batch.args, batch.kwargs)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, a, k: calls.append(1), with_kwargs=True)
    hooks_before = _hook_count(model)
    try:
        probe = probe_pass(model, layout, batch, at_init=True)
        assert len(calls) == 1  # one forward for both readers
        assert _hook_count(model) == hooks_before
        assert all(m.training for m in model.modules())
        assert probe.proof.proofs == alone.proofs and probe.proof.layout == alone.layout
        assert probe.usage == usage and probe.gains == norm_gains(model, usage.norm_inputs)
        assert all(p.status == "verified" for p in probe.proof.proofs)
        trained = probe_pass(model, layout, batch, at_init=False)  # the proof only
        assert trained.usage is None and trained.gains is None
        assert trained.proof.proofs == alone.proofs and len(calls) == 2
    finally:
        handle.remove()


def test_a_failing_probe_pass_notes_the_proof_and_falls_back_for_usage() -> None:
    """A model whose batch-1 forward raises: the proof is skipped with a note, and usage
    is measured on its own pass, which retries with the full batch."""
    from actscan.layout.probe import probe_pass
    from actscan.measure.inputs import Batch

    class Pairs(nn.Module):  # needs at least two samples
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] < 2:
                raise ValueError("batch of one")
            for b in self.blocks:
                x = x + b(x)
            return x

    model = Pairs()
    probe = probe_pass(model, detect_layout(model), Batch((torch.randn(3, 8),)), at_init=True)
    assert [p.status for p in probe.proof.proofs] == ["skipped", "skipped"]
    assert "layout self-check could not run (ValueError: batch of one)" in probe.notes[0]
    assert probe.usage is not None
    assert probe.usage.role("blocks.0.0.weight").fan_in == 8  # type: ignore[union-attr]
    assert _hook_count(model) == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_proof_and_usage_ride_on_the_recorded_pass(family: str) -> None:
    """A scan runs one forward per recorded batch, no probe pass of its own: the proof
    and the at-init usage read the recorded batch inside the hooks the pass has, and find
    what the separate probe pass finds (same proofs, fan-ins and norm gains)."""
    from actscan.layout.probe import probe_pass
    from actscan.measure.inputs import Batch

    model = hf_model(family).train()
    x = torch.cat([ids(), ids()])  # batch 2, seq 12
    layout = detect_layout(model)
    alone = probe_pass(model, layout, Batch((), {"input_ids": x}), at_init=True)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, a, k: calls.append(1), with_kwargs=True)
    try:
        info = dataclasses.replace(infer_info(model), at_init=True)
        report = scan(model, {"input_ids": x}, info=info)
    finally:
        handle.remove()
    assert len(calls) == 1  # the recorded batch only
    assert [(p.status, p.writes, p.roles, p.placement) for p in report.layout] == [
        (p.status, p.writes, p.roles, p.placement) for p in alone.proof.proofs
    ]
    assert all(p.status == "verified" for p in report.layout)
    assert alone.usage is not None and alone.gains is not None
    by_name = {p.name: p for p in report.params}
    for name, uses in alone.usage.uses.items():
        use = alone.usage.role(name)
        assert use is not None and uses
        if use.op in ("matmul", "conv"):
            assert (by_name[name].kind, by_name[name].fan_in) == ("weight", use.fan_in)
    for name, (mean, _std) in alone.gains.items():
        assert by_name[f"{name}.weight"].gain == pytest.approx(mean, rel=1e-6)
    assert _hook_count(model) == 0


def test_with_dropout_on_the_proof_takes_its_own_eval_mode_pass() -> None:
    """dropout=True: a train-mode forward makes fresh tensors of the writes, so the proof
    runs its own (eval-mode, batch-1) forward before the recorded batch, and verifies."""
    model = hf_model("gpt2").train()
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, a, k: calls.append(1), with_kwargs=True)
    try:
        report = scan(model, {"input_ids": torch.cat([ids(), ids()])}, dropout=True)
    finally:
        handle.remove()
    assert len(calls) == 2
    assert [p.status for p in report.layout] == ["verified", "verified"]


def test_a_block_called_through_its_forward_method_is_said_to_bypass_hooks() -> None:
    """SqueezeBERT's encoder runs each layer as `layer.forward(...)`, which no module
    hook sees: the blocks' modules ran, so the proof must not say they did not run; it
    says the hooks were bypassed (ran stays True) and proves nothing there."""

    class Direct(_Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = b.forward(h)
            return self.out(h)

    torch.manual_seed(0)
    model = Direct(lambda: _MlpBlock(), n=3)
    x = features()
    result = prove_layout(model, detect_layout(model), lambda: model(x[:1]))
    assert [(p.status, p.ran) for p in result.proofs] == [("skipped", True)] * 3
    assert all("bypasses module hooks" in p.note for p in result.proofs)
    assert all(p.bypassed for p in result.proofs)
    assert not any("did not run" in n for n in result.notes)


def test_a_norm_of_an_already_normalised_stream_is_not_taken_for_a_write() -> None:
    # FocalNet's last stage at 1×1: its input is the patch-merging LayerNorm's output, so
    # the first layer's norm1(x) equals x; a fit shared the stream's coefficient with it
    # (0.5 each) and named norm1 an MLP write with no gradient (a false dead-branch). The
    # writes it fitted at 1 hold with unit coefficients: they are the proof.
    from benchmarks import families

    model = families.build("focalnet", "FocalNetModel")
    report = scan(model, batch=2, backward=True)
    last = report.layout[-1]
    assert last.name == "encoder.stages.3" and last.status == "verified"
    assert last.stream_scale is None
    assert last.writes == tuple(
        f"encoder.stages.3.layers.{i}.{b}" for i in (0, 1) for b in ("modulation", "mlp")
    )
    assert not [
        f for f in report.findings if f.check == CheckId.DEAD_BRANCH and f.severity.name != "INFO"
    ]


class _InplaceConvBlock(nn.Module):
    """SuperPoint's conv block without pooling: conv → ReLU(inplace=True), twice; with
    `residual`, x is added in place before a last in-place ReLU (a residual block)."""

    def __init__(self, residual: bool = False) -> None:
        super().__init__()
        self.residual = residual
        self.conv_a, self.conv_b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_b(self.relu(self.conv_a(x)))
        if self.residual:
            h += x
        return self.relu(h)


class _InplaceStack(nn.Module):
    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.blocks = nn.ModuleList(_InplaceConvBlock(residual) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("residual", [False, True])
def test_a_block_ending_in_an_in_place_relu_is_a_plain_chain_and_a_residual_is_not(
    residual: bool,
) -> None:
    # ReLU(inplace=True) is recorded after it wrote its input: the chain steps back one
    # version of the same storage to the conv that made it (LightGlue's SuperPoint block 3
    # was unverified). A functional in-place add before it is no module: not plain.
    model = _InplaceStack(residual)
    report = scan(model, inputs=torch.randn(2, 3, 8, 8), backward=False)
    if residual:  # relu(F(x) + x) is no sum of writes either: never proven plain
        assert not [p for p in report.layout if p.placement == "plain"]
    else:
        assert [(p.status, p.placement) for p in report.layout] == [("verified", "plain")] * 4


def test_a_block_that_only_lends_a_module_to_another_method_did_not_run() -> None:
    """LightGlue calls its match assignment layers' forward on the last layer only; the
    others only lend their `matchability` Linear to `get_matchability`. Those blocks did
    not run (ran False, nothing to prove), their hooks were not bypassed."""

    class Helper(_MlpBlock):
        def gate(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x)

    class Partial(_Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks[:-1]:
                h = h * b.gate(h).sigmoid()
            return self.out(self.blocks[-1](h))

    torch.manual_seed(0)
    model = Partial(lambda: Helper(), n=4)
    x = features()
    result = prove_layout(model, detect_layout(model), lambda: model(x[:1]))
    assert [p.ran for p in result.proofs] == [False, False, False, True]
    assert not any("bypasses module hooks" in p.note for p in result.proofs)
    assert result.proofs[-1].status == "verified"


class _MaskedBlock(nn.Module):
    """A residual block that also adds a stream-sized mask holding −inf (Doge's dynamic
    mask, added where its numel and sizes pass for the stream's): a candidate with inf."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x)
        mask[..., 0] = float("-inf")
        _ = (x + mask).softmax(-1)  # the masked scores: used, never added to the stream
        return x + self.mlp(x)


def test_a_non_finite_candidate_is_no_write_and_the_block_still_proves() -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: _MaskedBlock()).eval()
    x = features()
    ps = proofs(proven(model, lambda: model(x[:1])))
    assert [p.status for p in ps] == ["verified"] * 4
    assert all(p.writes == (f"blocks.{i}.mlp",) for i, p in enumerate(ps))


class _Mixing(nn.Module):
    """An attention-like module with no residual inside: q/k/v, functional matmuls and
    softmax, an output projection (XLM's `attentions` list)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        return self.o(w @ self.v(x))


class _BranchLists(nn.Module):
    """The model's forward holds the residual adds; the block lists are its branches."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.attentions = nn.ModuleList(_Mixing(d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for attn, norm in zip(self.attentions, self.norms, strict=True):
            h = norm(h + 30.0 * attn(h))  # each branch's own scale: no stream through them
        return self.out(h)


def test_a_list_of_branches_is_plain_and_no_stream_for_the_depth_checks() -> None:
    torch.manual_seed(0)
    model = _BranchLists()
    x = features()
    report = scan(model, x, lambda out: out.square().mean())
    ps = list(report.layout)
    assert [(p.status, p.placement) for p in ps] == [("verified", "plain")] * 4
    assert all("no + of the stream's shape" in p.note for p in ps)
    assert [p.chained for p in ps] == [True, False, False, False]
    depth = {"sqrt-growth", "exp-growth", "collapse", "vanishing-grad", "exploding-grad"}
    assert not [f for f in report.findings if f.check in depth]
    assert any("no stream" in s.reason for s in report.skipped if s.check in depth)


class _Decomp(nn.Module):
    """No parameters: the seasonal part x − (time mean), as a series decomposition."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        trend = x.mean(1, keepdim=True).expand_as(x)
        return x - trend, trend


class _DecompBlock(nn.Module):
    """Autoformer's layer: add, LayerNorm, decomposition; add, decomposition, LayerNorm."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attn, self.fc = nn.Linear(d, d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.decomp1, self.decomp2 = _Decomp(), _Decomp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.decomp1(self.ln1(x + self.attn(x)))
        x, _ = self.decomp2(x + self.fc(x))
        return self.ln2(x)


def test_the_stream_passes_parameter_free_modules_and_chains_of_norms() -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: _DecompBlock()).eval()
    x = features()
    ps = proofs(proven(model, lambda: model(x[:1])))
    assert [(p.status, p.placement) for p in ps] == [("verified", "post-norm")] * 4
    assert all(p.writes == (f"blocks.{i}.attn", f"blocks.{i}.fc") for i, p in enumerate(ps))


class _ScaledBroadcast(nn.Module):
    """LayerScale held as a (1, 1, C) parameter that broadcasts (FastViT's RepMixer and
    SAM3-LiteText hold theirs as (C, 1, 1)), 1e-5 at init."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.layer_scale = nn.Parameter(1e-5 * torch.ones(1, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer_scale * self.mlp(x)


def test_a_broadcast_shaped_layer_scale_is_a_gain_by_design() -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: _ScaledBroadcast())
    report = scan(model, features(), lambda out: out.square().mean())
    dead = [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    assert [f.severity for f in dead] == ["info"]
    assert "LayerScale: layer_scale = 1.00e-05" in dead[0].message


def test_zero_writes_on_a_stream_that_is_exactly_zero_are_no_branches() -> None:
    """BLIP-2's Q-Former starts from zero query tokens: on a stream exactly 0, every
    zero-bias module writes 0 whatever its weights; the proof keeps no such write, so no
    dead-branch names them. On a living stream a zeroed projection stays a dead branch."""
    torch.manual_seed(0)
    model = _Stack(lambda: _MlpBlock(), n=4)
    with torch.no_grad():
        model.inp.weight.zero_()
        model.inp.bias.zero_()
        for b in model.blocks:
            for m in b.modules():
                if isinstance(m, nn.Linear):
                    m.bias.zero_()
    x = features()
    ps = proofs(proven(model, lambda: model(x[:1])))
    assert [(p.status, p.writes) for p in ps] == [("verified", ())] * 4


class _MacaronPostNorm(nn.Module):
    """A post-norm Conformer-style block: two feed-forwards scaled by 0.5 (macaron) around
    an MLP, each add followed by its norm, then a final norm of the last norm's output
    (FastSpeech2-Conformer's final_layer_norm). `how="squared"` adds f² at the last
    feed-forward: no write, no scale fits."""

    def __init__(self, how: str = "half", d: int = 32) -> None:
        super().__init__()
        self.how = how
        self.ff1 = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ff1_norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.mix_norm = nn.LayerNorm(d)
        self.ff2 = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ff2_norm = nn.LayerNorm(d)
        self.final_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ff1_norm(x + 0.5 * self.ff1(x))
        x = self.mix_norm(x + self.mix(x))
        f = self.ff2(x)
        x = self.ff2_norm(x + (f * f if self.how == "squared" else 0.5 * f))
        return self.final_norm(x)


def test_a_macaron_write_scaled_by_a_constant_behind_chained_norms_is_proven() -> None:
    """x + 0.5·FFN(x) is a write with a fitted coefficient 0.5 (verified by its residual
    like any other), and a norm of the last norm's output rides along with that norm; a
    write of f² instead is still rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _MacaronPostNorm(), n=3)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert p.status == "verified" and p.placement == "post-norm", p
        assert p.norms[-1] == f"{b.name}.final_norm"
        scales = {br.name.rsplit(".", 1)[-1]: br.scale for br in b.branches}
        assert scales == {"ff1": pytest.approx(0.5), "mix": None, "ff2": pytest.approx(0.5)}
    only_block_1_fails(model, x, _MacaronPostNorm("squared"))


class _MaybeResidual(nn.Module):
    """x + mlp(x), or (a stage's first block, no residual add) a projection that writes
    1e-6 of the stream's scale at the same shape (EfficientNet at a tiny width)."""

    def __init__(self, residual: bool, d: int = 32) -> None:
        super().__init__()
        self.residual = residual
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        if not residual:
            with torch.no_grad():
                self.mlp[2].weight.mul_(1e-6)
                self.mlp[2].bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) if self.residual else self.mlp(x)


class _TwoStages(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(_MaybeResidual(i != 6, d) for i in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return h


def test_a_block_fitted_as_a_zero_stream_with_no_write_is_plain_and_starts_a_stage() -> None:
    """x_out ≈ 1e-6·x_in "holds" as x_out = α·x_in with α ≈ 0 and no write: that says only
    that the output is tiny, no equation. The block is a plain chain, and in a stream of
    residual blocks it starts a stage: growth is judged within the stage, so the one-block
    drop is no collapse."""
    torch.manual_seed(0)
    model = _TwoStages().eval()
    x = features()
    ps = proofs(proven(model, lambda: model(x[:1])))
    assert [p.placement for p in ps] == ["additive"] * 6 + ["plain"] + ["additive"] * 5
    assert ps[6].stream_scale is None and "no residual add" in ps[6].note
    report = scan(model, x, lambda out: out.square().mean())
    assert not [f for f in report.findings if f.check == CheckId.COLLAPSE], report.findings


class _PostAct(nn.Module):
    """ResNet v1's relu(x + F(x)) (UVDoc's residual blocks); "squared" adds F² instead,
    through `addcmul` (no `+` the add watch sees, so no functional write either)."""

    def __init__(self, how: str = "plain", d: int = 32) -> None:
        super().__init__()
        self.how = how
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.mlp(x)
        return self.act(x.addcmul(f, f) if self.how == "squared" else x + f)


def test_a_post_activation_residual_holds_at_the_activations_input() -> None:
    """x_out = relu(x_in + F(x_in)): the equation holds at the input of the activation
    that makes the output, as at a post-norm's; F² added instead is rejected."""
    torch.manual_seed(0)
    model = _Stack(lambda: _PostAct(), n=3)
    x = features()
    layout = proven(model, lambda: model(x[:1]))
    for b, p in zip(layout.blocks, proofs(layout), strict=True):
        assert (p.status, p.placement) == ("verified", "post-act"), p
        assert p.norms == (f"{b.name}.act",) and p.writes == (f"{b.name}.mlp",)
    model.blocks[1] = _PostAct("squared")
    # F² is no write of the equation: the block is unverified, or (no `+` the add watch
    # sees) a plain block that restarts the stream, never a proven post-act residual
    got = [(p.status, p.placement) for p in proofs(proven(model, lambda: model(x[:1])))]
    assert got[0] == got[2] == ("verified", "post-act")
    assert got[1][0] == "unverified" or got[1][1] == "plain", got[1]
