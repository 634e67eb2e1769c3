"""The standing breadth matrix (issue 22): every model type this transformers lists in its
auto mappings, built tiny with the library's own init and scanned (benchmarks/families.py
derives the configs and runs each row; docs/families.md publishes the result).

Per type: exit 0/1/2 only (a crash is exit 3); on healthy init no warn/error finding and
every block's layout verified, unless benchmarks/families.py's ARGUED table argues the
finding true. Types that do not clean up yet are listed with their cause in
tests/breadth_baseline.json: they are expected failures (xfail, not strict, so a fix shows
as XPASS and the entry is then removed by `python benchmarks/families.py --baseline`). A
type not in the baseline that is not clean is a regression."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import families  # noqa: E402

BASELINE: dict[str, str] = json.loads((ROOT / "tests" / "breadth_baseline.json").read_text())
TYPES = families.model_types()
# In the suite the budgets are hang guards only (a busy CI machine must not turn a 2 s
# build into "slow"): ≥ 6× the benchmark's, whose 20 s / 60 s sort the published rows.
families.BUILD_BUDGET_S = 120.0
families.SCAN_BUDGET_S = 360.0
# `make test` runs every SAMPLE-th type (the whole matrix is ~10 min of one core, twice
# the suite); ACTSCAN_BREADTH=all runs them all, as `benchmarks/families.py` does.
SAMPLE = 1 if os.environ.get("ACTSCAN_BREADTH") == "all" else 10
SAMPLED = sorted(TYPES)[::SAMPLE]


def test_the_matrix_covers_at_least_150_types() -> None:
    assert len(TYPES) >= 150
    assert set(BASELINE) <= set(TYPES), sorted(set(BASELINE) - set(TYPES))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SAMPLED)
def test_each_type_runs_clean(model_type: str, request: pytest.FixtureRequest) -> None:
    if model_type in BASELINE:
        request.applymarker(pytest.mark.xfail(reason=BASELINE[model_type], strict=False))
    row = families.run_one(model_type, TYPES[model_type])
    if row.status == "needs-package":  # an optional package this environment lacks
        pytest.skip(row.reason)
    assert row.exit in (None, 0, 1, 2), (row.status, row.reason)
    assert row.status == "clean", (row.status, row.layout, row.findings or row.reason)


def test_tiny_configs_are_tiny_and_keep_what_configs_derive() -> None:
    llama = families.tiny_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.vocab_size) == (64, 4, 512)
    assert llama.num_attention_heads * llama.head_dim == 64
    # derived fields are derived again from the shrunk values, not kept at full size
    ds = families.tiny_config("deepseek_v3")
    assert ds.qk_head_dim == ds.qk_nope_head_dim + ds.qk_rope_head_dim
    assert ds.num_key_value_heads == ds.num_attention_heads  # 128/128 at full size
    # Mamba-2 validates heads × head_dim = expand × hidden
    m2 = families.tiny_config("mamba2")
    assert m2.num_heads * m2.head_dim == m2.expand * m2.hidden_size
    # a vision-language model's image token moves inside the shrunk text vocabulary
    llava = families.tiny_config("llava")
    assert llava.image_token_index < llava.text_config.vocab_size


@pytest.mark.parametrize("model_type", ["llama", "clip", "vit"])
def test_a_sample_row_runs_clean(model_type: str) -> None:
    """The fast suite's sample of the matrix: a language model, a two-tower model, a
    vision backbone, each through the same row function."""
    row = families.run_one(model_type, TYPES[model_type])
    assert row.status == "clean", (row.status, row.layout, row.findings or row.reason)
    assert row.inputs and row.loss and row.layout.startswith("verified")


def test_a_per_layer_config_shrinks_through_its_layers() -> None:
    """transformers 5's heterogeneous configs (`per_layer_config`): Gemma 4's full-attention
    layers override head_dim. The tiny config keeps overrides inside the new depth, each on
    a layer of the kind it belonged to, shrunk; and the model builds."""
    full = transformers.AutoConfig.for_model("gemma4_text")
    tiny = families.tiny_config("gemma4_text")
    kinds = tiny.layer_types
    assert len(kinds) == tiny.num_hidden_layers == 4
    assert set(kinds) == set(full.layer_types)  # both kinds survive the cut
    wide = [i for i, layer in enumerate(tiny.per_layer_config) if layer.head_dim != 16]
    assert wide and all(kinds[i] == "full_attention" for i in wide)
    assert all(tiny.per_layer_config[i].head_dim <= 16 for i in range(4) if i not in wide)
    model = families.build("gemma4_text", TYPES["gemma4_text"])
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_validated_relations_survive_the_shrink() -> None:
    """Relations that configs' validate_architecture checks, kept by general rules."""
    # an inner width that is heads × head dim of its own prefix (Falcon-H1's Mamba mixer)
    fh = families.tiny_config("falcon_h1")
    assert fh.mamba_d_ssm == fh.mamba_n_heads * fh.mamba_d_head < 1024
    # MLA: a sliding layer's head_dim = its no-rope + rope parts, through per_layer_config
    dots = families.tiny_config("dots3_note_text")
    swa = dots.per_layer_config["sliding_attention"]
    assert swa.head_dim == swa.qk_nope_head_dim + swa.qk_rope_head_dim
    # a size equal to another config's width (a flow head conditioned on the backbone)
    pocket = families.tiny_config("pocket_tts")
    assert pocket.flow_head_config.condition_dim == pocket.hidden_size < 1024
    # one value per layer cut to the new depth (Gemma 3n's intermediate_size)
    g3n = families.tiny_config("gemma3n_text")
    assert len(g3n.intermediate_size) == g3n.num_hidden_layers
    assert max(g3n.intermediate_size) <= families.FFN
    # conv groups equal to the width stay so (depthwise); GroupNorm groups divide channels
    mimi = families.tiny_config("mimi")
    assert mimi.upsample_groups == mimi.hidden_size
    for model_type in ("falcon_h1", "dots3_note_text", "pocket_tts", "gemma3n_text", "bit"):
        families.build(model_type, TYPES[model_type])  # each validates and builds


def test_backbone_stages_and_channels_survive_the_shrink() -> None:
    """A backbone keeps the stages its neck reads, and every channel field that mirrors a
    stage width is scaled with it (else the neck's convs get the full-width channels)."""
    rt = families.tiny_config("rt_detr")  # the three stages its encoder projects
    assert rt.backbone_config.out_indices == [2, 3, 4]
    hg = families.tiny_config("d_fine").backbone_config  # HGNetV2: stage i feeds stage i+1
    assert hg.stage_in_channels[1:] == hg.stage_out_channels[:-1]
    assert max(hg.stage_out_channels) < 2048
    fine = families.tiny_config("d_fine")
    outs = [hg.stage_out_channels[i - 1] for i in hg.out_indices]
    assert fine.encoder_in_channels == outs  # the neck's inputs are the stages it reads
    text = families.tiny_config("textnet")  # the stem's width is the first stage's
    assert text.stem_out_channels == text.hidden_sizes[0] < 64
    hiera = families.tiny_config("sam2_hiera_det_model")  # 96 -> 64: stages scaled by 2/3
    assert hiera.embed_dim_per_stage[0] == hiera.hidden_size == 64
    sam = families.tiny_config("sam")  # sine + cosine features: half the embedding width
    assert 2 * sam.vision_config.num_pos_feats == sam.prompt_encoder_config.hidden_size
    v3 = families.tiny_config("pp_doclayout_v3")  # its head reads the first stage's width
    assert v3.x4_feat_dim == v3.backbone_config.stage_out_channels[0] < 128
    # SAM 3's feature grids are 4, 2 and 1 × its patch grid (1008 / 14 = 72): of 32 / 8 = 4
    s3 = families.tiny_config("sam3_tracker").vision_config
    assert s3.backbone_feature_sizes == [[16, 16], [8, 8], [4, 4]]
    # DepthPro's hooks into its 12-layer patch encoder, at the same places of 4 layers
    assert families.tiny_config("depth_pro").intermediate_hook_ids == [3, 1]
    for model_type in ("d_fine", "textnet", "sam2_hiera_det_model"):
        model = families.build(model_type, TYPES[model_type])
        assert sum(p.numel() for p in model.parameters()) < 20_000_000


def test_a_head_over_a_sub_config_builds_on_it() -> None:
    """The causal-LM mapping lists Emu3ForCausalLM for emu3, whose config is the composite
    Emu3Config: the head is built on its text sub-config, as from_pretrained would."""
    model = families.build("emu3", TYPES["emu3"])
    assert type(model.config).__name__ == "Emu3TextConfig"


def test_a_missing_optional_package_is_named() -> None:
    pytest.importorskip("torch")
    try:
        import timm  # noqa: F401
    except ImportError:
        row = families.run_one("timm_wrapper", TYPES["timm_wrapper"])
        assert (row.status, row.reason) == ("needs-package", "needs timm (not installed here)")
        doc = families.markdown([row])
        assert "1 need an optional package not installed here (timm: 1)" in doc
    else:
        pytest.skip("timm is installed here")
