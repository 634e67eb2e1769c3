"""Inputs for transformers models that do not take token ids alone.

A transformers model names its main input (`main_input_name`: `pixel_values`,
`input_values`, `input_features`, `input_ids`) and its config says the shape that input
must have (image size and channels, mel bins and the encoder's fixed frame count, the conv
feature extractor's kernels and strides). Encoder-decoder models also need decoder ids:
they get random `labels` and `decoder_input_ids` = the labels shifted right behind
`decoder_start_token_id`, so the model computes its own loss (`output.loss`).

`hf_input_source` returns None for token-only models without a decoder: `choose_inputs`
invents their ids. Everything here duck-types `model.config`; nothing imports
transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from actscan.errors import UsageError
from actscan.measure.audio_text import FRAMES, audio_text_source
from actscan.measure.audio_text import MASKS as AUDIO_MASKS
from actscan.measure.audio_text import MELS as MELS_DEEP
from actscan.measure.inputs import (
    Batch,
    InputSource,
    default_loss,
    describe_loss,
    random_tokens,
    token_source,
    user_source,
)
from actscan.measure.named_inputs import FLOAT_SUFFIXES, named_float_source
from actscan.measure.recorder import first_tensor
from actscan.measure.side_inputs import with_side_inputs
from actscan.measure.state import eval_mode
from actscan.measure.vision_text import (
    PATCH_FORMS,
    REGION_INPUTS,
    deep_config_int,
    forward_params,
    image_sides,
    packed_patches,
    patch_grid,
    patch_sequence,
    positioned_patches,
    region_source,
    runs_on,
    text_config,
    text_ids,
    vision_text_source,
)
from actscan.measure.vision_text import config_int as _int
from actscan.measure.vision_text import required_params as _required
from actscan.records import ModelInfo

__all__ = [
    "ChosenInputs",
    "cannot_invent",
    "check_positions",
    "choose_inputs",
    "describe_batch",
    "hf_input_source",
    "learned_positions",
    "takes_token_ids",
]

DEFAULT_SEQ = 64
DEFAULT_IMAGE = 224  # the side of an image when the config names none (CNN backbones)
DEFAULT_FRAMES = 50  # about one second of 16 kHz audio for wav2vec2-like extractors
TRAJECTORY = 16  # steps of an offline-RL trajectory (return, state, action each)
LATENT_FRAMES = 16  # latent frames for a codec's decoder: about a second at 12.5 Hz
WAVE_CHANNELS = 8  # a waveform's channel axis is this narrow or less; a wider one is frames
LATENT_WIDTHS = ("hidden_size", "latent_dim", "codebook_dim")  # a latent's width, tried in turn


def _main_input(model: nn.Module) -> str | None:
    """The model's main input: `main_input_name` (the first of a list, OneFormer's
    images before its task), or `input_ids` where the forward takes none of the name it
    inherited but takes ids (SAM 3 Lite's text tower says `pixel_values`)."""
    name = getattr(model, "main_input_name", None)
    if isinstance(name, list | tuple) and name and isinstance(name[0], str):
        name = name[0]
    if not isinstance(name, str) or getattr(model, "config", None) is None:
        return None
    params = forward_params(model)
    if params and name not in params and name != "input_ids" and "input_ids" in params:
        return "input_ids"
    return name


def takes_token_ids(model: nn.Module) -> bool:
    """A transformers model whose only required input is token ids (no decoder)."""
    return _main_input(model) in (None, "input_ids") and not _is_encoder_decoder(model)


def _is_encoder_decoder(model: nn.Module) -> bool:
    """A model with a token (or spectrogram) decoder to feed: the config says encoder-
    decoder and the forward takes decoder inputs. DETR-like detectors say encoder-decoder
    too, but their decoder runs on learned queries: they take the encoder's input only."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    params = forward_params(model)
    return not params or bool({"decoder_input_ids", "decoder_input_values"} & params)


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int) and value > 0:
        return value, value
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return int(value[0]), int(value[1])
    return None


def _samples_for_frames(config: Any, frames: int) -> int:
    """Shortest waveform whose conv feature extractor gives `frames` frames (inverting
    L_out = (L_in - kernel) // stride + 1 layer by layer, last layer first)."""
    kernels = getattr(config, "conv_kernel", None)
    strides = getattr(config, "conv_stride", None)
    if not kernels or not strides:
        return 16_000
    length = frames
    for k, s in reversed(list(zip(kernels, strides, strict=False))):
        length = (length - 1) * int(s) + int(k)
    return length


MELS = MELS_DEEP[:4]  # the top-level names: a sub-config's are searched past them


def _main_shapes(
    model: nn.Module, name: str, batch: int, seq_len: int | None
) -> list[tuple[int, ...]]:
    """The shapes the main input `name` may have, read off the config, most likely first
    (one where the config settles it; `_main_shape` probes the model when several)."""
    config: Any = _input_config(model)  # a transformers config: fields vary by family
    if name == "pixel_values":
        # CNN backbones (ResNet, RegNet) name no image size: they take any, and were
        # trained at ImageNet's 224 on RGB, the defaults of their image processors. An
        # encoder-decoder (Donut, Nougat) names its encoder's in the encoder's config.
        # SAM 2's vision config keeps it in its backbone's (Hiera) config
        vision = _sub(config, "vision_config", "encoder_config", "encoder")
        size = (
            _pair(getattr(config, "image_size", None))
            or _pair(getattr(vision, "image_size", None))
            or _pair(getattr(_sub(vision, "backbone_config"), "image_size", None))
            or (DEFAULT_IMAGE, DEFAULT_IMAGE)
        )
        channels = _int(config, "num_channels") or _int(vision, "num_channels") or 3
        frames = _int(config, "num_frames") or _int(vision, "num_frames")
        shapes: list[tuple[int, ...]] = []
        for longest in image_sides(max(size)):  # the config's size, then doublings
            hw = (size[0] * longest // max(size), size[1] * longest // max(size))
            # a video model (ViViT, VideoMAE, TimeSformer) names its clip's frame count
            shapes += [(batch, frames, channels, *hw)] if frames else []
            shapes.append((batch, channels, *hw))
        if _image_companions(model):  # stacked over its prompt image (SegGPT): half as tall
            shapes.append((batch, channels, size[0] // 2, size[1]))
        shapes.append((batch, 2, channels, *size))  # an image pair (keypoint matchers)
        return shapes
    if name == "input_values":
        # a waveform, mono or with the codec's channel axis (EnCodec, DAC, Mimi); one
        # second, else a whole number of a long hop (19 200 = 10 × 1 920 = 6 × 3 200)
        samples = _samples_for_frames(config, seq_len or DEFAULT_FRAMES)
        channels = _int(config, "audio_channels", "channels") or 1
        waves = [
            shape
            for n in dict.fromkeys((samples, 19_200))
            for shape in ((batch, n), (batch, channels, n))
        ]
        return waves + _spectrograms(config, batch)
    if name == "input_features":
        mels = _int(config, *MELS)
        positions = _int(config, "max_source_positions")
        if mels and positions and hasattr(config, "num_mel_bins"):
            # Whisper-like: the encoder's two stride-1/2 convs map 2·P frames to P positions,
            # and the model refuses any other length.
            return [(batch, mels, 2 * positions)]
        # --seq-len frames first, else (or if the model refuses them) FRAMES
        counts = dict.fromkeys(f for f in (seq_len, FRAMES) if f)
        widths = _widths(model)
        return [s for w in widths for f in counts for s in ((batch, f, w), (batch, w, f))]
    if name == "pixel_values_videos":
        config = _sub(config, "vision_config") or config  # a two-tower's video tower
        side = _pair(getattr(config, "image_size", None)) or _pair(
            getattr(config, "crop_size", None)
        )
        channels = _int(config, "num_channels", "in_chans") or 3
        tubelet = getattr(config, "tubelet_size", None)  # frames per patch: 2, or [t, h, w]
        if isinstance(tubelet, list | tuple) and tubelet and isinstance(tubelet[0], int):
            tubelet = tubelet[0]
        per_patch = tubelet if isinstance(tubelet, int) and tubelet > 0 else 1
        fixed = _int(config, "num_frames", "frames_per_clip")
        # the fewest frames first (two patches deep): a fixed count (learned positions) next
        clips = list(dict.fromkeys(f for f in (2 * per_patch, fixed) if f))
        if side:
            return [(batch, f, channels, *side) for f in clips]
    if name == "flattened_patches":  # Pix2Struct: a 4 × 4 grid, row and column first
        width = deep_config_int(config, ("patch_embed_hidden_size",))
        if width:
            return [(batch, PATCH_GRID * PATCH_GRID, 2 + width)]
    if name == "inputs_embeds":  # a model fed embeddings only: one row of the width each
        width = _int(config, "hidden_size", "d_model") or deep_config_int(config, ("hidden_size",))
        return [(batch, seq_len or DEFAULT_SEQ, width)] if width else []
    if name == "states" and _int(config, "state_dim"):  # a trajectory (Decision Transformer)
        steps = min(seq_len or TRAJECTORY, _int(config, "max_ep_len") or TRAJECTORY)
        positions = _int(config, "n_positions", "max_position_embeddings")
        steps = min(steps, positions // 3) if positions else steps  # 3 tokens a step
        return [(batch, steps, _int(config, "state_dim") or 1)]
    if name == "audio_mel":  # Gemma 3n's audio tower: frames × mel bins
        mels = _int(config, "input_feat_size", *MELS)
        return [(batch, seq_len or FRAMES, mels)] if mels else []
    if name == "latents":  # a codec's decoder (Mimi's): channels-first, of a width it names
        frames = seq_len or LATENT_FRAMES
        named = [w for w in (_int(config, k) for k in LATENT_WIDTHS) if w is not None]
        return [s for w in dict.fromkeys(named) for s in ((batch, w, frames), (batch, frames, w))]
    if name == "past_values" and _lags(config):  # a lagged forecaster (Informer)
        length = _past_length(config)
        width = _int(config, "input_size") or 1
        return [(batch, length, width) if width > 1 else (batch, length)]
    if name == "past_values":
        context = _int(config, "context_length")
        patch = _int(config, "patch_length") or 1
        if context:
            if context > 1024:  # a long-context forecaster takes shorter series
                context = 8 * patch
            series = _int(config, "num_input_channels")
            shapes = [(batch, context, series)] if series else []
            return [*shapes, (batch, context)]
    return []


def _spectrograms(config: Any, batch: int) -> list[tuple[int, ...]]:
    """A spectrogram given as `input_values` (AST: frames × mel bins), tried after the
    waveforms: where the config names mel bins, its `max_length` frames (the patch grid
    its learned positions fix) else FRAMES, frames first, then mel bins first."""
    mels = _int(config, "num_mel_bins")
    if not mels:
        return []
    frames = _int(config, "max_length") or FRAMES
    return [(batch, frames, mels), (batch, mels, frames)]


def _lags(config: Any) -> list[int]:
    """The lags a forecaster feeds its transformer (`lags_sequence`), else []."""
    lags = getattr(config, "lags_sequence", None)
    if isinstance(lags, list | tuple) and lags and all(isinstance(v, int) for v in lags):
        return [int(v) for v in lags]
    return []


def _past_length(config: Any) -> int:
    """The history a lagged forecaster needs: its context plus its longest lag."""
    return (_int(config, "context_length") or 1) + max(_lags(config))


def _companions(
    model: nn.Module,
    name: str,
    shape: tuple[int, ...],
    gen: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """What a forward requires beside a time series (TimesFM): its padding
    (`<name>_padding`, zeros: every value is real) and its frequency class (`freq`,
    where the config names `freq_size` classes: 0, the finest); a lagged forecaster's
    too (`_forecast_companions`)."""
    config: Any = model.config  # a transformers config: its fields vary by family
    out: dict[str, torch.Tensor] = {}
    required = _required(model)
    if f"{name}_padding" in required:
        out[f"{name}_padding"] = torch.zeros(shape)
    if name == "audio_mel" and "audio_mel_mask" in required:
        # True marks a padded frame (Gemma 3n keeps ~mask): none is
        out["audio_mel_mask"] = torch.zeros(shape[:2], dtype=torch.bool)
    if "freq" in required and _int(config, "freq_size"):
        out["freq"] = torch.zeros(shape[0], 1, dtype=torch.long)
    if name == "states" and "returns_to_go" in forward_params(model):
        out.update(_trajectory(config, shape, gen or torch.Generator().manual_seed(0)))
    if name == "past_values" and _lags(config) and "past_time_features" in forward_params(model):
        out.update(_forecast_companions(config, shape, gen or torch.Generator().manual_seed(0)))
    return out


def _trajectory(config: Any, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, Any]:
    """Beside a trajectory's states: an action of `act_dim` per step, its reward and
    return-to-go, the steps' timesteps (0, 1, …, below `max_ep_len`) and a mask of
    every step; the forward embeds them all and fails on any it lacks."""
    rows, steps = shape[0], shape[1]
    actions = _int(config, "act_dim") or 1
    times = torch.arange(steps, dtype=torch.long).expand(rows, steps).clone()
    return {
        "actions": torch.randn(rows, steps, actions, generator=gen),
        "rewards": torch.randn(rows, steps, 1, generator=gen),
        "returns_to_go": torch.randn(rows, steps, 1, generator=gen),
        "timesteps": times,
        "attention_mask": torch.ones(rows, steps, dtype=torch.long),
    }


def _forecast_companions(
    config: Any, shape: tuple[int, ...], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Beside a lagged forecaster's history (Time Series Transformer, Informer,
    Autoformer): its time features (`num_time_features` + `num_dynamic_real_features`
    per step), an all-ones observed mask, the static features the config counts, and a
    future of `prediction_length` steps with its time features, so the decoder runs on
    the horizon it was trained to predict."""
    rows, length = shape[0], shape[1]
    per_step = shape[2:]
    features = (_int(config, "num_time_features") or 0) + (
        _int(config, "num_dynamic_real_features") or 0
    )
    horizon = _int(config, "prediction_length") or 1
    out = {
        "past_time_features": torch.randn(rows, length, features, generator=gen),
        "past_observed_mask": torch.ones(shape),
        "future_values": torch.randn(rows, horizon, *per_step, generator=gen),
        "future_time_features": torch.randn(rows, horizon, features, generator=gen),
    }
    categorical = _int(config, "num_static_categorical_features")
    if categorical:
        out["static_categorical_features"] = torch.zeros(rows, categorical, dtype=torch.long)
    real = _int(config, "num_static_real_features")
    if real:
        out["static_real_features"] = torch.randn(rows, real, generator=gen)
    return out


def input_arg(model: nn.Module, name: str) -> str:
    """The forward's argument that takes the main input `name`: itself, or the one
    tensor the forward requires when it names the input otherwise (VibeVoice's acoustic
    tokenizer says `input_values` but its forward takes `hidden_states`)."""
    if name in forward_params(model):
        return name
    required = [r for r in _required(model) if r not in ("self", "kwargs")]
    if len(required) != 1:
        return name
    import inspect

    try:
        annotation = inspect.signature(model.forward).parameters[required[0]].annotation
    except (TypeError, ValueError, KeyError):
        return name
    # an argument that must be an object (SAM 2 video's inference session) takes no tensor
    return name if _object_kind(annotation) else required[0]


def _encoder_input(model: nn.Module) -> str | None:
    """SpeechEncoderDecoder's forward names its main input `inputs`: the encoder's own
    (`input_values` for wav2vec2, `input_features` for Speech2Text), which the forward
    also takes by name."""
    encoder = getattr(model, "encoder", None)
    name = getattr(encoder, "main_input_name", None)
    return name if isinstance(name, str) and name in forward_params(model) else None


def _input_config(model: nn.Module) -> Any:
    """The config that says the main input's shape: the model's, or for a composite
    whose main input is its encoder's (`inputs`) the encoder's config."""
    config: Any = model.config
    if getattr(model, "main_input_name", None) == "inputs":
        return _sub(config, "encoder") or config
    return config


COMMON_MELS = (80, 128)  # the mel bins of every speech feature extractor transformers has
STACKED = ("num_stacked_frames", "stacked_frames", "lfr_m")  # low-frame-rate stacking


def feature_widths(config: Any) -> list[int]:
    """The widths a frame of audio features may have, most likely first: the config's
    mel bins times the frames a low-frame-rate front end stacks into one (Fun-ASR's 7),
    then the mel bins alone; where the config names no mel bins, the two counts speech
    feature extractors use (Gemma 4's audio tower says none)."""
    mels = _int(config, *MELS) or deep_config_int(config, MELS_DEEP)
    if mels is None:
        return list(COMMON_MELS)
    stack = _int(config, *STACKED) or deep_config_int(config, STACKED)
    return [mels * stack, mels] if stack and stack > 1 else [mels]


def _widths(model: nn.Module) -> list[int]:
    """Every width a frame of the model's audio features may have (`feature_widths`,
    then `_widened`)."""
    widths = feature_widths(_input_config(model))
    return widths + [w for w in _widened(model, widths[-1]) if w not in widths]


def _widened(model: nn.Module, mels: int) -> list[int]:
    """Frame widths a front end makes of `mels` bins without the config saying so
    (Granite Speech 5 appends deltas and stacks pairs: 4 × 80), read off the model:
    the input widths of its linear and conv layers that are 2–8 × the mel bins, in
    module order; tried after the mel bins themselves."""
    found: list[int] = []
    for m in model.modules():
        width = getattr(m, "in_features", None) if isinstance(m, nn.Linear) else None
        if isinstance(m, nn.Conv1d):
            width = m.in_channels
        if isinstance(width, int) and width % mels == 0 and 2 <= width // mels <= 8:
            found.append(width)
    return list(dict.fromkeys(found))


def _sub(config: Any, *names: str) -> Any:
    """The first of the named sub-configs the config holds, else None."""
    for name in names:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return None


# the inputs of each modality a forward may take beside its main one
_MODALITIES = ("input_ids", "pixel_values", "input_features", "input_values")


def _main_shape(
    model: nn.Module,
    name: str,
    batch: int,
    seq_len: int | None,
    extra: Callable[[int], dict[str, torch.Tensor]] | None = None,
) -> tuple[int, ...]:
    """The shape of the main input for `name`: the config's, or the first of its
    candidates one forward pass (one row, eval mode, no gradients; `extra` adds the
    decoder's inputs) accepts; UsageError if the config says none (the user then passes
    --input-shape)."""
    arg = input_arg(model, name)
    built = {arg, "attention_mask", "decoder_input_ids", "decoder_input_values", "labels"}
    built |= set(_companions(model, name, (1, 1)))
    built |= set(AUDIO_MASKS) if name == "input_features" else set()
    built |= (
        set(_image_companions(model)) | set(_sized_tokens(model))
        if name == "pixel_values"
        else set()
    )
    built |= {"input_ids", "attention_mask"} if _text_beside(model, name, 1, 1, 0, 0) else set()
    if set(_required(model)) - built:  # one --input-shape cannot give the others
        raise UsageError(cannot_invent(model))
    shapes = _main_shapes(model, name, batch, seq_len)
    if arg != name:  # an input named otherwise may be hidden states of the config's width
        width = _int(_input_config(model), "hidden_size", "d_model")
        length = seq_len or DEFAULT_FRAMES
        shapes += [(batch, width, length), (batch, length, width)] if width else []
    if not shapes:
        beside = [m for m in _MODALITIES if m != arg and m in forward_params(model)]
        if beside:  # one --input-shape cannot give the prefix a policy model also reads
            raise UsageError(
                f"cannot build inputs for {type(model).__name__} (its main input '{name}' "
                f"goes with {', '.join(beside)}): pass them as inputs= (Python), or on the "
                "CLI as a module:function target that returns (model, inputs)"
            )
        raise UsageError(
            f"cannot build inputs for {type(model).__name__} (its main input is '{name}'): "
            "pass --input-shape with that input's full shape, batch first"
        )
    if len(shapes) == 1:
        return shapes[0]
    masks = _frame_masks(model, name)
    for shape in shapes:
        kwargs = {arg: torch.randn(1, *shape[1:]), **(extra(1) if extra else {})}
        kwargs.update(_companions(model, name, (1, *shape[1:])))
        kwargs.update(_image_extras(model, name, kwargs[arg], torch.Generator()))
        kwargs.update(_text_beside(model, name, 1, seq_len or 8, seed=0, index=0))
        frames = _frames_axis(model, name, shape)
        kwargs.update({m: torch.ones(1, frames, dtype=torch.long) for m in masks if frames})
        if _runs_on(model, kwargs):
            return shape
        optional = "attention_mask" in kwargs and "attention_mask" not in _required(model)
        if optional and _runs_on(model, {k: v for k, v in kwargs.items() if k != "attention_mask"}):
            return shape  # `_kept_masks` then drops the mask
    return shapes[0]  # none runs: the model's own error then says why


PATCH_GRID = 4  # patches per side of an image given as flattened patches


def _place_patches(patches: torch.Tensor) -> None:
    """Pix2Struct's flattened patches carry their 1-based row and column in their first
    two values (0 marks padding, none here): the row-major places of a square grid."""
    n = patches.shape[1]
    side = max(1, round(n**0.5))
    place = torch.arange(n)
    patches[:, :, 0] = (place // side + 1).float()
    patches[:, :, 1] = (place % side + 1).float()


def _text_beside(
    model: nn.Module, name: str, rows: int, seq: int, seed: int, index: int
) -> dict[str, torch.Tensor]:
    """Token ids (and their all-ones mask) for a video-text two-tower model whose forward
    requires them beside its videos (VideoPrism's CLIP model), from its text config's
    vocabulary; {} for any other model."""
    if name != "pixel_values_videos" or "input_ids" not in _required(model):
        return {}
    ids = text_ids(model.config, rows, seq, seed, index)
    return {} if ids is None else {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _image_companions(model: nn.Module) -> list[str]:
    """Required image-shaped inputs beside `pixel_values`: another image of the same size
    (`prompt_pixel_values`, SegGPT's example) or its mask (`prompt_masks`)."""
    return [
        p
        for p in _required(model)
        if p != "pixel_values"
        and (p.endswith("pixel_values") or (p.endswith(("masks", "mask")) and "attention" not in p))
    ]


def _image_extras(
    model: nn.Module, name: str, pixels: torch.Tensor, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The companions `_image_companions` names, of the images' shape (a mask in [0, 1])."""
    if name != "pixel_values" or pixels.dim() != 4:
        return {}
    out: dict[str, torch.Tensor] = {}
    for p in _image_companions(model):
        make = torch.rand if p.endswith(("masks", "mask")) else torch.randn
        out[p] = make(*pixels.shape, generator=gen)
    for p, (length, vocab) in _sized_tokens(model).items():
        out[p] = torch.randint(0, vocab, (pixels.shape[0], length), generator=gen)
    return out


def _sized_tokens(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Required token inputs `<prefix>_inputs` whose length the config names as
    `<prefix>_seq_len` (OneFormer's tokenised task, "the task is semantic"): name ->
    (length, the config's text vocabulary)."""
    config: Any = model.config  # a transformers config: its fields vary by family
    vocab = next(
        (
            v
            for k, v in sorted(vars(config).items())
            if k.endswith("vocab_size") and _int(config, k)
        ),
        None,
    )
    out: dict[str, tuple[int, int]] = {}
    for p in _required(model):
        length = (
            _int(config, p.removesuffix("_inputs") + "_seq_len") if p.endswith("_inputs") else None
        )
        if length and isinstance(vocab, int):
            out[p] = (length, vocab)
    return out


def _kept_masks(
    model: nn.Module,
    name: str,
    shape: tuple[int, ...],
    masks: list[str],
    extra: Callable[[int], dict[str, torch.Tensor]],
) -> list[str]:
    """The frame masks, less an optional `attention_mask` the forward runs only
    without (Voxtral-Realtime's encoder masks its positions after the convs, not
    frames), two rows (one broadcasts past the mismatch), no gradients."""
    if _runs_masked(model, name, shape, masks, extra):
        return masks
    without = [m for m in masks if m != "attention_mask"]
    return without if _runs_masked(model, name, shape, without, extra) else masks


def _needed_masks(
    model: nn.Module,
    name: str,
    shape: tuple[int, ...],
    masks: list[str],
    extra: Callable[[int], dict[str, torch.Tensor]],
) -> list[str]:
    """The frame masks, plus the optional audio masks (`AUDIO_MASKS`) the forward takes
    where it runs only with them (AudioFlamingo 3's encoder sums `input_features_mask`
    although its default is None); an optional mask it runs without stays out."""
    optional = [m for m in AUDIO_MASKS if m in forward_params(model) and m not in masks]
    if not optional or _runs_masked(model, name, shape, masks, extra):
        return masks
    given = masks + optional
    return given if _runs_masked(model, name, shape, given, extra) else masks


def _runs_masked(
    model: nn.Module,
    name: str,
    shape: tuple[int, ...],
    given: list[str],
    extra: Callable[[int], dict[str, torch.Tensor]],
) -> bool:
    """Whether the forward runs on the features with the masks `given` (every frame
    real), two rows (one broadcasts past a mismatch), no gradients."""
    frames = _frames_axis(model, name, shape) or 0
    rows = min(2, shape[0])
    kwargs = {input_arg(model, name): torch.randn(rows, *shape[1:]), **extra(rows)}
    kwargs.update(_companions(model, name, (rows, *shape[1:])))
    kwargs.update({m: torch.ones(rows, frames, dtype=torch.long) for m in given})
    return _runs_on(model, kwargs)


def _frames_axis(model: nn.Module, name: str, shape: tuple[int, ...]) -> int | None:
    """The frame count of mel features (frames × mels or mels × frames), else None."""
    if name != "input_features" or len(shape) != 3:
        return None
    return shape[1] if shape[2] in _widths(model) else shape[2]


def _frame_masks(model: nn.Module, name: str) -> list[str]:
    """The frame masks to give mel features: those the forward requires
    (`input_features_mask`), and `attention_mask` where it takes one (not Whisper's fixed
    2·P frames, which need none)."""
    config: Any = _input_config(model)  # a transformers config: fields vary by family
    masks = [m for m in AUDIO_MASKS if m in _required(model)]
    whisper = _int(config, "max_source_positions") and hasattr(config, "num_mel_bins")
    if "attention_mask" in forward_params(model) and not whisper:
        masks.append("attention_mask")
    return masks


def _runs_on(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """`runs_on` as the scan will call the model: use_cache=False where it asks for a
    cache (a cache can hide a wrong mask, sliced to its length)."""
    if asks_cache(model) and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    return runs_on(model, kwargs)


def _tokens(vocab: int, batch: int, seq: int, seed: int, index: int) -> torch.Tensor:
    return random_tokens(vocab, batch, seq, seed, index)


def _check_positions(model: nn.Module, seq: int, names: Sequence[str], what: str) -> None:
    config: Any = model.config  # a transformers config: its fields vary by family
    for key in names:
        limit = getattr(config, key, None)
        if isinstance(limit, int) and 0 < limit < seq:
            raise UsageError(
                f"--seq-len {seq}: this {config.model_type} model takes at most {limit} "
                f"{what} ({key} = {limit})"
            )


LABEL_FORMS = ("shifted", "transducer", "codebooks", "none")


def _decoder_batch(
    model: nn.Module, batch: int, seq: int, seed: int, index: int, form: str = "shifted"
) -> dict[str, torch.Tensor]:
    """Random labels and the decoder ids they give: `form` "shifted" (a seq2seq decoder:
    the labels shifted right behind the start token), "transducer" (an RNN-T/TDT
    decoder: the start token, then every label, one position more than the labels),
    "codebooks" (`_codebook_batch`), "none" (the shifted ids without labels: no loss of
    the model's own); a spectrogram
    decoder (SpeechT5's text-to-speech) gets random mel frames as labels, a whole number
    of its reduction factor, and a speaker embedding."""
    config: Any = model.config  # a transformers config: its fields vary by family
    if _spectrogram(model):
        return _spectrogram_batch(config, batch, seq, seed, index)
    decoder = _decoder_config(config)
    vocab = _int(config, "vocab_size") or _int(decoder, "vocab_size")
    start = None
    for cfg, key in (
        (config, "decoder_start_token_id"),
        (config, "pad_token_id"),
        (decoder, "decoder_start_token_id"),
        (decoder, "bos_token_id"),
        (decoder, "pad_token_id"),
    ):
        start = getattr(cfg, key, None)
        if isinstance(start, int) and not isinstance(start, bool):
            break
    if vocab is None or not isinstance(start, int):
        raise UsageError(
            f"cannot build decoder inputs for {type(model).__name__}: its config has no "
            "vocab_size or decoder_start_token_id"
        )
    if not 0 <= start < vocab:
        raise UsageError(
            f"decoder_start_token_id = {start} lies outside the vocabulary "
            f"(vocab_size = {vocab}): fix the config"
        )
    codebooks = _int(decoder, "num_codebooks", "num_channels")
    if form == "codebooks" and codebooks:
        return _codebook_batch(
            _int(decoder, "vocab_size") or vocab, start, codebooks, batch, seq, seed, index
        )
    labels = _tokens(vocab, batch, seq, seed + 1, index)
    if form == "transducer":
        labels = labels[:, :-1]
        return {
            "decoder_input_ids": torch.cat([torch.full((batch, 1), start), labels], 1),
            "labels": labels,
        }
    decoder_ids = torch.cat([torch.full((batch, 1), start), labels[:, :-1]], dim=1)
    if form == "none":
        return {"decoder_input_ids": decoder_ids}
    return {"decoder_input_ids": decoder_ids, "labels": labels}


def _codebook_batch(
    vocab: int, start: int, codebooks: int, batch: int, seq: int, seed: int, index: int
) -> dict[str, torch.Tensor]:
    """A decoder over several audio codebooks at once (Dia: its decoder config's
    `num_channels`): ids batch × seq × codebooks, each codebook shifted right behind the
    start token; labels one row per (sample, codebook), as the model flattens its
    logits."""
    labels = _tokens(vocab, batch * codebooks, seq, seed + 1, index)
    per = labels.view(batch, codebooks, seq)
    shifted = torch.cat([torch.full((batch, codebooks, 1), start), per[..., :-1]], dim=2)
    return {"decoder_input_ids": shifted.transpose(1, 2).contiguous(), "labels": labels}


def _label_form(
    model: nn.Module, one_row: Callable[[str], dict[str, Any]]
) -> tuple[str, str | None]:
    """The first label form (`LABEL_FORMS`) the model's own loss runs on, one row, no
    gradients; "none" with the first line of the model's error when its loss raises on
    every form but its forward runs without labels (a loss that needs a package not
    installed, torchaudio's rnnt_loss, or one that is broken)."""
    error: str | None = None
    for form in LABEL_FORMS:
        try:
            with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
                model(**one_row(form))
        except Exception as err:
            error = error or " ".join(f"{type(err).__name__}: {err}".split())[:160]
            continue
        return form, (error if form == "none" else None)
    return "shifted", None  # nothing runs: the model's own error then says why


def _decoder_config(config: Any) -> Any:
    """The decoder's own config (VisionEncoderDecoder's `decoder`, a text config), else
    the config itself."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except (TypeError, ValueError, AttributeError):
            pass
    return getattr(config, "decoder", None) or config


def _takes(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _spectrogram_batch(
    config: Any, batch: int, seq: int, seed: int, index: int
) -> dict[str, torch.Tensor]:
    mels = _int(config, "num_mel_bins")
    if mels is None:
        raise UsageError("cannot build spectrogram labels: the config has no num_mel_bins")
    factor = _int(config, "reduction_factor") or 1
    frames = max(factor, seq // factor * factor)
    gen = torch.Generator().manual_seed(seed * 100_003 + index + 1)
    out = {"labels": torch.randn(batch, frames, mels, generator=gen)}
    if dim := _int(config, "speaker_embedding_dim"):
        out["speaker_embeddings"] = torch.randn(batch, dim, generator=gen)
    return out


def hf_input_source(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int | None,
    seed: int,
    input_shape: Sequence[int] | None = None,
) -> InputSource | None:
    """Inputs for a transformers model from its `main_input_name` and config, or None
    when it takes token ids only (scan() invents those).

    `input_shape` (--input-shape) replaces the shape of a float main input. Encoder-decoder
    models add decoder ids and labels; their encoder's tokens (T5, BART) get an all-ones
    attention mask. The side inputs the forward needs (`side_inputs`: UDOP's boxes) go
    along, so the CLI, which passes this source as the caller's inputs, gets them too.
    """
    found = _hf_source(model, batch=batch, seq_len=seq_len, seed=seed, input_shape=input_shape)
    if isinstance(found, NotedSource):
        return NotedSource(with_side_inputs(model, found.source, seed), found.note, found.fed)
    return with_side_inputs(model, found, seed) if found is not None else None


def _hf_source(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int | None,
    seed: int,
    input_shape: Sequence[int] | None = None,
) -> InputSource | None:
    if input_shape is None and not _is_encoder_decoder(model):
        paired = _media_with_text(model, batch, seq_len, seed)
        if paired is not None:
            return paired
    name = _main_input(model)
    if name == "inputs":  # a composite's generic name: its encoder's own main input
        name = _encoder_input(model)
    inherited = name == "input_ids" and "input_ids" not in forward_params(model)
    gridded = name == "pixel_values" and bool(set(_GRIDS) & set(_required(model)))
    if input_shape is None and (inherited or gridded):
        towers = _tower_source(model, batch=batch, seed=seed)
        towers = towers or (_embeds_source(model, batch, seq_len, seed) if inherited else None)
        if towers is not None:
            return towers
    images = name == "pixel_values" or (inherited and "pixel_values" in _required(model))
    sequence = _patch_sequence_kind(model) if input_shape is None and images else None
    if sequence is not None:
        config_: Any = model.config

        def sequences(i: int) -> Batch:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            return Batch(kwargs=sequence(config_, batch, gen))

        return sequences
    if named := _named_floats(model, name, input_shape, batch, seq_len, seed):
        return named
    if name is None or (name == "input_ids" and not _is_encoder_decoder(model)):
        return _ids_alone(model, batch=batch, seq_len=seq_len, seed=seed)
    config: Any = model.config  # a transformers config: its fields vary by family
    vocab: int | None = None
    if name == "input_ids":
        if input_shape is not None:
            raise UsageError(
                f"--input-shape gives a float tensor, but this {config.model_type} model takes "
                "token ids (use --batch and --seq-len)"
            )
        # an encoder-decoder of two configs (EncoderDecoderModel, Florence-2, Dia) keeps
        # its encoder's vocabulary in the encoder's or the text config
        text = _sub(config, "encoder", "text_config", "encoder_config")
        vocab = _int(config, "vocab_size") or _int(text, "vocab_size")
        if vocab is None:
            raise UsageError(f"cannot build token ids for {type(model).__name__}: no vocab_size")
        seq = seq_len or min(DEFAULT_SEQ, _int(config, "max_position_embeddings") or DEFAULT_SEQ)
        _check_positions(model, seq, ("max_position_embeddings", "n_positions"), "positions")
        shape: tuple[int, ...] = (batch, seq)
    dec_seq = 0
    if _is_encoder_decoder(model):
        dec_seq = seq_len or min(
            DEFAULT_SEQ,
            _int(config, "max_target_positions", "max_position_embeddings") or DEFAULT_SEQ,
        )
        _check_positions(
            model, dec_seq, ("max_target_positions", "max_position_embeddings"), "decoder tokens"
        )
    if name != "input_ids":

        def decoder(rows: int) -> dict[str, torch.Tensor]:
            return _decoder_batch(model, rows, dec_seq, seed, 0, "none") if dec_seq else {}

        shape = (
            tuple(input_shape)
            if input_shape is not None
            else _main_shape(model, name, batch, seq_len, decoder)
        )

    frames = _frames_axis(model, name, shape) if input_shape is None else None
    masks = _frame_masks(model, name) if frames else []
    if frames and "attention_mask" in masks and "attention_mask" not in _required(model):
        masks = _kept_masks(model, name, shape, masks, decoder)
    if frames:
        masks = _needed_masks(model, name, shape, masks, decoder)
    form, why = "shifted", None

    def source(i: int, rows: int = shape[0]) -> Batch:
        kwargs: dict[str, Any] = {}
        if vocab is not None:
            ids = _tokens(vocab, rows, shape[1], seed, i)
            kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            arg = input_arg(model, name)
            kwargs = {arg: torch.randn(rows, *shape[1:], generator=gen)}
            kwargs.update(_companions(model, name, (rows, *shape[1:]), gen))
            kwargs.update(_image_extras(model, name, kwargs[arg], gen))
            if name == "flattened_patches" and input_shape is None:
                _place_patches(kwargs[arg])
            kwargs.update(_text_beside(model, name, rows, seq_len or 16, seed, i))
            for mask in masks:  # every frame is real (an RNN-T loss reads lengths off it)
                kwargs[mask] = torch.ones(rows, frames or 0, dtype=torch.long)
        if dec_seq:
            kwargs.update(_decoder_batch(model, rows, dec_seq, seed, i, form))
        return Batch(kwargs=kwargs)

    if dec_seq and not _spectrogram(model):

        def one_row(f: str) -> dict[str, Any]:
            given = {k: v for k, v in source(0, 1).kwargs.items() if k != "labels"}
            return {**given, **_decoder_batch(model, 1, dec_seq, seed, 0, f)}

        form, why = _label_form(model, one_row)
    if why is not None:
        return NotedSource(source, f"the model's own loss raised on random labels ({why})")
    return source


def _media_with_text(
    model: nn.Module, batch: int, seq_len: int | None, seed: int
) -> InputSource | None:
    """Images, detector regions or audio fed together with token ids (vision-language,
    region and audio-language models), the first rule whose inputs the model runs on."""
    for rule in (vision_text_source, region_source, audio_text_source):
        found = rule(model, batch=batch, seq_len=seq_len, seed=seed, default_seq=DEFAULT_SEQ)
        if found is not None:
            return found
    return None


def _named_floats(
    model: nn.Module,
    name: str | None,
    input_shape: Sequence[int] | None,
    batch: int,
    seq_len: int | None,
    seed: int,
) -> NotedSource | None:
    """Float tensors named for what they are (`named_inputs`) for a forward whose main
    input no modality rule shapes (a drafter's `noise_embeds` and a target's
    `context_hidden_states`), probed as the scan calls the model."""
    if input_shape is not None or name in (None, "input_ids"):
        return None
    assert name is not None
    if _main_shapes(model, name, 1, seq_len):
        return None
    found = named_float_source(
        model, batch=batch, seq_len=seq_len, seed=seed, runs=lambda kw: _runs_on(model, kw)
    )
    return NotedSource(found[0], "", found[1]) if found is not None else None


def _patch_sequence_kind(
    model: nn.Module,
) -> Callable[[Any, int, torch.Generator], dict[str, torch.Tensor]] | None:
    """A tower that takes its images as sequences of patches: with their grids
    (`spatial_shapes`, SigLIP 2), with each patch's position (`pixel_position_ids`,
    Gemma 4), or packed into one row with each image's grid (`target_sizes`, MiniCPM-V)."""
    params = forward_params(model)
    if "spatial_shapes" in params:
        return patch_sequence
    if "pixel_position_ids" in _required(model):
        return positioned_patches
    if "target_sizes" in params:
        return packed_patches
    return None


# a multimodal forward's inputs of another modality than text (prefixes of their names)
_MEDIA = ("pixel_values", "input_features", "input_values", "audio_", "flattened_patches")


def _ids_alone(
    model: nn.Module, *, batch: int, seq_len: int | None, seed: int
) -> InputSource | None:
    """Token ids for a model whose vocabulary lies in a sub-config (Gemma 4, Molmo 2,
    Aria, Diffusion Gemma, a TTS model's `model_config`): the ids avoid every special
    id the configs name (no placeholder without its features). The image, video and
    audio inputs its forward takes go unfed when it runs without them; else the first
    one whose config shape it runs on goes beside the ids (CLVP's mel features). A
    canvas or decoder the forward takes beside its prompt (`decoder_input_ids`) gets
    ids of its own. The source says what it leaves out. None for a model with a
    vocabulary of its own (scan() invents its ids)."""
    config: Any = model.config  # a transformers config: its fields vary by family
    params = forward_params(model)
    unfed = sorted(p for p in params if p.startswith(_MEDIA) and not p.endswith("_mask"))
    if (
        set(_required(model)) - {"input_ids"}
        or _int(config, "vocab_size")
        or "input_ids" not in params
    ):
        return None
    config = _vocab_config(config)
    limit = _int(text_config(config), "max_position_embeddings")
    seq = seq_len or min(DEFAULT_SEQ, limit or DEFAULT_SEQ)
    canvas = "decoder_input_ids" in params

    def text(rows: int, length: int, i: int) -> dict[str, torch.Tensor]:
        tokens = text_ids(config, rows, length, seed, i)
        assert tokens is not None  # the probe had a vocabulary
        out = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
        if canvas:  # its own ids, as long as the prompt's
            decoder = text_ids(config, rows, length, seed + 1, i)
            assert decoder is not None
            out["decoder_input_ids"] = decoder
        if "mm_token_type_ids" in params:  # Qwen-VL-style M-RoPE (Molmo 2): 0, text
            out["mm_token_type_ids"] = torch.zeros_like(tokens)
        return out

    if text_ids(config, 1, 1, seed, 0) is None:
        return None
    probe = text(1, min(seq, 8), 0)
    alone = _runs_on(model, probe)
    beside = None if alone else _media_beside(model, unfed, probe)
    if not alone and beside is None:
        return None
    media, shape = beside or ("", ())
    rest = [u for u in unfed if u != media]

    def ids(i: int) -> Batch:
        kwargs: dict[str, Any] = text(batch, seq, i)
        if media:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            kwargs[media] = torch.randn(batch, *shape[1:], generator=gen)
        return Batch(kwargs=kwargs)

    if not rest:
        return NotedSource(ids, "", "")
    lead = f"token ids and {media}" if media else "token ids alone"
    return NotedSource(ids, "", f"{lead}; not fed: {', '.join(rest)}")


def _vocab_config(config: Any) -> Any:
    """The config whose text vocabulary ids come from: the config (its text config),
    else the first sub-config naming one (a TTS pair's `model_config`)."""
    if _int(text_config(config), "vocab_size"):
        return config
    subs = (v for k, v in vars(config).items() if k.endswith("_config") and hasattr(v, "to_dict"))
    return next((v for v in subs if _int(text_config(v), "vocab_size")), config)


def _media_beside(
    model: nn.Module, unfed: list[str], text: dict[str, torch.Tensor]
) -> tuple[str, tuple[int, ...]] | None:
    """The first optional media input (features, waveform, images) and shape from its
    config (`_main_shapes`) that the forward runs on beside the one-row `text`."""
    for media in (m for m in _MODALITIES if m in unfed):
        for shape in _main_shapes(model, media, 1, None)[:4]:
            if _runs_on(model, {**text, media: torch.randn(*shape)}):
                return media, shape
    return None


def _embeds_source(
    model: nn.Module, batch: int, seq_len: int | None, seed: int
) -> InputSource | None:
    """Embeddings for a module that takes them instead of the ids it inherits the name of
    (BLIP-2's Q-Former: `query_embeds`): each required `<prefix>_embeds` rows of the
    config's width, `num_<prefix>_tokens` long where the config names it; and, where its
    layers cross-attend to an encoder of `encoder_hidden_size` (the forward takes
    `encoder_hidden_states`), that encoder's states too. None when it requires anything
    else."""
    config: Any = model.config  # a transformers config: its fields vary by family
    required = [r for r in _required(model) if r not in ("self", "kwargs")]
    width = _int(config, "hidden_size", "d_model")
    if not required or not width or not all(r.endswith("_embeds") for r in required):
        return None
    seq = seq_len or DEFAULT_SEQ
    lengths = {r: _int(config, f"num_{r.removesuffix('_embeds')}_tokens") or seq for r in required}
    memory = _int(config, "encoder_hidden_size", "encoder_width")
    memory = memory if "encoder_hidden_states" in forward_params(model) else None

    def embeds(i: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        kw = {r: torch.randn(batch, n, width, generator=gen) for r, n in lengths.items()}
        if memory:
            kw["encoder_hidden_states"] = torch.randn(batch, seq, memory, generator=gen)
        return Batch(kwargs=kw)

    return embeds


def _spectrogram(model: nn.Module) -> bool:
    return _takes(model, "decoder_input_values") and not _takes(model, "decoder_input_ids")


@dataclass(frozen=True)
class NotedSource:
    """An input source with a note on its loss (the labels it leaves out, and why; ""
    when none), and one on what it feeds (`fed`: the optional inputs it leaves out)."""

    source: Callable[[int], Batch]
    note: str
    fed: str = ""

    def __call__(self, i: int) -> Batch:
        return self.source(i)


_GRIDS = ("grid_thw", "image_grid_thw")
_MERGES = ("merge_sizes", "image_merge_sizes")


def _tower_source(model: nn.Module, *, batch: int, seed: int) -> InputSource | None:
    """Inputs for a vision tower from its forward's required arguments: images as
    `pixel_values` for one that inherits `main_input_name = "input_ids"` from its parent
    class but takes none (SmolVLM's, Idefics 3's towers), or Qwen-VL-style patches with
    their grid (`hidden_states`/`pixel_values` + `grid_thw`, and the merge size where
    the forward asks for it) in the first form the tower runs on."""
    required = _required(model)
    config: Any = model.config  # a transformers config: its fields vary by family
    grid_key = next((g for g in _GRIDS if g in required), None)
    key = next((k for k in ("hidden_states", "pixel_values") if k in required), None)
    if grid_key and key:
        merge_key = next((m for m in _MERGES if m in required), None)
        if set(required) - {key, grid_key, merge_key}:
            return None
        found = _runs(model, key, grid_key, merge_key, config)
        if found is None:
            return None
        form = found

        def patches(i: int) -> Batch:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            return Batch(kwargs=_patches(config, batch, gen, form, key, grid_key, merge_key))

        return patches
    if required == ["pixel_values"]:
        shape = _main_shape(model, "pixel_values", batch, None)

        def images(i: int) -> Batch:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            return Batch(kwargs={"pixel_values": torch.randn(*shape, generator=gen)})

        return images
    return None


def _patches(
    config: Any,
    batch: int,
    gen: torch.Generator,
    form: str,
    key: str,
    grid_key: str,
    merge_key: str | None,
) -> dict[str, torch.Tensor]:
    flat, grid = patch_grid(config, batch, gen, form)
    out = {key: flat, grid_key: grid}
    if merge_key:  # the 2·merge × 2·merge grid merges merge × merge patches into one
        out[merge_key] = torch.full((batch,), int(grid[0, 1]) // 2, dtype=torch.long)
    return out


def _runs(
    model: nn.Module, key: str, grid_key: str, merge_key: str | None, config: Any
) -> str | None:
    """The first patch form (`patch_grid`) the tower's forward runs on, one image, no
    gradients."""
    for form in PATCH_FORMS:
        kwargs = _patches(
            config, 1, torch.Generator().manual_seed(0), form, key, grid_key, merge_key
        )
        if _runs_on(model, kwargs):
            return form
    return None


# forward arguments that are options, caches or targets, not inputs to invent
_NOT_INPUTS = {"self", "labels", "return_dict", "return_loss", "use_cache", "cache"}
_NOT_INPUTS |= {"past_key_values", "output_attentions", "output_hidden_states"}
_NOT_INPUTS |= {"cache_position", "position_ids", "inputs_embeds", "logits_to_keep"}


def cannot_invent(model: nn.Module) -> str:
    """The refusal when no inputs can be invented: the model's class, the inputs its
    forward takes (the required ones, else its first few), and what the caller can pass:
    `inputs=` in Python; on the CLI a `module:function` target returning
    (model, inputs), or --input-shape when a single float tensor is all it takes."""
    import inspect

    kind = type(model).__name__
    if type(model).forward is nn.Module.forward:  # nn.Module's unimplemented forward
        parts = [n for n, m in model.named_children() if getattr(m, "config", None) is not None]
        subs = f" ({', '.join(parts[:4])})" if parts else ""
        return (
            f"{kind} has no forward pass of its own: it generates through its sub-models"
            f"{subs}; scan one of them (in Python, or on the CLI as a module:function "
            "target that returns it)"
        )
    try:
        params = [
            p
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in _NOT_INPUTS
        ]
    except (TypeError, ValueError):
        params = []
    required = [p.name for p in params if p.default is p.empty]
    shown = required or [p.name for p in params if "mask" not in p.name][:4]
    kinds = {p.name: _object_kind(p.annotation) for p in params}
    held = {p.name for p in params if "dict[" in str(p.annotation)}
    named = [
        f"{n} (an object of class {kinds[n]}, not a tensor)"
        if kinds.get(n)
        else f"{n} (a dict of tensors another model computes, not a tensor)"
        if n in held
        else n
        for n in shown
    ]
    takes = f": its forward takes {', '.join(named)}" if shown else ""
    objects = [n for n in shown if kinds.get(n) or n in held]
    single = len(required) == 1 or (not required and len(shown) == 1)
    shape = ", or --input-shape for its one float input" if single and not objects else ""
    given = "them as inputs= (Python)"
    if objects:  # an object the model's processor builds (a video session): say which
        pairs = ", ".join(f"'{n}': <{kinds.get(n) or 'dict'}>" for n in objects)
        maker = "the model's processor" if any(kinds.get(n) for n in objects) else "another model"
        given = f"inputs={{{pairs}}} in Python ({maker} builds it)"
    return (
        f"cannot invent inputs for {kind}{takes}; pass {given}, or on the CLI "
        f"as a module:function target that returns (model, inputs){shape}"
    )


def _object_kind(annotation: Any) -> str | None:
    """The class a forward argument must be when it is an object, not a tensor or a plain
    value (SAM 2 video's `inference_session`: a `Sam2VideoInferenceSession` its processor
    builds from the video), so the refusal names what to build."""
    import inspect

    if annotation is inspect.Parameter.empty:  # unannotated: nothing says it is an object
        return None
    if not isinstance(annotation, type) or issubclass(annotation, torch.Tensor):
        return None
    if annotation.__module__.split(".")[0] in ("builtins", "torch", "typing", "numpy"):
        return None  # a plain value or a tensor type (torch.LongTensor)
    return annotation.__name__


def learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """(config field, limit) when the model has a learned position table of that many rows
    (BERT's `max_position_embeddings`, GPT-2's `n_positions`): longer inputs cannot run.
    Rotary models may list a limit but run past it, so they give None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    rows = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit in rows:
            return key, limit
    return None


def check_positions(model: nn.Module, seq: int) -> None:
    """One line naming the config field when random ids are longer than a learned
    position table (BERT's max_position_embeddings = 512), instead of a shape error."""
    found = learned_positions(model)
    if found is not None and seq > found[1]:
        key, limit = found
        raise UsageError(
            f"--seq-len {seq}: this model has learned positions for at most {limit} tokens "
            f"({key} = {limit}); use --seq-len {limit} or less"
        )


@dataclass(frozen=True)
class ChosenInputs:
    """The run's global batches, the loss on one batch's output, and `seq`: the sequence
    length asked for (or given to invented token ids); None when the inputs say it."""

    source: InputSource
    loss_of: Callable[[Any, Batch], torch.Tensor]
    seq: int | None = None
    loss: str | None = None  # the objective, in words (the report's run.loss)
    fed: str = ""  # what the invented inputs leave out, in words ("" when nothing)

    def batch_size(self) -> int:
        return batch_size(self.source)

    def seq_len(self) -> int:
        """The report's sequence length: of the token ids, 0 for images and audio."""
        if self.seq and self.source(0).token_ids is not None:
            return self.seq
        return seq_len_of(self.source)


def choose_inputs(
    model: nn.Module,
    info: ModelInfo,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    batch: int,
    seq_len: int | None,
    seed: int,
) -> ChosenInputs:
    """The caller's inputs, else what the model's config asks for (transformers' main
    input), else random token ids for language models and encoders; the caller's loss,
    else the task's (`default_loss`)."""
    source: InputSource
    seq = seq_len
    hf: InputSource | None = None
    if inputs is not None:
        source = user_source(inputs)
    elif (hf := hf_input_source(model, batch=batch, seq_len=seq_len, seed=seed)) is not None:
        source = hf
    elif (vocab := info.vocab_size or hashed_vocab(model)) and info.task in (
        "causal-lm",
        "encoder",
    ):
        limit = info.arch.get("max_positions")
        if not (isinstance(limit, int) and limit > 0):  # -1 (XLNet) or absent: no limit
            limit = DEFAULT_SEQ
        seq = seq_len or min(DEFAULT_SEQ, limit)
        check_positions(model, seq)
        layout = codebook_layout(model, vocab, seq)
        if layout is not None:
            hf = layout_source(layout, vocab, batch, seq, seed, mask=info.task == "encoder")
            source = hf
        else:
            source = token_source(
                vocab,
                batch,
                seq,
                seed,
                mask=info.task == "encoder",
                as_kwargs=info.family != "actscan-gpt",
            )
    else:
        raise UsageError(cannot_invent(model))
    if inputs is None:
        source = with_side_inputs(model, source, seed)
    if inputs is None and asks_cache(model):
        source = _without_cache(source)
    task_loss = default_loss(info.task, info.vocab_size)

    def loss_of(out: Any, b: Batch) -> torch.Tensor:
        return loss_fn(out) if loss_fn is not None else task_loss(out, b)

    loss = describe_loss(info.task, source(0), caller=loss_fn is not None)
    noted = next((s for s in (inputs, hf) if isinstance(s, NotedSource)), None)
    if noted is not None and loss_fn is None and noted.note:
        loss = f"{loss}: {noted.note}"
    return ChosenInputs(source, loss_of, seq, loss, noted.fed if noted is not None else "")


@dataclass(frozen=True)
class CodebookLayout:
    """Token ids over `codebooks` audio codebooks: one row per (sample, codebook)
    (`rows`, MusicGen's batch × num_codebooks), else a trailing axis of `channels` per
    position (Kyutai STT: the text token and each codebook's); `top` bounds every id."""

    codebooks: int
    rows: bool
    channels: int = 1
    top: int = 0


def codebook_layout(model: nn.Module, vocab: int, seq: int) -> CodebookLayout | None:
    """How a model whose config names `num_codebooks` takes its token ids, when plain
    (batch, seq) ids fail: the first layout one probe forward (no gradients) runs on,
    of (codebooks, seq) rows for one sample, then one sample's (seq, channels) with a
    channel per codebook, plus one for the text before them; ids below the smaller of
    the vocabulary and the config's `codebook_vocab_size` (each channel's own range).
    None for any other model, or when none runs (the model's own error then says why)."""
    config: Any = getattr(model, "config", None)
    codebooks = _int(config, "num_codebooks") if config is not None else None
    if not codebooks or codebooks < 2:
        return None
    top = min(vocab, _int(config, "codebook_vocab_size") or vocab)
    length = min(seq, 8)
    if _runs_on(model, {"input_ids": _tokens(vocab, 1, length, 0, 0)}):
        return None
    if _runs_on(model, {"input_ids": _tokens(vocab, codebooks, length, 0, 0)}):
        return CodebookLayout(codebooks, rows=True, top=vocab)
    for channels in (codebooks, codebooks + 1):
        ids = _tokens(top, length, channels, 0, 0).unsqueeze(0)
        if _runs_on(model, {"input_ids": ids}):
            return CodebookLayout(codebooks, rows=False, channels=channels, top=top)
    return None


def layout_source(
    layout: CodebookLayout, vocab: int, batch: int, seq: int, seed: int, *, mask: bool
) -> NotedSource:
    """Random ids in `layout` (with an all-ones mask per sample and position where
    `mask`), noting the rows or channels the header's shape stands for."""

    def source(i: int) -> Batch:
        if layout.rows:
            ids = _tokens(layout.top, batch * layout.codebooks, seq, seed, i)
        else:
            flat = _tokens(layout.top, batch * seq, layout.channels, seed, i)
            ids = flat.view(batch, seq, layout.channels)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if mask:
            kwargs["attention_mask"] = torch.ones(ids.shape[:2], dtype=torch.long)
        return Batch(kwargs=kwargs)

    if layout.rows:
        fed = f"{batch} samples × {layout.codebooks} codebooks, a row each"
    else:
        text = "the text's, then " if layout.channels > layout.codebooks else ""
        fed = f"a position's ids: {text}each of {layout.codebooks} codebooks'"
    return NotedSource(source, "", fed)


def hashed_vocab(model: nn.Module) -> int | None:
    """The id range of a model whose config names no vocabulary because it hashes its
    ids (CANINE's Unicode code points, hashed into `num_hash_buckets`): ids below the
    bucket count reach every bucket."""
    config = getattr(model, "config", None)
    if config is None or _int(config, "vocab_size"):
        return None
    return _int(config, "num_hash_buckets")


def asks_cache(model: nn.Module) -> bool:
    """Whether the forward takes `use_cache`: by name, or through its **kwargs into its
    base model, whose forward names it (Granite-MoE-Hybrid's causal LM names only
    `cache`); not into any inner module, which may be given use_cache itself (Mimi)."""
    import inspect

    params = forward_params(model)
    if "use_cache" in params:
        return True
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model or "use_cache" not in forward_params(base):
        return False
    try:
        kinds = [p.kind for p in inspect.signature(model.forward).parameters.values()]
    except (TypeError, ValueError):
        return False
    return inspect.Parameter.VAR_KEYWORD in kinds


def _without_cache(source: InputSource) -> InputSource:
    """Invented batches ask for no key/value cache (`use_cache=False`): a profiled pass
    is a training pass, never decoded from, and a hybrid whose cache holds no attention
    layer (Jamba, Bamba, Granite-MoE-Hybrid at small depth) refuses to build one."""

    def wrapped(i: int) -> Batch:
        b = source(i)
        return Batch(args=b.args, kwargs={**b.kwargs, "use_cache": False})

    return wrapped


def first_shape(b: Batch) -> tuple[int, ...]:
    """The shape of the batch's token ids, else of its first tensor; () when none."""
    t = b.token_ids
    if t is None:
        t = first_tensor((b.args, b.kwargs))
    return tuple(t.shape) if t is not None else ()


def batch_size(source: InputSource) -> int:
    """Rows of batch 0 (0 when it holds no tensor)."""
    shape = first_shape(source(0))
    return shape[0] if shape else 0


def seq_len_of(source: InputSource) -> int:
    """The second dim of batch 0's main tensor; 0 for images and audio (no tokens)."""
    b = source(0)
    media = {"pixel_values", "input_values", "input_features", "grid_thw"}
    media |= {"pixel_values_videos", "past_values"}
    if b.token_ids is None and media & set(b.kwargs):
        return 0  # images and audio have no sequence of tokens; RunInfo.inputs says what
    shape = first_shape(b)
    return shape[1] if len(shape) >= 2 else 0


def _dims(t: torch.Tensor) -> str:
    return "×".join(str(s) for s in t.shape[1:])


def describe_batch(batch: Batch) -> str | None:
    """What one batch holds, in words for the header: "2×16 tokens", "2 images 3×32×32",
    "2 clips of 16000 samples", "2 clips of 80×3000 features", "2×8 decoder tokens",
    "2 videos 4×3×32×32", "2 series of 32×1 values", "2 series of 11 values, 4 future
    values and their time features"."""
    kw = batch.kwargs
    parts: list[str] = []
    grid = next((kw[g] for g in (*_GRIDS, "image_grid_hw") if g in kw), None)
    media = ("pixel_values", "hidden_states", "pixel_values_videos", "input_values")
    named = ("input_features", "audio_mel", "past_values", "inputs_embeds", "latents", "states")
    for name in (*media, *named):
        t = kw.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            n = t.shape[0]
            if name == "hidden_states" and not isinstance(grid, torch.Tensor):
                continue
            if (
                isinstance(grid, torch.Tensor)
                and grid.dim() == 2
                and name in ("pixel_values", "hidden_states")
            ):
                parts.append(f"{grid.shape[0]} images as {n} patches of {_dims(t)}")
            elif name == "pixel_values" and isinstance(kw.get("target_sizes"), torch.Tensor):
                sizes = kw["target_sizes"]  # packed in one row: the grids say how many
                patches = int(sizes.prod(dim=-1).sum())
                parts.append(f"{sizes.shape[0]} images as {patches} patches, packed")
            elif name == "pixel_values" and t.dim() == 2:  # every image's patches, a row each
                parts.append(f"{n} image patches of {t.shape[1]}")
            elif name == "pixel_values" and t.dim() == 3:  # a sequence of patches per image
                parts.append(f"{n} images as {t.shape[1]} patches of {t.shape[2]}")
            elif name == "pixel_values":
                parts.append(f"{n} images {_dims(t)}")
            elif name == "pixel_values_videos":
                parts.append(f"{n} videos {_dims(t)}")
            elif name == "past_values":
                freq = kw.get("freq")
                at = ""
                if isinstance(freq, torch.Tensor):
                    at = f" at frequency {int(freq.flatten()[0])}"
                future = kw.get("future_values")
                if isinstance(future, torch.Tensor) and future.dim() >= 2:
                    at += f", {future.shape[1]} future values and their time features"
                parts.append(f"{n} series of {_dims(t)} values{at}")
            elif name == "inputs_embeds":
                parts.append(f"{n}×{t.shape[1]} embeddings of width {t.shape[-1]}")
            elif name == "input_values" and t.dim() == 3 and t.shape[1] > WAVE_CHANNELS:
                parts.append(f"{n} clips of {_dims(t)} spectrogram features")
            elif name == "input_values":
                parts.append(f"{n} clips of {_dims(t)} samples")
            elif name == "latents":
                parts.append(f"{n} clips of {_dims(t)} latents")
            elif name == "states" and t.dim() == 3 and "returns_to_go" in kw:
                parts.append(
                    f"{n} trajectories of {t.shape[1]} steps (state {t.shape[2]}, action, "
                    "reward, return-to-go)"
                )
            else:
                parts.append(f"{n} clips of {_dims(t)} features")
    for name, t in kw.items():  # embeddings or hidden states named for what they are
        known = name in (*media, *named) or name.startswith(("input", "decoder", "pixel"))
        if not known and name.endswith(FLOAT_SUFFIXES) and isinstance(t, torch.Tensor):
            parts.append(f"{t.shape[0]} × {name} {_dims(t)}")
    flat = kw.get("flattened_patches")
    if isinstance(flat, torch.Tensor) and flat.dim() == 3:
        n, count, width = flat.shape
        parts.append(f"{n} images as {count} flattened patches of {width - 2} (+ row, column)")
    regions = next((kw[a] for a, _ in REGION_INPUTS if isinstance(kw.get(a), torch.Tensor)), None)
    if regions is not None and regions.dim() == 3:
        n, r, width = regions.shape
        parts.append(f"{n} images as {r} regions of {width} features")
    ids = batch.token_ids
    if ids is not None and ids.dim() == 2:
        parts.append(f"{ids.shape[0]}×{ids.shape[1]} tokens")
    elif ids is not None and ids.dim() == 3:  # a channel per codebook (`codebook_layout`)
        parts.append(f"{ids.shape[0]}×{ids.shape[1]} tokens of {ids.shape[2]} channels")
    box = kw.get("bbox")
    if isinstance(box, torch.Tensor) and box.dim() == 3:
        kind = "normalised" if box.is_floating_point() else "integer"
        parts.append(f"{box.shape[0]}×{box.shape[1]} {kind} boxes")
    spec_key = "spectrogram_labels"
    spec = kw.get(spec_key)
    if isinstance(spec, torch.Tensor) and spec.dim() == 3:  # a variance adaptor's targets
        per = [k.removesuffix("_labels") for k in kw if k.endswith("_labels") and k != spec_key]
        parts.append(
            f"{spec.shape[0]}×{spec.shape[1]} target frames of {spec.shape[2]} mel bins "
            f"({', '.join(per)} targets)"
        )
    lang = kw.get("lang_ids")
    if isinstance(lang, torch.Tensor) and lang.numel():
        parts.append(f"language id {int(lang.flatten()[0])}")
    dec = kw.get("decoder_input_ids")
    if isinstance(dec, torch.Tensor) and dec.dim() == 2:
        parts.append(f"{dec.shape[0]}×{dec.shape[1]} decoder tokens")
    elif isinstance(dec, torch.Tensor) and dec.dim() == 3:
        parts.append(f"{dec.shape[0]}×{dec.shape[1]} decoder tokens of {dec.shape[2]} codebooks")
    if parts:
        return " + ".join(parts)

    t = first_tensor((batch.args, kw))
    if t is None:
        return None
    dims = "×".join(str(s) for s in t.shape)
    return f"input {dims} {str(t.dtype).removeprefix('torch.')}"
