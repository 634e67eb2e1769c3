"""The calibration matrix: every family's healthy init is quiet, every planted fault is loud.

Tiny transformers models built from configs (transformers' own init, eager attention, no
download) and small nn.Modules, each run through `actscan.scan` (a few through the CLI):

- healthy: no warn or error finding, and the layout self-check verifies every block;
- planted faults, found at the right layer: a zeroed MLP output projection in block 2
  (dead-branch naming block 2), one embedding channel ×100 (outlier-channels naming it),
  a std-1.0 init (init-scale), every block's branch write scaled ×g^i (growth);
- exit codes are only 0, 1 or 2.

Extend the tables, not the tests.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from actscan import scan
from actscan.records import CheckId, Finding, Severity
from actscan.report.report import Report

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LAYERS = 4  # the depth checks need 4 block outputs (min-blocks)
BATCH, SEQ = 2, 16
GROWTH = {CheckId.EXP_GROWTH, CheckId.SQRT_GROWTH}


# --------------------------------------------------------------------------- the table

DEC = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "num_hidden_layers": LAYERS,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ENC = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "num_hidden_layers": LAYERS,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Family:
    """One transformers family: its tiny config and where to plant the faults."""

    config: dict[str, Any]
    head: str = "causal"  # causal | masked
    blocks: str = "model.layers"
    down: str = "mlp.down_proj"  # the MLP's output projection inside a block
    write: str | None = None  # what the stream receives, when not `down` (sandwich norms)
    grow: float = 8.0  # block i's write is scaled ×grow^i
    post_norm: bool = False  # post-LN: the norm after each add undoes any branch scale
    marks: tuple[Any, ...] = field(default=())


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        {"n_layer": LAYERS, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64},
        blocks="transformer.h",
        down="mlp.c_proj",
    ),
    "llama": Family(DEC),
    "qwen2": Family(DEC),
    "qwen3": Family(DEC),
    "mistral": Family(DEC),
    "phi3": Family(DEC),
    "gemma2": Family(DEC, write="post_feedforward_layernorm"),
    "gemma3_text": Family(DEC, write="post_feedforward_layernorm"),
    "mixtral": Family(
        {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2},
        down="mlp.experts",
    ),
    "qwen2_moe": Family(
        {
            **DEC,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
        down="mlp",
    ),
    "falcon": Family(
        {
            "hidden_size": 64,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "vocab_size": 256,
        },
        blocks="transformer.h",
        down="mlp.dense_4h_to_h",
    ),
    "mamba": Family(
        {
            "hidden_size": 64,
            "num_hidden_layers": LAYERS,
            "vocab_size": 256,
            "state_size": 8,
            "expand": 2,
        },
        blocks="backbone.layers",
        down="mixer.out_proj",
    ),
    "bert": Family(
        ENC, head="masked", blocks="bert.encoder.layer", down="output.dense", post_norm=True
    ),
    "modernbert": Family(
        {**ENC, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2},
        head="masked",
        down="mlp.Wo",
        grow=40.0,  # its MLPs write ~7e-4 of the stream
    ),
}


def build(model_type: str) -> nn.Module:
    fam = FAMILIES[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **fam.config)
    auto = (
        transformers.AutoModelForCausalLM
        if fam.head == "causal"
        else transformers.AutoModelForMaskedLM
    )
    torch.manual_seed(0)
    return auto.from_config(cfg, attn_implementation="eager")


def profile(model: nn.Module, inputs: Any = None, loss: Any = None) -> Report:
    return scan(model, inputs, loss, batch=BATCH, seq_len=SEQ)


def loud(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.severity is not Severity.INFO]


def summary(report: Report) -> list[str]:
    return [f"{f.severity} {f.check}: {f.message[:160]}" for f in report.findings]


@pytest.fixture(scope="module")
def healthy() -> Callable[[str], Report]:
    """One scan per family, shared by the tests that only read it."""
    cache: dict[str, Report] = {}

    def get(model_type: str) -> Report:
        if model_type not in cache:
            cache[model_type] = profile(build(model_type))
        return cache[model_type]

    return get


# --------------------------------------------------------------------------- healthy


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_healthy_init_is_quiet_and_every_block_proves_its_layout(
    model_type: str, healthy: Callable[[str], Report]
) -> None:
    report = healthy(model_type)
    assert not loud(report), summary(report)
    assert len(report.layout) == LAYERS
    for p in report.layout:
        assert p.status == "verified", (model_type, p)
        assert p.residual is not None and p.tolerance is not None
        assert p.residual <= p.tolerance
        assert p.placement == ("post-norm" if FAMILIES[model_type].post_norm else "additive")
    assert not any("unverified" in n for n in report.notes)


def test_modernbert_small_mlp_writes_are_info_with_the_numbers(
    healthy: Callable[[str], Report],
) -> None:
    """ModernBERT's MLPs write ~7e-4 of the stream at width 64 (a GLU squares the 0.02
    init, Wo has 0.02/√(2L)), alike in every block, and learn: info, not a dead branch.
    At its real width (768) they write 1.25e-2 and nothing is reported."""
    report = healthy("modernbert")
    dead = [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    assert [f.severity for f in dead] == [Severity.INFO]
    assert dead[0].layers == tuple(f"model.layers.{i}.mlp" for i in range(LAYERS))
    assert dead[0].value is not None and 5e-4 < dead[0].value < 1e-3
    assert "All 4 MLP branches" in dead[0].message


# --------------------------------------------------------------------------- planted faults


def _in_block(model_type: str, i: int, name: str) -> bool:
    return name.startswith(f"{FAMILIES[model_type].blocks}.{i}.")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_zeroed_mlp_output_projection_is_a_dead_branch_at_its_block(model_type: str) -> None:
    fam = FAMILIES[model_type]
    model = build(model_type)
    with torch.no_grad():
        for p in model.get_submodule(f"{fam.blocks}.2.{fam.down}").parameters():
            p.zero_()
    report = profile(model)
    dead = [
        f
        for f in report.findings
        if f.check == CheckId.DEAD_BRANCH and f.severity is not Severity.INFO
    ]
    assert len(dead) == 1, summary(report)
    assert "block 2" in dead[0].message
    assert all(_in_block(model_type, 2, name) for name in dead[0].layers), dead[0].layers
    others = [f for f in loud(report) if f.check not in (CheckId.DEAD_BRANCH, CheckId.DEAD_UNITS)]
    assert not others, summary(report)  # nothing else is blamed on the dead branch


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_one_embedding_channel_x100_is_named_by_outlier_channels(model_type: str) -> None:
    model = build(model_type)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 17].mul_(100.0)
    report = profile(model)
    found = [f for f in report.findings if f.check == CheckId.OUTLIER_CHANNELS]
    assert found and found[0].severity is not Severity.INFO, summary(report)
    assert "channel 17 " in found[0].message
    assert found[0].layers[0].endswith(("embed_tokens", "embeddings", "wte", "word_embeddings"))


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "qwen2", "gemma2", "bert"])
def test_healthy_init_has_no_massive_activations_nor_outlier_channels(
    model_type: str, healthy: Callable[[str], Report]
) -> None:
    report = healthy(model_type)
    token_checks = {CheckId.MASSIVE_ACTIVATIONS, CheckId.OUTLIER_CHANNELS}
    assert not [f for f in report.findings if f.check in token_checks], summary(report)
    assert {s.check for s in report.skipped}.isdisjoint(token_checks)  # they ran
    assert all(p.median_abs and len(p.top_values) == 8 for p in report.stream)


def test_issue13_qwen2_d128_embedding_channel_x100_is_an_outlier_channel() -> None:
    """The issue's case: Qwen2 as transformers initializes it (6 layers, d = 128), embedding
    channel 17 × 100: stream max ≈ 5 against a median channel ≈ 0.05, under the old
    absolute floor |x| ≥ 6 ("No findings")."""
    cfg = transformers.AutoConfig.for_model(
        "qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_hidden_layers=6,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 17].mul_(100.0)
    report = profile(model)
    found = [f for f in report.findings if f.check == CheckId.OUTLIER_CHANNELS]
    assert found and found[0].severity is Severity.WARN, summary(report)
    assert found[0].message.startswith("Activation channel 17 stands out")
    assert found[0].layers[0] == "model.embed_tokens"
    assert "quantization levels" in found[0].message  # the int8 arithmetic stays
    assert report.stream[0].max_abs is not None and report.stream[0].max_abs < 6
    assert not [f for f in report.findings if f.check == CheckId.MASSIVE_ACTIVATIONS]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_unit_std_init_fires_init_scale_error(model_type: str) -> None:
    model = build(model_type)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Embedding):
                continue
            for p in mod.parameters(recurse=False):
                if p.dim() >= 2:
                    p.normal_(0.0, 1.0)
    report = profile(model)
    init = [f for f in report.findings if f.check == CheckId.INIT_SCALE]
    assert init and init[0].severity is Severity.ERROR, summary(report)
    assert init[0].value is not None and init[0].value >= 4  # ×√fan_in ≥ 8 at width 64


def _scale_writes(model: nn.Module, model_type: str) -> list[Any]:
    fam = FAMILIES[model_type]
    handles = []
    for i in range(LAYERS):
        mod = model.get_submodule(f"{fam.blocks}.{i}.{fam.write or fam.down}")

        def hook(_m: nn.Module, _a: Any, out: Any, g: float = fam.grow**i) -> Any:
            return (out[0] * g, *out[1:]) if isinstance(out, tuple) else out * g

        handles.append(mod.register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_branches_scaled_per_block_fire_growth_at_the_last_blocks(model_type: str) -> None:
    """Block i's write ×g^i makes the stream grow geometrically in every pre-norm family;
    a post-LN stack renormalises after each add and stays flat."""
    model = build(model_type)
    handles = _scale_writes(model, model_type)
    try:
        report = profile(model)
    finally:
        for h in handles:
            h.remove()
    growth = [f for f in report.findings if f.check in GROWTH]
    if FAMILIES[model_type].post_norm:
        assert not growth, summary(report)
        return
    assert growth and growth[0].severity is not Severity.INFO, summary(report)
    assert growth[0].layers[-1] == f"{FAMILIES[model_type].blocks}.{LAYERS - 1}"


# --------------------------------------------------------------------------- small modules

MODULES = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, init: str = "he", d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n))
        self.out = nn.Linear(d, 10)
        if init == "he":
            for b in self.blocks:
                nn.init.kaiming_normal_(b[0].weight, nonlinearity="relu")
                nn.init.zeros_(b[0].bias)
        elif init == "std1":
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, 0.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class CNN(nn.Module):
    def __init__(self, c: int = 32, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
            for _ in range(n)
        )
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        nn.init.normal_(self.mlp[0].weight, 0.0, d**-0.5)
        nn.init.normal_(self.mlp[2].weight, 0.0, (4 * d) ** -0.5 / (2 * n) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class PreLN(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, n) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def _seeded(make, shape):
    torch.manual_seed(0)
    model = make()
    return model, torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def mlp():
    return _seeded(MLP, (256, 64))


def mlp_torch_default():
    return _seeded(lambda: MLP("torch"), (256, 64))


def mlp_std1():
    return _seeded(lambda: MLP("std1"), (32, 64))


def cnn():
    return _seeded(CNN, (2, 3, 16, 16))


def preln():
    return _seeded(PreLN, (2, 16, 16))
"""
SMALL: dict[str, Any] = {}
exec(compile(MODULES, "matrix_modules", "exec"), SMALL)  # the same source the CLI imports


def small(name: str) -> Report:
    model, x = SMALL[name]()
    return scan(model, x, lambda out: out.square().mean())


@pytest.mark.parametrize(
    ("name", "placement"),
    [
        ("mlp", "plain"),
        ("cnn", "plain"),
        ("preln", "additive"),
    ],
)
def test_small_modules_healthy_and_proven(name: str, placement: str) -> None:
    report = small(name)
    assert [(p.status, p.placement) for p in report.layout] == [("verified", placement)] * 4
    assert not any("unverified" in n for n in report.notes)
    assert not loud(report), summary(report)


def test_plain_blocks_are_proven_without_branches_and_still_judged_for_depth() -> None:
    """A non-residual layer stack is verified as plain (its output is its modules' chain
    from its input), has no branches to judge, and keeps its depth checks: PyTorch's
    default Linear init (Var = 1/(3·fan_in)) with ReLU passes ~1/6 of the variance per
    layer, a true collapse."""
    report = small("mlp_torch_default")
    assert {p.placement for p in report.layout} == {"plain"}
    assert "blocks.0.0" in report.layout[0].note and not report.branches
    assert (report.findings[0].check, report.findings[0].severity) == (
        CheckId.COLLAPSE,
        Severity.WARN,
    )
    assert report.findings[0].layers[-1] == "blocks.3"


def test_residual_blocks_are_not_taken_for_plain_ones() -> None:
    """A residual block whose add the proof cannot match stays unverified: the chain from
    the output back meets the functional add, so it is not a plain block. (tanh, not
    relu: after one block the stream is ≥ 0, exp(·) > 0, and relu of their sum is the
    identity, so a relu block's add does hold and is proven.)"""

    class Warped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x + torch.exp(self.mlp(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Warped() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    report = scan(Stack(), torch.randn(2, 6, 32), lambda out: out.square().mean())
    assert {p.status for p in report.layout} == {"unverified"}


def test_small_module_faults() -> None:
    report = small("mlp_std1")
    init = [f for f in report.findings if f.check == CheckId.INIT_SCALE]
    assert init and init[0].severity is Severity.ERROR  # std 1 = 8× √(1/64)
    # ×5.4 per layer over 4 plain layers: geometric growth, not √k growth of branches
    growth = [f for f in report.findings if f.check in GROWTH]
    assert [(f.check, f.severity) for f in growth] == [(CheckId.EXP_GROWTH, Severity.ERROR)]
    assert growth[0].layers[-1] == "blocks.3"
    model, x = SMALL["preln"]()
    with torch.no_grad():
        model.blocks[2].mlp[2].weight.zero_()
        model.blocks[2].mlp[2].bias.zero_()
    report = scan(model, x, lambda out: out.square().mean())
    dead = [f for f in loud(report) if f.check == CheckId.DEAD_BRANCH]
    assert len(dead) == 1 and dead[0].layers == ("blocks.2.mlp",), summary(report)


# --------------------------------------------------------------------------- the CLI


def _cli(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from actscan.cli import app

    res = CliRunner().invoke(app, list(args))
    assert res.exit_code in (0, 1, 2), (res.exit_code, res.output, res.exception)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for model_type in ("gpt2", "llama", "modernbert"):
        path = tmp_path_factory.mktemp(model_type)
        build(model_type).save_pretrained(path)
        out[model_type] = path
    return out


@pytest.mark.parametrize(
    ("model_type", "code", "loud_checks"),
    [
        ("gpt2", 0, set()),
        ("llama", 0, set()),
        # a folder with weights is a checkpoint, not an init: every MLP writing ~7e-4 of
        # the stream is a warning there (the info downgrade is for inits)
        ("modernbert", 1, {"dead-branch"}),
    ],
)
def test_cli_on_a_saved_folder(
    model_type: str, code: int, loud_checks: set[str], folders: dict[str, Path], tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    got, out = _cli(
        "profile",
        str(folders[model_type]),
        "--batch",
        "2",
        "--seq-len",
        "16",
        "-q",
        "--fail-on",
        "warn",
        "--json",
        str(report),
    )
    assert got == code, out
    data = json.loads(report.read_text())
    assert [p["status"] for p in data["layout"]] == ["verified"] * LAYERS
    assert {f["check"] for f in data["findings"] if f["severity"] != "info"} == loud_checks
    if code:
        assert _cli("profile", str(folders[model_type]), "-q", "--batch", "2")[0] == 0


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "actscan_matrix_modules"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("factory", "fail_on", "code"),
    [
        ("mlp", "warn", 0),
        ("preln", "warn", 0),
        ("mlp_std1", "error", 1),  # init-scale error: callables are at init
        ("no_such_factory", "error", 2),
    ],
)
def test_cli_on_module_callables(modules: str, factory: str, fail_on: str, code: int) -> None:
    got, out = _cli("profile", f"{modules}:{factory}", "-q", "--fail-on", fail_on)
    assert got == code, out


# --------------------------------------------------------------------------- more families


def _seq2seq(
    model_type: str, auto: str = "AutoModelForSeq2SeqLM", **kw: Any
) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        cfg = transformers.AutoConfig.for_model(model_type, **kw)
        torch.manual_seed(0)
        return getattr(transformers, auto).from_config(cfg, attn_implementation="eager")

    return make


def _auto(model_type: str, auto: str, **kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        cfg = transformers.AutoConfig.for_model(model_type, **kw)
        torch.manual_seed(0)
        return getattr(transformers, auto).from_config(cfg, attn_implementation="eager")

    return make


def _compiled() -> nn.Module:  # scan() profiles the original module (_orig_mod)
    return torch.compile(build("llama"))  # type: ignore[return-value]


def _meta() -> nn.Module:
    """Built on the meta device, materialised as a module:callable target is (to_empty and
    the model's own initialisers); scan() itself refuses a meta model in one line."""
    from actscan.measure.prepare import materialize_meta

    cfg = transformers.AutoConfig.for_model("llama", **DEC)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    materialize_meta(model, "matrix:meta")
    return model


PENDING: dict[str, Callable[[], nn.Module]] = {
    "t5": _seq2seq(
        "t5",
        d_model=64,
        d_ff=128,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=4,
        d_kv=16,
        vocab_size=256,
        decoder_start_token_id=0,
    ),
    "bart": _seq2seq(
        "bart",
        d_model=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    ),
    "whisper": _seq2seq(
        "whisper",
        "AutoModelForSpeechSeq2Seq",
        d_model=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        vocab_size=256,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    ),
    "vit": _auto(
        "vit",
        "AutoModelForImageClassification",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    ),
    "wav2vec2": _auto(
        "wav2vec2",
        "AutoModelForCTC",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        vocab_size=32,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    ),
    "torch.compile": _compiled,
    "meta-device": _meta,
}


# encoder-decoders: (encoder list, decoder list, decoder block 1's cross-attention, its
# output projection)
SEQ2SEQ = {
    "t5": ("encoder.block", "decoder.block", "decoder.block.1.layer.1.EncDecAttention", "o"),
    "bart": (
        "model.encoder.layers",
        "model.decoder.layers",
        "model.decoder.layers.1.encoder_attn",
        "out_proj",
    ),
    "whisper": (
        "model.encoder.layers",
        "model.decoder.layers",
        "model.decoder.layers.1.encoder_attn",
        "out_proj",
    ),
}


@pytest.mark.parametrize("name", list(PENDING))
def test_other_families_are_quiet_and_proven(name: str) -> None:
    report = profile(PENDING[name]())
    assert report.layout and all(p.status == "verified" for p in report.layout)
    assert not loud(report), summary(report)
    if name in SEQ2SEQ:
        _both_stacks_profiled(report, name)


def _both_stacks_profiled(report: Report, name: str) -> None:
    """Two streams (encoder, decoder), every block of both proven, decoder blocks with a
    cross-attention branch (3 writes: k grows by 3), the decoder as `stream`/`summary`."""
    enc, dec, _, _ = SEQ2SEQ[name]
    assert [(s.name, s.container, s.primary) for s in report.streams] == [
        ("encoder", enc, False),
        ("decoder", dec, True),
    ]
    assert [p.name for p in report.layout] == [
        f"{c}.{i}" for c in (enc, dec) for i in range(LAYERS)
    ]
    assert [p.stream for p in report.layout] == ["encoder"] * LAYERS + ["decoder"] * LAYERS
    for p in report.layout:
        assert p.status == "verified" and p.residual is not None and p.tolerance is not None
        assert p.residual <= p.tolerance
        want = ("attn", "mlp") if p.stream == "encoder" else ("attn", "cross_attn", "mlp")
        assert p.roles == want, (name, p)
    encoder, decoder = report.streams
    assert [p.k for p in encoder.points] == [0, 2, 4, 6, 8]
    assert [p.k for p in decoder.points] == [0, 3, 6, 9, 12]
    assert [p.block for p in decoder.points] == [None, *range(LAYERS, 2 * LAYERS)]
    assert decoder.points[0].name == f"{dec}.0:input" and decoder.points[0].rms
    assert report.stream == decoder.points and report.summary == decoder.summary
    assert encoder.summary.growth is not None and decoder.summary.grad_ratio is not None
    cross = [b for b in report.branches if b.kind == "cross_attn"]
    assert [b.block for b in cross] == list(range(LAYERS, 2 * LAYERS))
    # the JSON round trip keeps the streams; the table shows one stream table per stream
    back = Report.from_dict(json.loads(report.to_json()))
    assert back.streams == report.streams


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_zeroed_cross_attention_in_the_decoder_is_a_dead_branch_there(name: str) -> None:
    _, _, cross, out = SEQ2SEQ[name]
    model = PENDING[name]()
    with torch.no_grad():
        for p in model.get_submodule(f"{cross}.{out}").parameters():
            p.zero_()
    report = profile(model)
    dead = [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    assert [f.severity for f in dead] == [Severity.WARN], summary(report)
    assert dead[0].layers == (cross,)
    assert "cross-attention of decoder block 1" in dead[0].message
    assert all(p.status == "verified" for p in report.layout)


def test_skipped_checks_are_listed() -> None:
    cfg = transformers.AutoConfig.for_model("llama", **{**DEC, "num_hidden_layers": 3})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    data = json.loads(profile(model).to_json())
    skipped = {s["check"] for s in data["skipped"]}
    assert CheckId.SQRT_GROWTH.value in skipped
