"""The breadth matrix: every model type this transformers can build on CPU, scanned.

Enumerates transformers' auto mappings (one class per model type: the language-model or
vision-language head a user would point actscan at, else the bare model), derives a tiny
config from each type's default config by shrinking every size-like field (`shrink`),
builds it with the library's own init (no download, no remote code) and runs
`actscan.scan` on it. Each type gets a row: status, seconds, the exit code the CLI would
give (0 quiet, 1 a warn/error finding, 2 refused with a reason, 3 a crash), the loud
findings and the layout proof. A type whose class needs an optional package this
environment lacks (timm, natten, ...) is `needs-package`, its reason naming the package.

The shrink is generic (rules by field name and by the relations the full config holds:
widths, heads × head dim, per-layer lists and `per_layer_config`, layer groups); the two
small tables below (DEFAULT_FIXES, OVERRIDES) hold only what a default config leaves to
its checkpoints, each entry with its reason.

    python benchmarks/families.py [--only TYPE,...] [--json OUT.json] [--write-docs]

`--write-docs` writes docs/families.md (the published matrix). `tests/test_breadth_matrix.py`
runs the same rows in the suite (slow). Heavy on CPU: run it under `nice`, one thread.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS = 4  # the depth checks need 4 block outputs (min-blocks)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
VOCAB = 512
IMAGE, PATCH = 32, 8
BUILD_BUDGET_S = 20.0  # a type whose build + scan takes longer is skipped (not clean)
SCAN_BUDGET_S = 60.0

# The heads tried in order: what a user points actscan at (a language model, a
# vision-language model, a sequence-to-sequence model), else the bare model (encoders,
# vision and audio backbones), whose loss then reaches every output position.
HEADS_ORDER = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)

# Overrides where the generic shrink gives a config the model cannot build; each says why.
# Merged into the tiny config (nested dicts merged key by key).
_KINDS = ["conv", "full_attention", "conv", "full_attention"]
_QSA = {
    "indexer_n_heads": HEADS,
    "indexer_kv_heads": 1,  # the only count its config accepts
    "indexer_head_dim": HEAD_DIM,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
}
_COMPASS_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
}
_SWIN_SIDE = {"image_size": 224}  # window 7 · patch 4 · 2^3: every stage's grid ≥ its window
_T5_HEADS = {"d_kv": HIDDEN // HEADS}  # its attention output maps heads · d_kv to the width
# a pixel decoder over all four Swin stages (the shrunk config keeps only the last)
_PYRAMID = {
    "backbone_config": {
        **_SWIN_SIDE,
        "out_indices": [1, 2, 3, 4],
        "out_features": ["stage1", "stage2", "stage3", "stage4"],
    }
}
# a Swin backbone, and fewer queries than the tiny backbone's one output stage has places
_DINO = {"backbone_config": _SWIN_SIDE, "num_queries": 64}
_PLACEHOLDER = 24  # refused22: an image placeholder id below VOCAB (see OVERRIDES' last group)
OVERRIDES: dict[str, dict[str, Any]] = {
    # defaults that leave None what every checkpoint sets and the model reads
    "lfm2_moe": {"layer_types": _KINDS},  # conv/attention kinds, as LFM2's checkpoints
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}},
    "diffusion_gemma": {
        "text_config": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64}
    },
    "chameleon": {"vocabulary_map": {"<image>": 8}},  # the tokenizer's map, read by the model
    # the speech encoder reads the decoder's speech codes: its vocabulary is the decoder's
    # (8194 both in every checkpoint; the default leaves it the text encoder's 256)
    # its encoders' rotary embedding is at least 32 wide: two heads of 32 at width 64
    "clvp": {
        "speech_config": {"vocab_size": VOCAB, "num_attention_heads": 2},
        "text_config": {"num_attention_heads": 2},
    },
    # fields this transformers' model reads but its config class no longer declares
    # (checkpoints saved by older versions carry them)
    "moonshine_streaming": {"num_key_value_heads": HEADS},
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # its validator ties the adaptor's intermediate size to a quarter of the text width
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},
    # the shared transformer is tied across its hybrid layers: two of them, not one
    "zamba": {
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
    },
    # image then audio codebooks laid end to end inside the text vocabulary
    "apertus1p5": {
        "image_token_offset": VOCAB // 2,
        "vision_config": {"codebook_size": VOCAB // 4},
        "audio_token_offset": VOCAB // 2 + VOCAB // 4,
        "audio_config": {"codebook_size": VOCAB // 4},
    },
    # its config counts blocks (attention + MLP per layer, twice the layers) and splits
    # the layers into input, recurrent and output groups: 3 layers, one each
    "dory": {
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
        "layer_types": [*(["sliding_attention", "mlp"] * 2), "full_attention", "mlp"],
    },
    # windows tile the image side: 4 windows (2 × 2) of the 32-pixel image
    # and its projector levels, which the default leaves empty (the small checkpoint: one, 1×)
    "lw_detr": {"backbone_config": {"num_windows": 4}, "projector_scale_factors": [1.0]},
    # which vision layers feed which text layers (checkpoints name them), inside 4 layers
    "granite4_vision": {
        "deepstack_layer_map": [[1, 0], [3, 1]],
        "spatial_target_layers": [2, 3],
        "downsample_rate": "1/2",  # query / window side of its Q-Former downsampler
    },
    # its full-attention layers always build the QSA indexer the default leaves unset
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": _QSA},
    # the default's rope_parameters name no layer kind, and its M-RoPE sections fit a
    # 128-wide head: one per kind, sections for the tiny head
    "cohere_compass_text": {"rope_parameters": _COMPASS_ROPE},
    "cohere_compass": {"text_config": {"rope_parameters": _COMPASS_ROPE}},
    # its LM head asserts is_decoder; the axial position widths must add up to the width
    # and the axial shape multiply to the scanned length (16 tokens, as training requires)
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [16, HIDDEN - 16],
        "axial_pos_shape": [4, 4],
    },
    # KV sharing needs each layer kind among the cache-producing layers: 1 of 4 layers shares
    "gemma3n_text": {
        "num_kv_shared_layers": 1,
        "layer_types": ["sliding_attention", "full_attention"] + ["sliding_attention"] * 2,
    },
    # inputs: image sides, heads and sizes the shrink misses
    "swin": _SWIN_SIDE,
    "donut-swin": _SWIN_SIDE,
    "pix2struct": {"text_config": _T5_HEADS, "vision_config": _T5_HEADS},
    "mask2former": _PYRAMID,
    "oneformer": _PYRAMID,
    "tvp": {"num_frames": 4},  # 48 frames of 448 × 448 are minutes on CPU, not seconds
    # sizes the shrink misses: a pooler width, per-layer key/value head counts
    "vision-text-dual-encoder": {"vision_config": {"pooler_output_size": HIDDEN}},
    "sapiens2": {"num_key_value_heads_per_layer": [HEADS] * LAYERS},
    "grounding-dino": _DINO,
    "mm-grounding-dino": _DINO,
    # inputs: audio, document and text sizes the shrink misses
    # xLSTM sizes its blocks by `embedding_dim`, which mirrors hidden_size (4096) and is no
    # size name the shrink knows
    "xlstm": {"embedding_dim": 64},
    # LongCat-Flash splits its query heads as qk_nope + qk_rope = qk_head_dim (16 + 16)
    "longcat_flash": {"qk_head_dim": 32},
    # LayoutLMv3 concatenates 4 coordinate and 2 shape embeddings into the width:
    # 4 × 12 + 2 × 8 = 64
    "layoutlmv3": {"coordinate_size": 12, "shape_size": 8},
    # LiLT's layout stream is 6 box embeddings of hidden // 6, divided by its channel
    # shrink ratio (4) into its heads: a width of 48 divides by 6 and by 4 × 4
    "lilt": {"hidden_size": 48},
    # Voxtral's default config leaves its audio placeholder unset (None); the released
    # checkpoints name 24
    "voxtral": {"audio_token_id": 24},
    # CLAP's audio Swin doubles its patch width over 4 stages into `hidden_size`:
    # 8 × 2³ = 64
    "clap": {"audio_config": {"patch_embeds_hidden_size": 8}},
    # the Nemotron-H text model's Mamba heads (4) must be a multiple of its groups (8)
    "nemo_speechlm": {"text_config": {"n_groups": 4}},
    # VibeVoice's acoustic tokenizer doubles `num_filters` (32) over 6 stages: 2 048
    # channels and 130 M parameters at the generic shrink; 4 filters give 256
    "vibevoice_acoustic_tokenizer_encoder": {"num_filters": 4},
    "vibevoice_acoustic_tokenizer_decoder": {"num_filters": 4},
    # EfficientNet's top conv is round_filters(1280) = 1280 × width_coefficient wide, which
    # `hidden_dim` (2560 → 64) must equal: 0.05 gives 64 (and 8-channel early blocks)
    "efficientnet": {"width_coefficient": 0.05},
    # ALIGN's image embedding is its last block's width, round_filters(320) = 320 ×
    # width_coefficient, which projection_dim (64) must equal; the top conv then 256 wide
    "align": {"vision_config": {"width_coefficient": 0.2, "hidden_dim": 256}},
    # UVDoc's head concatenates all six bridge outputs (bridge_connector 128 × 6 in); the
    # default backbone names only the last stage
    "uvdoc": {"backbone_config": {"out_indices": [1, 2, 3, 4, 5, 6], "out_features": None}},
    # ---- refused22: what a released checkpoint sets and the default leaves unset or
    # out of range, so actscan's inputs (which follow the config) can run
    # Autoformer's decoder starts from the last `label_length` (10) context steps: its
    # checkpoints keep it within the context, here 4 (prediction_length)
    "autoformer": {"label_length": 2},
    # vision-language defaults that set no image (video) placeholder, which actscan rightly
    # refuses for a user; every released checkpoint names one (BLIP-2's 50265, MiniCPM-V's
    # <image>): here an id inside the matrix's small vocabulary
    "blip-2": {"image_token_index": _PLACEHOLDER},
    "instructblip": {"image_token_index": _PLACEHOLDER},
    "instructblipvideo": {"video_token_index": _PLACEHOLDER},
    "minicpm_ocr": {"image_token_id": _PLACEHOLDER},
    "minicpmv4_6": {"image_token_id": _PLACEHOLDER},
    "minicpmv4_7": {"image_token_id": _PLACEHOLDER},
    "nemotron_h_omni": {"image_token_id": _PLACEHOLDER},
    # ---- model-error22: fields the model reads unconditionally, which the default leaves
    # None and every released checkpoint sets (a user's folder without one gets a line
    # naming the field: `unset_config_fields`)
    "esm": {"pad_token_id": 1},  # position ids count from it (ESM-2's <pad> is 1)
    # DBRX clamps q, k, v at 8 (rope_theta: read, no longer declared by its config class)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8}},
    # it builds a sliding-window mask even when no layer slides (the released config: 512)
    "step3p7": {"text_config": {"sliding_window": 512}},
    # its 2-D RoPE spans head_dim × partial_rotary_factor (4) = half the width: the real
    # 8 heads (the shrink's 4 give the whole width, and the rotary tables do not fit)
    "efficientloftr": {"num_attention_heads": 8},
    # its M-RoPE index reads vision_start_token_id, which the thinker's config class no
    # longer declares and the released thinker configs carry (151652): an id in the range
    "qwen2_5_omni_thinker": {"vision_start_token_id": VOCAB - 7},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": VOCAB - 7},
    # its prompt encoder's grid (image_size / patch_size) must be the backbone's last
    # feature grid, 16× finer than the image (stride 4, then two 2× poolings): the
    # released 16, which the shrink's patch size halves
    "sam2": {"prompt_encoder_config": {"patch_size": 16}},
    # ---- h-audio: codec widths the shrink split that the full config keeps equal
    # Mimi's quantizer projects to `vector_quantization_hidden_dimension` and looks up
    # codebooks `codebook_dim` wide: both 256 in the default, equal in every checkpoint
    "mimi": {"vector_quantization_hidden_dimension": HIDDEN},
    # X-Codec's `codebook_dim` is derived (acoustic + semantic width) when left None; the
    # default's to_dict writes the full value down, which the shrink then cut alone
    "xcodec": {"codebook_dim": None},
}
# Default configs that do not validate as this transformers ships them: the fields that
# make them valid, given when the default is made (before it is shrunk).
DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    # the assistant's validator wants a text config without per-layer inputs, MoE or wide MLP
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        }
    },
}
# M-RoPE text models whose modeling code falls back to sections for a 128-wide head when
# the config names none: sections for the tiny head (they sum to HEAD_DIM/2).
MROPE: dict[str, list[int]] = {
    "qwen2_vl_text": [2, 3, 3],
    "qwen2_5_vl_text": [2, 3, 3],
    "glm4v_text": [2, 3, 3],
    "glm4v_moe_text": [2, 1, 1],  # half its rotary dims: partial_rotary_factor 0.5
    "hunyuan_vl_text": [2, 2, 2, 2],  # its default names none; HunYuan-VL needs ≥ 3 axes
    "glm_ocr_text": [2, 3, 3],
    "glm_image_text": [2, 3, 3],
    "paddleocr_vl_text": [2, 3, 3],
    "ernie4_5_vl_moe_text": [3, 3, 2],  # height, width, time (its fallback: [22, 22, 20])
    "qwen2_5_omni_text": [2, 3, 3],  # the thinker's text model (its fallback: [16, 24, 24])
}

# Findings argued true on a type's healthy tiny init (check id -> why), or a reason a
# type is not expected to verify its layout. Each argument is a measured fact of the
# library's own init, not a family's name: the check is right there.
_SAM_INIT = (
    "SAM's vision config defaults initializer_range to 1e-10 (its weights are meant to be "
    "loaded): every vision weight is ~1e-10 at init, so its branches truly write ~1e-17 "
    "of the stream"
)
_FLAT_002 = (
    "{what} is not shrunk by the generic tiny config: a flat 0.02 over that fan-in is "
    "1.8–2.2× √(1/fan_in), the planted case of tests/test_calibration.py (flat 0.02 at "
    "width 2048 warns); true at this width"
)
_PE_DAC = "its DAC encoder's conv fan-in 12288"
# HGNetV2's backbone (D-FINE, DEIMv2, PP-DocLayout v3/v4) at the library's init: the
# stream actscan proves is one HGNetV2 block's 6 plain ConvLayers (conv -> frozen BN -> ReLU,
# no residual; their outputs are concatenated into the block's aggregation).
_HGNET_FROZEN = (
    "freeze_backbone_batch_norms defaults to True: the HGNetV2 backbone's BatchNorms are "
    "DFineFrozenBatchNorm2d (running stats 0/1, gain 1: the identity) and every conv is "
    "N(0, 0.02) (measured std 0.018 at fan-in 27): conv -> identity -> ReLU passes ~0.09 per "
    "layer, so the pixels are at RMS 4e-5 entering stage 0 and 1.9e-11 after its 6 plain "
    "ConvLayers; the frozen BN is meant for a pretrained backbone, true of this init"
)
_BN_GAIN_INIT = (
    "{cls}._init_weights draws every nn.BatchNorm2d weight N(0, initializer_range = {r}) "
    "(measured effective gain mean ~0, std {std}), not 1: the check's reading is right and "
    "true of this init"
)
ARGUED_HGNET = {c: _HGNET_FROZEN for c in ("collapse", "exploding-grad")}
ARGUED: dict[str, dict[str, str]] = {
    **{t: dict(ARGUED_HGNET) for t in ("d_fine", "deimv2")},
    **{
        t: {
            **ARGUED_HGNET,
            "init-scale": _BN_GAIN_INIT.format(cls=f"{cls}PreTrainedModel", r="0.01", std="~0.01")
            + " (the encoder's BNs; the backbone's are frozen)",
        }
        for t, cls in (("pp_doclayout_v3", "PPDocLayoutV3"), ("pp_doclayout_v4", "PPDocLayoutV4"))
    },
    "rt_detr": {
        "init-scale": _BN_GAIN_INIT.format(cls="RTDetrPreTrainedModel", r="0.01", std="0.0118")
        + " (the backbone's BNs are frozen; the encoder's 42 are the ones drawn)"
    },
    "rt_detr_v2": {
        "init-scale": _BN_GAIN_INIT.format(cls="RTDetrV2PreTrainedModel", r="0.01", std="0.0118")
        + " (the backbone's BNs are frozen; the encoder's 42 are the ones drawn)"
    },
    "efficientnet": {
        "init-scale": _BN_GAIN_INIT.format(
            cls="EfficientNetPreTrainedModel", r="0.02", std="0.0226"
        ),
        "dead-branch": _BN_GAIN_INIT.format(
            cls="EfficientNetPreTrainedModel", r="0.02", std="0.0226"
        )
        + ": each MBConv branch passes three such BNs (and its depthwise conv, 0.02·√9 = 0.06) "
        "below BN's eps 1e-3, where BN stops renormalising: writes 1e-4 to 1e-13 of the stream",
    },
    "sam_vision_model": {"dead-branch": _SAM_INIT},
    "sam_hq_vision_model": {"dead-branch": _SAM_INIT},
    **{
        t: {
            "dead-branch": _SAM_INIT + f" ({who}'s vision tower keeps its own SamVisionConfig "
            "init: measured block-2 attention RMS ~4e-26 on a stream of ~1e-9)"
        }
        for t, who in (("sam", "SamModel"), ("sam_hq", "SamHQModel"))
    },
    "got_ocr2": {"dead-branch": _SAM_INIT + " (GOT-OCR2's SAM vision tower)"},
    "pp_chart2table": {"dead-branch": _SAM_INIT + " (GOT-OCR2's SAM vision tower)"},
    "deepseek_vl_hybrid": {
        "dead-branch": _SAM_INIT + " (DeepSeek-VL hybrid's high-res tower is a SamVisionConfig)"
    },
    "blip": {"dead-branch": "BlipVisionConfig defaults initializer_range to 1e-10, as SAM's"},
    "blip-2": {
        "dead-branch": "Blip2VisionConfig defaults initializer_range to 1e-10, as SAM's: the "
        "image features the Q-Former's cross-attention reads are ~0 (the vision stream's "
        "RMS rounds to 0.0), so that cross-attention truly writes 9.1e-9 of the stream "
        "(block 2); block 0's self-attention reads the zero-initialised query tokens and "
        "writes exactly 0, not judged (it says nothing of its weights)"
    },
    "lfm3_vl": {
        "dead-branch": "at width 64 the vision tower's gated short convolution multiplies "
        "three 0.02-std projections (gain 0.02·√64 = 0.16 each) and a 3×3 depthwise conv: "
        "its write is ~3e-5 of the stream, true at this width (~1e-2 at width 1024)"
    },
    "modernvbert": {
        "dead-branch": "ModernBERT's init at width 64: a GLU of two 0.02-std projections "
        "(gain 0.16 each) into an output projection at 0.02/√(2L): the text MLPs write "
        "~7e-4 of the stream, true at this width (~4e-2 at width 768)"
    },
    "cpmant": {
        c: "CpmAntConfig defaults init_std to 1.0 (its weights are meant to be loaded): "
        "every matrix at std 1 is the planted 'every weight at std 1' case (tests/"
        "test_family_matrix.py), and the stream truly jumps ×3e3 inside block 0"
        for c in ("init-scale", "exp-growth", "exploding-grad", "logit-scale")
    },
    "ctrl": {"init-scale": _FLAT_002.format(what="CTRL's dff = 8192")},
    "deepseek_v4": {"init-scale": _FLAT_002.format(what="DeepSeek-V4's o_b_proj fan-in 8192")},
    "dac": {"init-scale": _FLAT_002.format(what="DAC's encoder conv1 fan-in 8192")},
    "pe_audio_encoder": {"init-scale": _FLAT_002.format(what=_PE_DAC)},
    "pe_audio": {"init-scale": _FLAT_002.format(what=_PE_DAC)},
    "funnel": {
        "logit-scale": "Funnel's embeddings are N(0, 1) when initializer_std is None, tied to "
        "the head: logits of std √64 = 8, the planted case of tests/test_calibration.py "
        "(tied unit-variance embedding); true of this init"
    },
    "mt5": {
        "logit-scale": "mT5's untied lm_head is initialised at std factor·1.0 with no d^-1/2 "
        "on the decoder output (only tied T5 heads get it): logits of std √d = 8, the "
        "planted unit-variance head; true of this init"
    },
    "minicpm3": {
        c: "MiniCPM3Config defaults initializer_range to 0.1 (5× the usual 0.02): "
        "q_b_proj over fan-in 768 gives queries of std 2.8, and the scores truly are sharp "
        "at init (normalised entropy 0.34–0.5 over 9 keys)"
        for c in ("init-scale", "logit-scale", "attn-entropy")
    },
    **{
        t: {
            "init-scale": "its (1 + w) RMSNorms get w = 1 from transformers' default norm init "
            "(no model-specific init): every effective gain is truly 2"
        }
        for t in ("muse_glimmer", "muse_glimmer_text")
    },
    "pp_formulanet": {
        "dead-branch": _SAM_INIT + " (PP-FormulaNet's vision config, initializer_range "
        "1e-10): its encoder output is ~1e-9, so the decoder's cross-attention truly reads "
        "zeros (k/v exactly 0, no gradient to q/k)"
    },
    "switch_transformers": {
        "init-scale": "transformers initialises the Switch router at std factor·1.0 (8.5× "
        "√(1/64)), where the Switch paper draws it at √(0.1/fan_in): router logits of std "
        "~8, near one-hot routing at init, as the finding says"
    },
    "mobilevit": {
        "init-scale": "transformers' MobileViT init draws BatchNorm2d gains from N(0, "
        "initializer_range = 0.02), not 1: every effective gain truly is ~0 (mean −0.002, "
        "std 0.022)"
    },
    "nemotron": {
        "init-scale": "NemotronLayerNorm1P computes with weight + 1 and transformers' "
        "Nemotron init sets weight = 1 (init.ones_): every effective gain truly is 2"
    },
    "mobilevitv2": {
        "init-scale": "transformers' MobileViTV2 init draws BatchNorm2d gains from N(0, "
        "initializer_range = 0.02), as MobileViT's: every effective gain truly is ~0 "
        "(mean −0.004, std 0.019)"
    },
    **{
        t: {
            "overflow": "GroundingDinoContrastiveEmbedding fills −inf on purpose: at text "
            "positions the token mask excludes and on the padding up to max_text_len (256), "
            "so encoder_output_class_embed's output is non-finite by design"
        }
        for t in ("grounding-dino", "mm-grounding-dino")
    },
    **{
        t: {
            "overflow": "transformers' NemotronAsrStreaming attention masks with "
            "attention_mask.logical_not() on the float additive mask eager receives (0 where "
            "allowed), so every key is masked: all outputs are NaN under eager, at any length "
            "and with or without attention_mask (measured: 1152/1152 at 64 frames; sdpa: 0)",
            "layout": "the same NaN: from the first conformer block on, the stream itself is "
            "non-finite (384 inf/nan values out of layers.0.self_attn.o_proj), so x_in + Σ "
            "writes = x_out cannot be measured in layers.*; the subsampling stages verify",
        }
        for t in ("nemotron3_5_asr", "nemotron_asr_streaming", "nemotron_asr_streaming_encoder")
    },
    "xclip": {
        c: "XCLIPConfig has no initializer_range, only initializer_factor = 1.0, which "
        "transformers' default init takes as the std, and XCLIP's _init_weights leaves its "
        "prompt generator (XCLIPCrossAttention, the MLP) to it: q/k/v_proj and mlp weights "
        "truly are N(0, 1) (std 1.01 measured over fan-in 64), q and k of RMS ~8.5 and "
        "scores of std ≈ ¼·8.7·8.3·√16 = 72 (measured 65.9)"
        for c in ("init-scale", "logit-scale", "attn-entropy")
    },
    "apertus1p5": {
        "init-scale": "Apertus 1.5's vision tokenizer init draws every nn.Linear with "
        "init.normal_ (std 1) on purpose: the IBQ codebook scorer truly is N(0, 1); its "
        "scores feed only an argmax (hard codebook indices, inference-only)"
    },
    "mimi": {
        "dead-branch": "transformers' Mimi init zeroes every codebook (init.zeros_(embed_sum): "
        "filled by EMA in training, by checkpoints): every code dequantizes to 0, so the "
        "decoder transformer runs on a zero stream (RMS 0 vs stream 0 measured) and the "
        "argmin quantizer passes it no gradient; the encoder's branches write"
    },
    "xlstm": {
        "dead-branch": "transformers' xLSTM init zeroes every Linear whose name holds 'gate' "
        "(meant for the i/f/o gates), the FFN's proj_up_gate too (std 0 measured): SiLU(0) · "
        "up = 0, so every FFN branch truly writes exactly 0 at init (the mLSTM branches write)"
    },
    "efficientloftr": {
        "init-scale": "transformers' EfficientLoFTR init draws BatchNorm2d gains from N(0, "
        "initializer_range = 0.02), not 1, as MobileViT's: every effective gain truly is ~0 "
        "(worst mean −0.002, std 0.024)"
    },
    "autoformer": {
        "dead-branch": "at this length the context (4 steps) is shorter than moving_average "
        "(25): encoder block 1 reads the decomposition's seasonal part, whose time-mean is "
        "2.7e-8 (RMS 0.93), and its auto-correlation aggregates all 4 lags (top-k = "
        "int(3·ln 4) = 4) with near-uniform weights: the attention output truly is 8.3e-5 "
        "of the stream (its v_proj 0.15); block 0, on the embedding, writes 0.024"
    },
    "blt": {
        "exp-growth": "BltCrossAttention returns o_proj(·) + its input, and BltLocalDecoder "
        "adds that to the stream again (h = h + cross(h), as Meta's BLT code does), with "
        "cross_attn_all_layers: every decoder layer doubles the stream (measured 2.08 → "
        "4.31 → 8.74 → 17.5, γ = 2.04; the cross-attentions' own list 1.14 → 8.81), true "
        "of the architecture; the decoder's final norm takes the scale out"
    },
    "mra": {
        "dead-branch": "without its CUDA kernel transformers' mra2_attention returns zeros: "
        "MRA's attention branch truly writes nothing on CPU"
    },
}


# --------------------------------------------------------------------------- tiny configs

_LAYERS = re.compile(r"(^|_)(num_hidden_layers|n_layers?|num_layers|layers|depth)$")
_HEADS = re.compile(r"(^|_)(num_attention_heads|n_heads?|num_heads|attention_heads)$")
_KV = re.compile(r"(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$")
_HEAD_DIM = re.compile(r"(^|_)(head_dim|attention_head_dim|kv_channels|head_size|d_head)$")
_HIDDEN = re.compile(
    r"^(hidden_size|d_model|n_embd|embed_dim|emb_dim|dim|model_dim|d_embed|hidden_dim)$"
)
_FFN = re.compile(
    r"(intermediate_size|ffn_dim|^d_ff$|^d_inner$|^n_inner$|mlp_dim|ffn_hidden_size|"
    r"^inner_dim$|intermediate_dim)$"
)
_EXPERTS = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")
_TOPK = re.compile(r"^(num_experts_per_tok(en)?|top_k|moe_topk|moe_k|num_selected_experts)$")
_GROUPS = re.compile(r"^(n_group|num_expert_group)$")  # expert groups (DeepSeek-V3 routing)
_TOKEN = re.compile(r"(token_id|token_index|_token)$")


def _shrink_int(key: str, v: int) -> int:
    if _KV.search(key):
        return min(v, KV_HEADS)
    if _HEADS.search(key):
        return min(v, HEADS)
    if _HEAD_DIM.search(key):
        return min(v, HEAD_DIM)
    if _LAYERS.search(key):
        return min(v, LAYERS)
    if _HIDDEN.search(key) or "hidden_size" in key:  # Gemma 4's hidden_size_per_layer_input
        return min(v, HIDDEN)
    if _FFN.search(key):
        return min(v, FFN)
    if _EXPERTS.search(key):
        return min(v, 4)
    if _TOPK.search(key):
        return min(v, 2)
    if _GROUPS.search(key):  # 2 groups of the 4 experts, 1 of them picked: 2 ≥ top-k
        return min(v, 2)
    if key == "topk_group":
        return min(v, 1)
    if key == "num_groups":  # a GroupNorm's groups: within the narrowest shrunk stage
        return min(v, 4)
    if key.endswith("tokens_per_image"):  # pooled from the patch grid: at most its size
        return min(v, (IMAGE // PATCH) ** 2 // 4)
    if key in ("projection_size", "projection_dim", "codebook_dim"):
        return min(v, HIDDEN)
    if "vocab" in key:  # vocab_size_per_layer_input, BLT's encoder_hash_byte_group_vocab
        return min(v, VOCAB)
    if key in ("image_size", "crop_size"):
        return min(v, IMAGE)
    if key == "patch_size":
        return min(v, PATCH)
    return v


def _vocabs(d: dict[str, Any]) -> list[int]:
    found = [v for k, v in d.items() if k == "vocab_size" and isinstance(v, int) and v > 0]
    for v in d.values():
        if isinstance(v, dict):
            found += _vocabs(v)
    return found


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """A tiny version of a config's dict: `_shrink` it, then move every token id (at any
    level: a vision-language model names its image token at the top, its vocabulary in
    `text_config`) beyond the smallest new vocabulary inside it, one distinct id each."""
    out = _shrink(d)
    _same_widths(d, out, _widths(d, out))
    _scale_pinpoints(d, out)
    _feature_layers(d, out)
    _feature_sizes(d, out)
    _hook_ids(d, out)
    vocabs = [v for v in _vocabs(out) if v <= VOCAB]
    if vocabs:
        _move_ids(d, out, min(vocabs), [min(vocabs) - 1])
    return out


# sizes (and conv groups: a depthwise conv's `upsample_groups` = its width) kept equal to a width
_DIMLIKE = re.compile(r"(_dim|_size|_channels|_features|_groups)$")
_NOT_WIDTH = re.compile(
    r"(vocab|codebook|position|window|image|patch|kernel|chunk|length|batch|stride)"
)


def _widths(d: dict[str, Any], out: dict[str, Any]) -> dict[int, int]:
    """Every width of the config and its sub-configs: full size -> shrunk size."""
    found: dict[int, int] = {}
    for key in _ints(d, _HIDDEN) + [k for k in _ints(d, _DIMLIKE) if k.endswith("hidden_size")]:
        if type(out.get(key)) is int and out[key] != d[key]:
            found[d[key]] = out[key]
    for key, v in d.items():
        if isinstance(v, dict) and isinstance(out.get(key), dict):
            found.update(_widths(v, out[key]))
    return found


def _same_widths(d: dict[str, Any], out: dict[str, Any], widths: dict[int, int]) -> None:
    """A size the full config sets equal to a width (of any of its configs: an adapter's
    `adapter_in_dim`/`adapter_out_dim`, a flow head's `condition_dim` = the backbone's
    width) that the name-based caps left alone: given the new width, so the configs'
    equality checks hold (sub-configs recursively)."""
    for key, v in d.items():
        sub = out.get(key)
        if isinstance(v, dict) and isinstance(sub, dict):
            _same_widths(v, sub, widths)
        elif (
            type(v) is int
            and v in widths
            and sub == v
            and _DIMLIKE.search(str(key))
            and not _NOT_WIDTH.search(str(key))
        ):
            out[key] = widths[v]
        elif type(v) is int and str(key).endswith("pos_feats") and sub == v and 2 * v in widths:
            # sine and cosine features per position: half the width they are added to (SAM)
            out[key] = widths[2 * v] // 2


def _image_sides(d: dict[str, Any]) -> list[int]:
    found = [v for k, v in d.items() if k == "image_size" and type(v) is int and v > 0]
    for v in d.values():
        if isinstance(v, dict):
            found += _image_sides(v)
    return found


def _scale_pinpoints(d: dict[str, Any], out: dict[str, Any]) -> None:
    """LLaVA-NeXT's `image_grid_pinpoints` are whole multiples of the vision tower's
    image side: kept so at the shrunk side (336 → 32: [336, 672] → [32, 64])."""
    points = d.get("image_grid_pinpoints")
    sides = [s for s in _image_sides(d) if s > IMAGE]
    if not (isinstance(points, list) and sides):
        return
    side = max(sides)
    out["image_grid_pinpoints"] = [
        [max(1, round(v / side)) * IMAGE for v in p] if isinstance(p, list) else p for p in points
    ]


def _feature_layers(d: dict[str, Any], out: dict[str, Any]) -> None:
    """A vision-language model's `vision_feature_layer(s)` index the vision tower's hidden
    states (depth + 1 of them, negative from the end): kept inside the shrunk tower, those
    that fall outside dropped (the last one kept when none is left)."""
    vision = out.get("vision_config")
    if not isinstance(vision, dict):
        return
    depth = next((v for k, v in vision.items() if _LAYERS.search(k) and type(v) is int), None)
    if not depth:
        return
    states = depth + 1

    def inside(x: int) -> bool:
        return -states <= x < states

    # at the top, or in a sibling of the tower (Molmo 2's adapter_config)
    places = [(d, out)] + [
        (v, out[k])
        for k, v in d.items()
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "vision_config"
    ]
    for full, small in places:
        for key, v in full.items():
            if "feature_layer" not in str(key):
                continue
            if type(v) is int and not inside(v):
                small[key] = -1
            elif isinstance(v, list) and all(type(x) is int for x in v):
                small[key] = [x for x in v if inside(x)] or [-1]


_HOOKS = re.compile(r"(hook_ids|layer_ids)$")


def _hook_ids(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Layer indices a head reads from a sub-config's encoder (DepthPro's
    `intermediate_hook_ids` [11, 5] into a 12-layer ViT): kept at the same place in the
    shrunk depth (11 → 3, 5 → 1 of 4)."""
    depths = [
        (v[k], out[key][k])
        for key, v in d.items()
        if isinstance(v, dict) and isinstance(out.get(key), dict)
        for k in _ints(v, _LAYERS)
        if type(out[key].get(k)) is int and out[key][k] < v[k]
    ]
    for key, v in d.items():
        if not (_HOOKS.search(str(key)) and isinstance(v, list) and v and depths):
            continue
        if not all(type(x) is int and x >= 0 for x in v) or out.get(key) != v:
            continue
        full, new = depths[0]
        if max(v) < full:
            out[key] = [x * new // full for x in v]


def _side_and_patch(d: dict[str, Any]) -> tuple[int, int] | None:
    """The first image side and patch (or patch stride) in a config's tree."""
    side = patch = None
    stack = [d]
    while stack and not (side and patch):
        node = stack.pop(0)
        for key, v in node.items():
            first = v[0] if isinstance(v, list) and v and type(v[0]) is int else v
            if key == "image_size" and type(first) is int and not side:
                side = first
            elif key in ("patch_size", "patch_stride") and type(first) is int and not patch:
                patch = first
            elif isinstance(v, dict):
                stack.append(v)
    return (side, patch) if side and patch else None


def _feature_sizes(d: dict[str, Any], out: dict[str, Any]) -> None:
    """SAM 2/3's `backbone_feature_sizes`, each level's [h, w] grid: a multiple of the
    patch grid (side / patch), kept that multiple of the shrunk grid (sub-configs too)."""
    for key, v in d.items():
        if isinstance(v, dict) and isinstance(out.get(key), dict):
            _feature_sizes(v, out[key])
    sizes = d.get("backbone_feature_sizes")
    full, small = _side_and_patch(d), _side_and_patch(out)
    kept = out.get("backbone_feature_sizes") == sizes
    if not (full and small and isinstance(sizes, list) and kept):
        return
    old_grid, new_grid = full[0] // full[1], small[0] // small[1]
    if old_grid and new_grid and old_grid != new_grid:
        out["backbone_feature_sizes"] = [
            [max(1, x * new_grid // old_grid) for x in level] if isinstance(level, list) else level
            for level in sizes
        ]


def _move_ids(d: dict[str, Any], out: dict[str, Any], vocab: int, top: list[int]) -> None:
    for key, v in d.items():
        if isinstance(v, dict) and isinstance(out.get(key), dict):
            _move_ids(v, out[key], vocab, top)
        elif (
            _TOKEN.search(str(key))
            and isinstance(v, int)
            and not isinstance(v, bool)
            and v >= vocab
        ):
            out[key] = top[0]
            top[0] -= 1


def _ints(d: dict[str, Any], pattern: re.Pattern[str]) -> list[str]:
    return [k for k, v in d.items() if isinstance(k, str) and pattern.search(k) and type(v) is int]


def _keep_relations(d: dict[str, Any], out: dict[str, Any]) -> None:
    """The relations between sizes that configs validate, kept from the full-size config:
    query heads per key/value head (MLA: one each), heads × head_dim as a multiple of the
    width (Mamba-2: expand × hidden), a rotary dim within the head dim."""
    heads = next((k for k in _ints(d, _HEADS) if not _KV.search(k)), None)
    hidden = next(iter(_ints(d, _HIDDEN)), None)
    head_dim = next(iter(_ints(d, _HEAD_DIM)), None)
    if heads:
        for kv in _ints(d, _KV):
            if d[kv] and d[heads] % d[kv] == 0:
                out[kv] = max(1, out[heads] // (d[heads] // d[kv]))
    pairs = _head_pairs(d)
    if not pairs and heads and head_dim:
        pairs = [(heads, head_dim)]
    for h, hd in pairs if hidden else []:
        product = d[h] * d[hd]  # 0 where a head dim is unused (GLM-5's MLA head_dim 0)
        if product and out[hd] and product % d[hidden] == 0 and product != d[hidden]:
            out[h] = max(1, product // d[hidden] * out[hidden] // out[hd])
    _inner_widths(d, out, pairs)
    _wide_widths(d, out, hidden)
    _fill_unset(d, out, heads)
    experts = next(iter(_ints(d, _EXPERTS)), None)
    for key, v in d.items():  # a top-k the config leaves None beside experts: 2 of them
        if v is None and _TOPK.search(str(key)) and key in out and experts:
            out[key] = 2
    # the attention head dim the config leaves to the model (None): derived. A prefixed
    # one left None (Qwen4-Exp's indexer_head_dim) is a feature left off: stays None
    for key, v in d.items():
        if v is None and _HEAD_DIM.match(str(key)) and key in out and heads and hidden:
            out[key] = out[hidden] // out[heads]
    # MLA: a head dim the full config makes the sum of its no-rope and rope parts stays so
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    if all(type(d.get(p)) is int for p in ("head_dim", *parts)) and d["head_dim"] == sum(
        d[p] for p in parts
    ):
        out["head_dim"] = sum(out[p] for p in parts)
    per_head = out[head_dim] if head_dim else None
    if per_head is None and heads and hidden:
        per_head = out[hidden] // out[heads]
    for key in ("rotary_dim", "rotary_emb_dim"):
        if type(d.get(key)) is int and per_head:
            out[key] = min(out[key], per_head)


# Fields a default config leaves None that its model needs (real checkpoints set them):
# the value a tiny model takes. Key/value heads left None are the query heads (MHA).
UNSET: dict[str, int] = {"vocab_size": VOCAB, "prediction_length": 4}


def _fill_unset(d: dict[str, Any], out: dict[str, Any], heads: str | None) -> None:
    for key, v in d.items():
        if v is not None or key not in out:
            continue
        if key in UNSET:
            out[key] = UNSET[key]
        elif _KV.search(str(key)) and heads:
            out[key] = out[heads]


def _head_pairs(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(heads, head dim) keys named with the same prefix: `num_attention_heads`/`head_dim`,
    Bamba's `mamba_n_heads`/`mamba_d_head` (whose product is expand × hidden)."""
    pairs = []
    for hd in _ints(d, _HEAD_DIM):
        match = _HEAD_DIM.search(hd)
        prefix = hd[: match.start(2)] if match else ""
        for h in _ints(d, _HEADS):
            if not _KV.search(h) and h.startswith(prefix) and _HEADS.fullmatch(h[len(prefix) :]):
                pairs.append((h, hd))
                break
    return pairs


_INNER = re.compile(r"(_d_|_dim$|_size$)")
_WIDTH_NAMED = re.compile(r"(attn|attention)_hidden_size$")


def _wide_widths(d: dict[str, Any], out: dict[str, Any], hidden: str | None) -> None:
    """An attention width named as a width (Zamba's attention_hidden_size = 2 × hidden_size, its
    attention reading the stream concatenated with the embeddings) stays that multiple."""
    if not hidden or not d[hidden]:
        return
    for key in _ints(d, _WIDTH_NAMED):
        ratio, rest = divmod(d[key], d[hidden])
        if key != hidden and not rest and 2 <= ratio <= 8:
            out[key] = out[hidden] * ratio


def _inner_widths(d: dict[str, Any], out: dict[str, Any], pairs: list[tuple[str, str]]) -> None:
    """An inner width named with a (heads, head dim) pair's prefix that the full config
    sets to their product (Falcon-H1's `mamba_d_ssm` = `mamba_n_heads` × `mamba_d_head`):
    the product of the shrunk pair. Unprefixed pairs are left out (a plain product of
    attention heads matches too many unrelated fields, max_position_embeddings among them)."""
    for h, hd in pairs:
        match = _HEAD_DIM.search(hd)
        prefix = hd[: match.start(2)] if match else ""
        if not prefix:
            continue
        for key in _ints(d, _INNER):  # a width by its name (not Ax-K2's index_topk)
            if not key.startswith(prefix) or key in (h, hd):
                continue
            if d[key] and d[key] == d[h] * d[hd]:
                out[key] = out[h] * out[hd]


def _per_layer_values(v: Any, depth: int) -> bool:
    """A list of one number per layer (`depth` > LAYERS, so no stage list of 4)."""
    return (
        isinstance(v, list)
        and len(v) == depth
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
    )


def _every_kind(v: list[Any], new: int) -> list[Any]:
    """A per-layer list cut to the new depth, keeping every kind of layer the full list
    has (a hybrid's few attention layers among linear ones): a kind the cut lost takes
    the last place not holding another kind that appears once."""
    out = list(v[:new])
    missing = [k for k in dict.fromkeys(x for x in v if isinstance(x, str)) if k not in out]
    place = new - 1
    for kind in missing:
        while place > 0 and out.count(out[place]) == 1:
            place -= 1
        if place <= 0:
            break
        out[place] = kind
        place -= 1
    return out


def _period_offsets(d: dict[str, Any], out: dict[str, Any], new: int) -> None:
    """Jamba's `attn_layer_period`/`attn_layer_offset` (layer i is attention when
    i % period == offset): the period within the new depth, the offset inside it."""
    for key, period in d.items():
        if not (str(key).endswith("_period") and type(period) is int and period > new):
            continue
        offset_key = str(key)[: -len("period")] + "offset"
        offset = d.get(offset_key)
        out[key] = new
        if type(offset) is int:
            out[offset_key] = min(offset, new - 1)


def _layer_groups(d: dict[str, Any], out: dict[str, Any], depth_from: int, new: int) -> None:
    """Layer counts that add up to the depth (Dory's input, recurrent and output layers,
    16 + 40 + 16 = 72): shared out over the new depth in proportion, at least one each."""
    keys = [k for k in _ints(d, _LAYERS) if d[k] != depth_from and d[k] > 0]
    if len(keys) < 2 or len(keys) > new or sum(d[k] for k in keys) != depth_from:
        return
    shares = {k: max(1, d[k] * new // depth_from) for k in keys}
    by_size = sorted(keys, key=lambda k: -d[k])
    i = 0
    while sum(shares.values()) != new:
        key = by_size[i % len(by_size)]
        if sum(shares.values()) < new:
            shares[key] += 1
        elif shares[key] > 1:
            shares[key] -= 1
        i += 1
    out.update(shares)


def _run_lengths(v: Any, depth_from: int, new: int) -> Any:
    """GPT-Neo's `attention_types`, [[pattern, repeats], ...] covering every layer: one
    pattern repeated over the new depth."""
    if not (isinstance(v, list) and v and all(isinstance(x, list) and len(x) == 2 for x in v)):
        return v
    if sum(len(p) * n for p, n in v if isinstance(p, list) and type(n) is int) != depth_from:
        return v
    pattern = v[0][0]
    return [[pattern, max(1, new // len(pattern))]]


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """Size-like ints capped, per-layer lists cut to the new depth, layer indices kept
    below it (sub-configs recursively)."""
    out: dict[str, Any] = {}
    depth_from: int | None = None
    for key, v in d.items():
        configish = isinstance(v, dict) and "model_type" in v  # EncoderDecoder's `encoder`
        if configish or (
            isinstance(v, dict) and str(key).endswith(("config", "rope_parameters", "rope_scaling"))
        ):
            out[key] = _shrink(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            out[key] = _shrink_int(key, v)
            if _LAYERS.search(key) and out[key] != v and depth_from is None:
                depth_from = v
        elif key == "image_size" and isinstance(v, list) and all(isinstance(x, int) for x in v):
            out[key] = [min(x, IMAGE) for x in v]
        elif key == "hidden_sizes" and isinstance(v, list) and all(isinstance(x, int) for x in v):
            # by rank among its distinct sizes: stages of one width stay one width
            ranks = sorted(set(v))
            out[key] = [min(x, 16 * 2 ** ranks.index(x)) for x in v]
        elif key == "mrope_section" and isinstance(v, list) and sum(v) > HEAD_DIM // 2:
            # M-RoPE splits half the head dim in sections: kept in proportion
            out[key] = [max(1, x * (HEAD_DIM // 2) // sum(v)) for x in v]
            out[key][0] += HEAD_DIM // 2 - sum(out[key])
        elif key == "depths" and isinstance(v, list) and all(isinstance(x, int) for x in v):
            out[key] = [min(x, 2) for x in v]
        elif (
            _HEADS.search(str(key))
            and isinstance(v, list)
            and v
            and all(type(x) is int and x > 0 for x in v)
        ):
            # per-stage heads (Swin's [3, 6, 12, 24], PVT's [1, 2, 5, 8]) over the shrunk
            # power-of-two stage widths: each the largest power of two within it, so
            # every stage's width divides by its heads
            out[key] = [1 << (x.bit_length() - 1) for x in v]
        else:
            out[key] = v
    if depth_from is not None:
        new = next(out[k] for k in out if _LAYERS.search(k) and d[k] == depth_from)
        _period_offsets(d, out, new)
        _layer_groups(d, out, depth_from, new)
        for key, v in d.items():
            if key == "attention_types":
                out[key] = _run_lengths(v, depth_from, new)
            elif isinstance(v, list) and len(v) == depth_from and "layer" in key:
                out[key] = _every_kind(v, new)
            elif _per_layer_values(v, depth_from):
                # one value per layer under a field's own name (Gemma 3n's intermediate_size
                # and activation_sparsity_pattern): cut to the new depth, sizes capped
                kept = out[key][:new]  # as the first pass shrank it (Swin2SR's depths)
                out[key] = [_shrink_int(key, x) if type(x) is int else x for x in kept]
            elif isinstance(v, str) and len(v) == depth_from and "layer" in key:
                out[key] = v[:new]
            elif (
                isinstance(v, list)
                and v
                and "layer" in key
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and max(v) < depth_from
                and len(v) < depth_from
            ):
                kept = [x for x in v if x < new]
                out[key] = kept or [new - 1]
    _keep_relations(d, out)
    _stage_channels(d, out)
    _backbone_channels(d, out)
    _out_stages(d, out, depth_from)
    if isinstance(d.get("per_layer_config"), dict):
        out["per_layer_config"] = _per_layer_config(d, out, depth_from)
    return out


_CHANNEL_LISTS = re.compile(r"(channels|features|dims|dim_per_stage)$")


def _stage_channels(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Per-stage channel lists that end at (hold) the width (EfficientLoFTR's
    `out_features` [64, 64, 128, 256] with hidden_size 256, its nested per-block channel
    lists): divided by the factor the width was, so the last stage is the new width. Only
    multiples of the factor are divided (3 RGB or 1 grey input channels stay)."""
    hidden = next(iter(_ints(d, _HIDDEN)), None)
    if not hidden or not (0 < out[hidden] < d[hidden]):
        return
    full, small = d[hidden], out[hidden]

    def flat(v: Any) -> list[Any]:
        return [y for x in v for y in flat(x)] if isinstance(v, list) else [v]

    def scale(v: Any) -> Any:
        if isinstance(v, list):
            return [scale(x) for x in v]
        return v * small // full if type(v) is int and v * small % full == 0 else v

    for key, v in d.items():
        if not (isinstance(v, list) and _CHANNEL_LISTS.search(str(key))):
            continue
        values = flat(v)
        if not (all(type(x) is int for x in values) and full in values):
            continue
        # a width not a whole multiple of the new one (Hiera's 96 -> 64): only where
        # every stage scales to a whole number
        if full % small == 0 or all(x * small % full == 0 for x in values):
            out[key] = scale(v)


def _channel_factor(d: dict[str, Any], out: dict[str, Any]) -> int | None:
    """The one factor a stage-width list (`hidden_sizes`) was divided by, if one."""
    full, small = d.get("hidden_sizes"), out.get("hidden_sizes")
    if not (isinstance(full, list) and isinstance(small, list) and full != small):
        return None
    pairs = list(zip(full, small, strict=True))  # the shrink caps it element by element
    if not all(type(a) is int and type(b) is int and b and a % b == 0 for a, b in pairs):
        return None
    ratios = {a // b for a, b in pairs}
    return ratios.pop() if len(ratios) == 1 else None


def _scale_channels(v: Any, factor: int) -> Any:
    if isinstance(v, list):
        return [_scale_channels(x, factor) for x in v]
    return v // factor if type(v) is int and v % factor == 0 else v


_FEAT_WIDTH = re.compile(r"feat.*(_dim|_channels)$")


def _backbone_channels(d: dict[str, Any], out: dict[str, Any]) -> None:
    """A CNN's other channel fields (HGNetV2's `stage_in/mid/out_channels`, TextNet's
    `stem_out_channels` = its first stage width) divided by the factor its `hidden_sizes`
    were, so stage i's output still feeds stage i+1; and a neck's input channel lists
    that mirror a sub-config backbone's output channels (RT-DETR-like
    `encoder_in_channels`) mapped as the backbone's were."""
    factor = _channel_factor(d, out)
    if factor:
        for key, v in d.items():
            if key != "num_channels" and str(key).endswith("channels") and key in out:
                out[key] = _scale_channels(v, factor)
    mapped: dict[int, int] = {}
    for key, v in d.items():
        sub = out.get(key)
        if not (isinstance(v, dict) and isinstance(sub, dict) and str(key).startswith("backbone")):
            continue
        for name, full in v.items():
            small = sub.get(name)
            if not (name == "hidden_sizes" or _CHANNEL_LISTS.search(str(name))):
                continue
            if isinstance(full, list) and isinstance(small, list) and len(full) == len(small):
                pairs = zip(full, small, strict=True)
                mapped.update((a, b) for a, b in pairs if type(a) is int and a != b)
    for key, v in d.items():
        if (
            str(key).endswith(("in_channels", "channel_list"))
            and isinstance(v, list)
            and v
            and out.get(key) == v  # not already a width the rules above shrank
            and all(type(x) is int and x in mapped for x in v)
        ):
            out[key] = [mapped[x] for x in v]
        elif _FEAT_WIDTH.search(str(key)) and type(v) is int and v in mapped and out.get(key) == v:
            out[key] = mapped[v]  # one stage's width read by the head (PP-DocLayoutV3's x4)


def _out_stages(d: dict[str, Any], out: dict[str, Any], depth_from: int | None) -> None:
    """A backbone's `out_indices` over stages named by layer (a ViT backbone's
    `stage1..stage12`): where the cut depth drops some, the last as many stages as it
    had (at least stage 1), `out_features` re-derived from them."""
    v = out.get("out_indices")
    if depth_from is None or not (isinstance(v, list) and v and all(type(x) is int for x in v)):
        return
    new = next(out[k] for k in out if _LAYERS.search(k) and d[k] == depth_from)
    if all(0 <= x <= new for x in v):
        return
    count = min(len(v), new)
    out["out_indices"] = list(range(new - count + 1, new + 1))
    if "out_features" in out:
        out["out_features"] = None
    if isinstance(d.get("stage_names"), list):
        out["stage_names"] = d["stage_names"][: new + 1]


def _per_layer_config(d: dict[str, Any], out: dict[str, Any], depth_from: int | None) -> Any:
    """transformers 5's heterogeneous configs (`per_layer_config`: layer index -> the fields
    that layer overrides, Gemma 4's wider full-attention heads): each new layer takes the
    overrides of an old layer of its kind (`layer_types`, as cut by `_every_kind`), shrunk
    as the whole config is (the global fields beside them, for the relations kept)."""
    overrides = {int(k): v for k, v in d["per_layer_config"].items() if isinstance(v, dict)}
    old_kinds, new_kinds = d.get("layer_types"), out.get("layer_types")
    depth = depth_from or len(old_kinds or ()) or (max(overrides, default=-1) + 1)
    new = len(new_kinds) if isinstance(new_kinds, list) else min(depth, LAYERS)
    glob = {k: v for k, v in d.items() if k != "per_layer_config"}
    result: dict[str, dict[str, Any]] = {}
    for i in range(new):
        source = i
        if isinstance(old_kinds, list) and isinstance(new_kinds, list) and len(old_kinds) == depth:
            kind = new_kinds[i]
            if old_kinds[i] != kind and kind in old_kinds:
                source = len(old_kinds) - 1 - old_kinds[::-1].index(kind)
        if source in overrides:
            shrunk = _shrink({**glob, **overrides[source]})
            # the override's own fields, and any a relation re-derived (an MLA head dim)
            moved = {
                k
                for k, v in shrunk.items()
                if _HEAD_DIM.search(k) and type(v) is int and v != out.get(k, v)
            }
            result[str(i)] = {k: shrunk[k] for k in set(overrides[source]) | moved}
            _keep_apart(result[str(i)], overrides[source], glob, out)
    return result


def _keep_apart(
    layer: dict[str, Any], full: dict[str, Any], glob: dict[str, Any], out: Any
) -> None:
    """An override the caps made equal to the global value (Gemma 4's 512-wide heads and
    the 256 of the others both capped at 16) would vanish: one that is a whole multiple or
    divisor of the global value keeps that ratio to the shrunk global value instead."""
    for key, o in full.items():
        g, small = glob.get(key), out.get(key)
        if not (type(o) is int and type(g) is int and type(small) is int and 0 < o != g):
            continue
        if layer.get(key) != small:
            continue
        if o % g == 0:
            layer[key] = small * (o // g)
        elif g % o == 0:
            layer[key] = max(1, small // (g // o))


# --------------------------------------------------------------------------- enumeration


def model_types() -> dict[str, str]:
    """model type -> the class the matrix builds (the first head of HEADS_ORDER with one)."""
    from transformers.models.auto import modeling_auto

    chosen: dict[str, str] = {}
    for mapping in reversed(HEADS_ORDER):
        for mt, cls in getattr(modeling_auto, mapping).items():
            if isinstance(cls, tuple | list):
                cls = cls[0]
            chosen[mt] = cls
    return dict(sorted(chosen.items()))


def tiny_config(model_type: str) -> Any:
    import transformers

    try:
        base = transformers.AutoConfig.for_model(model_type)
    except Exception:
        if model_type not in DEFAULT_FIXES:
            raise
        base = transformers.AutoConfig.for_model(model_type, **DEFAULT_FIXES[model_type])
    data = _declared(base, shrink(base.to_dict()))
    _merge(data, OVERRIDES.get(model_type, {}))
    _set_mrope(data, model_type)
    data.pop("model_type", None)
    return type(base).from_dict(data)


def _merge(data: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value


def _set_mrope(data: dict[str, Any], model_type: str | None) -> None:
    sections = MROPE.get(model_type or "")
    rope = data.get("rope_parameters")
    if sections and isinstance(rope, dict):
        data["rope_parameters"] = {**rope, "mrope_section": sections}
    for value in data.values():
        if isinstance(value, dict) and "model_type" in value:
            _set_mrope(value, value["model_type"])


def _fields(config: Any) -> set[str] | None:
    import dataclasses
    import inspect

    cls = type(config)
    if dataclasses.is_dataclass(cls):
        # and the names `attribute_map` stores fields under (Inkling's vision n_layers)
        aliases = getattr(cls, "attribute_map", None) or {}
        names = {f.name for f in dataclasses.fields(cls)} | set(aliases.values())
        # a private field read through its property, which the dict names publicly (a
        # backbone's `_out_indices` as `out_indices`): dropped, the backbone would fall
        # back to its last stage alone and leave its neck's other inputs missing
        exposed = {
            n[1:]
            for n in names
            if n.startswith("_") and isinstance(getattr(cls, n[1:], None), property)
        }
        return names | exposed
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and len(params) <= 3:
        return None  # no declared fields to go by
    return set(params) - {"self", "kwargs"}


def _global_attr(config: Any, key: str) -> Any:
    """`getattr` that reads a heterogeneous config's global value of a per-layer field
    (plain getattr raises AmbiguousGlobalPerLayerAttributeError there)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if callable(read):
        return read(key, None)
    return getattr(config, key, None)


def _declared(config: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Only the fields a config declares (at every level): what its __init__ derives from
    them (DeepSeek's qk_head_dim, a default head_dim) is derived again from the shrunk
    values instead of kept at its full-size value."""
    names = _fields(config)
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = _global_attr(config, key) if isinstance(key, str) else None
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            value = {**_declared(sub, value), "model_type": getattr(sub, "model_type", None)}
            value = {k: v for k, v in value.items() if v is not None or k != "model_type"}
        if names is None or key in names or isinstance(value, dict):
            out[key] = value
    return out


def _config_of(cls: Any, config: Any) -> Any:
    """The config `cls` is defined over: a head the mappings list for a multimodal type but
    built on one of its sub-configs (Emu3ForCausalLM on Emu3TextConfig, MusicGen's
    decoder) gets that sub-config, as `from_pretrained` would give it."""
    want = getattr(cls, "config_class", None)
    if not isinstance(want, type) or isinstance(config, want):
        return config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, want):
            return sub
    return config


def build(model_type: str, cls_name: str) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, cls_name, None)
    if cls is None:  # the auto mapping names a class this version does not define
        raise LookupError(
            f"transformers {transformers.__version__} maps {model_type} to {cls_name}, "
            "which it does not define"
        )
    config = _config_of(cls, tiny_config(model_type))
    with contextlib.suppress(AttributeError, TypeError):
        config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config)


# --------------------------------------------------------------------------- one row


@dataclass
class Row:
    model_type: str
    cls: str
    status: str  # clean | loud | refused | model-error | crash | no-build | needs-package | slow
    exit: int | None = None
    seconds: float = 0.0
    params: int = 0
    inputs: str = ""
    loss: str = ""
    layout: str = ""
    findings: list[str] = field(default_factory=list)
    reason: str = ""
    # warn/error findings that fired but are argued true (ARGUED): shown, not hidden
    argued: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.status == "clean"


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """A hang guard (SIGALRM in the main thread; none elsewhere)."""

    def fire(signum: int, frame: Any) -> None:
        raise _Timeout(f"over {seconds:.0f} s")

    try:
        old = signal.signal(signal.SIGALRM, fire)
    except ValueError:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _line(err: BaseException) -> str:
    """The error's first non-empty line (transformers' ImportErrors start with a newline)."""
    lines = [line for line in f"{type(err).__name__}: {err}".splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines[0] = f"{lines[0]} {lines[1].strip()}"
    return lines[0][:200]


_REQUIRES = re.compile(r"requires the (\S+) library")


def _missing_package(err: ImportError) -> str | None:
    """The optional package a class needs and this environment lacks (transformers'
    requires_backends: timm, torchvision, natten, detectron2, ...), as one line."""
    found = _REQUIRES.findall(str(err)) or ([err.name] if err.name else [])
    return f"needs {', '.join(dict.fromkeys(found))} (not installed here)" if found else None


def _layout(report: Any) -> str:
    proofs = list(report.layout)
    if not proofs:
        note = next((n for n in report.notes if "block" in n or "stream" in n), "")
        return f"no blocks ({note[:100]})" if note else "no blocks"
    # blocks the forward never called have nothing to prove (BlockProof.ran): counted apart
    idle = sum(not getattr(p, "ran", True) for p in proofs)
    # blocks run past module hooks (block.forward(...)): a reason the report gives itself
    hidden = sum(getattr(p, "bypassed", False) for p in proofs)
    ran = [p for p in proofs if getattr(p, "ran", True) and not getattr(p, "bypassed", False)]
    tail = (f"; {idle} did not run" if idle else "") + (
        f"; {hidden} bypass module hooks" if hidden else ""
    )
    bad = [p for p in ran if p.status != "verified"]
    if not ran and hidden:  # the report's own reason: counts as given, not as verified
        return f"reason given ({tail.removeprefix('; ')})"
    if not bad:
        return f"verified ({len(ran)}{tail})"
    return f"{len(ran) - len(bad)}/{len(ran)} verified{tail}"


def run_one(model_type: str, cls_name: str) -> Row:
    """Build one type tiny and scan it; never raises."""
    from actscan import scan
    from actscan.errors import ActscanError
    from actscan.measure.prepare import model_error_line
    from actscan.records import Severity

    row = Row(model_type, cls_name, "no-build")
    try:  # importing the class's module is no part of the budget (the first row of a
        # process imports transformers' modeling machinery: seconds, ×4 under load)
        import transformers

        getattr(transformers, cls_name)
    except Exception:
        pass  # build() meets the same error and reports it
    t0 = time.perf_counter()
    try:
        with (
            _deadline(BUILD_BUDGET_S),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            model = build(model_type, cls_name)
    except _Timeout as err:
        row.status, row.reason = "slow", f"build {err}"
        row.seconds = time.perf_counter() - t0
        return row
    except Exception as err:
        missing = _missing_package(err) if isinstance(err, ImportError) else None
        row.status = "needs-package" if missing else row.status
        row.reason = missing or _line(err)
        row.seconds = time.perf_counter() - t0
        return row
    row.params = sum(p.numel() for p in model.parameters())
    try:
        with (
            _deadline(SCAN_BUDGET_S),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            report = scan(model, batch=2, seq_len=16)
    except _Timeout as err:
        row.status, row.reason = "slow", f"scan {err}"
    except ActscanError as err:
        row.status, row.exit, row.reason = "refused", 2, _line(err)
    except Exception as err:
        line = model_error_line(err)  # the CLI's exit 2: the model raised on its inputs
        if line is not None:
            row.status, row.exit, row.reason = "model-error", 2, line[:200]
        else:
            row.status, row.exit, row.reason = "crash", 3, _line(err)
    else:
        argued = ARGUED.get(model_type, {})
        loud = [
            f
            for f in report.findings
            if f.severity is not Severity.INFO and str(f.check) not in argued
        ]
        row.findings = [f"{f.severity} {f.check}: {f.message[:140]}" for f in loud]
        row.argued = sorted(
            {
                f"{f.check}: {argued[str(f.check)]}"
                for f in report.findings
                if f.severity is not Severity.INFO and str(f.check) in argued
            }
        )
        row.exit = 1 if loud else 0
        row.inputs = report.run.inputs or ""
        row.loss = getattr(report.run, "loss", "") or ""
        row.layout = _layout(report)
        layout_ok = row.layout.startswith(("verified", "reason given")) or "layout" in argued
        row.status = "clean" if not loud and layout_ok else "loud"
    row.seconds = time.perf_counter() - t0
    return row


# --------------------------------------------------------------------------- the document


UNBUILT = ("no-build", "needs-package")  # rows never scanned: counted apart from the tried


def markdown(rows: list[Row]) -> str:
    tried = [r for r in rows if r.status not in UNBUILT]
    needs = [r for r in rows if r.status == "needs-package"]
    packages: dict[str, int] = {}
    for r in needs:
        name = r.reason.removeprefix("needs ").split(" (")[0]
        packages[name] = packages.get(name, 0) + 1
    clean = [r for r in tried if r.clean]
    argued = [r for r in clean if r.argued]
    by: dict[str, int] = {}
    for r in tried:
        by[r.status] = by.get(r.status, 0) + 1
    lines = [
        "# Model families",
        "",
        "Every model type this version of transformers lists in its auto mappings, built",
        "tiny on CPU with the library's own init (no download) and scanned with",
        "`actscan.scan(model, batch=2, seq_len=16)`. Regenerate with",
        "`python benchmarks/families.py --write-docs`; `tests/test_breadth_matrix.py` holds",
        "the same rows in the suite.",
        "",
        f"**{len(clean)} of {len(tried)} types clean** "
        f"({100 * len(clean) / max(1, len(tried)):.1f} %): "
        + ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
        + f"; {len(rows) - len(tried) - len(needs)} more types do not build from a generically "
        f"shrunk config, and {len(needs)} need an optional package not installed here ("
        + ", ".join(f"{p}: {n}" for p, n in sorted(packages.items()))
        + f") (both listed at the end). {len(argued)} of the clean types do get a warn/error "
        "finding that is argued true of the library's own init (the *argued* rows, each "
        "with its measured reason).",
        "",
        "Status: *clean* — no warn/error finding and every block's layout verified (or a",
        "reason given); *loud* — a warn/error finding or an unverified layout; *refused* —",
        "exit 2 with a reason; *model-error* — the model raised on the inputs actscan built (exit",
        "2, its first line); *crash* — an unexpected error (exit 3); *slow* — over the",
        "time budget.",
        "",
        "| type | class | status | s | inputs | layout | findings / reason |",
        "|---|---|---|---:|---|---|---|",
    ]
    for r in tried:
        why = "; ".join(r.findings) or r.reason or "; ".join(f"argued {a}" for a in r.argued)
        why = why.replace("|", "\\|").replace("\n", " ")[:220]
        lines.append(
            f"| {r.model_type} | {r.cls} | {r.status} | {r.seconds:.1f} | {r.inputs} | "
            f"{r.layout} | {why} |"
        )
    for title, status in (
        ("Types that do not build tiny", "no-build"),
        ("Types that need an optional package", "needs-package"),
    ):
        lines += ["", f"## {title}", "", "| type | class | reason |", "|---|---|---|"]
        for r in rows:
            if r.status == status:
                lines.append(f"| {r.model_type} | {r.cls} | {r.reason.replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def cause(row: Row) -> str:
    """One line: why a row is not clean (its status, then the first finding or reason)."""
    first = row.findings[0] if row.findings else row.reason or f"layout {row.layout}"
    return f"{row.status}: {first[:150]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--write-docs", action="store_true", help="write docs/families.md")
    parser.add_argument(
        "--baseline", action="store_true", help="write tests/breadth_baseline.json (non-clean)"
    )
    parser.add_argument("--from-json", type=Path, default=None, help="rows of an earlier run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    types = model_types()
    if args.only:
        wanted = set(args.only.split(","))
        types = {k: v for k, v in types.items() if k in wanted}
    rows: list[Row] = []
    if args.from_json:
        rows = [Row(**r) for r in json.loads(args.from_json.read_text())]
        types = {}
    for mt, cls in types.items():
        row = run_one(mt, cls)
        rows.append(row)
        print(
            f"{mt:32s} {row.status:8s} {row.seconds:6.1f}s {row.layout:18s} "
            f"{(row.findings[:1] or [row.reason])[0][:120]}",
            flush=True,
        )
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    tried = [r for r in rows if r.status not in UNBUILT]
    clean = sum(r.clean for r in tried)
    needs = sum(r.status == "needs-package" for r in rows)
    print(
        f"{clean}/{len(tried)} clean, {len(rows) - len(tried) - needs} not built, "
        f"{needs} need a package",
        flush=True,
    )
    if args.write_docs:
        (ROOT / "docs" / "families.md").write_text(markdown(rows))
    if args.baseline:
        known = {r.model_type: cause(r) for r in rows if not r.clean}
        path = ROOT / "tests" / "breadth_baseline.json"
        path.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
