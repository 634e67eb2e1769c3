"""Families a user points actscan at that once failed (issue 22): folders transformers
itself saved, models whose inputs the config describes, and verdicts on what a family
does on purpose. Tiny configs built in process (transformers' own init, no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from actscan.cli import app
from actscan.targets import safetensors_io as st
from actscan.targets.hf import hf_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAMBA2: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "num_heads": 4,
    "head_dim": 16,
    "state_size": 8,
    "expand": 2,
    "n_groups": 1,
}
BAMBA: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 64,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "attn_layer_indices": [1],
}


def run(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _saved(folder: Path, model_type: str, auto: str, **kw: Any) -> Path:
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    getattr(transformers, auto).from_config(cfg).save_pretrained(folder)
    return folder


# -- loading what transformers saved -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "kw"), [("mamba2", MAMBA2), ("bamba", BAMBA)])
def test_a_folder_transformers_saved_loads(
    model_type: str, kw: dict[str, Any], tmp_path: Path
) -> None:
    """save_pretrained writes Mamba-2's time_step_limit (0, inf) as {"__float__":
    "Infinity"}; transformers' reader decodes it, and so must ours."""
    folder = _saved(tmp_path / model_type, model_type, "AutoModelForCausalLM", **kw)
    assert "__float__" in (folder / "config.json").read_text()
    result = run("profile", folder, "--batch", "2", "--seq-len", "8", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["model"]["family"] == model_type
    assert data["layout"] and all(p["status"] == "verified" for p in data["layout"])


def test_special_floats_are_decoded_as_transformers_does() -> None:
    data = json.loads(
        json.dumps(
            {**MAMBA2, "model_type": "mamba2", "time_step_limit": [0.0, {"__float__": "Infinity"}]}
        )
    )
    config = hf_config(data, "config.json")
    assert tuple(config.time_step_limit) == (0.0, float("inf"))


def test_a_validation_error_is_not_cut_at_its_colon() -> None:
    data = {**MAMBA2, "model_type": "mamba2", "num_heads": "four"}
    with pytest.raises(Exception) as err:
        hf_config(data, "config.json")
    message = str(err.value)
    assert "Validation error for field 'num_heads':" in message
    assert "expected int" in message  # the reason, on the same line
    assert "\n" not in message


def test_first_line_joins_an_announcing_colon() -> None:
    err = ValueError("Validation error for field 'x':\n    TypeError: bad value\nmore detail")
    assert st.first_line(err) == "ValueError: Validation error for field 'x': TypeError: bad value"
    assert st.first_line(RuntimeError("one\ntwo")) == "RuntimeError: one"


SPEECHT5: dict[str, Any] = {
    "hidden_size": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "vocab_size": 64,
    "num_mel_bins": 16,
    "speaker_embedding_dim": 8,
    "speech_decoder_postnet_units": 16,
    "speech_decoder_prenet_units": 16,
    "conv_dim": [16, 16],
    "conv_stride": [5, 2],
    "conv_kernel": [10, 3],
}


@pytest.mark.slow
@pytest.mark.parametrize("cls", ["SpeechT5ForTextToSpeech", "SpeechT5ForSpeechToText"])
def test_the_class_is_the_saved_architecture(cls: str, tmp_path: Path) -> None:
    """SpeechT5's two models share one config; the folder's `architectures` says which
    weights it holds (the Auto mapping alone picks speech-to-text for both)."""
    cfg = transformers.AutoConfig.for_model("speecht5", **SPEECHT5)
    torch.manual_seed(0)
    getattr(transformers, cls)(cfg).save_pretrained(tmp_path)
    result = run("profile", tmp_path, "--batch", "2", "--seq-len", "16", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.stdout)["model"]["arch"]["hf_class"] == cls


# -- inputs from the model's own description -----------------------------------------------

CNN: dict[str, Any] = {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8}


def _config_json(folder: Path, model_type: str, **kw: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())
    return path


@pytest.mark.parametrize(
    ("model_type", "kw"), [("resnet", CNN), ("regnet", {**CNN, "groups_width": 8})]
)
def test_a_cnn_gets_images_from_its_config(
    model_type: str, kw: dict[str, Any], tmp_path: Path
) -> None:
    """ResNet/RegNet configs name channels but no image size: RGB at ImageNet's 224."""
    path = _config_json(tmp_path, model_type, **kw)
    result = run("profile", path, "--batch", "2", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.stdout)["run"]["inputs"] == "2 images 3×224×224"


def test_a_negative_position_limit_is_no_limit(tmp_path: Path) -> None:
    """XLNet's max_position_embeddings = -1 (relative positions, no table) once became a
    sequence length of -1: exit 3."""
    kw = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_inner": 64, "vocab_size": 64}
    path = _config_json(tmp_path, "xlnet", **kw)
    assert transformers.AutoConfig.for_model("xlnet").max_position_embeddings == -1
    result = run("profile", path, "--batch", "2", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["run"]["seq_len"] == 64 and data["run"]["inputs"] == "2×64 tokens"
    assert data["model"]["arch"]["max_positions"] is None


# -- what a family does on purpose ---------------------------------------------------------


def _convnext() -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "convnext", hidden_sizes=[16, 32], depths=[3, 3], num_stages=2, image_size=32
    )
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(cfg)


def test_layerscale_parameter_near_zero_is_info_with_its_value() -> None:
    """ConvNeXt multiplies each branch by `layer_scale_parameter` = 1e-6 at init, a
    parameter of the layer (no module of its own): the block starts as the identity."""
    from actscan import scan
    from actscan.records import CheckId, Severity

    report = scan(_convnext(), batch=2)
    dead = [f for f in report.findings if f.check == CheckId.DEAD_BRANCH]
    assert [f.severity for f in dead] == [Severity.INFO], [f.message for f in dead]
    assert "layer_scale_parameter = 1.00e-06" in dead[0].message
    assert all(name.endswith(".layer_scale_parameter") for name in dead[0].layers)


def test_a_zeroed_branch_behind_a_layerscale_is_still_dead() -> None:
    from actscan import scan
    from actscan.records import CheckId, Severity

    model = _convnext()
    with torch.no_grad():
        for p in model.get_submodule("encoder.stages.0.layers.1.pwconv2").parameters():
            p.zero_()
    report = scan(model, batch=2)
    loud = [
        f
        for f in report.findings
        if f.check == CheckId.DEAD_BRANCH and f.severity is not Severity.INFO
    ]
    assert len(loud) == 1 and "block 1" in loud[0].message, [f.message for f in loud]


def test_attention_probabilities_are_not_judged_as_outlier_channels() -> None:
    """GPT-Neo records the dropout on its attention probabilities: under a causal mask
    their "channel 0" (the first key) is large in every row, a property of softmax over a
    causal mask, not an activation channel. Judged by name or by rows that sum to one."""
    from helpers import ctx, outlier_rec

    from actscan.diagnose.channels import outlier_channels
    from actscan.records import CheckId

    width = 64
    probs = {"mean": 1.0 / width, "max_abs": 1.0, "n_channels": width}
    by_name = outlier_rec("h.0.attn.attention.attn_dropout", 50.0, (0,), type="Dropout")
    by_value = outlier_rec("h.1.attn.softmax_out", 50.0, (0,), order=2)
    by_value = type(by_value)(**{**by_value.__dict__, **probs})
    mask = outlier_rec("h.0.attn.causal_mask", 50.0, (0,), order=3)
    quiet = outlier_channels(ctx(layers=[by_name, by_value, mask]))
    assert not [f for f in quiet if getattr(f, "check", None) == CheckId.OUTLIER_CHANNELS]
    real = outlier_rec("h.0.mlp", 50.0, (17,), order=4)
    loud = outlier_channels(ctx(layers=[by_name, by_value, mask, real]))
    assert [f.layers for f in loud] == [("h.0.mlp",)]


# -- images and text together ----------------------------------------------------------------

TOWER: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
}


def _clip() -> torch.nn.Module:
    cfg = transformers.CLIPConfig(
        text_config={**TOWER, "vocab_size": 64, "max_position_embeddings": 32},
        vision_config={**TOWER, "image_size": 16, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    return transformers.CLIPModel(cfg)


def test_a_two_tower_model_gets_both_towers_inputs_and_a_loss_on_every_position() -> None:
    """CLIP takes token ids and images at once; the loss reaches every position of both
    towers' last hidden states (not only the pooled embeddings its logits compare)."""
    from actscan import scan

    report = scan(_clip(), batch=2, seq_len=8)
    assert report.run.inputs == "2 images 3×16×16 + 2×8 tokens"
    assert report.run.loss is not None and "every output position" in report.run.loss
    grads = {r.name: r.grad_rms for r in report.layers}
    for tower in ("text_model", "vision_model"):
        last = f"{tower}.encoder.layers.1"
        assert grads.get(last) and grads[last] > 0, (tower, sorted(grads)[:8])


def test_a_vision_language_model_gets_as_many_image_tokens_as_its_images_fill() -> None:
    """LLaVA's text holds one placeholder per image feature; the count comes from the
    model's own get_image_features, checked here against the vision tower's patch grid
    ((16/8)² = 4 patches, the CLS token dropped by the default feature strategy)."""
    from actscan.measure.model_inputs import hf_input_source

    cfg = transformers.LlavaConfig(
        text_config={
            "model_type": "llama",
            **TOWER,
            "vocab_size": 64,
            "num_key_value_heads": 1,
        },
        vision_config={
            "model_type": "clip_vision_model",
            **TOWER,
            "image_size": 16,
            "patch_size": 8,
        },
        image_token_index=63,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg)
    source = hf_input_source(model, batch=2, seq_len=8, seed=0)
    assert source is not None
    batch = source(0).kwargs
    assert tuple(batch["pixel_values"].shape) == (2, 3, 16, 16)
    assert ((batch["input_ids"] == 63).sum(dim=1) == 4).all()
    assert batch["input_ids"].shape == (2, 4 + 8)
    out = model(**batch)  # the model accepts them: placeholders match its features
    assert out.logits.shape == (2, 12, 64)


def test_the_report_names_the_loss() -> None:
    from actscan import scan

    llama = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(
            "llama", **TOWER, vocab_size=64, num_key_value_heads=1, head_dim=16
        )
    )
    assert scan(llama, batch=2, seq_len=8).run.loss == "next-token cross-entropy"
    report = scan(llama, batch=2, seq_len=8, loss_fn=lambda out: out.logits.square().mean())
    assert report.run.loss == "the caller's loss"


def test_a_module_shared_by_every_block_is_no_crash() -> None:
    """GPT-1, XLM and FlauBERT give every block the same activation instance
    (named_modules lists it once, under block 0): layout detection once raised KeyError."""
    from torch import nn

    from actscan import scan

    act = nn.GELU()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Linear(16, 32), act, nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.act(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block(x)
            return x

    torch.manual_seed(0)
    report = scan(Net(), torch.randn(2, 8, 16))
    assert len(report.layout) == 4


def test_a_two_tower_config_folder_runs_from_the_cli(tmp_path: Path) -> None:
    """The issue's CLIP refusal ("cannot invent inputs ... pass inputs=") from the CLI,
    where inputs= cannot be passed: the config alone says what to feed both towers."""
    path = tmp_path / "config.json"
    path.write_text(_clip().config.to_json_string())
    result = run("profile", path, "--batch", "2", "--seq-len", "8", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["run"]["inputs"] == "2 images 3×16×16 + 2×8 tokens"
    assert "every output position" in data["run"]["loss"]


# -- heterogeneous configs and depth-shaped tensors (transformers 5) ------------------------


def _tiny(model_type: str) -> Any:
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import families

    return families.build(model_type, families.model_types()[model_type])


def test_a_per_layer_field_reads_as_the_value_the_layers_share() -> None:
    """Reading a per-layer field of a heterogeneous config raises in transformers 5; the
    info actscan reports takes the value every layer shares, None where they differ."""
    from actscan.targets.hf_layers import config_value

    config = _tiny("gemma4_text").config
    assert "head_dim" in config.per_layer_attributes
    heads = {layer.head_dim for layer in config.per_layer_config}
    assert len(heads) == 2  # the full-attention layers' wider heads
    assert config_value(config, "head_dim") is None
    assert config_value(config, "hidden_size") == config.hidden_size == 64


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma4_text", "dots3_note_text"])
def test_a_heterogeneous_folder_transformers_loads_loads(model_type: str, tmp_path: Path) -> None:
    """Gemma 4's per-layer embeddings are layers × width outside the layer stack (the
    depth-2 meta build must not hold them to its own shape), and Dots3's per-layer head
    counts raise on a global read: transformers' own from_pretrained loads both folders,
    and so must actscan, with the class the folder's `architectures` names."""
    model = _tiny(model_type)
    model.save_pretrained(tmp_path)
    cls = type(model).__name__
    assert type(getattr(transformers, cls).from_pretrained(tmp_path)).__name__ == cls
    result = run("profile", tmp_path, "--batch", "2", "--seq-len", "8", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["model"]["arch"]["hf_class"] == cls
    assert data["model"]["n_blocks"] == model.config.num_hidden_layers
