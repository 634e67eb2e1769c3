"""The breadth matrix: every model type this transformers can build on CPU, scanned.

Enumerates transformers' auto mappings (one class per model type: the language-model or
vision-language head a user would point actscan at, else the bare model), derives a tiny
config from each type's default config by shrinking every size-like field (`shrink`),
builds it with the library's own init (no download, no remote code) and runs
`actscan.scan` on it. Each type gets a row: status, seconds, the exit code the CLI would
give (0 quiet, 1 a warn/error finding, 2 refused with a reason, 3 a crash), the loud
findings and the layout proof.

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
OVERRIDES: dict[str, dict[str, Any]] = {
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
    # VibeVoice's acoustic tokenizer doubles `num_filters` (32) over 6 stages: 2 048
    # channels and 130 M parameters at the generic shrink; 4 filters give 256
    # the Nemotron-H text model's Mamba heads (4) must be a multiple of its groups (8)
    "nemo_speechlm": {"text_config": {"n_groups": 4}},
    "vibevoice_acoustic_tokenizer_encoder": {"num_filters": 4},
    "vibevoice_acoustic_tokenizer_decoder": {"num_filters": 4},
}
# M-RoPE text models whose modeling code falls back to sections for a 128-wide head when
# the config names none: sections for the tiny head (they sum to HEAD_DIM/2).
MROPE: dict[str, list[int]] = {
    "qwen2_vl_text": [2, 3, 3],
    "qwen2_5_vl_text": [2, 3, 3],
    "glm4v_text": [2, 3, 3],
    "glm4v_moe_text": [2, 3, 3],
    "glm_ocr_text": [2, 3, 3],
    "glm_image_text": [2, 3, 3],
    "paddleocr_vl_text": [2, 3, 3],
}

# Findings argued true on a type's healthy tiny init (check id -> why), or a reason a
# type is not expected to verify its layout. Each argument is a measured fact of the
# library's own init, not a family's name: the check is right there.
_SAM_INIT = (
    "SAM's vision config defaults initializer_range to 1e-10 (its weights are meant to be "
    "loaded): every vision weight is ~1e-10 at init, so its branches truly write ~1e-17 "
    "of the stream"
)
ARGUED: dict[str, dict[str, str]] = {
    "sam_vision_model": {"dead-branch": _SAM_INIT},
    "sam_hq_vision_model": {"dead-branch": _SAM_INIT},
    "got_ocr2": {"dead-branch": _SAM_INIT + " (GOT-OCR2's SAM vision tower)"},
    "pp_chart2table": {"dead-branch": _SAM_INIT + " (GOT-OCR2's SAM vision tower)"},
    "blip": {"dead-branch": "BlipVisionConfig defaults initializer_range to 1e-10, as SAM's"},
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
_HIDDEN = re.compile(r"^(hidden_size|d_model|n_embd|embed_dim|dim|model_dim|d_embed|hidden_dim)$")
_FFN = re.compile(
    r"(intermediate_size|ffn_dim|^d_ff$|^d_inner$|^n_inner$|mlp_dim|ffn_hidden_size|"
    r"^inner_dim$|intermediate_dim)$"
)
_EXPERTS = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")
_TOPK = re.compile(r"^(num_experts_per_tok|top_k|moe_topk|moe_k|num_selected_experts)$")
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
    if _HIDDEN.search(key) or key.endswith("hidden_size"):
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
    if key.endswith("tokens_per_image"):  # pooled from the patch grid: at most its size
        return min(v, (IMAGE // PATCH) ** 2 // 4)
    if key in ("projection_size", "projection_dim", "codebook_dim"):
        return min(v, HIDDEN)
    if key == "vocab_size":
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
    _scale_pinpoints(d, out)
    _feature_layers(d, out)
    vocabs = [v for v in _vocabs(out) if v <= VOCAB]
    if vocabs:
        _move_ids(d, out, min(vocabs), [min(vocabs) - 1])
    return out


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

    for key, v in d.items():
        if "feature_layer" not in str(key):
            continue
        if type(v) is int and not inside(v):
            out[key] = -1
        elif isinstance(v, list) and all(type(x) is int for x in v):
            out[key] = [x for x in v if inside(x)] or [-1]


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
        product = d[h] * d[hd]
        if product % d[hidden] == 0 and product != d[hidden]:
            out[h] = max(1, product // d[hidden] * out[hidden] // out[hd])
    experts = next(iter(_ints(d, _EXPERTS)), None)
    for key, v in d.items():  # a top-k the config leaves None beside experts: 2 of them
        if v is None and _TOPK.search(str(key)) and key in out and experts:
            out[key] = 2
    for key, v in d.items():  # a head dim the config leaves to the model (None): derived
        if v is None and _HEAD_DIM.search(str(key)) and key in out and heads and hidden:
            out[key] = out[hidden] // out[heads]
    per_head = out[head_dim] if head_dim else None
    if per_head is None and heads and hidden:
        per_head = out[hidden] // out[heads]
    for key in ("rotary_dim", "rotary_emb_dim"):
        if type(d.get(key)) is int and per_head:
            out[key] = min(out[key], per_head)


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
            out[key] = [min(x, 16 * 2**i) for i, x in enumerate(v)]
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
        for key, v in d.items():
            if key == "attention_types":
                out[key] = _run_lengths(v, depth_from, new)
            elif isinstance(v, list) and len(v) == depth_from and "layer" in key:
                out[key] = _every_kind(v, new)
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
    return out


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

    base = transformers.AutoConfig.for_model(model_type)
    data = _declared(base, shrink(base.to_dict()))
    for key, value in OVERRIDES.get(model_type, {}).items():  # a sub-config's merged
        sub = data.get(key)
        data[key] = {**sub, **value} if isinstance(sub, dict) and isinstance(value, dict) else value
    _set_mrope(data, model_type)
    data.pop("model_type", None)
    return type(base).from_dict(data)


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
        return {f.name for f in dataclasses.fields(cls)}
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and len(params) <= 3:
        return None  # no declared fields to go by
    return set(params) - {"self", "kwargs"}


def _declared(config: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Only the fields a config declares (at every level): what its __init__ derives from
    them (DeepSeek's qk_head_dim, a default head_dim) is derived again from the shrunk
    values instead of kept at its full-size value."""
    names = _fields(config)
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = getattr(config, key, None) if isinstance(key, str) else None
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            value = {**_declared(sub, value), "model_type": getattr(sub, "model_type", None)}
            value = {k: v for k, v in value.items() if v is not None or k != "model_type"}
        if names is None or key in names or isinstance(value, dict):
            out[key] = value
    return out


def build(model_type: str, cls_name: str) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, cls_name)
    config = tiny_config(model_type)
    with contextlib.suppress(AttributeError, TypeError):
        config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config)


# --------------------------------------------------------------------------- one row


@dataclass
class Row:
    model_type: str
    cls: str
    status: str  # clean | loud | refused | model-error | crash | no-build | slow
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
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text[:200]


def _layout(report: Any) -> str:
    proofs = list(report.layout)
    if not proofs:
        note = next((n for n in report.notes if "block" in n or "stream" in n), "")
        return f"no blocks ({note[:100]})" if note else "no blocks"
    bad = [p for p in proofs if p.status != "verified"]
    if not bad:
        return f"verified ({len(proofs)})"
    return f"{len(proofs) - len(bad)}/{len(proofs)} verified"


def run_one(model_type: str, cls_name: str) -> Row:
    """Build one type tiny and scan it; never raises."""
    from actscan import scan
    from actscan.errors import ActscanError
    from actscan.measure.prepare import model_error_line
    from actscan.records import Severity

    row = Row(model_type, cls_name, "no-build")
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
        row.reason = _line(err)
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
        layout_ok = row.layout.startswith("verified") or "layout" in argued
        row.status = "clean" if not loud and layout_ok else "loud"
    row.seconds = time.perf_counter() - t0
    return row


# --------------------------------------------------------------------------- the document


def markdown(rows: list[Row]) -> str:
    tried = [r for r in rows if r.status != "no-build"]
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
        + f"; {len(rows) - len(tried)} more types do not build from a generically shrunk "
        f"config (listed at the end). {len(argued)} of the clean types do get a warn/error "
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
    lines += ["", "## Types that do not build tiny", ""]
    lines += ["| type | class | reason |", "|---|---|---|"]
    for r in rows:
        if r.status == "no-build":
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
    tried = [r for r in rows if r.status != "no-build"]
    clean = sum(r.clean for r in tried)
    print(f"{clean}/{len(tried)} clean, {len(rows) - len(tried)} not built", flush=True)
    if args.write_docs:
        (ROOT / "docs" / "families.md").write_text(markdown(rows))
    if args.baseline:
        known = {r.model_type: cause(r) for r in rows if not r.clean}
        path = ROOT / "tests" / "breadth_baseline.json"
        path.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
