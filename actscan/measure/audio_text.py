"""Inputs for models that take audio and text together, from the model's own description.

Two kinds, told apart by the config alone, as for images (`vision_text`):

- **audio-language** (Qwen2-Audio, Voxtral, AudioFlamingo, GLM-ASR, Granite Speech): the
  config names an audio placeholder token (`audio_token_id` / `audio_token_index`). The
  text holds as many placeholders as the audio tower gives features for the batch's
  clips, read off the model itself (`get_audio_features`, without gradients).
- **two-tower** (CLAP, CLVP, PE-Audio): a forward that takes `input_ids` beside the audio
  input and no placeholder token: random ids for the text tower, random audio for the
  other, both at once.

The audio input is the forward's own (`input_features`: log-mel frames; `input_values`: a
waveform). Its shape comes from the audio sub-config: mel bins (`num_mel_bins`,
`feature_size`, `input_dim`), and a Whisper-like encoder's fixed frame count
(2 × `max_source_positions`); the layout (mels × frames or frames × mels, a channel axis
for waveforms) is the first of the few candidates the model's own audio path accepts.
Everything duck-types `model.config`; nothing imports transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from actscan.measure.inputs import Batch
from actscan.measure.vision_text import (
    config_int,
    deep_config_int,
    feature_rows,
    forward_params,
    placeholder_token,
    text_config,
    text_ids,
)

__all__ = ["audio_text_source"]

SAMPLES = 16_000  # one second at 16 kHz, the rate of nearly every speech checkpoint
# two seconds of 10 ms mel frames: a whole number of 8× subsampling and of 100-frame windows
FRAMES = 200
AUDIO_INPUTS = ("input_features", "input_values")
MASKS = ("input_features_mask", "feature_attention_mask", "audio_attention_mask", "padding_mask")
# where a config (or a sub-config of it) keeps its mel bins
MELS: tuple[str, ...] = ("num_mel_bins", "feature_size", "input_feat_per_channel")
MELS += ("input_feat_size", "feature_projection_input_dim", "input_dim", "n_mels", "num_mels")
SUB_CONFIGS = ("audio_config", "encoder_config", "speech_config", "audio_encoder_config")


def _audio_config(config: Any) -> Any:
    for name in SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    for name, sub in vars(config).items():  # the first sub-config that names audio
        named = name.endswith("_config") and ("audio" in name or "acoustic" in name)
        if named and hasattr(sub, "to_dict"):
            return sub
    return config


def _declares_audio_token(config: Any) -> bool:
    return any(
        name in vars(cfg)
        for cfg in (config, text_config(config))
        for name in ("audio_token_id", "audio_token_index")
    )


def _candidates(name: str, config: Any, batch: int, seed: int) -> Iterator[dict[str, Any]]:
    """The audio input in each layout the config allows (with its frame count)."""
    audio = _audio_config(config)
    gen = torch.Generator().manual_seed(seed * 100_003 + 11)
    if name == "input_values":
        channels = config_int(audio, "channels", "audio_channels", "num_channels") or 1
        for samples in (SAMPLES, SAMPLES * 3 // 2):
            wave = torch.randn(batch, samples, generator=gen)
            yield {name: wave}
            yield {name: wave.view(batch, 1, samples).expand(batch, channels, samples)}
        return
    mels = deep_config_int(audio, MELS) or deep_config_int(config, MELS)
    if mels is None:
        return
    fixed = [
        2 * p
        for p in (
            config_int(audio, "max_source_positions"),
            config_int(audio, "max_position_embeddings"),
        )
        if p
    ]
    for frames in (*fixed[:1], FRAMES):
        feats = torch.randn(batch, mels, frames, generator=gen)
        yield {name: feats, "frames": frames}
        yield {name: feats.transpose(1, 2).contiguous(), "frames": frames}
        yield {name: feats.transpose(1, 2).unsqueeze(1).contiguous(), "frames": frames}


def _named(fn: Callable[..., Any] | None) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters) if fn is not None else set()
    except (TypeError, ValueError):
        return set()


def _passes_kwargs(fn: Callable[..., Any] | None) -> bool:
    try:
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()] if fn else []
    except (TypeError, ValueError):
        return False
    return inspect.Parameter.VAR_KEYWORD in kinds


def _with_masks(cand: dict[str, Any], names: set[str]) -> dict[str, torch.Tensor]:
    """The candidate's audio and a mask of every frame (none is padding) under each mask
    name in `names`."""
    frames = cand.get("frames")
    out = {k: v for k, v in cand.items() if isinstance(v, torch.Tensor)}
    if isinstance(frames, int):
        rows = next(iter(out.values())).shape[0]
        for mask in MASKS:
            if mask in names:
                out[mask] = torch.ones(rows, frames, dtype=torch.long)
    return out


def _layout(
    model: nn.Module, name: str, batch: int, seed: int, ids: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], int | None] | None:
    """The first audio layout the model's audio path runs on, and the feature rows it
    gives (None for a two-tower model probed through its whole forward)."""
    params = forward_params(model)
    get = getattr(model, "get_audio_features", None)
    if not callable(get):
        get = getattr(getattr(model, "model", None), "get_audio_features", None)
    width = config_int(text_config(model.config), "hidden_size")
    # A mask the audio path names is one of frames; the forward's masks of the same
    # kind go with it. An audio path that names none masks its own output (Granite
    # Speech's projected features): no mask is given then, every frame counts.
    # An audio path that passes **kwargs on to an inner one (MOSS's, whose inner path
    # names `padding_mask`) gets the forward's masks too when its own names fail.
    named = _named(get) & set(MASKS) if callable(get) else set(MASKS)
    sets = [named]
    if named and _passes_kwargs(get) and not (params & set(MASKS)) <= named:
        sets.append(named | (params & set(MASKS)))
    for cand, given in ((c, g) for c in _candidates(name, model.config, batch, seed) for g in sets):
        audio = _with_masks(cand, params if given else set())
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                if callable(get):
                    out = get(**{name: audio[name], **_with_masks(cand, given)})
                elif ids is not None:
                    model(input_ids=ids, **audio)
                    return audio, None
                else:
                    return None
        except Exception:
            continue
        return audio, feature_rows(out, width)
    return None


def _aligned_text(
    model: nn.Module, audio: dict[str, torch.Tensor], rows: int | None, seq: int, seed: int
) -> int:
    """The text length for a model with no placeholder token: `seq`, or where the
    forward runs only then, as many tokens as the clip's audio features (`rows`, one
    clip): Voxtral-Realtime adds each audio position to one text position. One forward
    of one clip each, no gradients."""
    if rows is None or rows == seq:
        return seq

    def runs(n: int) -> bool:
        ids = text_ids(model.config, 1, n, seed, 0)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                model(input_ids=ids, **_like(audio, 1, seed, 0))
        except Exception:
            return False
        return True

    return rows if not runs(seq) and runs(rows) else seq


def _audio_tower(model: nn.Module) -> nn.Module | None:
    """The audio encoder a model holds (on itself or its inner `model`), by the names
    transformers gives it."""
    for owner in (model, getattr(model, "model", None)):
        for attr in ("audio_tower", "audio_encoder", "audio_model"):
            tower = getattr(owner, attr, None)
            if isinstance(tower, nn.Module):
                return tower
    return None


def _tower_layout(
    model: nn.Module, name: str, batch: int, seed: int, token: int, seq: int
) -> tuple[dict[str, torch.Tensor], int | None] | None:
    """For a model whose `get_audio_features` is missing (Qwen2-Audio) or cannot run on
    audio alone (Music Flamingo's also reads the placeholders): the features are its
    audio tower's output positions, one per placeholder, checked by one forward of the
    whole model on one clip, no gradients."""
    tower = _audio_tower(model)
    if tower is None:
        return None
    params = forward_params(model)
    for cand in _candidates(name, model.config, 1, seed):
        audio = _with_masks(cand, params)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = tower(**_with_masks(cand, _named(tower.forward)))
                rows = feature_rows(out, None)
                ids = text_ids(model.config, 1, seq, seed, 0)
                if rows is None or ids is None:
                    continue
                ids = torch.cat([torch.full((1, rows), token), ids], dim=1)
                model(input_ids=ids, attention_mask=torch.ones_like(ids), **audio)
        except Exception:
            continue
        return _like(audio, batch, seed, 0), rows * batch
    return None


def audio_text_source(
    model: nn.Module, *, batch: int, seq_len: int | None, seed: int, default_seq: int
) -> Callable[[int], Batch] | None:
    """Audio and token ids for an audio-language or two-tower audio model, or None when
    the model is neither (its forward takes no audio input beside `input_ids`)."""
    config: Any = getattr(model, "config", None)
    params = forward_params(model)
    name = next((n for n in AUDIO_INPUTS if n in params), None)
    if config is None or name is None or "input_ids" not in params:
        return None
    limit = config_int(text_config(config), "max_position_embeddings")
    seq = seq_len or min(default_seq, limit or default_seq)
    if text_ids(config, 1, 1, seed, 0) is None:
        return None
    token = placeholder_token(config, "audio")
    if token is None:
        if _audio_config(config) is config or _declares_audio_token(config):
            return None  # no second tower, or a placeholder the config leaves unset
        probe = text_ids(config, 1, seq, seed, 0)
        found = _layout(model, name, 1, seed, probe)
        if found is None:
            return None
        one = found[0]
        text = _aligned_text(model, one, found[1], seq, seed)

        def two_tower(i: int) -> Batch:
            ids = text_ids(config, batch, text, seed, i)
            assert ids is not None  # checked above
            kw: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            kw.update(_like(one, batch, seed, i))
            if "return_loss" in params:
                kw["return_loss"] = False
            return Batch(kwargs=kw)

        return two_tower

    found = _layout(model, name, batch, seed, None)
    if found is None or found[1] is None or found[1] % batch:
        found = _tower_layout(model, name, batch, seed, token, seq)
    if found is None or found[1] is None or found[1] % batch:
        return None
    audio, per_clip = found[0], found[1] // batch

    def alm(i: int) -> Batch:
        ids = text_ids(config, batch, seq, seed, i)
        assert ids is not None
        ids = torch.cat([torch.full((batch, per_clip), token), ids], dim=1)
        kw: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kw.update(_like(audio, batch, seed, i))
        return Batch(kwargs=kw)

    return alm


def _like(audio: dict[str, torch.Tensor], batch: int, seed: int, index: int) -> dict[str, Any]:
    """Fresh random audio in the layout found (masks kept), `batch` rows."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index + 13)
    out: dict[str, Any] = {}
    for key, t in audio.items():
        shape = (batch, *t.shape[1:])
        if t.dtype.is_floating_point:
            out[key] = torch.randn(*shape, generator=gen)
        else:
            out[key] = torch.ones(shape, dtype=t.dtype)
    return out
