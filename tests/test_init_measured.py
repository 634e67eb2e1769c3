"""init-scale on measured facts: fan-in from how the forward pass contracts each weight,
norm gains from a probe, structured parameters left alone, callables and the API at init.

Healthy inits of tiny transformers configs (and the shipped configs) give no init-scale
warn; planted faults (a std-1 Linear stack from a callable, 0.02 at a fan-in of 8192, a
norm gain of 3) still fire at the right weights.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from actscan.layout.usage import measure_usage, probe_gain
from actscan.records import CheckId, Finding, Severity
from actscan.report.report import Report
from actscan.run import scan
from actscan.targets.classify import shipped_configs
from actscan.targets.resolve import resolve
from actscan.targets.resolved import Resolved, TargetOptions

transformers = pytest.importorskip("transformers")

D = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=32,
)
NO_KV = {k: v for k, v in D.items() if k != "num_key_value_heads"}
FAMILIES: dict[str, dict[str, object]] = {
    "gpt2": dict(
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        vocab_size=128,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": D,
    "qwen2": D,
    "qwen3": {**D, "head_dim": 8},
    "gemma2": {**D, "head_dim": 8},
    "gemma3_text": {**D, "head_dim": 8},
    "mistral": D,
    # hidden 64: shape-guessed fan-in 256·64 made 0.02 look 2.56× too large
    "mixtral": {
        **D,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **D,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    "phi3": {**D, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
    "mamba": dict(
        hidden_size=32, state_size=8, num_hidden_layers=2, vocab_size=128, intermediate_size=64
    ),
    "bert": NO_KV,
    "modernbert": {
        **NO_KV,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "cls_token_id": 1,
        "sep_token_id": 2,
    },
}


def config_target(
    tmp_path: Path, model_type: str, init: str | None = None, **extra: object
) -> Resolved:
    cfg = transformers.AutoConfig.for_model(model_type, **{**FAMILIES[model_type], **extra})
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return resolve(str(path), TargetOptions(init=init))


def profile(r: Resolved, **kw: object) -> Report:
    return scan(r.model, inputs=r.inputs, info=r.info, batch=1, seq_len=8, backward=False, **kw)  # type: ignore[arg-type]


def init_findings(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.check == CheckId.INIT_SCALE]


def loud_init(report: Report) -> list[Finding]:
    return [f for f in init_findings(report) if f.severity is not Severity.INFO]


def params(report: Report) -> dict[str, object]:
    return {p.name: p for p in report.params}


# --------------------------------------------------------------------------- healthy inits


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_healthy_transformers_inits_get_no_init_scale_warn(tmp_path: Path, model_type: str) -> None:
    report = profile(config_target(tmp_path, model_type))
    assert report.model.at_init
    assert not loud_init(report), [f.message for f in loud_init(report)]
    assert any(p.kind == "weight" and p.fan_in for p in report.params)


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_shipped_configs_get_no_init_scale_warn(name: str) -> None:
    r = resolve(name, TargetOptions(overrides={"n_layers": "2", "vocab_size": "256"}))
    assert not loud_init(profile(r))


# --------------------------------------------------------------------------- fan-in


def test_fused_experts_take_the_contracted_size(tmp_path: Path) -> None:
    # gate_up_proj (E, 2·ffn, hidden) contracts over hidden: 0.02·√64 = 0.16×, not 2.56×
    report = profile(config_target(tmp_path, "mixtral"))
    p = params(report)["model.layers.0.mlp.experts.gate_up_proj"]
    assert (p.kind, p.fan_in, p.fan_out) == ("weight", 64, 256)  # type: ignore[attr-defined]
    assert params(report)["model.layers.0.mlp.experts.down_proj"].fan_in == 128  # type: ignore[attr-defined]


def test_flat_002_at_fan_in_8192_fires_on_the_expert_down_projection(tmp_path: Path) -> None:
    r = config_target(
        tmp_path, "mixtral", intermediate_size=8192, num_local_experts=2, num_hidden_layers=1
    )
    found = loud_init(profile(r))
    assert len(found) == 1 and found[0].severity is Severity.WARN
    assert "experts.down_proj" in found[0].message and "√(1/8192)" in found[0].message
    assert found[0].value == pytest.approx(0.02 * math.sqrt(8192), rel=0.05)  # 1.81×
    assert found[0].layers == ("model.layers.0.mlp.experts",)


def test_mamba_structured_parameters_are_not_judged(tmp_path: Path) -> None:
    report = profile(config_target(tmp_path, "mamba"))
    p = params(report)
    for name in ("A_log", "D", "dt_proj.bias"):
        assert p[f"backbone.layers.0.mixer.{name}"].kind == "structured", name  # type: ignore[attr-defined]
    assert p["backbone.layers.0.mixer.dt_proj.weight"].fan_in == 2  # type: ignore[attr-defined]  # dt_rank
    assert p["backbone.layers.0.mixer.conv1d.weight"].fan_in == 4  # type: ignore[attr-defined]  # depthwise, k=4
    assert not loud_init(report)
    assert any("structured, not judged" in n and "A_log" in n for n in report.notes)


class Contractions(nn.Module):
    """Weights used as the right operand, transposed, in einsum, bmm and conv."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.w = nn.Parameter(torch.randn(6, 5))  # x @ w: contracts 6
        self.t = nn.Parameter(torch.randn(7, 5))  # x @ t.T: contracts 5
        self.e = nn.Parameter(torch.randn(3, 7, 4))  # einsum over d=7
        self.b = nn.Parameter(torch.randn(3, 4, 2))  # bmm: contracts 4
        self.conv = nn.Conv1d(2, 3, kernel_size=5, padding=2)  # 2·5
        self.scale = nn.Parameter(torch.ones(3))  # elementwise only

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) @ self.w  # (B, T, 5)
        x = x @ self.t.T  # (B, T, 7)
        x = torch.einsum("btd,edf->ebtf", x, self.e).flatten(1, 2)  # (3, B·T, 4)
        x = torch.bmm(x, self.b)  # (3, B·T, 2)
        x = self.conv(x.transpose(1, 2))  # (3, 3, B·T)
        return x * self.scale[:, None]


def test_contraction_sizes_are_measured_per_call() -> None:
    usage = measure_usage(Contractions(), (torch.randint(0, 10, (2, 4)),), {})
    fan = {name: usage.role(name) for name in ("w", "t", "e", "b", "conv.weight", "emb.weight")}
    assert {k: (u.op, u.fan_in) for k, u in fan.items() if u} == {
        "w": ("matmul", 6),
        "t": ("matmul", 5),
        "e": ("matmul", 7),
        "b": ("matmul", 4),
        "conv.weight": ("conv", 10),
        "emb.weight": ("embedding", None),
    }
    assert usage.role("conv.bias").op == "bias" and usage.role("scale") is None  # type: ignore[union-attr]


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha, self.lstm = nn.MultiheadAttention(16, 4), nn.LSTM(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.mha(x, x, x)[0])[0]


def test_fused_torch_layers_count_as_weights() -> None:
    # MultiheadAttention and LSTM run inside one fused call: weights are (out, in), 1-D biases
    usage = measure_usage(Fused(), (torch.randn(5, 2, 16),), {})
    got = {n: (u.op, u.fan_in) for n, us in usage.uses.items() for u in us}
    assert got == {
        "mha.in_proj_weight": ("matmul", 16),
        "mha.in_proj_bias": ("bias", None),
        "mha.out_proj.weight": ("matmul", 16),
        "mha.out_proj.bias": ("bias", None),
        "lstm.weight_ih_l0": ("matmul", 16),
        "lstm.weight_hh_l0": ("matmul", 8),
        "lstm.bias_ih_l0": ("bias", None),
        "lstm.bias_hh_l0": ("bias", None),
    }


# --------------------------------------------------------------------------- norm gains


def test_norm_gain_is_probed_not_read() -> None:
    ln = nn.LayerNorm(16)
    assert probe_gain(ln, ln.weight).mean().item() == pytest.approx(1.0, abs=1e-4)  # type: ignore[union-attr]
    bn = nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        bn.weight.fill_(3.0)
    assert probe_gain(bn, bn.weight).mean().item() == pytest.approx(3.0, abs=1e-3)  # type: ignore[union-attr]


class _GroupNormAct(nn.GroupNorm):
    """BiT's GroupNormActivation: a GroupNorm whose forward ends in its own ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__(2, c)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(super().forward(x))


def test_a_fused_activation_and_a_flattened_batchnorm_read_their_true_gain() -> None:
    # ReLU's odd part halves the slope (0.5 on a gain of 1); a BatchNorm1d recorded on
    # (N, C) tokens normalises each column, not each row. Both read 1 at 1 and 3 at 3.
    gn = _GroupNormAct(8)
    bn = nn.BatchNorm1d(8)
    for gain in (1.0, 3.0):
        with torch.no_grad():
            gn.weight.fill_(gain)
            bn.weight.fill_(gain)
        g = probe_gain(gn, gn.weight)
        b = probe_gain(bn, bn.weight, (14, 8))
        assert g is not None and b is not None
        assert g.mean().item() == pytest.approx(gain, abs=1e-3)
        assert b.mean().item() == pytest.approx(gain, abs=1e-3)
        assert b.std().item() < 1e-3
    assert isinstance(gn.activation, nn.ReLU)  # put back after the probe


def test_gemma_one_plus_w_gains_are_one_at_zero_and_a_gain_of_3_fires(tmp_path: Path) -> None:
    r = config_target(tmp_path, "gemma2")
    report = profile(r)
    g = params(report)["model.layers.0.input_layernorm.weight"]
    assert g.mean == 0 and g.gain == pytest.approx(1.0, abs=1e-4)  # type: ignore[attr-defined]
    assert not loud_init(report)
    with torch.no_grad():
        r.model.model.layers[1].post_feedforward_layernorm.weight.fill_(2.0)  # (1 + 2) = 3
    found = loud_init(profile(r))
    assert len(found) == 1 and "effective gain mean 3" in found[0].message
    assert found[0].layers == ("model.layers.1.post_feedforward_layernorm",)


def test_plain_norm_gain_of_3_fires(tmp_path: Path) -> None:
    r = config_target(tmp_path, "llama")
    with torch.no_grad():
        r.model.model.layers[0].input_layernorm.weight.fill_(3.0)
    found = loud_init(profile(r))
    assert len(found) == 1 and found[0].value == pytest.approx(3.0, abs=1e-3)
    assert found[0].layers == ("model.layers.0.input_layernorm",)


# --------------------------------------------------------------------------- --init fan-in


def test_init_fan_in_sets_effective_gain_one_and_reinits_experts(tmp_path: Path) -> None:
    gemma = config_target(tmp_path, "gemma2", init="fan-in").model
    assert torch.all(gemma.model.layers[0].input_layernorm.weight == 0)  # (1 + 0) = 1
    mixtral = config_target(tmp_path, "mixtral", init="fan-in").model.model.layers[0].mlp
    assert mixtral.experts.gate_up_proj.std().item() == pytest.approx(1 / 8, rel=0.05)  # √(1/64)
    assert mixtral.experts.down_proj.std().item() == pytest.approx(1 / math.sqrt(128), rel=0.05)
    assert mixtral.gate.weight.std().item() == pytest.approx(1 / 8, rel=0.1)  # the router
    assert torch.all(mixtral.experts.gate_up_proj != 0)
    mamba = config_target(tmp_path, "mamba", init="fan-in").model.backbone.layers[0].mixer
    assert mamba.dt_proj.bias.mean().item() < -2  # the SSM time scales are kept, not zeroed
    assert mamba.in_proj.weight.std().item() == pytest.approx(1 / math.sqrt(32), rel=0.05)


# --------------------------------------------------------------------------- callables, API


def _six_linear(std: float) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        lin = nn.Linear(128, 128)
        nn.init.normal_(lin.weight, 0.0, std)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def test_callable_std_1_stack_gets_init_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "badinit_mod.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            layers = []
            for _ in range(6):
                lin = nn.Linear(128, 128)
                nn.init.normal_(lin.weight, 0.0, 1.0)
                nn.init.zeros_(lin.bias)
                layers += [lin, nn.ReLU()]
            return nn.Sequential(*layers), torch.randn(4, 128)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r = resolve("badinit_mod:build")
    assert r.info.at_init
    found = loud_init(scan(r.model, inputs=r.inputs, info=r.info))
    assert len(found) == 1 and found[0].severity is Severity.ERROR
    assert found[0].value == pytest.approx(11.4, rel=0.05) and len(found[0].layers) == 6
    trained = resolve("badinit_mod:build", TargetOptions(at_init=False))
    assert not trained.info.at_init
    assert not init_findings(scan(trained.model, inputs=trained.inputs, info=trained.info))


def test_api_is_at_init_by_default_and_at_init_false_turns_it_off() -> None:
    x = torch.randn(4, 128)
    assert loud_init(scan(_six_linear(1.0), x))
    assert not init_findings(scan(_six_linear(1.0), x, at_init=False))
    assert not loud_init(scan(_six_linear(math.sqrt(2 / 128)), x))  # He: healthy


class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 24, 16))  # (experts, out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([2, 4, 6], dtype=torch.int32)
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_experts_contract_over_their_input() -> None:
    usage = measure_usage(Grouped(), (torch.randn(6, 16),), {})
    assert usage.role("w") is not None and usage.role("w").fan_in == 16  # type: ignore[union-attr]


class Reuses(nn.Module):
    """Lets go of its norm's weight after use, as FSDP frees an unsharded parameter after a
    module's forward, then contracts a fresh activation that sits at the freed address (a
    buffer the test owns, so the reuse is certain rather than up to the allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(64), nn.Linear(64, 64)
        self.memory = bytearray(64 * 4)
        with torch.no_grad():
            self.norm.weight.data = torch.frombuffer(self.memory, dtype=torch.float32)
            self.norm.weight.fill_(1.0)
        self.address = self.norm.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        self.norm.weight.data = torch.ones(64)  # the parameter now lives elsewhere
        act = torch.frombuffer(self.memory, dtype=torch.float32)  # another tensor, same bytes
        assert act.data_ptr() == self.address
        return y + torch.matmul(act.view(1, 64), self.lin.weight.T)


def test_a_freed_parameters_address_reused_by_an_activation_is_not_that_parameter() -> None:
    usage = measure_usage(Reuses(), (torch.randn(1, 64),), {})
    assert usage.role("norm.weight") is None  # the activation is not the norm's gain
    assert usage.role("lin.weight").op == "matmul"  # type: ignore[union-attr]
